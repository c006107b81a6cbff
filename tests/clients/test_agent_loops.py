"""The agent loops stock client libraries run, through a real `prepos serve` with the OpenAI
SDK and httpx: one tool message per call after a parallel call (stateless and on an agentic
session), past calls whose arguments are not a JSON object, forced calls constrained to
their function's schema (and the turn ended when the call closes), a cut call's `length`,
and the points vLLM's own OpenAI tests found (max_tokens left out, echo with logprobs, seed
bounds, every bad logit_bias key, a prompt over the context). Calls in history are sent as
assistant messages with `tool_calls`, as frameworks do: the tiny models need not make any.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest

from tests.support.server_harness import ServerProc, state_of

ENUM = ["rising steadily over the whole session", "falling steadily over the whole session",
        "flat with no clear direction at all"]
PRICE = {"type": "function", "function": {"name": "get_price", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string", "enum": ["ACME", "MSFT"]},
                                     "live": {"type": "boolean"}},
    "required": ["ticker", "live"], "additionalProperties": False}}}
NEWS = {"type": "function", "function": {"name": "get_news", "parameters": {
    "type": "object", "properties": {"topic": {"type": "string", "enum": ENUM}},
    "required": ["topic"], "additionalProperties": False}}}
TOOLS = [PRICE, NEWS]
USER = {"role": "user", "content": "What is ACME doing?"}


def two_calls(ids=("call_a", "call_b"), args=('{"ticker": "ACME", "live": true}', "{}")):
    calls = [{"type": "function", "function": {"name": n, "arguments": a}}
             for n, a in zip(("get_price", "get_news"), args)]
    for c, i in zip(calls, ids):
        if i:
            c["id"] = i
    return {"role": "assistant", "content": None, "tool_calls": calls}


def result(cid, content="42"):
    return {"role": "tool", "content": content, **({"tool_call_id": cid} if cid else {})}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-agents")) as srv:
        yield srv


@pytest.fixture(scope="module")
def llama3(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["llama3"], tmp_path_factory.mktemp("srv-agents-l3")) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(http, model, messages, **kw):
    return http.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                   "max_tokens": 2, **kw})


def expect(r, status, code, *words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    for w in words:
        assert w in err["message"] or w == err["param"], (w, err)
    return err


def rendered_tokens(tok, messages, tools):
    """The prompt's tokens as the template renders the conversation (ids left out)."""
    plain = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("tool_calls"):
            m["content"] = m["content"] or ""
            m["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.loads(c["function"][
                    "arguments"])}} for c in m["tool_calls"]]
        plain.append(m)
    text = tok.apply_chat_template(plain, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


# -- 1. one tool message per call ---------------------------------------------------------
def test_stateless_takes_every_result_of_a_parallel_call(oai, http, model, tok):
    for results in ([result("call_a"), result("call_b")],  # in order
                    [result("call_b"), result("call_a")],  # any order, matched by id
                    [result(None), result(None)]):  # without ids: the next call in order
        msgs = [USER, two_calls(), *results]
        r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=2)
        assert r.choices[0].message is not None
        assert r.usage.prompt_tokens == rendered_tokens(tok, msgs, TOOLS)  # both rendered
    # an id no call awaits; a result too many; a conversation that ends with one awaited
    expect(chat(http, model, [USER, two_calls(), result("call_a"), result("call_x")],
                tools=TOOLS), 400, "unknown_tool_call_id", "'call_x'", "'call_b'",
           "messages[3].tool_call_id")
    expect(chat(http, model, [USER, two_calls(), result("call_a"), result("call_a")],
                tools=TOOLS), 400, "unknown_tool_call_id", "'call_a'")
    expect(chat(http, model, [USER, two_calls(), result(None), result(None), result(None)],
                tools=TOOLS), 409, "no_tool_result_awaited", "messages[4]")
    expect(chat(http, model, [USER, two_calls(), result("call_a")], tools=TOOLS), 409,
           "tool_result_awaited", "'call_b'")
    expect(chat(http, model, [USER, two_calls(), result("call_a"), USER], tools=TOOLS), 409,
           "tool_result_awaited", "messages[3]")


