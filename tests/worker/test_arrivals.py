"""Requests sent together start together: a step that would start from idle waits, at most
`batch_wait_ms`, for requests still on their way into the engine (`Engine.arrival`), and a
step with work in flight never waits. What each step carried is read at the scheduler; no
outcome depends on timing."""

from __future__ import annotations

import threading
import time

from prepos.worker import scheduler as scheduler_module
from tests.support.helpers import no_end, record_steps

SYSTEM = "Live prices. Answer in one word: up, down or flat."
QUESTION = "Which way is ACME moving?"


def sessions(eng, n: int) -> list[str]:
    return [eng.create_session("streaming", system=SYSTEM, preposition=False)
            for _ in range(n)]


def first_step_with(log, sid: str) -> int:
    return next(i for i, step in enumerate(log) if any(k == sid for k, _, _ in step))


def test_a_step_from_idle_waits_for_the_requests_arriving_beside_it(make_engine, monkeypatch):
    eng = make_engine("chatml", batch_wait_ms=600_000)  # bounded by the arrival alone
    a, b = sessions(eng, 2)
    log = record_steps(eng, monkeypatch)
    arrival = eng.arrival()  # a request on its way in (a server's, being read)
    first = eng.query(a, QUESTION, no_end(eng, 4))
    time.sleep(0.2)  # the worker holds `a`'s step while the other request arrives
    assert not log
    second = eng.query(b, QUESTION, no_end(eng, 4))
    arrival()
    arrival()  # idempotent
    first.result(timeout=120), second.result(timeout=120)
    if eng.backend.max_batch >= 2:  # one step, both prompts
        assert first_step_with(log, a) == first_step_with(log, b) == 0
    else:  # a step a session: both prompts before either decodes
        assert {first_step_with(log, a), first_step_with(log, b)} == {0, 1}


def test_nothing_waits_for_an_arrival_while_work_is_in_flight(make_engine, monkeypatch):
    eng = make_engine("chatml", batch_wait_ms=600_000)
    a, b = sessions(eng, 2)
    log = record_steps(eng, monkeypatch)
    spy, in_step, submitted = scheduler_module.run_forwards, threading.Event(), threading.Event()

    def held(backend, forwards, plans=None, moves=True):  # `a`'s first step lasts until `b`
        if not submitted.is_set() and any(f.kv.key == a for f in forwards):  # is submitted:
            in_step.set()  # `a` is in flight then, whatever this machine's speed
            submitted.wait(120)
        return spy(backend, forwards, plans, moves)

    monkeypatch.setattr(scheduler_module, "run_forwards", held)
    running = eng.query(a, QUESTION, no_end(eng, 8))
    assert in_step.wait(120)
    arrival = eng.arrival()  # never arrives while these run
    try:
        joined = eng.query(b, QUESTION, no_end(eng, 4))
        submitted.set()
        joined.result(timeout=120), running.result(timeout=120)
    finally:
        submitted.set()
        arrival()
    assert first_step_with(log, b) > 0


def test_the_wait_is_bounded(make_engine, monkeypatch):
    eng = make_engine("chatml", batch_wait_ms=50)
    (a,) = sessions(eng, 1)
    arrival = eng.arrival()  # a request that never comes
    try:
        assert eng.query(a, QUESTION, no_end(eng, 4)).result(timeout=120).tokens
    finally:
        arrival()


def test_an_entry_counts_as_arriving_until_it_returns(make_engine):
    eng = make_engine("chatml", batch_wait_ms=600_000)
    sid = eng.create_session("agentic", system=SYSTEM, preposition=False)
    # the turn's own entry submits its task before it returns: its step does not wait for
    # the entry's own count (bounded by nothing here but the entry's return)
    assert eng.turn(sid, "hello", no_end(eng, 2)).result(timeout=120).tokens
    assert eng.scheduler._arriving == 0

