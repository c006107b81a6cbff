"""Persistence: a server killed without warning, restarted on the same journal, restores
every session (history, versions kept for rollback, owner, pending tool call) and answers
as before; KV caches and ready records are rebuilt, never read back. Also: /health is 503
while the model loads, and `prepos serve` without a model fails fast."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tests.support.server_harness import SRC, ServerProc, state_of

SYSTEM = "You are a market analyst. Answer with one word."
Q = "What is the trend?"
KEY, OTHER = "key-a", "key-b"
KEYS = ["--api-key", KEY, "--api-key", OTHER]


def client(srv, key=KEY):
    return httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def answers(c, sid):
    c.get(f"/sessions/{sid}", params={"wait_ready": 30})
    out = {}
    for q in (Q, "Is it rising?"):
        r = c.post(f"/sessions/{sid}/query", json={"question": q, "max_tokens": 3})
        assert r.status_code == 200, r.text
        out[q] = (r.json()["tokens"], r.json()["path"])
    return out


def snapshot(c, sids):
    out = {}
    for sid in sids:
        info = c.get(f"/sessions/{sid}").json()
        out[sid] = (state_of(c, sid), info["versions_kept"], info["awaiting_tool_result"],
                    info["standing_queries"], info["kind"], info["push_max_tokens"])
    return out


@pytest.mark.slow
def test_sessions_survive_a_crash_and_restarts(model_dirs, tmp_path):
    model = model_dirs["chatml"]
    journal = tmp_path / "journal.sqlite3"
    srv = ServerProc(model, tmp_path / "first", *KEYS, journal=journal).start()
    try:
        with client(srv) as c:
            s = c.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                          "standing_queries": [Q], "push_max_tokens": 2}).json()
            s = s["id"]
            for d in ("AAPL 101 102 103", "AAPL 104 105 106", "AAPL 107 106 108"):
                c.post(f"/sessions/{s}/append", json={"data": d})
            v1_state = state_of(c, s)
            c.post(f"/sessions/{s}/rollback", json={"version": 2})
            c.post(f"/sessions/{s}/append", json={"data": "AAPL 109 110 111"})
            a = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM, "tools": [
                {"type": "function", "function": {"name": "price"}}]}).json()["id"]
            assert c.post(f"/sessions/{a}/turn", json={"user": "Hi", "max_tokens": 3}) \
                .status_code == 200
            call = {"function": {"name": "price", "arguments": {"t": "AAPL"}}}
            c.post(f"/sessions/{a}/messages", json={"role": "assistant", "content": "",
                                                    "tool_calls": [call]})
            b = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM}).json()["id"]
            oai = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
            msgs = [{"role": "user", "content": "One?"}]  # the system prompt is implied
            r = oai.chat.completions.create(model=model.name, messages=msgs, max_tokens=2,
                                            extra_body={"session_id": b})
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            before = snapshot(c, [s, a, b])
            said = answers(c, s)
            assert said[Q][1] == "fast"
        srv.stop(signal.SIGKILL)  # a crash: nothing flushed on the way out

        srv = ServerProc(model, tmp_path / "second", *KEYS, journal=journal).start()
        with client(srv) as c, client(srv, OTHER) as other:
            assert c.get("/health").json()["restored"] == 3
            assert {x["id"] for x in c.get("/sessions").json()["data"]} == {s, a, b}
            assert other.get("/sessions").json()["data"] == []
            assert other.get(f"/sessions/{s}").status_code == 404
            assert snapshot(c, [s, a, b]) == before
            assert answers(c, s) == said  # ready records recomputed: the fast path again
            r = c.post(f"/sessions/{s}/rollback", json={"version": 3})  # pre-crash history
            assert r.status_code == 200 and state_of(c, s)[1:] == v1_state[1:]
            r = c.post(f"/sessions/{a}/tool_result", json={"content": "101", "max_tokens": 2})
            assert r.status_code == 200, r.text
            oai = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
            msgs.append({"role": "user", "content": "Two?"})
            r = oai.chat.completions.create(model=model.name, messages=msgs, max_tokens=2,
                                            extra_body={"session_id": b})  # the delta only
            assert r.model_extra["prepos"]["session_id"] == b
            c.delete(f"/sessions/{b}")
            after = snapshot(c, [s, a])
        assert srv.stop(signal.SIGTERM) == 0  # a graceful stop

        srv = ServerProc(model, tmp_path / "third", *KEYS, journal=journal).start()
        with client(srv) as c:
            assert {x["id"] for x in c.get("/sessions").json()["data"]} == {s, a}
            assert snapshot(c, [s, a]) == after
    finally:
        srv.stop()


def test_health_is_503_while_loading(model_dirs):
    from prepos.engine import Engine
    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    gate = threading.Event()

    def slow_load(cfg):
        gate.wait(60)
        return Engine.from_pretrained(cfg.model, cfg.engine)

    app = create_app(ServerConfig(model=model_dirs["chatml"]), engine_factory=slow_load)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(url + "/sessions", json={"kind": "streaming"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        assert r.headers["retry-after"] == "1"
        gate.set()
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(url + "/sessions", json={"kind": "streaming"}).status_code == 201
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)


def test_serve_without_a_model_fails_fast(tmp_path):
    r = subprocess.run([sys.executable, "-m", "prepos.cli", "serve", "--model",
                        str(tmp_path / "missing")], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "no model" in r.stderr
