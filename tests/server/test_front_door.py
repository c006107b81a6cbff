"""The front door (`server/http/front.py`): a request's head is read once, whichever way it
goes on (the straight line, FastAPI's routes, a refusal), and sizes are refused there, before
any route, with the connection closed and the refusal counted."""

from __future__ import annotations

import pytest

from prepos.server.http import head as head_module
from prepos.server.http.head import Head
from tests.support.helpers import loaded_app


def scope(*headers: tuple[bytes, bytes], path: str = "/v1/chat/completions") -> dict:
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "headers": list(headers)}


def test_a_head_keeps_the_first_of_each_header_and_counts_its_size():
    s = scope((b"host", b"localhost:8000"), (b"content-length", b"12"),
              (b"content-length", b"99"), (b"authorization", b"Bearer a"),
              (b"x-session-id", b"s1"), (b"session-id", b"codex-1"), (b"session-id", b"x"),
              (b"idempotency-key", b"k"), (b"content-type", b"application/json"))
    h = Head(s)
    assert (h.host, h.length, h.auth, h.session) == (b"localhost:8000", b"12", b"Bearer a",
                                                     b"s1")
    assert h.agents == {b"session-id": b"codex-1"} and h.idempotent and h.body
    assert h.size == len(b"/v1/chat/completions") + sum(
        len(k) + len(v) + 4 for k, v in s["headers"])
    assert not Head(scope((b"content-length", b"0"))).body
    assert Head(scope((b"transfer-encoding", b"chunked"))).body


@pytest.fixture(scope="module")
def app_client(model_dirs):

    from prepos.config import EngineConfig
    from prepos.server.http.app import create_app
    from prepos.server.http.limits import Limits
    from prepos.server.http.state import ServerConfig

    app = create_app(ServerConfig(model=model_dirs["chatml"], limits=Limits(
        max_body_bytes=4096, max_header_bytes=2048), engine=EngineConfig(
        backend="torch", threads=2)))
    with loaded_app(app) as c:
        yield c


def test_every_way_in_reads_the_head_once(app_client, monkeypatch):
    """The straight line (a standing query), FastAPI's routes (chat, a session's append),
    and a refusal each read the request's head once."""
    c = app_client
    reads = []
    real = head_module.Head.__init__

    def counted(self, scope):
        reads.append(scope["path"])
        real(self, scope)

    sid = c.post("/sessions", json={"kind": "streaming", "standing_queries": ["Up?"]}
                 ).json()["id"]
    c.post(f"/sessions/{sid}/append", json={"data": "ACME 1 2 3"})
    model = c.get("/v1/models").json()["data"][0]["id"]
    monkeypatch.setattr(head_module.Head, "__init__", counted)
    r = c.post(f"/sessions/{sid}/query", json={"question": "Up?", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.headers["x-session-id"] == sid  # named back by the straight line
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "model": model})
    assert r.status_code == 200, r.text
    r = c.post(f"/sessions/{sid}/append", json={"data": "ACME 4"},
               headers={"x-session-id": sid})
    assert r.status_code == 200, r.text
    assert c.post("/v1/chat/completions", content=b"x" * 5000,
                  headers={"content-type": "application/json"}).status_code == 413
    assert reads == [f"/sessions/{sid}/query", "/v1/chat/completions",
                     f"/sessions/{sid}/append", "/v1/chat/completions"]


def test_sizes_are_refused_at_the_door_closed_and_counted(app_client):
    c = app_client

    def refused(code: str) -> float:
        text = c.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("prepos:http_errors_total") and f'code="{code}"' in line)

    before = {code: refused(code) for code in ("body_too_large", "headers_too_large",
                                               "invalid_request")}
    cases = [({"content": b"{}" * 3000, "headers": {"content-type": "application/json"}},
              413, "body_too_large"),
             ({"json": {}, "headers": {"x-big": "x" * 3000}}, 431, "headers_too_large"),
             ({"content": b"{}", "headers": {"content-type": "application/json",
                                             "content-length": "two"}},
              400, "invalid_request")]
    for kw, status, code in cases:
        r = c.post("/v1/chat/completions", **kw)
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        assert r.headers["connection"] == "close"
    after = {code: refused(code) for code in before}
    assert all(after[code] == before[code] + 1 for code in before), (before, after)
