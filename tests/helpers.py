"""Shared test helpers: a cold forward with no cache, and session state snapshots."""

import torch

from prepos.backends.base import in_idle_work
from prepos.kv import Forward, KVSequence


def cold_logits(eng, tokens):
    """The reference: a fresh forward over the whole sequence, on a KV of its own (no cache
    reuse), on the engine's own back end (through its model worker, which owns the back end;
    at batch size 1 unless another request runs at the same moment)."""
    if eng.backend.name == "torch":  # the model itself, no cache at all
        with torch.inference_mode():
            out = eng.backend.model(input_ids=torch.tensor([list(tokens)]))
        return out.logits[0, -1].float()
    got = {}

    def run():
        kv = KVSequence(eng.backend)
        try:
            got["logits"] = (yield Forward(kv, tuple(tokens))).logits
        finally:
            kv.release()

    eng._call(run())
    return got["logits"].float()


def tolerance(eng):
    """How far a logit may move with the batch it was computed in, on this back end."""
    return eng.backend.logit_tolerance


def greedy_agrees(eng, tokens, token, tol=None):
    """`token` is the cold argmax, or ties it within the back end's tolerance."""
    logits = cold_logits(eng, tokens)
    return float(logits.max() - logits[token]) <= (tolerance(eng) if tol is None else tol)


def during_idle_forwards(eng, fn):
    """Call `fn()` as each idle forward starts (its back-end call, before any layer runs);
    returns the function that stops it."""
    orig = eng.backend.extend_batch

    def extend_batch(steps):
        if in_idle_work():
            fn()
        return orig(steps)

    eng.backend.extend_batch = extend_batch
    return lambda: delattr(eng.backend, "extend_batch")


def state(eng, sid):
    s = eng.session(sid)
    return (s.snap.version, s.snap.tokens, s.snap.messages)


def query_entry(eng, sid, question):
    s = eng.session(sid)
    return tuple(eng.fmt.encode(eng.fmt.frame(s.entries().user, question)))
