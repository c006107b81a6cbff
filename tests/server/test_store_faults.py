"""Nothing acknowledged that was not written, nothing committed by a refused request.

- The journal writes ahead: with the SQLite file locked by another connection, a commit fails
  with StoreUnavailable (an HTTP 503 naming the store, not its path or the driver's text)
  within the store timeout and the session is as it was; a create that cannot be written
  creates nothing. `/health` answers meanwhile (the event loop never waits on the store).
- One turn at a time per session: turns and mutations while one is in flight are refused
  (409 `session_busy`) before they commit anything.
- One process per SQLite journal: a second `prepos serve` on it refuses to start, naming the
  holder's pid.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from prepos.core import Request, SamplingParams
from prepos.engine.session import TURN
from prepos.errors import SessionBusy
from prepos.server.store.database import StoreUnavailable
from prepos.server.store.journal import Journal
from tests.support.helpers import hold_worker
from tests.support.server_harness import ServerProc, state_of

SYSTEM = "You are a market analyst. Answer with one word."
TWO = SamplingParams(max_tokens=2)


def locked(path):
    """A second connection holding the SQLite file's write lock until closed."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    return con


def messages(eng, sid):
    return [(m["role"], m["content"]) for m in eng.session(sid).snap.messages]


@pytest.mark.parametrize("backend", ["torch"])
def test_four_turns_at_once_commit_only_the_admitted_one(make_engine):
    eng = make_engine()
    sid = eng.create_session("agentic", system=SYSTEM)
    gate = hold_worker(eng)  # the first turn's answer waits: it is in flight
    first = eng.turn(sid, "user 0", Request(TWO))
    before = eng.session(sid).snap
    for i in (1, 2, 3):
        with pytest.raises(SessionBusy):
            eng.turn(sid, f"user {i}", Request(TWO))
    with pytest.raises(SessionBusy):  # nor does any other mutation pass meanwhile
        eng.add_message(sid, "user", "sneaked in")
    with pytest.raises(SessionBusy):
        eng.rollback(sid, 0)
    assert eng.session(sid).snap is before  # the refusals changed nothing
    gate.set()
    res = first.result(timeout=60)
    got = messages(eng, sid)
    assert got == [("system", SYSTEM), ("user", "user 0"), ("assistant", got[-1][1])], got
    assert res.finish_reason in ("stop", "length")
    eng.turn(sid, "user 1", Request(TWO)).result(timeout=60)  # the lease is free again
    assert [r for r, _ in messages(eng, sid)] == ["system", "user", "assistant", "user",
                                                  "assistant"]


