"""`/openapi.json` against the server it documents: every registered route is in it with
its methods; real responses of every operation (JSON bodies, each event of an SSE stream,
error bodies) validate against the documented schemas (`jsonschema`, Draft 2020-12); and a
bounded, derandomized schemathesis run over every operation finds no 5xx, no undocumented
status or content type, no response off its schema, and only 4xx error bodies of the one
JSON shape, naming the problem, with OpenAI's error type (Anthropic's shape and types on the
Messages API's routes)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

from prepos.server.http.app import create_app
from prepos.server.http.state import ServerConfig
from tests.support.server_harness import ServerProc, sse_events

SYSTEM = "Live price feed. Answer in one word."
Q = "Which way is ACME moving?"
TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string"}}}}}]
CALL = {"function": {"name": "get_price", "arguments": "{\"ticker\": \"ACME\"}"}}
ARGS = ["--max-tokens", "8", "--default-max-tokens", "4", "--max-session-tokens", "512",
        "--max-input-tokens", "400", "--max-sessions", "64", "--response-sessions", "8"]
FASTAPI_OWN = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def openai_type(status: int) -> str:
    """OpenAI's error type of a 4xx: invalid_request_error, but for keys and rate limits."""
    return {401: "authentication_error", 403: "permission_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error")


def anthropic_type(status: int) -> str:
    """Anthropic's error type of a 4xx (the Messages API's routes)."""
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error"}.get(status,
                                                                   "invalid_request_error")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-openapi"), *ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def doc(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# -- the document -------------------------------------------------------------------------
def test_every_registered_route_is_documented_with_its_methods(model_dirs, doc):
    app = create_app(ServerConfig(model=model_dirs["chatml"]))
    local = app.openapi()
    assert local["openapi"].startswith("3.1") and local == doc
    registered = {(r.path.replace(":path", ""), r.method) for r in app.state.api_routes}
    documented = {(p, m.upper()) for p, ops in doc["paths"].items() for m in ops}
    assert registered == documented and len(documented) >= 17
    served = {r.path.replace(":path", "") for r in app.router.routes} - FASTAPI_OWN
    assert served == set(doc["paths"])  # no route outside the registry
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["summary"] and op["operationId"], (method, path)
            ok = [s for s in op["responses"] if s.startswith("2")]
            assert ok and op["responses"][ok[0]]["content"], (method, path)
            shape = "AnthropicError" if path.startswith("/v1/messages") else "ErrorBody"
            for status, resp in op["responses"].items():
                if status.startswith("4"):
                    ref = resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref == f"#/components/schemas/{shape}", (method, path, status)
            if "requestBody" in op:
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in schemas
                assert "400" in op["responses"] and "413" in op["responses"]
            if "{" in path:
                assert "404" in op["responses"]
    params = {p["name"]: p for p in doc["paths"]["/sessions/{sid}"]["get"]["parameters"]}
    assert params["sid"]["in"] == "path" and params["sid"]["required"]
    assert params["wait_ready"]["in"] == "query" and params["include"]["in"] == "query"
    for path in ("/sessions/{sid}/query", "/v1/chat/completions", "/sessions/{sid}/events"):
        assert "text/event-stream" in doc["paths"][path][
            "post" if "events" not in path else "get"]["responses"]["200"]["content"]
    for schema in schemas.values():  # every schema is itself valid JSON Schema
        Draft202012Validator.check_schema(schema)


