"""Bad input of every class the hardening issue found, against a real `prepos serve`: each
is a 4xx whose JSON body names the problem, leaves every session as it was (version, tokens
and messages compared before and after) and leaves the server healthy. Values at the edge of
the valid range (a temperature of 1e-38, a top_p of 1e-320) are answered, never a 500.
Then the connection-level bounds: huge headers (431), a half-sent request (408 once its
deadline passes), and concurrent creations at the session limit (never past it)."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import httpx
import pytest

from tests.support.helpers import fill_ids
from tests.support.server_harness import ServerProc, sse_events, state_of

SYSTEM = "You are a market analyst. Answer with one word."
Q = "What is the trend?"
KEY = "key-a"
LIMITS = ["--api-key", KEY, "--max-tokens", "16", "--max-input-tokens", "400",
          "--max-session-tokens", "256", "--max-header-bytes", "16384"]
TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {}}}]
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv-bad-input")
    with ServerProc(model_dirs["chatml"], root, *LIMITS, journal=root / "j.sqlite3") as srv:
        yield srv


@pytest.fixture(scope="module")
def long_text(tok):
    """Text within the per-request input limit (400 tokens) but over the context (256)."""
    text = ""
    while len(tok(text, add_special_tokens=False)["input_ids"]) < 300:
        text += "AAPL 101.2 zq "
    return text


@pytest.fixture(scope="module")
def sessions(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        s = c.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                      "standing_queries": [Q]}).json()["id"]
        assert c.post(f"/sessions/{s}/append", json={"data": "AAPL 101 102"}).status_code == 200
        a = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM,
                                      "tools": TOOLS}).json()["id"]
        assert c.post(f"/sessions/{a}/turn", json={"user": "Hi", "max_tokens": 2}).is_success
        t = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM,
                                      "tools": TOOLS}).json()["id"]
        c.post(f"/sessions/{t}/messages", json={"role": "user", "content": "Price?"})
        call = {"function": {"name": "get_price", "arguments": "{\"ticker\": \"AAPL\"}"}}
        r = c.post(f"/sessions/{t}/messages", json={"role": "assistant", "content": "",
                                                    "tool_calls": [call]})
        assert r.status_code == 200, r.text
        e = c.post("/sessions", json={"kind": "streaming"}).json()["id"]  # no data yet
        held_t = c.get(f"/sessions/{t}", params={"include": "messages"}).json()["message_list"]
        yield {"S": s, "A": a, "T": t, "E": e, "held_t": held_t}


def cases(model: str, t: dict, long_text: str):
    def chat(messages=None, **kw):
        return {"model": model, "messages": messages or [{"role": "user", "content": "Hi"}],
                "max_tokens": 2, **kw}

    def cmpl(**kw):
        return {"model": model, "prompt": "AAPL", "max_tokens": 2, **kw}

    V1, CMPL = "/v1/chat/completions", "/v1/completions"
    q = {"question": Q, "max_tokens": 2}
    awaited = [*t["held_t"], {"role": "assistant", "content": "I will not wait."}]
    return [
        # (name, method, path, request, status, code, a word the error must name)
        # OpenAI's seed is an int64, refused in its words
        ("seed-over-int64", "POST", V1, {"json": chat(seed=2**63, temperature=1)}, 400,
         "integer_above_max_value", "seed"),
        ("seed-over-uint64-streamed", "POST", V1,
         {"json": chat(seed=2**64, temperature=1, stream=True)}, 400,
         "integer_above_max_value", "seed"),
        ("seed-under-int64-completion", "POST", CMPL, {"json": cmpl(seed=-(2**63) - 1)}, 400,
         "integer_below_min_value", "seed"),
        ("seed-query", "POST", "/sessions/{S}/query", {"json": {**q, "seed": 2**64}}, 400,
         "invalid_sampling", "seed"),
        ("seed-under-int64-turn", "POST", "/sessions/{A}/turn",
         {"json": {"user": "u", "seed": -(2**63) - 1}}, 400, "invalid_sampling", "seed"),
        ("temperature-infinite", "POST", "/sessions/{S}/query",
         {"content": b'{"question": "q", "temperature": 1e400}', "headers": JSON}, 400, None,
         "temperature"),
        ("presence-penalty", "POST", V1, {"json": chat(presence_penalty=3)}, 400,
         "invalid_request", "presence_penalty"),
        ("frequency-penalty", "POST", CMPL, {"json": cmpl(frequency_penalty=-2.5)}, 400,
         "invalid_request", "frequency_penalty"),
        ("logit-bias-key", "POST", V1, {"json": chat(logit_bias={"abc": 1})}, 400,
         "invalid_request", "logit_bias"),
        ("logit-bias-value", "POST", V1, {"json": chat(logit_bias={"5": 101})}, 400,
         "invalid_request", "logit_bias"),
        ("logit-bias-vocab", "POST", "/sessions/{S}/query",
         {"json": {**q, "logit_bias": {"1000000000": 1}}}, 400, "invalid_request",
         "logit_bias"),
        ("n-zero", "POST", V1, {"json": chat(n=0)}, 400, "invalid_request", "n"),
        ("n-too-many", "POST", CMPL, {"json": cmpl(n=99)}, 400, "invalid_request", "n"),
        ("n-on-agentic-session", "POST", V1,
         {"json": chat([*t["held_t"], {"role": "tool", "content": "42"}], n=2,
                       session_id="{T}")}, 400, "invalid_request", "n"),
        ("best-of", "POST", CMPL, {"json": cmpl(best_of=3)}, 400, "unsupported", "best_of"),
        ("stream-options-without-stream", "POST", V1,
         {"json": chat(stream_options={"include_usage": True})}, 400, "invalid_request",
         "stream_options"),
        ("tool-choice-unknown-function", "POST", V1,
         {"json": chat(tools=TOOLS, tool_choice={"type": "function",
                                                 "function": {"name": "nope"}})}, 400,
         "invalid_request", "tool_choice"),
        ("tool-choice-required-no-tools", "POST", V1, {"json": chat(tool_choice="required")},
         400, "invalid_request", "tool_choice"),
        ("tool-choice-garbage", "POST", V1, {"json": chat(tools=TOOLS, tool_choice=7)}, 400,
         "invalid_request", "tool_choice"),
        ("prompt-token-out-of-vocab", "POST", CMPL, {"json": cmpl(prompt=[1, 10**9])}, 400,
         "invalid_request", "prompt"),
        ("prompt-empty-list", "POST", CMPL, {"json": cmpl(prompt=[])}, 400, "invalid_request",
         "prompt"),
        ("echo-with-logprobs-on-a-session", "POST", CMPL,
         {"json": cmpl(echo=True, logprobs=1, session_id="{S}")}, 400, "unsupported", "echo"),
        ("top-logprobs", "POST", V1, {"json": chat(logprobs=True, top_logprobs=21)}, 400,
         "invalid_request", "top_logprobs"),
        ("response-format-schema", "POST", V1,
         {"json": chat(response_format={"type": "json_schema", "json_schema": {}})}, 400,
         "invalid_request", "response_format"),
        ("response-format-type", "POST", V1,
         {"json": chat(response_format={"type": "yaml"})}, 400, "invalid_request",
         "response_format"),
        ("response-format-keyword", "POST", V1,
         {"json": chat(response_format={"type": "json_schema", "json_schema": {
             "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}})}, 400,
         "invalid_request", "response_format"),
        ("tool-call-arguments-not-text", "POST", V1,
         {"json": chat([{"role": "user", "content": "Price?"},
                        {"role": "assistant", "content": "", "tool_calls": [{
                            "id": "c1", "type": "function", "function": {
                                "name": "get_price", "arguments": 7}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "42"}])}, 400,
         "invalid_request", "arguments"),
        ("tool-result-for-an-unknown-call", "POST", V1,
         {"json": chat([{"role": "user", "content": "Price?"},
                        {"role": "assistant", "content": "", "tool_calls": [{
                            "id": "c1", "type": "function", "function": {
                                "name": "get_price", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c2", "content": "42"}])}, 400,
         "unknown_tool_call_id", "'c2'"),
        ("forced-call-strict-schema-unenforceable", "POST", V1,
         {"json": chat(tool_choice="required", tools=[{"type": "function", "function": {
             "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
                 "a": {"type": "array", "uniqueItems": True}}}}}])}, 400, "invalid_request",
         "tools[0].function.parameters"),
        ("forced-call-parameters-not-an-object", "POST", V1,
         {"json": chat(tool_choice="required", tools=[{"type": "function", "function": {
             "name": "f", "parameters": {"type": "array"}}}])}, 400, "invalid_request",
         "tools[0].function.parameters"),
        ("image-content", "POST", V1,
         {"json": chat([{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": {"url": "x"}}]}])},
         400, "unsupported", "content"),
        ("assistant-while-tool-awaited", "POST", "/sessions/{T}/messages",
         {"json": {"role": "assistant", "content": "no"}}, 409, "tool_result_awaited",
         "tool result"),
        ("assistant-while-tool-awaited-v1", "POST", V1,
         {"json": chat([*awaited, {"role": "user", "content": "and?"}], session_id="{T}")},
         409, "tool_result_awaited", "messages[3]"),
        ("shift-empty-session", "POST", "/sessions/{E}/shift", {"json": {}}, 400,
         "invalid_input", "no data"),
        ("budget-cells-huge", "POST", "/sessions",
         {"json": {"kind": "streaming", "budget_cells": 2**100}}, 400, "invalid_input",
         "budget_cells"),
        ("tools-on-streaming", "POST", "/sessions", {"json": {"kind": "streaming",
                                                              "tools": TOOLS}}, 409,
         "wrong_session_kind", "tools"),
        ("context-overflow-chat", "POST", V1,
         {"json": chat([{"role": "user", "content": long_text}])}, 400,
         "context_length_exceeded", "256"),
        ("context-overflow-completion", "POST", CMPL, {"json": cmpl(prompt=long_text)}, 400,
         "context_length_exceeded", "256"),
        ("huge-headers", "GET", "/sessions/{S}", {"headers": {"X-Big": "x" * 40000}}, 431,
         "headers_too_large", "16384"),
        ("model-retrieve-unknown", "GET", "/v1/models/nope", {}, 404, "model_not_found",
         "nope"),
        ("method-not-allowed", "PUT", "/sessions/{S}", {}, 405, "method_not_allowed", "GET"),
    ]


def test_every_class_of_bad_input_is_a_named_4xx_and_changes_nothing(server, sessions, model,
                                                                     long_text):
    ids = {k: sessions[k] for k in ("S", "A", "T", "E")}
    table = cases(model, sessions, long_text)
    assert len(table) >= 30
    failures = []
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        def states():
            return {k: state_of(c, sid) for k, sid in ids.items()}

        count = len(c.get("/sessions").json()["data"])
        before = states()
        for name, method, path, kw, status, code, mention in table:
            kw = fill_ids(dict(kw), ids)
            with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as one:
                r = one.request(method, path.format(**ids), **kw)
            try:
                err = r.json()["error"]
            except (ValueError, KeyError, TypeError):
                err = {"code": None, "message": r.text, "param": None}
            text = f"{err.get('message')} {err.get('param')}"
            if r.status_code != status or (code and err.get("code") != code) or \
                    mention not in text:
                failures.append(f"{name}: {r.status_code} {err} (wanted {status} {code} "
                                f"naming {mention!r})")
            if status == 405 and "GET" not in r.headers.get("allow", ""):
                failures.append(f"{name}: Allow {r.headers.get('allow')!r} omits GET")
            after = states()
            if after != before:
                failures.append(f"{name}: changed a session")
                before = after
            health = c.get("/health")
            if health.status_code != 200:
                failures.append(f"{name}: the server is not healthy after it: {health.text}")
        assert len(c.get("/sessions").json()["data"]) == count, "a refused create made one"
    assert not failures, "\n".join(failures)


def test_edge_values_are_answered_never_500(server, sessions, model):
    """The smallest positive temperature and top_p pick the likeliest token (no NaN), on
    the OpenAI routes, /query and /turn, streamed or not."""
    edge = [{"temperature": 1e-38}, {"temperature": 1.0, "top_p": 1e-320},
            {"temperature": 0.7, "seed": 2**63 - 1}, {"temperature": 0.7, "seed": -(2**63)}]
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        for kw in edge:
            for stream in (False, True):
                fresh = c.post("/sessions", json={"kind": "agentic"}).json()["id"]
                bodies = [("/v1/chat/completions", {"model": model, "max_tokens": 2,
                                                    "messages": [{"role": "user",
                                                                  "content": "Hi"}]}),
                          ("/v1/completions", {"model": model, "prompt": "AAPL",
                                               "max_tokens": 2}),
                          (f"/sessions/{sessions['S']}/query", {"question": Q,
                                                                "max_tokens": 2}),
                          (f"/sessions/{fresh}/turn", {"user": "again?",
                                                       "max_tokens": 2})]
                for path, body in bodies:
                    r = c.post(path, json={**body, **kw, "stream": stream})
                    assert r.status_code == 200, (path, kw, r.text)
                    if stream:
                        names = [n for n, _ in sse_events(r.text)]
                        assert "error" not in names, (path, kw, r.text)
                        assert "internal_error" not in r.text
                assert c.delete(f"/sessions/{fresh}").status_code == 200


def test_rollback_to_the_current_version_makes_no_version(server, sessions):
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        sid = sessions["S"]
        before = state_of(c, sid)
        r = c.post(f"/sessions/{sid}/rollback", json={"version": before[0]})
        assert r.status_code == 200 and r.json()["version"] == before[0]
        assert state_of(c, sid) == before


def test_health_shows_the_journal_path_to_key_holders_only(server):
    anon = httpx.get(server.url + "/health").json()
    assert anon["journal"] is True and "journal_path" not in anon
    assert str(server.journal) not in httpx.get(server.url + "/health").text
    keyed = httpx.get(server.url + "/health", headers=AUTH).json()
    assert keyed["journal_path"] == str(server.journal)


def test_options_lists_every_method(server, sessions):
    r = httpx.options(f"{server.url}/sessions/{sessions['S']}", headers=AUTH)
    assert r.status_code == 204
    assert {"GET", "DELETE", "OPTIONS"} <= {m.strip() for m in r.headers["allow"].split(",")}


@pytest.fixture(scope="module")
def small(model_dirs, tmp_path_factory):
    """A server at a limit of 4 sessions, whose requests must arrive within 2 s."""
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-small"),
                    "--max-sessions", "4", "--request-timeout", "2") as srv:
        yield srv


def test_concurrent_creations_at_the_limit_never_overshoot(small):
    async def run():
        async with httpx.AsyncClient(base_url=small.url, timeout=120) as c:
            return await asyncio.gather(*[c.post("/sessions", json={"kind": "streaming"})
                                          for _ in range(64)])

    replies = asyncio.run(run())
    codes = sorted(r.status_code for r in replies)
    assert codes.count(201) == 4 and codes.count(429) == 60, codes
    assert all(r.json()["error"]["code"] == "too_many_sessions"
               for r in replies if r.status_code == 429)
    listed = httpx.get(small.url + "/sessions").json()["data"]
    assert len(listed) == 4
    for s in listed:
        assert httpx.delete(f"{small.url}/sessions/{s['id']}").status_code == 200


def test_half_sent_requests_are_closed_at_their_deadline(small):
    """A request whose headers (or body) never finish gets a 408 and a closed connection
    once its deadline (2 s here) passes; the server answers others meanwhile."""
    host, port = small.url.removeprefix("http://").split(":")
    replies: dict[str, bytes] = {}

    def hold(name: str, data: bytes):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(data)
            chunks = []
            while True:
                got = sock.recv(65536)
                if not got:
                    break
                chunks.append(got)
            replies[name] = b"".join(chunks)

    partial = {"head": b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ",
               "body": b"POST /sessions HTTP/1.1\r\nHost: localhost\r\n"
                       b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                       b"{\"kind\": ",
               "silent": b""}
    threads = [threading.Thread(target=hold, args=item) for item in partial.items()]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    assert httpx.get(small.url + "/health").status_code == 200  # not held up by them
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 30
    for name in partial:
        assert replies[name].startswith(b"HTTP/1.1 408"), (name, replies.get(name))
        assert b'"request_timeout"' in replies[name]
    assert httpx.get(small.url + "/health").status_code == 200


def _exchange(url: str, pieces: list[bytes]) -> bytes:
    """What the server writes back to these bytes, sent as separate writes, until it closes
    the connection (a read waiting 10 s fails the test)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except OSError:  # the server closed the connection already
                break
            time.sleep(0.01)
        chunks = []
        while got := sock.recv(65536):
            chunks.append(got)
    return b"".join(chunks)