@pytest.mark.parametrize("backend", ["torch"])
def test_a_write_the_store_refuses_changes_nothing(make_engine, tmp_path):
    path = tmp_path / "journal.sqlite3"
    eng = make_engine()
    journal = Journal(path, timeout=0.2)
    journal.attach(eng)
    sid = eng.create_session("agentic", system=SYSTEM)
    eng.turn(sid, "Hi", Request(TWO)).result(timeout=60)
    eng.add_message(sid, "user", "And now?")
    eng.wait_idle()  # the next turn's answer is pre-positioned: an exact fast-path turn
    assert eng.serves_exact(sid, TURN, Request(SamplingParams(max_tokens=1)))
    before = eng.session(sid).snap
    con = locked(path)
    try:
        with pytest.raises(StoreUnavailable) as err:  # one token: committed where served
            eng.turn(sid, None, Request(SamplingParams(max_tokens=1))).result(timeout=60)
        assert "SQLite" in str(err.value) and str(path) not in str(err.value)
        with pytest.raises(StoreUnavailable):
            eng.add_message(sid, "user", "not written")
        with pytest.raises(StoreUnavailable):  # a session whose create is not written is
            eng.create_session("agentic", system=SYSTEM)  # not made
        assert eng.session(sid).snap is before and eng.session_count() == 1
        with pytest.raises(StoreUnavailable):  # nor closed while its rows cannot go
            eng.close_session(sid)
        assert eng.has_session(sid)
    finally:
        con.rollback()
        con.close()
    res = eng.turn(sid, None, Request(TWO)).result(timeout=60)  # the store is back
    journal.close()
    (_, _, history), = Journal(path).load()
    assert history[-1][1] == list(eng.session(sid).snap.messages)
    assert history[-1][1][-1] == {"role": "assistant", "content": res.text}
    assert len(history[-1][1]) == len(before.messages) + 1


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    """POST over a socket of its own: the whole request is written before this returns,
    and the response read in `read` once the server answers."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    return sock


def _read(sock) -> tuple[int, dict]:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    srv = ServerProc(model_dirs["chatml"], tmp / "a", "--store-timeout", "3",
                     journal=tmp / "journal.sqlite3").start()
    yield srv, tmp
    srv.stop()


def test_a_locked_store_fails_the_turn_and_health_answers_meanwhile(server):
    srv, _ = server
    journal = srv.journal
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        sid = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM}).json()["id"]
        r = c.post(f"/sessions/{sid}/messages", json={"role": "user", "content": "Hi"})
        assert r.status_code == 200, r.text
        info = c.get(f"/sessions/{sid}", params={"wait_ready": 30}).json()
        assert "turn" in info["ready"]["records"], info  # the next turn: the exact fast path
        before = state_of(c, sid)
        con = locked(journal)
        order = []
        try:
            # one token: the answer is the ready record's, committed where it is served
            sock = _raw_post(srv.url, f"/sessions/{sid}/turn", {"max_tokens": 1})
            turn = ThreadPoolExecutor(1).submit(lambda: (_read(sock), order.append("turn")))
            health = []
            while not turn.done():  # health, asked again and again while the turn waits
                health.append(c.get("/health").status_code)
                order.append("health")
            (status, body), _ = turn.result()
            order.append("released")  # the lock is let go only now
        finally:
            con.rollback()
            con.close()
        assert set(health) == {200}
        # answered while the turn waited on the store: the event loop did not
        assert order[:5] == ["health"] * 5 and order[-1] == "released", order
        assert status == 503 and body["error"]["code"] == "store_unavailable", body
        message = body["error"]["message"]
        assert "SQLite" in message and str(journal) not in message and "locked" not in message
        assert state_of(c, sid) == before  # the answer was not committed, nor half of it
        r = c.post(f"/sessions/{sid}/turn", json={"max_tokens": 1})  # the store is back
        assert r.status_code == 200 and r.json()["path"] == "fast", r.text
        acked = state_of(c, sid)
        assert acked[0] == before[0] + 1
    srv.stop(signal.SIGKILL)
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert state_of(c, sid) == acked  # what was acknowledged, and nothing else


def test_concurrent_turns_are_admitted_one_at_a_time(server):
    srv, _ = server
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        sid = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM}).json()["id"]

        def turn(i):
            return c.post(f"/sessions/{sid}/turn", json={"user": f"user {i}",
                                                         "max_tokens": 24})

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(turn, range(4)))
        history = state_of(c, sid)[2]
    msgs = json.loads(history)
    said = [m["content"] for m in msgs if m["role"] == "user"]
    ok = [f"user {i}" for i, r in enumerate(replies) if r.status_code == 200]
    for r in replies:
        assert r.status_code == 200 or r.json()["error"]["code"] == "session_busy", r.text
    assert sorted(said) == sorted(ok)  # only the admitted ones committed, each once
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * len(ok)


def test_a_second_server_on_the_journal_refuses_to_start(server, model_dirs):
    srv, tmp = server
    other = ServerProc(model_dirs["chatml"], tmp / "b", journal=srv.journal)
    with pytest.raises(RuntimeError) as err:
        other.start(timeout=60)
    assert f"pid {srv.proc.pid}" in str(err.value) and "exited with 2" in str(err.value)
    with httpx.Client(base_url=srv.url, timeout=60) as c:  # the first serves on
        assert c.get("/health").status_code == 200
