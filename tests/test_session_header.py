"""`x-session-id`, on one node (no shared store): accepted on every request naming a session
and set on every response that names one; a session made with the id a client chose; the
header alone names an OpenAI request's session; a malformed or contradicting id is a 400
naming the problem, and a malformed id in a path the route's 404, never a 500."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerProc


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
