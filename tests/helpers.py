"""Shared test helpers: a cold forward with no cache, and session state snapshots."""

import torch


def cold_logits(eng, tokens):
    """The reference: a fresh forward over the whole sequence, no cache at all."""
    with torch.inference_mode():
        out = eng.backend.model(input_ids=torch.tensor([list(tokens)]))
    return out.logits[0, -1].float()


def greedy_agrees(eng, tokens, token, tol=1e-3):
    """`token` is the cold argmax, or ties it within float noise."""
    logits = cold_logits(eng, tokens)
    return float(logits.max() - logits[token]) <= tol


def state(eng, sid):
    s = eng.session(sid)
    return (s.snap.version, s.snap.tokens, s.snap.messages)


def query_entry(eng, sid, question):
    s = eng.session(sid)
    return tuple(eng.fmt.encode(eng.fmt.frame(s.entries().user, question)))