def test_an_agentic_session_commits_every_result_then_answers(oai, http, model):
    sid = http.post("/sessions", json={"kind": "agentic", "tools": TOOLS}).json()["id"]
    ask = oai.chat.completions.create(model=model, messages=[USER], max_tokens=2,
                                      extra_body={"session_id": sid})
    said = {"role": "assistant", "content": ask.choices[0].message.content}
    # the client's own call (as a framework holds it), then one result per call
    before = state_of(http, sid)
    for bad, status, code in (([result("call_a")], 409, "tool_result_awaited"),
                              ([result("call_a"), result("call_z")], 400,
                               "unknown_tool_call_id"),
                              ([result("call_a"), result("call_b"), result(None)], 409,
                               "no_tool_result_awaited")):
        r = chat(http, model, [USER, said, {"role": "user", "content": "Look it up."},
                               two_calls(), *bad], session_id=sid)
        expect(r, status, code)
        assert state_of(http, sid) == before  # refused: nothing committed
    msgs = [USER, said, {"role": "user", "content": "Look it up."}, two_calls(),
            result("call_b", "news"), result("call_a", "41.5")]
    r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=2,
                                    extra_body={"session_id": sid})
    held = http.get(f"/sessions/{sid}", params={"include": "messages"}).json()
    roles = [m["role"] for m in held["message_list"]]
    assert roles == ["user", "assistant", "user", "assistant", "tool", "tool", "assistant"]
    assert [m["content"] for m in held["message_list"][4:6]] == ["news", "41.5"]
    assert not held["awaiting_tool_result"]
    # the next turn extends it, the ids sent again or not
    nxt = [*msgs, {"role": "assistant", "content": r.choices[0].message.content},
           {"role": "user", "content": "And now?"}]
    again = oai.chat.completions.create(model=model, messages=nxt, max_tokens=2,
                                        extra_body={"session_id": sid})
    assert again.model_extra["prepos"]["path"] in ("fall-through", "cold")


def test_the_session_api_adds_results_then_the_last_starts_the_turn(http):
    sid = http.post("/sessions", json={"kind": "agentic", "tools": TOOLS}).json()["id"]
    http.post(f"/sessions/{sid}/messages", json={"role": "user", "content": "Price?"})
    call = two_calls()
    assert http.post(f"/sessions/{sid}/messages", json={
        "role": "assistant", "content": "", "tool_calls": call["tool_calls"]}).is_success
    before = state_of(http, sid)
    expect(http.post(f"/sessions/{sid}/tool_result", json={"content": "41", "max_tokens": 2}),
           409, "tool_result_awaited", "2 tool results")
    assert state_of(http, sid) == before
    assert http.post(f"/sessions/{sid}/messages", json={"role": "tool",
                                                        "content": "41"}).is_success
    assert http.get(f"/sessions/{sid}").json()["awaiting_tool_result"]
    r = http.post(f"/sessions/{sid}/tool_result", json={"content": "news", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert not http.get(f"/sessions/{sid}").json()["awaiting_tool_result"]


# -- 2. past calls whose arguments are not a JSON object ----------------------------------
def test_call_arguments_that_are_not_json_are_taken_and_rendered_as_sent(oai, http, model, tok):
    cut = '{"ticker": "AC'  # a call cut off by max_tokens, as prepos itself returns one
    for args in (cut, "not json at all", "[1, 2]"):
        call = two_calls(args=(args, "{}"))
        msgs = [USER, call, result("call_a"), result("call_b")]
        r = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=2)
        # the prompt holds the arguments as sent, where the template writes them
        text = tok.apply_chat_template(
            [USER, {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_price", "arguments": {}}},
                {"type": "function", "function": {"name": "get_news", "arguments": {}}}]},
             {"role": "tool", "content": "42"}, {"role": "tool", "content": "42"}],
            tools=TOOLS, add_generation_prompt=True, tokenize=False)
        text = text.replace('"arguments": {}', '"arguments": ' + args, 1)
        assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    # an agentic session holds it as sent, and the same history extends it next time
    sid = http.post("/sessions", json={"kind": "agentic", "tools": TOOLS}).json()["id"]
    msgs = [USER, two_calls(args=(cut, "{}")), result("call_a"), result("call_b")]
    r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=2,
                                    extra_body={"session_id": sid})
    held = http.get(f"/sessions/{sid}", params={"include": "messages"}).json()["message_list"]
    assert held[1]["tool_calls"][0]["function"]["arguments"] == cut
    nxt = [*msgs, {"role": "assistant", "content": r.choices[0].message.content}, USER]
    assert oai.chat.completions.create(model=model, messages=nxt, max_tokens=2,
                                       extra_body={"session_id": sid}).choices
    for bad in (7, None, ["x"]):
        call = two_calls(args=(bad, "{}"))
        expect(chat(http, model, [USER, call, result("call_a"), result("call_b")],
                    tools=TOOLS), 400, "invalid_request", "messages[1].tool_calls[0]")


