"""Limits against a real server: sessions per server and per key (429), and backpressure:
with the model worker's queue full, requests that need it get 429 with Retry-After and
change nothing, while a one-token exact match, which needs no model work, is still served."""

from __future__ import annotations

import httpx
import pytest

from tests.support.server_harness import ServerProc, state_of

Q = "What is the trend?"
A, B = "key-a", "key-b"


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    args = ["--api-key", A, "--api-key", B, "--max-sessions", "3",
            "--max-sessions-per-key", "2", "--max-queue", "0"]
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-limits"), *args) as srv:
        yield srv


def client(server, key):
    return httpx.Client(base_url=server.url, timeout=120,
                        headers={"Authorization": f"Bearer {key}"})


def test_session_limits_per_key_and_per_server(server):
    with client(server, A) as a, client(server, B) as b:
        made = [a.post("/sessions", json={"kind": "streaming"}) for _ in range(3)]
        assert [r.status_code for r in made] == [201, 201, 429]
        assert made[2].json()["error"]["code"] == "too_many_sessions"
        assert "this key" in made[2].json()["error"]["message"]
        assert b.post("/sessions", json={"kind": "agentic"}).status_code == 201
        r = b.post("/sessions", json={"kind": "agentic"})
        assert r.status_code == 429 and "this server" in r.json()["error"]["message"]
        assert r.headers["retry-after"]
        for s in a.get("/sessions").json()["data"]:
            assert a.delete(f"/sessions/{s['id']}").status_code == 200
        for s in b.get("/sessions").json()["data"]:
            assert b.delete(f"/sessions/{s['id']}").status_code == 200


def test_backpressure_refuses_model_work_but_serves_ready_answers(server):
    with client(server, A) as a:
        sid = a.post("/sessions", json={"kind": "streaming", "standing_queries": [Q]}).json()
        sid = sid["id"]
        # appends that do not wait for the worker are accepted; the pre-position ingests them
        r = a.post(f"/sessions/{sid}/append", json={"data": "AAPL 101 102 103", "wait": False})
        assert r.status_code == 200
        assert a.get(f"/sessions/{sid}", params={"wait_ready": 30}).json()["ready"]["done"]
        before = state_of(a, sid)
        for path, body in ((f"/sessions/{sid}/append", {"data": "AAPL 104"}),
                           (f"/sessions/{sid}/query", {"question": "Up?", "max_tokens": 1}),
                           (f"/sessions/{sid}/query",  # sampled: its later tokens need work
                            {"question": Q, "max_tokens": 4, "temperature": 1.0, "seed": 1}),
                           ("/v1/completions", {"model": "chatml-llama", "prompt": "x"})):
            r = a.post(path, json=body)
            assert r.status_code == 429, (path, r.text)
            assert r.json()["error"]["code"] == "overloaded"
            assert int(r.headers["retry-after"]) >= 1
        assert state_of(a, sid) == before
        r = a.post(f"/sessions/{sid}/query", json={"question": Q, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["path"] == "fast"
        # a greedy answer pre-decoded whole at idle needs no model work either
        r = a.post(f"/sessions/{sid}/query", json={"question": Q, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["path"] == "fast"
        assert r.json()["predecoded"] == len(r.json()["tokens"]) > 1
        metrics = a.get("/metrics").text
        assert 'prepos:rejected_requests_total{reason="queue_full"} 4.0' in metrics
        assert 'prepos:rejected_requests_total{reason="sessions_per_key"}' in metrics
