"""A forced tool call cut by max_tokens comes back as the call so far, as OpenAI returns one,
through the stock SDKs against a real `prepos serve` on the chatml tiny model: the OpenAI
SDK's chat completions (`finish_reason` "length", the forced function's call, its
`arguments` a prefix of JSON; streamed: the call's deltas, then the finish), the Responses
API (an `incomplete` `function_call` item, the response `incomplete` for
max_output_tokens) and Anthropic's Messages API (a `tool_use` block, its input read as far
as it goes, `stop_reason` "max_tokens"; streamed, the SDK's accumulator rebuilding it).
Forced to one function, the call is that function's even where its name was not yet
written (max_tokens 4). API behaviour, never the model's wording."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from jiter import from_json

from tests.support.server_harness import ServerProc

PRICE = {"type": "function", "function": {
    "name": "get_price", "description": "a ticker's last price",
    "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}},
                   "required": ["ticker"]}}}
USER = {"role": "user", "content": "What is ACME trading at? Use the tool."}
CUTS = [4, 12, 30]  # before the name is written, in it or just past it, in the arguments
# forced to the one function: by name, or `required` with it the only tool
CHOICES = {"named": {"type": "function", "function": {"name": "get_price"}},
           "required": "required"}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-partial")) as srv:
        yield srv


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def json_prefix(text: str) -> bool:
    """Whether `text` is the start of a JSON object (the SDKs' own partial parser reads
    it), or nothing yet."""
    if not text:
        return True
    try:
        return isinstance(from_json(text.encode(), partial_mode="trailing-strings"), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("max_tokens", CUTS)
@pytest.mark.parametrize("choice", list(CHOICES))
def test_chat_completions_return_the_cut_call(oai, model, choice, max_tokens):
    kw = {"model": model, "messages": [USER], "tools": [PRICE],
          "tool_choice": CHOICES[choice], "max_tokens": max_tokens}
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_price" and call.id
    assert json_prefix(call.function.arguments), call.function.arguments
    # streamed: the call's deltas (as the SDK accumulates them), then the finish
    name, args, ids, finish = "", "", set(), None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for t in delta.tool_calls or ():
            assert t.index == 0
            ids.add(t.id) if t.id else None
            name += t.function.name or ""
            args += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and name == "get_price" and len(ids) == 1
    assert json_prefix(args), args


@pytest.mark.parametrize("max_tokens", CUTS)
@pytest.mark.parametrize("choice", ["named", "required"])
def test_responses_return_an_incomplete_function_call(oai, model, choice, max_tokens):
    kw = {"model": model, "input": USER["content"], "max_output_tokens": max_tokens,
          "tools": [{"type": "function", **PRICE["function"]}], "store": False,
          "tool_choice": {"type": "function", "name": "get_price"} if choice == "named"
          else "required"}
    r = oai.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert item.name == "get_price" and item.status == "incomplete" and item.call_id
    assert json_prefix(item.arguments), item.arguments
    assert not [o for o in r.output if o.type == "message"]
    # streamed: the item added, its arguments' delta and done, the response incomplete
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].name == "get_price" and done[0].arguments == deltas
    assert json_prefix(deltas), deltas
    (last,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert last.status == "incomplete" and last.arguments == deltas


@pytest.mark.parametrize("max_tokens", CUTS)
@pytest.mark.parametrize("choice", ["named", "required"])
def test_messages_return_a_tool_use_cut_at_max_tokens(server, model, choice, max_tokens):
    tool = {"name": "get_price", "description": PRICE["function"]["description"],
            "input_schema": PRICE["function"]["parameters"]}
    body = {"model": model, "max_tokens": max_tokens, "tools": [tool],
            "messages": [USER], "tool_choice": {"type": "tool", "name": "get_price"}
            if choice == "named" else {"type": "any"}}
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as c:
        m = c.messages.create(**body)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == max_tokens
        (use,) = m.content
        assert use.type == "tool_use" and use.name == "get_price"
        assert use.id.startswith("toolu_") and isinstance(use.input, dict)
        assert set(use.input) <= {"ticker"}
        # streamed: its input as input_json_delta, which the SDK's accumulator reads back
        with c.messages.stream(**body) as s:
            partial = "".join(e.delta.partial_json for e in s if e.type == "content_block_delta"
                              and e.delta.type == "input_json_delta")
            final = s.get_final_message()
    (streamed,) = final.content
    assert final.stop_reason == "max_tokens" and streamed.type == "tool_use"
    assert streamed.name == "get_price" and streamed.input == json.loads(partial)
    assert set(streamed.input) <= {"ticker"}