# -- 3. and 4. forced calls ----------------------------------------------------------------
def _args_valid(name: str, args: dict) -> bool:
    if name == "get_price":
        return set(args) == {"ticker", "live"} and args["ticker"] in ("ACME", "MSFT") and \
            isinstance(args["live"], bool)
    return set(args) == {"topic"} and args["topic"] in ENUM


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_forced_calls_follow_the_schema_and_end_the_turn(family, request, model_dirs):
    srv = request.getfixturevalue("server" if family == "chatml" else "llama3")
    name = model_dirs[family].name
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as oai:
        for choice, names in (({"type": "function", "function": {"name": "get_news"}},
                               {"get_news"}), ("required", {"get_price", "get_news"})):
            for temperature in (0.0, 1.0):
                r = oai.chat.completions.create(model=name, messages=[USER], tools=TOOLS,
                                                tool_choice=choice, max_tokens=300,
                                                temperature=temperature, seed=3,
                                                parallel_tool_calls=False)
                c = r.choices[0]
                assert c.finish_reason == "tool_calls" and c.message.content is None
                (call,) = c.message.tool_calls  # one call, and the answer ends with it
                assert call.function.name in names
                assert _args_valid(call.function.name, json.loads(call.function.arguments))
                assert r.usage.completion_tokens < 300
        # streamed: the call in the last chunk, with finish_reason tool_calls
        chunks = list(oai.chat.completions.create(
            model=name, messages=[USER], tools=TOOLS, tool_choice="required", max_tokens=300,
            stream=True, parallel_tool_calls=False))
        deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or ()]
        assert len(deltas) == 1 and _args_valid(deltas[0].function.name,
                                                json.loads(deltas[0].function.arguments))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # n choices, each its own constrained call
        r = oai.chat.completions.create(model=name, messages=[USER], tools=TOOLS, n=2,
                                        tool_choice="required", max_tokens=300,
                                        temperature=1.0, seed=5, parallel_tool_calls=False)
        assert [c.finish_reason for c in r.choices] == ["tool_calls"] * 2


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_required_with_parallel_calls_lets_the_model_call_again_or_end(family, model_dirs):
    """'required' with parallel calls (OpenAI's default) is one or more calls: after a
    complete call the grammar takes the end of the turn or the next call, as the template
    writes calls one after another; without parallel calls, only the end of the turn."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from prepos.chat.format import ChatFormat
    from prepos.core import SamplingParams
    from prepos.decode.structured import Grammars
    from prepos.server.openai.checks import forced_call

    fmt = ChatFormat(AutoTokenizer.from_pretrained(str(model_dirs[family])))
    grammars = Grammars(fmt)
    markup = fmt.call_markup([USER], TOOLS, "get_news")
    call = fmt.encode(markup.opening + json.dumps({"topic": ENUM[0]}) + markup.closing)
    sep = fmt.call_separator([USER], TOOLS)
    assert sep is not None  # both templates write calls one after another
    again = fmt.encode(sep + markup.opening)[0]
    for parallel in (True, False):
        grammar, _ = forced_call(SimpleNamespace(fmt=fmt), [USER], TOOLS, "required",
                                 parallel=parallel)
        c = grammars.constraint(SamplingParams(grammar=grammar))
        for t in call:
            assert c.allowed()[t]
            c.accept(t)
        allowed = c.allowed()
        assert all(allowed[t] for t in fmt.end_of_turn)
        assert allowed[again] == parallel


def test_a_forced_call_on_a_named_session_is_constrained_and_committed(oai, http, model):
    """tool_choice 'required' or a function on an agentic session: the call follows the
    schema, the turn ends with it, it is committed (the session awaits its result) and the
    result sent back continues the session."""
    for choice, names in (({"type": "function", "function": {"name": "get_news"}},
                           {"get_news"}), ("required", {"get_price", "get_news"})):
        sid = http.post("/sessions", json={"kind": "agentic", "tools": TOOLS}).json()["id"]
        r = oai.chat.completions.create(model=model, messages=[USER], max_tokens=300,
                                        tool_choice=choice, parallel_tool_calls=False,
                                        extra_body={"session_id": sid})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name in names
        assert _args_valid(call.function.name, json.loads(call.function.arguments))
        held = http.get(f"/sessions/{sid}", params={"include": "messages"}).json()
        assert held["awaiting_tool_result"]
        assert held["message_list"][-1]["tool_calls"][0]["function"]["name"] == \
            call.function.name
        msgs = [USER, c.message.model_dump(exclude_none=True), result(call.id, "41.5")]
        after = oai.chat.completions.create(model=model, messages=msgs, max_tokens=2,
                                            extra_body={"session_id": sid})
        assert after.model_extra["prepos"]["session_id"] == sid
        assert not http.get(f"/sessions/{sid}").json()["awaiting_tool_result"]


def test_a_cut_call_says_length_and_goes_back_into_history(oai, model):
    r = oai.chat.completions.create(model=model, messages=[USER], tools=TOOLS, max_tokens=24,
                                    tool_choice={"type": "function",
                                                 "function": {"name": "get_price"}})
    c = r.choices[0]  # its markup alone is 22 tokens, its arguments 20 more
    assert c.finish_reason == "length" and r.usage.completion_tokens == 24
    (call,) = c.message.tool_calls
    assert call.function.name == "get_price"
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut: not JSON
    # as instructor's re-ask and the Agents SDK's error turn send it back
    msgs = [USER, c.message.model_dump(exclude_none=True),
            result(call.id, "error: the call was cut off")]
    again = oai.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=2)
    assert again.choices[0].message is not None


def test_forced_call_schemas_that_cannot_be_enforced_are_refused_by_name(http, model):
    unique = {"type": "object", "properties": {"tags": {"type": "array",
                                                         "uniqueItems": True}}}
    strict = {"type": "function", "function": {"name": "tag", "strict": True,
                                                "parameters": unique}}
    expect(chat(http, model, [USER], tools=[strict], tool_choice="required"), 400,
           "invalid_request", "tools[0].function.parameters", "strict")
    lenient = {"type": "function", "function": {"name": "tag", "parameters": unique}}
    r = chat(http, model, [USER], tools=[lenient], tool_choice="required", max_tokens=40)
    assert r.status_code == 200, r.text  # not strict: the keyword is not enforced
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "tag"
    for params in ({"type": "string"}, "object", [1]):
        bad = {"type": "function", "function": {"name": "f", "parameters": params}}
        expect(chat(http, model, [USER], tools=[PRICE, bad], tool_choice="required"), 400,
               "invalid_request", "tools[1].function.parameters")
    # a named function whose schema is bad is refused; another named one is not affected
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    r = chat(http, model, [USER], tools=[PRICE, bad], max_tokens=300,
             tool_choice={"type": "function", "function": {"name": "get_price"}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"


# -- 5. from vLLM's OpenAI tests ------------------------------------------------------------
def test_max_tokens_left_out_is_the_rest_of_the_answer(oai, model):
    schema = {"type": "object", "properties": {k: {"type": "string", "enum": ENUM}
                                               for k in ("open", "midday", "close")},
              "required": ["open", "midday", "close"], "additionalProperties": False}
    r = oai.chat.completions.create(model=model, messages=[USER], response_format={
        "type": "json_schema", "json_schema": {"name": "day", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 64  # the old default would have cut it
    assert set(json.loads(r.choices[0].message.content)) == {"open", "midday", "close"}


@pytest.fixture(scope="module")
def small(model_dirs, tmp_path_factory):
    """A server whose context (160) and limits are small: generated tokens at most 100 (a
    session reserves 64 of its context for a request), input text at most 64 tokens per
    message."""
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-agents-small"),
                    "--max-session-tokens", "160", "--max-tokens", "100",
                    "--max-input-tokens", "64") as srv:
        yield srv


def test_max_tokens_left_out_is_bounded_by_the_context_and_the_server(small, model, tok):
    up = tok("up", add_special_tokens=False)["input_ids"]
    assert len(up) == 1
    never_ends = {"logit_bias": {str(up[0]): 100}}  # "upup...": never ends by itself

    def text_of(n):
        t = ""
        while len(tok(t, add_special_tokens=False)["input_ids"]) < n:
            t += "AAPL 101.2 zq "
        return t

    with httpx.Client(base_url=small.url, timeout=120) as h:
        def ask(messages, **kw):
            return h.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                        **never_ends, **kw})

        short = h.post("/v1/completions", json={"model": model, "prompt": "Hi",
                                                **never_ends}).json()
        assert short["usage"]["completion_tokens"] == 100  # the server's --max-tokens
        assert short["choices"][0]["finish_reason"] == "length"
        # a prompt with less room than that: the answer takes the rest of the context
        msgs = [{"role": "user", "content": text_of(24)},
                {"role": "assistant", "content": text_of(8)},
                {"role": "user", "content": text_of(8)}]
        r = ask(msgs).json()
        assert r["usage"]["prompt_tokens"] > 40, r
        # a chat answer is committed to its session, which keeps its reserve (64) for the
        # next request, and the message's end (2 tokens)
        assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 160 - 64 - 2
        assert r["choices"][0]["finish_reason"] == "length"
        ids = tok(text_of(130), add_special_tokens=False)["input_ids"][:130]
        c = h.post("/v1/completions", json={"model": model, "prompt": ids,
                                            **never_ends}).json()
        assert (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) == (130, 30)
        # asked for more than the room: answered to it, as llama.cpp's server answers it
        r = ask(msgs, max_tokens=100).json()
        assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 160 - 64 - 2
        assert r["choices"][0]["finish_reason"] == "length"
        # one message over the context is context_length_exceeded whatever the input
        # limit; one within the context but over --max-input-tokens stays 413
        expect(ask([{"role": "user", "content": text_of(200)}]), 400,
               "context_length_exceeded", "messages[0].content")
        expect(h.post("/v1/completions", json={"model": model, "prompt": text_of(200)}),
               400, "context_length_exceeded")
        expect(ask([{"role": "user", "content": text_of(100)}]), 413, "input_too_large")
        expect(h.post("/v1/completions", json={"model": model, "prompt": ids + ids}), 400,
               "context_length_exceeded")


def test_echo_with_logprobs_lists_the_prompt_tokens_first(oai, model, tok):
    prompt = "ACME 101 102 103"
    ids = tok(prompt)["input_ids"]
    for lp_arg in (0, 2):
        c = oai.completions.create(model=model, prompt=prompt, echo=True, logprobs=lp_arg,
                                   max_tokens=3)
        ch = c.choices[0]
        lp = ch.logprobs
        n = len(ids) + c.usage.completion_tokens
        assert ch.text.startswith(prompt) and c.usage.prompt_tokens == len(ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert "".join(lp.tokens[:len(ids)]) == prompt
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
        for t, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
            assert max(lp_arg, 1) <= len(top) <= lp_arg + 1 and t in top
    # a prompt token's logprob is the model's at that position: the first generated
    # token's logprob, echoed as a prompt token of the prompt extended by it
    first = oai.completions.create(model=model, prompt=ids, max_tokens=1, logprobs=0)
    g = first.choices[0].logprobs
    (gid,) = [i for i in range(len(tok)) if tok.decode([i]) == g.tokens[0]]
    longer = oai.completions.create(model=model, prompt=[*ids, gid], echo=True, logprobs=0,
                                    max_tokens=1)
    assert longer.choices[0].logprobs.token_logprobs[len(ids)] == pytest.approx(
        g.token_logprobs[0], abs=1e-4)
    # streamed: the echo's chunk carries the prompt's logprobs
    chunks = [x.choices[0] for x in oai.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=2, stream=True)]
    assert chunks[0].text == prompt and chunks[0].logprobs.token_logprobs[0] is None
    assert len(chunks[0].logprobs.tokens) == len(ids)


def test_seeds_are_int64_and_refused_in_openai_s_words(http, model):
    for seed in (2**63 - 1, -(2**63)):
        assert chat(http, model, [USER], seed=seed, temperature=1.0).status_code == 200
    err = expect(chat(http, model, [USER], seed=2**63), 400, "integer_above_max_value")
    assert err["message"] == ("Invalid 'seed': integer above maximum value. Expected a value "
                              "<= 9223372036854775807, but got 9223372036854775808 instead.")
    assert err["param"] == "seed"
    err = expect(http.post("/v1/completions", json={"model": model, "prompt": "x",
                                                     "seed": -(2**63) - 1}),
                 400, "integer_below_min_value")
    assert err["message"].startswith("Invalid 'seed': integer below minimum value. Expected "
                                      "a value >= -9223372036854775808, but got ")


def test_every_bad_logit_bias_key_is_named(http, model):
    err = expect(chat(http, model, [USER], logit_bias={"x": 1, "-1": 2, "5": 1,
                                                       "99999999": 1, "7": 300, "8": -101}),
                 400, "invalid_request")
    for part in ("'x'", "'-1'", "'99999999'", "300", "token 7", "-101", "token 8"):
        assert part in err["message"], part
    assert "'5'" not in err["message"] and err["param"] == "logit_bias"


def test_a_back_end_without_grammars_continues_the_call_unconstrained(model_dirs):
    """Where the back end samples itself or returns top-k (remote engines), no grammar is
    sent: a forced call is the calls' opening continued and read back, response_format
    stays a 400, and the engine refuses a grammar outright."""
    import time
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from prepos.config import EngineConfig
    from prepos.core import Request, SamplingParams
    from prepos.engine.admission import check_request
    from prepos.errors import InvalidSampling
    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    app = create_app(ServerConfig(model=model_dirs["chatml"],
                                  engine=EngineConfig(backend="torch", threads=2)))
    with TestClient(app, base_url="http://localhost") as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        app.state.prepos.engine.backend.full_distribution = False  # as a top-k back end
        name = model_dirs["chatml"].name
        r = client.post("/v1/chat/completions", json={
            "model": name, "messages": [USER], "tools": TOOLS, "max_tokens": 6,
            "tool_choice": {"type": "function", "function": {"name": "get_news"}}})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["get_news"]
        assert c["finish_reason"] in ("tool_calls", "length")
        r = client.post("/v1/chat/completions", json={
            "model": name, "messages": [USER], "response_format": {"type": "json_object"}})
        expect(r, 400, "unsupported", "response_format")
        # on a session the answer is committed as generated: a forced call is refused there
        sid = client.post("/sessions", json={"kind": "agentic", "tools": TOOLS}).json()["id"]
        before = client.get(f"/sessions/{sid}").json()["version"]
        r = client.post("/v1/chat/completions", json={
            "model": name, "messages": [USER], "tools": TOOLS, "tool_choice": "required",
            "session_id": sid})
        expect(r, 400, "unsupported", "tool_choice")
        assert client.get(f"/sessions/{sid}").json()["version"] == before
    remote = SimpleNamespace(name="remote", streams_answers=True, full_distribution=False,
                             verifies_drafts=False)
    with pytest.raises(InvalidSampling, match="grammars"):
        check_request(Request(SamplingParams(grammar='start: "a"')), remote, False)
    with pytest.raises(InvalidSampling, match="prompt logprobs"):
        check_request(Request(prompt_logprobs=True), remote, False)


def test_the_agents_sdk_runs_a_forced_call_and_the_turn_after_it(server, model):
    """The OpenAI Agents SDK, unchanged, where it is installed (not a test dependency): a
    strict function tool called under tool_choice required, its result sent back, and the
    turn after it (the SDK resets tool_choice to auto once a tool ran)."""
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is not "
                        "installed")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_price(ticker: Literal["ACME", "MSFT"]) -> str:
        """The latest price of a ticker."""
        asked.append(ticker)
        return "41.5"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    agent = Agent(name="analyst", instructions="Answer in one word.", tools=[get_price],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=40,
                                               parallel_tool_calls=False))
    result = Runner.run_sync(agent, "What is ACME at?", max_turns=4)
    assert len(asked) == 1 and asked[0] in ("ACME", "MSFT")
    assert isinstance(result.final_output, str)
