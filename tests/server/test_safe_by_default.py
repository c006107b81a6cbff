"""Safe by default: no web page can drive a local server (its Host, Origin and Content-Type
checked before any route runs, keys or not), no API key crowds out another (sessions and
event subscriptions shared between keys), no error body shows an internal id, and a
forwarding signature is good for its one request only."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading

import httpx
import pytest

from prepos.server.http.cross_site import CrossSite
from prepos.server.http.errors import ApiError, scrub
from prepos.server.http.forwarding import FORWARDED, Forwarder
from tests.support.server_harness import ServerProc

KEY_A, KEY_B = "key-a", "key-b"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def open_server(model_dirs, tmp_path_factory):
    """No keys, on loopback: the default."""
    work = tmp_path_factory.mktemp("srv-open")
    with ServerProc(model_dirs["chatml"], work, "--threads", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server(model_dirs, tmp_path_factory):
    """Two keys, five sessions and four subscriptions in all: two of each a key."""
    work = tmp_path_factory.mktemp("srv-keyed")
    with ServerProc(model_dirs["chatml"], work, "--threads", "1", "--api-key", KEY_A,
                    "--api-key", KEY_B, "--max-sessions", "5", "--max-subscribers", "4",
                    journal=work / "journal.sqlite3") as srv:
        yield srv


def sessions(url: str, headers: dict | None = None) -> int:
    r = httpx.get(url + "/sessions", headers=headers or {})
    assert r.status_code == 200, r.text
    return len(r.json()["data"])


def code(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


# -- a web page cannot drive it ---------------------------------------------------------------
def test_a_cross_site_simple_post_is_refused_and_changes_nothing(open_server):
    url = open_server.url
    before = sessions(url)
    body = json.dumps({"kind": "streaming"})
    evil = {"origin": "http://evil.example"}
    r = httpx.post(url + "/sessions", content=body, headers={"content-type": "text/plain",
                                                                **evil})
    assert r.status_code == 403 and code(r) == "origin_not_allowed", r.text
    r = httpx.post(url + "/sessions", content=body, headers={**JSON, **evil})
    assert r.status_code == 403 and code(r) == "origin_not_allowed", r.text
    r = httpx.post(url + "/sessions", content=body, headers={**JSON,
                                                             "sec-fetch-site": "cross-site"})
    assert r.status_code == 403 and code(r) == "origin_not_allowed", r.text
    r = httpx.post(url + "/sessions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and code(r) == "unsupported_media_type", r.text
    r = httpx.post(url + "/sessions", content=body)  # no Content-Type at all
    assert r.status_code == 415, r.text
    r = httpx.post(url + "/v1/conversations", data={"metadata": "x"})  # form data
    assert r.status_code == 415, r.text
    r = httpx.post(url + "/v1/conversations", data={"metadata": "x"}, headers=evil)
    assert r.status_code == 403, r.text
    assert sessions(url) == before
    assert httpx.get(url + "/v1/conversations/conv_none").status_code == 404  # nothing made


def test_a_foreign_host_is_refused(open_server):
    """DNS rebinding: a page's own name resolved to this machine sends its Host."""
    url = open_server.url
    sid = httpx.post(url + "/sessions", json={"kind": "streaming"}).json()["id"]
    port = url.rsplit(":", 1)[1]
    r = httpx.get(f"{url}/sessions/{sid}", headers={"host": f"evil.example:{port}"})
    assert r.status_code == 403 and code(r) == "host_not_allowed", r.text
    assert sid not in r.text
    r = httpx.post(f"{url}/sessions/{sid}/append", json={"data": "x"},
                   headers={"host": f"evil.example:{port}"})
    assert r.status_code == 403, r.text
    assert httpx.get(f"{url}/sessions/{sid}").json()["version"] == 0  # nothing appended
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"app.localhost:{port}"):
        assert httpx.get(f"{url}/sessions/{sid}", headers={"host": host}).status_code == 200


def test_the_console_s_own_origin_is_taken(open_server):
    url = open_server.url
    r = httpx.post(url + "/sessions", json={"kind": "streaming"}, headers={"origin": url})
    assert r.status_code == 201, r.text
    assert httpx.get(url + "/ui").status_code == 200


