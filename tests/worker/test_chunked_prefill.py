"""Chunked prefill: a prompt longer than a step's token cap is cut into chunks that share
steps with the streams decoding beside it, so no decoding stream starves while it runs, on
every back end. What each step carried is read at the scheduler (no timing)."""

from __future__ import annotations

import math

import pytest

from prepos.core import Request, SamplingParams
from tests.support.helpers import greedy_agrees, hold_worker, no_end, record_steps

SYSTEM = "Live prices. Answer in one word: up, down or flat."
CAP = 16  # a step's tokens, small so the tiny model's prompts run in several chunks


def entry(eng, sid, question):
    snap = eng.snapshot(sid)
    frame = eng.fmt.frame(eng.session(sid).entries(snap).user, question)
    return list(snap.tokens) + eng.fmt.encode(frame)


def test_a_long_prefill_runs_in_chunks_beside_streams_that_each_advance_in_turn(
        make_engine, monkeypatch):
    eng = make_engine("chatml", max_sequences=8, kv_idle_cells=None, batch_tokens=CAP)
    log = record_steps(eng, monkeypatch)
    short = [eng.create_session("streaming", system=SYSTEM, preposition=False)
             for _ in range(3)]
    long = eng.create_session("streaming", system=SYSTEM, preposition=False)
    words = " ".join(f"ACME {n} BOLT {n % 7}" for n in range(12))
    questions = {sid: "Which way is ACME moving?" for sid in short}
    questions[long] = f"Which of these moved most? {words}"
    seqs = {sid: entry(eng, sid, q) for sid, q in questions.items()}
    assert len(seqs[long]) > 4 * CAP
    gate = hold_worker(eng, 300)  # taken together, in this order: the short answers'
    # prompts run first (each in chunks too) and they decode while the long one's run
    streams = {sid: eng.query(sid, questions[sid], no_end(eng, 24)) for sid in short}
    streams[long] = eng.query(long, questions[long], no_end(eng, 4))
    gate.set()
    results = {sid: s.result(timeout=600) for sid, s in streams.items()}

    for step in log:  # every step within the cap, a forward cut to fit where it was long
        assert sum(n for _, n, _ in step) <= CAP
    long_steps = [i for i, step in enumerate(log) if any(k == long for k, _, _ in step)]
    first_long = long_steps[0]
    reached = next(i for i in long_steps if any(k == long and done for k, _, done in log[i]))
    assert reached - first_long >= 3  # the long prompt ran in chunks ...
    shared = [i for i in range(first_long, reached + 1)
              if any(k != long for k, _, _ in log[i])]
    assert shared  # ... sharing steps with the decoding streams
    # no stream starves: once decoding, each one's steps are at most ceil(streams / the
    # back end's batch) steps apart (every step, where the batch holds them all)
    bound = math.ceil(len(streams) / eng.backend.max_batch)
    for sid in short:
        mine = [i for i, step in enumerate(log) if any(k == sid for k, _, _ in step)]
        decoding = next(i for i in mine if any(k == sid and done for k, _, done in log[i]))
        after = [i for i in mine if i >= decoding]
        assert max(b - a for a, b in zip(after, after[1:])) <= bound, sid
    for sid, res in results.items():  # each answer the cold one, chunks or not
        assert len(res.tokens) == (4 if sid == long else 24)
        seq = list(seqs[sid])
        for tok in res.tokens:
            assert greedy_agrees(eng, seq, tok), sid
            seq.append(tok)
    st = eng.scheduler.steps
    assert st.chunks >= 3 and (st.count["mixed"] >= 1 or eng.backend.max_batch == 1)
    assert st.tokens["prefill"] >= len(seqs[long]) - CAP


def test_a_forward_that_wants_every_positions_logits_runs_whole(make_engine, monkeypatch):
    """A forward whose every position's logits are wanted (a raw completion's prompt
    logprobs) is not cut: it runs whole, alone in its step, though longer than the cap."""
    eng = make_engine("chatml", batch_tokens=CAP)
    if not eng.backend.verifies_drafts:
        pytest.skip(f"the {eng.backend.name} back end gives no prompt logprobs")
    log = record_steps(eng, monkeypatch)
    sid = eng.create_session("streaming", preposition=False)
    prompt = " ".join(f"ACME {n} BOLT {n % 7}" for n in range(8))
    res = eng.complete(sid, prompt, Request(SamplingParams(max_tokens=2), fast_path="off",
                                            prompt_logprobs=True)).result(timeout=300)
    n = len(res.prompt_logprobs)
    assert n > CAP
    assert [step for step in log if any(k == sid for k, _, _ in step)][0] == [(sid, n, True)]
