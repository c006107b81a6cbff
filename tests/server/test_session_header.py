"""`x-session-id`, on one node (no shared store): accepted on every request naming a session
and set on every response that names one; a session made with the id a client chose; the
header alone names an OpenAI request's session; a malformed or contradicting id is a 400
naming the problem, and a malformed id in a path the route's 404, never a 500."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.helpers import loaded_app
from tests.support.server_harness import ServerProc


@pytest.fixture(scope="module")
def client(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("hdr")) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def test_a_session_made_with_the_clients_id_and_named_by_the_header(client):
    r = client.post("/sessions", json={"kind": "streaming", "standing_queries": ["trend?"]},
                    headers={"x-session-id": "dash-1"})
    assert r.status_code == 201 and r.json()["id"] == "dash-1"
    assert r.headers["x-session-id"] == "dash-1"
    again = client.post("/sessions", json={"kind": "agentic", "session_id": "dash-1"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "session_exists"
    made = client.post("/sessions", json={"kind": "agentic"})
    assert made.headers["x-session-id"] == made.json()["id"]  # the server's own id
    r = client.post("/sessions/dash-1/append", json={"data": "AAPL 101 102"})
    assert r.status_code == 200 and r.headers["x-session-id"] == "dash-1"
    # the OpenAI route: the header alone names the session (its body has no session_id)
    r = client.post("/v1/chat/completions", headers={"x-session-id": "dash-1"}, json={
        "model": "chatml-llama", "max_tokens": 1,
        "messages": [{"role": "user", "content": "trend?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["prepos"]["session_id"] == "dash-1" and r.json()["prepos"]["version"] == 1
    assert r.headers["x-session-id"] == "dash-1"


def test_coding_agents_name_their_conversation_in_their_own_headers(client):
    """Claude Code's `x-claude-code-session-id`, Codex's `session-id` / `thread-id` name the
    conversation on the /v1/ routes where `x-session-id` is not sent (named back in it, for
    a router to hash on); a value that is no valid name is ignored, never a 400; the session
    API's routes keep to `x-session-id` and the path."""
    chat = {"model": "chatml-llama", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]}
    for header in ("x-claude-code-session-id", "session-id", "thread-id"):
        r = client.post("/v1/chat/completions", json=chat, headers={header: f"cc-{header}"})
        assert r.status_code == 200 and r.headers["x-session-id"] == f"cc-{header}", r.text
    r = client.post("/v1/chat/completions", json=chat, headers={
        "session-id": "codex-1", "thread-id": "codex-2", "x-session-id": "mine"})
    assert r.headers["x-session-id"] == "mine"  # x-session-id first
    r = client.post("/v1/chat/completions", json=chat, headers={"session-id": "a b"})
    assert r.status_code == 200 and "x-session-id" not in r.headers
    r = client.post("/v1/responses", json={"model": "chatml-llama", "input": "hi",
                                           "max_output_tokens": 1, "store": False},
                    headers={"session-id": "codex-3"})
    assert r.status_code == 200 and r.headers["x-session-id"] == "codex-3", r.text
    made = client.post("/sessions", json={"kind": "agentic"}, headers={"session-id": "zz"})
    assert made.status_code == 201 and made.json()["id"] != "zz"