def test_the_checks_by_configuration():
    def scope(method="POST", host=b"127.0.0.1:8000", **headers):
        hs = [(b"host", host)] if host is not None else []
        hs += [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
        return {"type": "http", "method": method, "headers": hs, "scheme": "http"}

    local = CrossSite("127.0.0.1")
    assert local.check(scope(content_type="application/json", content_length="2")) is None
    assert local.check(scope(content_type="application/vnd.api+json; charset=utf-8",
                             content_length="2")) is None
    assert local.check(scope(content_length="0")) is None  # no body: no type needed
    assert local.check(scope(method="GET", origin="http://evil.example")) is None
    assert local.check(scope(host=b"[::1]:8000", origin="http://[::1]:8000")) is None
    assert local.check(scope(origin="null")).code == "origin_not_allowed"
    assert local.check(scope(host=b"evil.example")).status == 403
    assert local.check(scope(host=b"10.1.2.3:80")) is None  # an address: nothing resolved
    assert local.check(scope(host=None)) is None
    assert local.check(scope(host=b"a:b:c")).code == "host_not_allowed"
    assert local.check(scope(transfer_encoding="chunked")).status == 415
    named = CrossSite("0.0.0.0", allowed_hosts=(".example.test",),
                      allowed_origins=("https://app.example.test",))
    assert named.check(scope(host=b"api.example.test")) is None
    assert named.check(scope(host=b"example.test")) is None
    assert named.check(scope(host=socket.gethostname().encode())) is None  # bound beyond
    assert named.check(scope(host=b"api.example.test",
                             origin="https://app.example.test")) is None
    assert named.check(scope(host=b"api.example.test", origin="https://x.example.test")).status \
        == 403
    assert CrossSite("127.0.0.1", allowed_hosts=("*",)).check(scope(host=b"any.where")) is None
    assert CrossSite("127.0.0.1", allowed_origins=("*",)).check(
        scope(origin="http://evil.example")) is None


# -- keys share fairly -------------------------------------------------------------------------
def test_one_key_at_its_share_cannot_make_another_s_requests_fail(keyed_server, model):
    url = keyed_server.url
    a, b = ({"authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
    made = []
    for _ in range(4):  # A tries for more than its share (5 // 2 = 2)
        r = httpx.post(url + "/sessions", json={"kind": "streaming"}, headers=a)
        if r.status_code != 201:
            break
        made.append(r.json()["id"])
    assert len(made) == 2, made
    assert r.status_code == 429 and code(r) == "too_many_sessions", r.text
    assert "share" in r.json()["error"]["message"] and r.headers["retry-after"]
    r = httpx.post(url + "/sessions", json={"kind": "streaming"}, headers=b)
    assert r.status_code == 201, r.text  # B as if A were not there
    r = httpx.post(url + "/v1/responses", json={"model": model, "input": "Hi",
                                                "max_output_tokens": 2}, headers=b)
    assert r.status_code == 200, r.text
    for sid in made:
        assert httpx.delete(f"{url}/sessions/{sid}", headers=a).status_code == 200


def test_event_subscriptions_are_shared_between_keys(keyed_server):
    """A loop that tries to open more subscriptions than a key's share never holds more:
    the one past it is 429; the other key opens its own; a closed one frees its place."""
    url = keyed_server.url
    a, b = ({"authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
    sa = httpx.post(url + "/sessions", json={"kind": "streaming"}, headers=a).json()["id"]
    sb = httpx.post(url + "/sessions", json={"kind": "streaming"}, headers=b).json()["id"]
    client = httpx.Client(timeout=30)
    held, refused = [], []
    try:
        for sid, h in [(sa, a)] * 5 + [(sb, b)] * 2:
            r = client.send(client.build_request("GET", f"{url}/sessions/{sid}/events",
                                                 headers=h), stream=True)
            if r.status_code == 200:
                held.append(r)
            else:
                r.read()
                refused.append((sid, r.status_code, code(r), r.headers.get("retry-after")))
        assert [x[0] for x in refused] == [sa] * 3, refused
        assert all(x[1:3] == (429, "too_many_subscribers") and x[3] for x in refused)
        held.pop(0).close()  # one of A's ends: its place is A's again
        for _ in range(100):
            r = client.send(client.build_request("GET", f"{url}/sessions/{sa}/events",
                                                 headers=a), stream=True)
            if r.status_code == 200:
                held.append(r)
                break
            r.read()
            threading.Event().wait(0.05)  # the server sees the close at its next read
        assert r.status_code == 200
    finally:
        for r in held:
            r.close()
        client.close()


# -- nothing internal in messages ---------------------------------------------------------------
def test_no_error_body_shows_an_internal_id(keyed_server, model):
    url = keyed_server.url
    a = {"authorization": f"Bearer {KEY_A}"}
    r = httpx.post(url + "/sessions", json={"kind": "agentic", "session_id": "idc",
                                            "system": "S."}, headers=a)
    assert r.status_code == 201, r.text
    r = httpx.post(url + "/sessions/idc/turn", json={"user": "hi", "max_tokens": 2}, headers=a)
    assert r.status_code == 200, r.text
    bodies = [
        httpx.post(url + "/v1/chat/completions", headers=a, json={
            "model": model, "session_id": "idc", "max_tokens": 2,
            "messages": [{"role": "system", "content": "S."},
                         {"role": "user", "content": "something else"},
                         {"role": "assistant", "content": "x"},
                         {"role": "user", "content": "more"}]}),
        httpx.post(url + "/sessions/idc/append", json={"data": "x"}, headers=a),
        httpx.post(url + "/sessions/idc/rollback", json={"version": 99}, headers=a),
        httpx.get(url + "/sessions/idc~0123456789abcdef", headers=a),
    ]
    assert bodies[0].status_code == 409 and code(bodies[0]) == "conversation_diverged"
    digest = hashlib.sha256(KEY_A.encode()).hexdigest()[:16]
    for r in bodies:
        assert r.status_code >= 400 and "~" not in r.text and digest not in r.text, r.text
    assert "idc" in bodies[0].json()["error"]["message"]


def test_scrub():
    assert scrub("session orders~0123456789abcdef at version 2") == \
        "session orders at version 2"
    assert scrub("no session 'eph-12ab'") == "no session a kept conversation"
    assert scrub("owner key-0123456789abcdef") == "owner a key"
    assert scrub("a plain ~ message") == "a plain ~ message"


# -- the forwarding header ------------------------------------------------------------------------
def test_a_forwarding_signature_is_bound_to_its_request():
    """Signed over its body, a timestamp and a nonce: another body does not verify (the header
    dropped), the same header twice or an old one is refused."""
    sender, receiver = Forwarder(b"s" * 32, "na", 1 << 20), Forwarder(b"s" * 32, "nb", 1 << 20)
    body = b'{"data": "x"}'

    def arriving(value: bytes, sent: bytes):
        scope = {"method": "POST", "path": "/sessions/s/append", "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (FORWARDED, value)]}

        async def receive():
            return {"type": "http.request", "body": sent, "more_body": False}

        return scope, receive

    def verify(value: bytes, sent: bytes):
        scope, receive = arriving(value, sent)
        asyncio.run(receiver.verify(scope, "s", receive))
        return scope

    header = sender.header(arriving(b"", body)[0], "s", body)[1]
    tampered = verify(header, b'{"data": "y"}')
    assert tampered["prepos.forwarded"] is False
    assert all(k != FORWARDED for k, _ in tampered["headers"])
    verified = verify(header, body)
    assert verified["prepos.forwarded"] is True and verified["prepos.body"] == body
    with pytest.raises(ApiError) as again:
        verify(header, body)
    assert again.value.code == "forwarding_refused"
    node, ts, nonce, _ = header.decode().split(":")
    old = f"{float(ts) - 3600:.3f}"
    mac = sender.sign("na", old, "n2", arriving(b"", body)[0], "s", body)
    with pytest.raises(ApiError) as stale:
        verify(f"na:{old}:n2:{mac}".encode(), body)
    assert "stale" in stale.value.message