# -- real responses -----------------------------------------------------------------------
class Checker:
    """Validates responses against the document; remembers which operations it saw
    succeed."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.ok: set[tuple[str, str]] = set()
        self.events = 0

    def _validate(self, instance, schema: dict, where: str) -> None:
        root = {**schema, "components": self.doc["components"]}
        errors = sorted(Draft202012Validator(root).iter_errors(instance), key=str)
        assert not errors, f"{where}: {errors[0].message} at {list(errors[0].absolute_path)}"

    def _data_ok(self, spec: dict, data) -> bool:
        if "anyOf" in spec:
            return any(self._data_ok(s, data) for s in spec["anyOf"])
        if "const" in spec:
            return data == spec["const"]
        root = {**spec["contentSchema"], "components": self.doc["components"]}
        return not isinstance(data, str) and Draft202012Validator(root).is_valid(data)

    def __call__(self, path: str, method: str, r: httpx.Response) -> httpx.Response:
        where = f"{method} {path} -> {r.status_code}"
        op = self.doc["paths"][path][method.lower()]
        assert str(r.status_code) in op["responses"], f"{where}: undocumented status"
        media = r.headers["content-type"].split(";")[0].strip()
        content = op["responses"][str(r.status_code)]["content"]
        assert media in content, f"{where}: undocumented content type {media}"
        schema = content[media]["schema"]
        if media == "text/event-stream":
            events = sse_events(r.text)
            assert events, where
            for name, data in events:
                branches = [b for b in schema["oneOf"]
                            if b["properties"]["event"]["const"] == name]
                assert branches, f"{where}: undocumented event {name!r}"
                assert self._data_ok(branches[0]["properties"]["data"], data), \
                    f"{where}: event {name!r} off its schema: {data}"
                self.events += 1
        elif media == "application/json":
            self._validate(r.json(), schema, where)
        if r.is_success:
            self.ok.add((path, method.lower()))
        return r


def test_real_responses_of_every_route_validate_against_the_document(client, doc, model,
                                                                     server):
    check = Checker(doc)
    get, post = client.get, client.post
    check("/health", "GET", get("/health"))
    check("/metrics", "GET", get("/metrics"))
    # a streaming session: create, append, inspect, query (JSON and SSE), rollback, shift
    r = check("/sessions", "POST", post("/sessions", json={
        "kind": "streaming", "system": SYSTEM, "standing_queries": [Q]}))
    s = r.json()["id"]
    S = "/sessions/{sid}"
    check(S + "/append", "POST", post(f"/sessions/{s}/append", json={"data": "ACME 101 102"}))
    check(S, "GET", get(f"/sessions/{s}", params={"wait_ready": 5,
                                                 "include": "tokens,messages"}))
    check("/sessions", "GET", get("/sessions"))
    check(S + "/query", "POST", post(f"/sessions/{s}/query", json={
        "question": Q, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}))
    check(S + "/query", "POST", post(f"/sessions/{s}/query", json={
        "question": "Up or down?", "max_tokens": 3, "stream": True, "logprobs": True}))
    check(S + "/append", "POST", post(f"/sessions/{s}/append", json={"data": "ACME 103"}))
    check(S + "/rollback", "POST", post(f"/sessions/{s}/rollback", json={"version": 1}))
    check(S + "/shift", "POST", post(f"/sessions/{s}/shift", json={"drop": 1}))
    # its event stream: hello, then a commit, then close (the session closed) ends it
    with httpx.Client(base_url=server.url, timeout=60) as other, \
            client.stream("GET", f"/sessions/{s}/events") as ev:
        lines = ev.iter_lines()
        assert next(lines).startswith("event: hello")
        other.post(f"/sessions/{s}/append", json={"data": "ACME 104"})
        check(S, "DELETE", other.delete(f"/sessions/{s}"))
        text = "event: hello\n" + "\n".join(lines)
    ev._content = text.encode()  # the whole stream, as read
    check(S + "/events", "GET", ev)
    names = [n for n, _ in sse_events(text)]
    assert names[0] == "hello" and "commit" in names and names[-1] == "close"
    # an agentic session: a message, a turn (JSON, SSE), a tool call and its result
    a = check("/sessions", "POST", post("/sessions", json={
        "kind": "agentic", "system": SYSTEM, "tools": TOOLS})).json()["id"]
    check(S + "/messages", "POST", post(f"/sessions/{a}/messages", json={
        "role": "user", "content": "Price of ACME?"}))
    check(S + "/turn", "POST", post(f"/sessions/{a}/turn", json={"max_tokens": 3}))
    check(S + "/turn", "POST", post(f"/sessions/{a}/turn", json={
        "user": "And now?", "max_tokens": 3, "stream": True}))
    check(S + "/messages", "POST", post(f"/sessions/{a}/messages", json={
        "role": "assistant", "content": "", "tool_calls": [CALL]}))
    check(S + "/tool_result", "POST", post(f"/sessions/{a}/tool_result", json={
        "content": "101.5", "max_tokens": 3, "logprobs": True}))
    # the OpenAI routes: models, chat and completions, whole and streamed, with logprobs
    check("/v1/models", "GET", get("/v1/models"))
    check("/v1/models/{model_id}", "GET", get(f"/v1/models/{model}"))
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Hello?"}]
    check(chat, "POST", post(chat, json={"model": model, "messages": msgs, "max_tokens": 3,
                                         "logprobs": True, "top_logprobs": 2, "n": 2}))
    check(chat, "POST", post(chat, json={"model": model, "messages": msgs, "max_tokens": 3,
                                         "tools": TOOLS, "tool_choice": "required"}))
    check(chat, "POST", post(chat, json={"model": model, "messages": msgs, "max_tokens": 3,
                                         "stream": True, "logprobs": True,
                                         "stream_options": {"include_usage": True}}))
    check(chat, "POST", post(chat, json={"model": model, "session_id": a, "max_tokens": 3,
                                         "messages": [*msgs]}))  # diverged: a 409
    cmpl = "/v1/completions"
    for extra in ({"logprobs": 0}, {"logprobs": 2, "n": 2}, {"echo": True},
                  {"stream": True, "logprobs": 1, "stream_options": {"include_usage": True}}):
        check(cmpl, "POST", post(cmpl, json={"model": model, "prompt": "ACME", "max_tokens": 3,
                                             **extra}))
    # the Responses API: create (whole, streamed, a function call), retrieve, delete
    resp, one = "/v1/responses", "/v1/responses/{response_id}"
    tool = {"type": "function", "name": "get_price", "parameters": TOOLS[0]["function"][
        "parameters"]}
    rid = check(resp, "POST", post(resp, json={"model": model, "input": "Hello?",
                                               "max_output_tokens": 3, "metadata": {"a": "b"},
                                               "instructions": SYSTEM})).json()["id"]
    check(resp, "POST", post(resp, json={"model": model, "input": "Again?", "stream": True,
                                         "previous_response_id": rid, "instructions": SYSTEM,
                                         "max_output_tokens": 3}))
    check(resp, "POST", post(resp, json={"model": model, "input": "Price?", "tools": [tool],
                                         "tool_choice": "required", "max_output_tokens": 3}))
    check(one, "GET", get(f"/v1/responses/{rid}"))
    check(one, "DELETE", client.delete(f"/v1/responses/{rid}"))
    check(one, "GET", get(f"/v1/responses/{rid}"))  # 404
    check(resp, "POST", post(resp, json={"model": model, "input": []}))  # 400
    # the Conversations API: create, retrieve, update; items added, listed, one read and
    # deleted; a response on it; deleted
    cv, one_cv = "/v1/conversations", "/v1/conversations/{conversation_id}"
    cid = check(cv, "POST", post(cv, json={"items": [{"role": "user", "content": "Hi?"}],
                                           "metadata": {"a": "b"}})).json()["id"]
    check(one_cv, "GET", get(f"{cv}/{cid}"))
    check(one_cv, "POST", post(f"{cv}/{cid}", json={"metadata": {"a": "c"}}))
    items, item = one_cv + "/items", one_cv + "/items/{item_id}"
    iid = check(items, "POST", post(f"{cv}/{cid}/items", json={"items": [
        {"role": "assistant", "content": "Hello."},
        {"type": "function_call", "call_id": "c1", "name": "get_price", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}]})).json()["first_id"]
    check(items, "GET", get(f"{cv}/{cid}/items", params={"limit": 2, "order": "asc"}))
    check(item, "GET", get(f"{cv}/{cid}/items/{iid}"))
    check(item, "DELETE", client.delete(f"{cv}/{cid}/items/{iid}"))
    check(resp, "POST", post(resp, json={"model": model, "input": "And?", "conversation": cid,
                                         "max_output_tokens": 3}))
    check(one_cv, "DELETE", client.delete(f"{cv}/{cid}"))
    check(one_cv, "GET", get(f"{cv}/{cid}"))  # 404
    # the Anthropic Messages API: a message (whole, streamed, a forced call), a count
    msg, count = "/v1/messages", "/v1/messages/count_tokens"
    price = {"name": "get_price", "input_schema": TOOLS[0]["function"]["parameters"]}
    for extra in ({"system": SYSTEM}, {"stream": True},
                  {"tools": [price], "tool_choice": {"type": "any"}},
                  {"tools": [price], "tool_choice": {"type": "any"}, "stream": True}):
        check(msg, "POST", post(msg, json={"model": model, "max_tokens": 3,
                                           "messages": msgs, **extra}))
    check(count, "POST", post(count, json={"model": model, "messages": msgs}))
    check(msg, "POST", post(msg, json={"model": model, "messages": msgs}))  # 400
    check(count, "POST", post(count, json={"model": "nope", "messages": msgs}))  # 404
    # errors: the one shape, documented for each route
    check(S, "GET", get("/sessions/nope"))
    check(S + "/append", "POST", post(f"/sessions/{a}/append", json={"data": "x"}))  # 409
    check(S + "/turn", "POST", post(f"/sessions/{a}/turn", json={"max_tokens": "3"}))  # 400
    check("/v1/models/{model_id}", "GET", get("/v1/models/nope"))
    check(chat, "POST", post(chat, json={"model": "nope", "messages": msgs}))
    check(S, "GET", get(f"/sessions/{a}", params={"include": "everything"}))
    for path in (p for p in doc["paths"] if p == "/ui" or p.startswith("/ui/")):
        check(path, "GET", get(path))  # the web console's files
    assert check.ok == {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert check.events > 10


# -- schemathesis -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live_sessions(client):
    """A session of each kind for the operations that name one; the schemathesis run
    appends, rolls back and closes what it generates, on these or fresh ones."""
    s = client.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                       "standing_queries": [Q]}).json()["id"]
    client.post(f"/sessions/{s}/append", json={"data": "ACME 101 102"})
    a = client.post("/sessions", json={"kind": "agentic", "system": SYSTEM,
                                       "tools": TOOLS}).json()["id"]
    client.post(f"/sessions/{a}/messages", json={"role": "user", "content": "Price?"})
    return {"streaming": s, "agentic": a}


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def _operations() -> list[tuple[str, str]]:
    doc = create_app(ServerConfig(model=Path("doc-only"))).openapi()  # no model loaded
    return sorted((m.upper(), p) for p, ops in doc["paths"].items() for m in ops)


AGENTIC_OPS = ("/turn", "/tool_result", "/messages")
CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance,
          st_checks.content_type_conformance, st_checks.response_schema_conformance,
          st_checks.negative_data_rejection]
EXAMPLES = 6  # per operation and generation mode: bounded, and derandomized


@pytest.mark.parametrize("method,path", _operations())
def test_schemathesis_finds_no_5xx_and_every_response_on_its_schema(
        method, path, api_schema, client, model, live_sessions):
    op = api_schema[path][method]
    fixed = None
    if "{sid}" in path and not path.endswith("/events"):  # events: an unknown id, a 404
        kind = "agentic" if path.endswith(AGENTIC_OPS) else "streaming"
        fixed = {"sid": live_sessions[kind]}
    cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE, path_parameters=fixed),
                      op.as_strategy(GenerationMode.NEGATIVE, path_parameters=fixed))

    @given(cases)
    @settings(max_examples=2 * EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if method == "DELETE" and "{sid}" in path:  # a fresh session to close each time
            case.path_parameters["sid"] = client.post(
                "/sessions", json={"kind": "streaming"}).json()["id"]
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = model  # past the model check, into the request's own
        r = case.call_and_validate(checks=CHECKS, timeout=60)
        assert r.status_code < 500, r.text
        if 400 <= r.status_code < 500 and path.startswith("/v1/messages"):
            body = r.json()  # Anthropic's shape and error types
            assert body["type"] == "error" and body["error"]["message"], r.text
            assert body["error"]["type"] == anthropic_type(r.status_code), r.text
        elif 400 <= r.status_code < 500:
            err = r.json()["error"]
            assert err["message"] and err["code"], r.text
            assert err["type"] == openai_type(r.status_code), r.text

    run()


# -- OpenAI error types -------------------------------------------------------------------
def test_error_types_are_openais_and_field_errors_name_the_field(client, model):
    r = client.put("/v1/chat/completions", json={})
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found"
    assert err["type"] == "invalid_request_error" and err["param"] == "model"
    r = client.post("/v1/chat/completions", json={"model": model, "messages": [
        {"role": "user", "content": "hi"}], "temperature": "hot"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == "temperature"
    r = client.post("/v1/completions", json={"model": model, "prompt": "x", "logprobs": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = client.post("/sessions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_json"
    s = client.post("/sessions", json={"kind": "agentic"}).json()["id"]
    r = client.post(f"/sessions/{s}/append", json={"data": "x"})
    assert r.status_code == 409 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post(f"/sessions/{s}/messages", content=b" " * (2 << 20),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    client.delete(f"/sessions/{s}")
