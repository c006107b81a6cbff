"""Stock client libraries unchanged against the real server: LangChain's `ChatOpenAI`
(langchain-openai) and LiteLLM, each through a multi-turn conversation whose next turn finds
the previous prompt cached (an implicit session: they name none), a streamed answer with its
usage, and a tool call round trip (a forced call, constrained to the function's schema, its
result sent back, answered). On the chatml tiny model; API behaviour, not its wording."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.server_harness import ServerProc

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import

KEY = "stock-key"
SYSTEM = "You are a terse market assistant. " * 4
PRICE = {"type": "function", "function": {
    "name": "get_price", "description": "a ticker's last price",
    "parameters": {"type": "object", "properties": {
        "ticker": {"type": "string", "enum": ["ACME", "BOLT"]}},
        "required": ["ticker"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-stock"),
                    "--api-key", KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(model_dirs) -> str:
    return model_dirs["chatml"].name


# -- LangChain ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat(server, model):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=model, temperature=0,
                      max_tokens=6, max_retries=0, stream_usage=True)


def lc_cached(msg) -> int:
    return msg.usage_metadata["input_token_details"]["cache_read"]


def test_langchain_turns_find_the_previous_prompt_cached(chat):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    msgs, prompts = [SystemMessage(SYSTEM + "LangChain.")], []
    for i in range(3):
        msgs.append(HumanMessage(f"What about item {i}?"))
        r = chat.invoke(msgs)
        assert isinstance(r, AIMessage) and r.response_metadata["finish_reason"] in (
            "stop", "length")
        u = r.usage_metadata
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
        if prompts:  # the previous prompt is a prefix of this one, and it was kept
            assert prompts[-1] <= lc_cached(r) < u["input_tokens"]
        prompts.append(u["input_tokens"])
        msgs.append(r)
    msgs.append(HumanMessage("And streamed?"))
    chunks = list(chat.stream(msgs))
    whole = chunks[0]
    for ch in chunks[1:]:
        whole = whole + ch
    assert whole.content == "".join(ch.content for ch in chunks)
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    assert whole.usage_metadata["output_tokens"] >= 1
    assert lc_cached(whole) >= prompts[-1]


def test_langchain_tool_loop(chat):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    msgs = [HumanMessage("What is ACME trading at?")]
    r = chat.bind_tools([PRICE], tool_choice="get_price").invoke(msgs, max_tokens=300)
    (call,) = r.tool_calls  # one call, parsed, its arguments valid for the schema
    assert call["name"] == "get_price" and call["args"]["ticker"] in ("ACME", "BOLT")
    assert r.response_metadata["finish_reason"] == "tool_calls"
    msgs += [r, ToolMessage(content="41.5", tool_call_id=call["id"])]
    answer = chat.bind_tools([PRICE]).invoke(msgs)
    assert isinstance(answer, AIMessage)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    # the forced call was kept with its conversation: the next turn pays only the result
    assert lc_cached(answer) >= r.usage_metadata["input_tokens"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat, method):
    """Both of with_structured_output's ways: response_format, and a forced call (strict,
    so the schema's closed object is enforced: a lenient one lets a model add keys)."""
    from pydantic import BaseModel

    class Trend(BaseModel):
        up: bool

    llm = chat.model_copy(update={"max_tokens": 60})
    r = llm.with_structured_output(Trend, method=method, strict=True).invoke(
        "Is ACME going up?")
    assert isinstance(r, Trend)


# -- LiteLLM --------------------------------------------------------------------------------
def ll(server, model, **kw):
    import litellm

    return litellm.completion(model=f"openai/{model}", api_base=server.url + "/v1",
                              api_key=KEY, temperature=0, num_retries=0,
                              **{"max_tokens": 6, **kw})


def test_litellm_turns_find_the_previous_prompt_cached(server, model):
    import litellm

    msgs, prompts = [{"role": "system", "content": SYSTEM + "LiteLLM."}], []
    for i in range(3):
        msgs.append({"role": "user", "content": f"What about item {i}?"})
        r = ll(server, model, messages=msgs)
        assert r.choices[0].finish_reason in ("stop", "length")
        cached = r.usage.prompt_tokens_details.cached_tokens
        if prompts:
            assert prompts[-1] <= cached < r.usage.prompt_tokens
        prompts.append(r.usage.prompt_tokens)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    msgs.append({"role": "user", "content": "And streamed?"})
    chunks = list(ll(server, model, messages=msgs, stream=True,
                     stream_options={"include_usage": True}))
    built = litellm.stream_chunk_builder(chunks, messages=msgs)
    assert built.choices[0].message.content == "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert built.usage.prompt_tokens > prompts[-1]
    assert built.usage.prompt_tokens_details.cached_tokens >= prompts[-1]


def test_litellm_tool_loop(server, model):
    msgs = [{"role": "user", "content": "What is BOLT trading at?"}]
    r = ll(server, model, messages=msgs, tools=[PRICE], max_tokens=300,
           tool_choice={"type": "function", "function": {"name": "get_price"}})
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_price"
    assert json.loads(call.function.arguments)["ticker"] in ("ACME", "BOLT")
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "17.25"}]
    answer = ll(server, model, messages=msgs, tools=[PRICE])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
