"""Concurrent sessions against a real server: mixed updates and queries, zero errors and
zero stale answers (each answer computed from the version its session was at when asked).
A small version of the load run in benchmarks/http_ttft.py."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import ServerProc

from prepos.server.loadgen import load_run


@pytest.mark.slow
def test_concurrent_sessions_no_errors_no_stale_answers(model_dirs, tmp_path):
    with ServerProc(model_dirs["chatml"], tmp_path) as srv:
        report = asyncio.run(load_run(srv.url, sessions=16, ops=320, state_messages=3,
                                      think_ms=50))
    assert report["errors"] == 0, report["error_examples"]
    assert report["stale"] == 0, report["stale_examples"]
    assert report["operations"] >= 320 and report["updates"] > 0 and report["queries"] > 0
    # with think time between operations, pre-positions land: answers come from the cache
    # too, and those are the ones a stale record would show up in (at 20 ms of think time
    # only ~10 of ~160 queries found a finished pre-position: too few to count on)
    assert report["query_latency_by_path"]["fast"]["n"] >= 10