def test_bad_ids_are_400s_and_change_nothing(client):
    n = len(client.get("/sessions").json()["data"])
    bad = client.post("/sessions", json={"kind": "agentic"}, headers={"x-session-id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_session_id"
    differ = client.post("/sessions/s-x/append", json={"data": "x"},
                         headers={"x-session-id": "s-y"})
    assert differ.status_code == 400
    assert differ.json()["error"]["code"] == "session_id_mismatch"
    body = client.post("/v1/chat/completions", headers={"x-session-id": "s-y"}, json={
        "model": "chatml-llama", "messages": [{"role": "user", "content": "hi"}],
        "session_id": "s-x"})
    assert body.status_code == 400 and body.json()["error"]["param"] == "session_id"
    weird = client.get("/sessions/%C2%AC%F3%A2%B4%93/events")
    assert weird.status_code == 404 and "x-session-id" not in weird.headers
    assert len(client.get("/sessions").json()["data"]) == n


def test_an_append_answers_the_same_on_the_straight_line_and_through_the_stack(client):
    """A plain append is handled in front of FastAPI's stack; the same append naming its
    session in `x-session-id` goes through the stack. Both answer alike, success and every
    refusal (bad body, unknown session, wrong kind, a stale expected version)."""
    line = client.post("/sessions", json={"kind": "streaming"}).json()["id"]
    stack = client.post("/sessions", json={"kind": "streaming"}).json()["id"]
    agentic = client.post("/sessions", json={"kind": "agentic"}).json()["id"]
    cases = [("ok", {"json": {"data": "AAPL 101 102", "wait": False}}),
             ("ok-waited", {"json": {"data": "MSFT 301 302"}}),
             ("not-json", {"content": b"{data", "headers": {"content-type": "application/json"}}),
             ("no-data", {"json": {"wait": False}}),
             ("wrong-type", {"json": {"data": 7}}),
             ("extra-field", {"json": {"data": "x", "nope": 1}}),
             ("stale-version", {"json": {"data": "x", "expected_version": 0}}),
             ("unknown", {"json": {"data": "x"}, "sid": "no-such-session"}),
             ("agentic", {"json": {"data": "x"}, "sid": agentic})]
    for name, kw in cases:
        answers = []
        for sid, header in ((line, False), (stack, True)):
            sid = kw.get("sid", sid)
            headers = {**kw.get("headers", {}), **({"x-session-id": sid} if header else {})}
            r = client.post(f"/sessions/{sid}/append", headers=headers,
                            **{k: v for k, v in kw.items() if k in ("json", "content")})
            body = r.json()
            body.pop("session_id", None)
            body = json.dumps(body).replace(sid, "{sid}")  # an error names its session
            answers.append((r.status_code, r.headers["content-type"], body,
                            r.headers.get("x-session-id") == sid))
        assert answers[0] == answers[1], (name, answers)
        status = answers[0][0]
        assert status == 200 if name.startswith("ok") else 400 <= status < 500, (name, status)


def test_a_scrape_answers_the_same_on_the_straight_line_and_through_the_stack(model_dirs):
    """GET /metrics is handled in front of FastAPI's stack (fast.py); with CORS on, every
    request goes through the stack. Both answer alike: a 401 naming the problem without a
    metrics key, with a bad one and with an API key that is not one; the exposition's
    families with one, no session named back."""

    from prepos.config import EngineConfig
    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    answers = []
    for origins in ((), ("http://dash.example",)):
        app = create_app(ServerConfig(model=model_dirs["chatml"], api_keys=("key",),
                                      metrics_keys=("scrape",), allowed_origins=origins,
                                      engine=EngineConfig(backend="torch", threads=2)))
        assert (app.fast_route is None) == bool(origins)
        with loaded_app(app) as c:
            seen = []
            for auth in (None, "Basic x", "Bearer nope", "Bearer key", "Bearer scrape"):
                r = c.get("/metrics", headers={"Authorization": auth} if auth else {})
                body = ([line for line in r.text.splitlines() if line.startswith("# ")]
                        if r.status_code == 200 else r.json())
                seen.append((r.status_code, r.headers["content-type"], body,
                             r.headers.get("www-authenticate"), "x-session-id" in r.headers))
            answers.append(seen)
    assert answers[0] == answers[1]
    assert [a[0] for a in answers[0]] == [401, 401, 401, 401, 200]
    assert answers[0][-1][2][:2] == ["# HELP prepos:prompt_tokens_total Prompt tokens of "
                                     "finished requests (session state plus entry)",
                                     "# TYPE prepos:prompt_tokens_total counter"]
