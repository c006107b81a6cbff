"""Shared test helpers: a cold forward with no cache, and session state snapshots."""

import threading
import time
from contextlib import contextmanager

import torch

from prepos.backends.base import in_idle_work
from prepos.core import Request, SamplingParams
from prepos.worker import scheduler as scheduler_module
from prepos.worker.sequence import Forward, KVSequence


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

    def extend_batch(steps, *rest):
        if in_idle_work():
            fn()
        return orig(steps, *rest)

    eng.backend.extend_batch = extend_batch
    return lambda: delattr(eng.backend, "extend_batch")


def state(eng, sid):
    s = eng.session(sid)
    return (s.snap.version, s.snap.tokens, s.snap.messages)


def query_entry(eng, sid, question):
    s = eng.session(sid)
    return tuple(eng.fmt.encode(eng.fmt.frame(s.entries().user, question)))


def race_appends_with_queries(eng, sid, question, appends: int, sampling, reads_first: int = 2):
    """Appends to a streaming session on one thread while another asks `question` until the
    appends are done; the writer starts once `reads_first` answers are in, so the two do
    overlap however fast the machine is. Returns every answer (errors re-raised)."""
    results, errors = [], []
    stop, ready = threading.Event(), threading.Event()

    def writer():
        try:
            if not ready.wait(300):
                raise TimeoutError("the reader got no answers")
            for i in range(appends):
                eng.append(sid, f"AAPL {102 + i}.{i}", wait=bool(i % 2))
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            stop.set()

    def reader():
        try:
            while not stop.is_set():
                results.append(eng.query(sid, question, Request(sampling)).result())
                if len(results) >= reads_first:
                    ready.set()
        except Exception as exc:  # reported below
            errors.append(exc)
            ready.set()

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    if errors:
        raise errors[0]
    return results


def fill_ids(obj, ids: dict):
    """Put session ids into "{S}", "{A}", ... wherever they appear in a request body."""
    if isinstance(obj, str):
        for k, v in ids.items():
            obj = obj.replace("{" + k + "}", v)
        return obj
    if isinstance(obj, dict):
        return {k: fill_ids(v, ids) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill_ids(v, ids) for v in obj]
    return obj


def promote(eng, question, token):
    """Evidence promoting the question's class with `token` its verified answer, as agreeing
    full-path answers would: for tests of the relaxed path's mechanics on a random model,
    whose full path need not say what its header does."""
    from prepos.gate.question_class import classify

    gate, cls = eng.relaxed.gate, classify(question)
    gate.decide("", cls, None, token)  # a class is tracked once asked
    for _ in range(gate.config.min_verified):
        gate.evidence(cls, False, token)


def hold_worker(eng, seconds: float = 30):
    """Keep the (single) model worker busy until the returned event is set (at most
    `seconds`), so that requests submitted meanwhile wait, and are taken together."""
    gate = threading.Event()

    def blocker():
        gate.wait(seconds)
        yield

    eng.scheduler.submit(blocker())
    return gate


def record_steps(eng, monkeypatch) -> list[list[tuple[str, int, bool]]]:
    """Each foreground step's forwards as run: (session, tokens, whether it reached the end
    of its target)."""
    log: list[list[tuple[str, int, bool]]] = []
    real = scheduler_module.run_forwards

    def spy(backend, forwards, plans=None, moves=True):
        if moves:  # foreground steps (idle work never moves others' KV)
            log.append([(f.kv.key, stop - start, stop == len(f.target))
                        for f, (_, start, stop) in zip(forwards, plans)])
        return real(backend, forwards, plans, moves)

    monkeypatch.setattr(scheduler_module, "run_forwards", spy)
    return log


def no_end(eng, max_tokens: int) -> Request:
    """A greedy answer of exactly `max_tokens` tokens (its end-of-turn tokens banned)."""
    ban = tuple((t, -100.0) for t in sorted(eng.fmt.end_of_turn))
    return Request(SamplingParams(max_tokens=max_tokens, logit_bias=ban), fast_path="off")


@contextmanager
def loaded_app(app, timeout: float = 120):
    """A TestClient on `app` (prepos's, from `create_app`) once its model is loaded."""
    from starlette.testclient import TestClient

    with TestClient(app, base_url="http://localhost") as c:
        deadline = time.monotonic() + timeout
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        yield c