def test_a_head_sent_in_pieces_past_the_limit_is_431_and_closed(server):
    """Headers sent a few KB at a time, never ending: once they pass the limit (16 KB
    here) the answer is a JSON 431 and the connection closes; nothing else is answered."""
    pieces = [b"GET /health HTTP/1.1\r\nHost: localhost\r\n"] + \
        [b"X-Pad-%d: %s\r\n" % (i, b"y" * 4000) for i in range(8)]
    reply = _exchange(server.url, pieces)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert reply.count(b"HTTP/1.1") == 1
    assert b'"headers_too_large"' in reply and b"16384" in reply


def test_a_request_the_parser_cannot_read_is_a_json_400(server):
    reply = _exchange(server.url,
                      [b"GET /health HTTP/1.1\r\nHost: localhost\r\nBad Header\r\n\r\n"])
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b'"invalid_request"' in reply
    assert httpx.get(server.url + "/health").status_code == 200


def test_pipelined_requests_are_each_answered_in_order(server):
    """Two requests in one write on a kept-alive connection, then a third that closes it:
    three answers, in order (the guard's head count and deadline are per request)."""
    get = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer key-a\r\n\r\n"
    bad = b"GET /v1/models/nope HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer key-a\r\n" \
          b"Connection: close\r\n\r\n"
    reply = _exchange(server.url, [get + get, bad])
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", reply) == [b"200", b"200", b"404"], reply[:400]
