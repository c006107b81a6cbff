"""The Responses API end to end, with the OpenAI SDK's `client.responses` and the Agents SDK
against a real `prepos serve` process: create, retrieve, delete; a `previous_response_id`
chain on one session, each turn finding the previous turn's prompt cached; a fork; the
event stream (raw, and the SDK's stream helper); a function tool round trip through
`function_call_output`; the Agents SDK's full-resend loop continuing the session;
`store: false` on implicit sessions; another key's responses; bad input named; stored
responses across a restart, and the chain sessions bounded."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import httpx
import openai
import pytest

from tests.support.openai_helpers import ext, held, openai_client
from tests.support.server_harness import ServerProc

INSTR = "You are a market analyst. Answer in one word."
KEYS = ("key-a", "key-b")
TOOLS = [{"type": "function", "name": "price", "description": "a ticker's price",
          "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}},
                         "required": ["ticker"]}}]
TREND = {"type": "json_schema", "name": "trend", "strict": True, "schema": {
    "type": "object", "properties": {"up": {"type": "boolean"}}, "required": ["up"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    args = [a for k in KEYS for a in ("--api-key", k)]
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-responses"),
                    *args) as srv:
        yield srv


def sdk(srv, key: str = KEYS[0]) -> openai.OpenAI:
    return openai_client(srv, key)


@pytest.fixture
def c(server):
    with sdk(server) as client:
        yield client


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}) as client:
        yield client


def check_object(r, model: str, max_tokens: int) -> None:
    """What every response says of itself, whatever the model wrote."""
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status in ("completed", "incomplete")
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens > 0
    assert u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert u.output_tokens == max_tokens
    else:
        assert r.incomplete_details is None and u.output_tokens <= max_tokens
    assert r.output and all(o.status == r.status for o in r.output)


# -- create, retrieve, delete -------------------------------------------------------------
def test_create_retrieve_and_delete(c, http, model):
    raw = c.responses.with_raw_response.create(
        model=model, input="What is the trend?", instructions=INSTR, max_output_tokens=4,
        metadata={"run": "1"}, temperature=0, top_p=1, prompt_cache_key="k", user="u")
    r = raw.parse()
    check_object(r, model, 4)
    assert raw.headers["x-prepos-path"] == ext(r)["path"] in ("cold", "fall-through")
    assert raw.headers["x-prepos-session"] == ext(r)["session_id"]
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert r.output_text == msg.content[0].text and msg.content[0].type == "output_text"
    assert r.instructions == INSTR and r.metadata == {"run": "1"} and r.store is True
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.temperature == 0 and r.top_p == 1 and r.previous_response_id is None
    # the chain's session: the key's own, persistent, holding the conversation
    sid = ext(r)["session_id"]
    msgs = held(http, sid)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[0]["content"] == INSTR and msgs[1]["content"] == "What is the trend?"
    assert ext(r)["version"] + 1 == http.get(f"/sessions/{sid}").json()["version"]
    got = c.responses.retrieve(r.id)
    assert got.to_dict() == r.to_dict()
    gone = http.delete(f"/v1/responses/{r.id}")
    assert gone.status_code == 200
    assert gone.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    assert http.delete(f"/v1/responses/{r.id}").status_code == 404
    assert held(http, sid) == msgs  # deleting a response closes nothing


def test_a_chain_is_one_session_each_turn_finding_the_last_cached(c, http, model):
    r1 = c.responses.create(model=model, input="AAPL?", instructions=INSTR,
                            max_output_tokens=3)
    sid = ext(r1)["session_id"]
    http.get(f"/sessions/{sid}", params={"wait_ready": 30})
    raw = c.responses.with_raw_response.create(
        model=model, input="And MSFT?", instructions=INSTR, previous_response_id=r1.id,
        max_output_tokens=3)
    r2 = raw.parse()
    check_object(r2, model, 3)
    assert r2.previous_response_id == r1.id and ext(r2)["session_id"] == sid
    # only the new input was committed and prefilled, from the pre-positioned entry
    assert raw.headers["x-prepos-path"] == "fall-through"
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    assert ext(r2)["version"] == ext(r1)["version"] + 2
    r3 = c.responses.create(model=model, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "And "}, {"type": "input_text", "text": "IBM?"}]}],
        instructions=INSTR, previous_response_id=r2.id, max_output_tokens=3)
    assert ext(r3)["session_id"] == sid
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens
    msgs = held(http, sid)
    assert [m["content"] for m in msgs if m["role"] == "user"] == ["AAPL?", "And MSFT?",
                                                                  "And IBM?"]
    assert [m["content"].strip() for m in msgs if m["role"] == "assistant"] == [
        r.output_text.strip() for r in (r1, r2, r3)]


def test_a_fork_and_new_instructions_leave_the_chain_as_it_was(c, http, model):
    r1 = c.responses.create(model=model, input="Trend of ACME?", instructions=INSTR,
                            max_output_tokens=3)
    sid = ext(r1)["session_id"]
    r2 = c.responses.create(model=model, input="Why?", instructions=INSTR,
                            previous_response_id=r1.id, max_output_tokens=3)
    assert ext(r2)["session_id"] == sid
    before = held(http, sid)
    # r1 is no longer its chain's latest: a new session from r1's conversation
    fork = c.responses.create(model=model, input="How?", instructions=INSTR,
                              previous_response_id=r1.id, max_output_tokens=3)
    fsid = ext(fork)["session_id"]
    assert fsid != sid and held(http, sid) == before
    assert [m["content"] for m in held(http, fsid)][:3] == [m["content"] for m in before[:3]]
    assert held(http, fsid)[3]["content"] == "How?"
    assert fork.usage.input_tokens_details.cached_tokens > 0  # the prefix shared
    # instructions are this response's only: the next one without them has no system
    other = c.responses.create(model=model, input="Sure?", instructions="Be brief.",
                               previous_response_id=r2.id, max_output_tokens=3)
    assert other.instructions == "Be brief."
    assert http.get(f"/sessions/{ext(other)['session_id']}").json()["system"] == "Be brief."
    bare = c.responses.create(model=model, input="Then?", previous_response_id=other.id,
                              max_output_tokens=3)
    roles = [m["role"] for m in held(http, ext(bare)["session_id"])]
    assert roles[0] == "user" and "system" not in roles and bare.instructions is None
    assert held(http, sid) == before


# -- streaming ----------------------------------------------------------------------------
def test_streamed_events_are_the_responses_api_s(c, model):
    first = c.responses.create(model=model, input="Hello?", instructions=INSTR,
                               max_output_tokens=4)
    events = list(c.responses.create(model=model, input="Again?", instructions=INSTR,
                                     previous_response_id=first.id, max_output_tokens=4,
                                     stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert final.status == types[-1].split(".")[1]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.content_part.done", "response.output_item.done"):
        assert types.count(kind) == 1, kind
    assert types.index("response.output_item.added") < types.index(
        "response.content_part.added") < types.index("response.output_text.done")
    item = next(e for e in events if e.type == "response.output_item.done").item
    assert item.id == final.output[0].id == done[0].item_id
    assert final.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert c.responses.retrieve(final.id).to_dict() == final.to_dict()


def test_the_sdk_stream_helper_parses_a_structured_answer(c, model):
    with c.responses.stream(model=model, input="Is ACME up?", instructions=INSTR,
                            text={"format": TREND}, max_output_tokens=32) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # needs response.completed: the grammar ended it
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(json.loads(final.output_text)["up"], bool)
    assert final.text.format.type == "json_schema"
    whole = c.responses.create(model=model, input="Is ACME up?", instructions=INSTR,
                               text={"format": {"type": "json_object"}}, max_output_tokens=32)
    assert whole.status == "completed" and isinstance(json.loads(whole.output_text), dict)


# -- function tools -----------------------------------------------------------------------
def test_a_function_tool_round_trip(c, http, model):
    r = c.responses.create(model=model, input="Price of ACME?", instructions=INSTR,
                           tools=TOOLS, tool_choice={"type": "function", "name": "price"},
                           max_output_tokens=16)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "price" and calls[0].call_id
    assert r.tools[0].name == "price" and r.tool_choice.name == "price"
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=model, previous_response_id=r.id, tools=TOOLS,
                           input=[{"type": "function_call_output", "call_id": "call_nope",
                                   "output": "41.5"}])
    assert err.value.body["param"] == "input[0].call_id"
    out = c.responses.create(model=model, previous_response_id=r.id, tools=TOOLS,
                             instructions=INSTR, max_output_tokens=4,
                             input=[{"type": "function_call_output",
                                     "call_id": calls[0].call_id, "output": "41.5"}])
    check_object(out, model, 4)
    msgs = held(http, ext(out)["session_id"])
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "price"
    assert msgs[3] == {"role": "tool", "content": "41.5"} and msgs[4]["role"] == "assistant"
    # a call the client writes, answered in the same request, on the chain's session
    call = {"type": "function_call", "call_id": "call_1", "name": "price",
            "arguments": json.dumps({"ticker": "MSFT"})}
    nxt = c.responses.create(model=model, previous_response_id=out.id, tools=TOOLS,
                             instructions=INSTR, max_output_tokens=4, input=[
                                 call, {"type": "function_call_output", "call_id": "call_1",
                                        "output": "12.0"}])
    assert ext(nxt)["session_id"] == ext(out)["session_id"]
    assert nxt.usage.input_tokens_details.cached_tokens >= out.usage.input_tokens
    tail = held(http, ext(nxt)["session_id"])[-3:]
    assert tail[0]["tool_calls"][0]["function"]["arguments"] == {"ticker": "MSFT"}
    assert tail[1] == {"role": "tool", "content": "12.0"}


def test_a_resent_conversation_continues_its_session(c, model):
    """The Agents SDK's default: no previous_response_id, the whole conversation each time,
    the previous output items included as they were returned."""
    items = [{"role": "user", "content": "Price of ACME?"}]
    r1 = c.responses.create(model=model, input=items, instructions=INSTR, tools=TOOLS,
                            max_output_tokens=4)
    items += [o.to_dict() for o in r1.output] + [{"role": "user", "content": "And IBM?"}]
    r2 = c.responses.create(model=model, input=items, instructions=INSTR, tools=TOOLS,
                            max_output_tokens=4)
    assert ext(r2)["session_id"] == ext(r1)["session_id"]
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens


# -- store: false, keys, errors -----------------------------------------------------------
def test_store_false_runs_on_an_implicit_session_and_is_not_kept(c, http, model):
    sessions = len(http.get("/sessions").json()["data"])
    r1 = c.responses.create(model=model, input="Hi?", instructions=INSTR, store=False,
                            max_output_tokens=3)
    assert r1.store is False and ext(r1)["session_id"] is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=model, input="x", previous_response_id=r1.id)
    items = [{"role": "user", "content": "Hi?"}, *[o.to_dict() for o in r1.output],
             {"role": "user", "content": "Again?"}]
    r2 = c.responses.create(model=model, input=items, instructions=INSTR, store=False,
                            max_output_tokens=3)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    assert len(http.get("/sessions").json()["data"]) == sessions  # nothing persistent


def test_another_key_s_responses_are_not_found(server, c, model):
    r = c.responses.create(model=model, input="Mine?", max_output_tokens=2)
    with sdk(server, KEYS[1]) as other:
        for call in (lambda: other.responses.retrieve(r.id),
                     lambda: other.responses.delete(r.id),
                     lambda: other.responses.create(model=model, input="x",
                                                    previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError):
                call()
    assert c.responses.retrieve(r.id).id == r.id


def codex_request(model: str, said: str) -> dict:
    """A request shaped as Codex CLI's (0.169, `wire_api = "responses"`): no instructions,
    developer messages first, options for a reasoning model, a hosted tool and a namespace
    among its function tools, its thread named in `prompt_cache_key` and `client_metadata`."""
    return {
        "model": model, "stream": False, "store": False, "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
        "client_metadata": {"turn_id": "t1", "thread_id": "thread-1"},
        "max_output_tokens": 3,
        "tools": [{"type": "function", "name": "exec_command", "strict": False,
                   "description": "Runs a shell command.",
                   "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                  "required": ["cmd"]}},
                  {"type": "namespace", "name": "multi_agent", "description": "Sub-agents.",
                   "tools": [{"type": "function", "name": "spawn", "parameters": {}}]},
                  {"type": "web_search", "external_web_access": False}],
        "input": [{"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                  {"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "Skills: none."}]},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "<cwd>/work</cwd>"}]},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": said}]}]}


def test_a_coding_agent_s_request_is_answered(http, model):
    """Codex's options change nothing here and are never a 400: `reasoning` and `include`
    (no reasoning channel), `store: false`, `client_metadata`, developer messages; the tools
    the server cannot run are left out and named in the response's metadata."""
    r = http.post("/v1/responses", json=codex_request(model, "say hi"))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["metadata"]["prepos_tools_omitted"] == "multi_agent,web_search"
    assert [t["name"] for t in out["tools"]] == ["exec_command"]
    assert out["status"] in ("completed", "incomplete") and out["store"] is False
    again = http.post("/v1/responses", json={**codex_request(model, "say hi"), "stream": True})
    assert again.status_code == 200, again.text
    assert "event: response.completed" in again.text or "event: response.incomplete" in \
        again.text, again.text


BAD = [  # body, status, param
    ({"model": None, "input": "x"}, 400, "model"),
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     400, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     400, "input"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c",
                                                  "name": "f", "arguments": "{}"},
                {"role": "user", "content": "b"}]}, 409, "input[2]"),
    ({"input": "x", "tools": [{"type": 5}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, 400, "temperature"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": {"type": "nonsense"}}}}, 400, "text.format"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "conversation": "conv_1"}, 404, "conversation"),
    ({"input": "x", "reasoning": "high"}, 400, "reasoning"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"input": "x", "stream_options": {}}, 400, "stream_options"),
    ({"input": "x" * 40000}, 413, "input"),
    ({"input": "x", "user": "u" * 1_000_000}, 400, "user"),  # stored with the response
    ({"input": "x", "prompt_cache_key": "k" * 257}, 400, "prompt_cache_key"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_is_refused_by_name(http, model, body, status, param):
    r = http.post("/v1/responses", json={"model": model, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["code"], r.text


def test_other_malformed_requests_are_4xx(http, model):
    assert http.post("/v1/responses", content=b"{",
                     headers={"content-type": "application/json"}).status_code == 400
    assert http.post("/v1/responses").status_code == 400
    assert http.get("/v1/responses/resp_nope").status_code == 404
    r = http.get("/v1/responses/resp_nope", params={"stream": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    with httpx.Client(base_url=http.base_url) as anon:
        assert anon.post("/v1/responses", json={"model": model, "input": "x"}
                         ).status_code == 401


def test_a_stream_that_fails_ends_with_error_and_response_failed():
    """An engine error after the first events: an `error` event naming it, then
    `response.failed`, and the reply's cleanup runs (no server: the reply alone)."""
    from types import SimpleNamespace

    from prepos.chat.tool_formats import PREPOS
    from prepos.errors import PreposError
    from prepos.server.openai.response_objects import Reply
    from tests.support.server_harness import sse_events

    class Failing:
        done = False

        def result(self):
            raise PreposError("the worker failed")

    async def tokens():
        yield SimpleNamespace(text="Hi", token=1)

    state = SimpleNamespace(engine=SimpleNamespace(fmt=SimpleNamespace(tool_format=PREPOS)))
    reply, cleaned = Reply(state, {"model": "m"}, True), []

    async def run():
        chunks = reply._guarded(Failing(), lambda: cleaned.append(1))(tokens())
        return b"".join([c async for c in chunks]).decode()

    events = [data for _, data in sse_events(asyncio.run(run()))]
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the worker failed"
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]
    assert [e["sequence_number"] for e in events] == list(range(len(events))) and cleaned


# -- the Agents SDK -----------------------------------------------------------------------
def test_the_agents_sdk_runs_on_both_models(server, model):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    set_tracing_disabled(True)

    class Trend(BaseModel):
        up: bool

    @function_tool
    def price(ticker: str) -> str:
        """A ticker's price."""
        return "41.5"

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS[0],
                                    max_retries=0)
        responses = OpenAIResponsesModel(model, client)
        chat = OpenAIChatCompletionsModel(model, client)
        settings = ModelSettings(max_tokens=32)
        for m in (responses, chat):
            agent = Agent(name="analyst", instructions=INSTR, tools=[price], model=m,
                          model_settings=settings, output_type=Trend)
            first = await Runner.run(agent, "Is ACME up?", max_turns=3)
            assert isinstance(first.final_output, Trend)
            streamed = Runner.run_streamed(agent, "Is IBM up?", max_turns=3)
            kinds = {ev.type async for ev in streamed.stream_events()}
            assert isinstance(streamed.final_output, Trend) and "raw_response_event" in kinds
        # the Responses model's answers are stored, and a run continues the chain
        agent = Agent(name="analyst", instructions=INSTR, tools=[price], model=responses,
                      model_settings=settings, output_type=Trend)
        one = await Runner.run(agent, "Is ACME up?", max_turns=3)
        got = await client.responses.retrieve(one.last_response_id)
        assert got.output_text == one.raw_responses[-1].output[0].content[0].text
        two = await Runner.run(agent, "And MSFT?", max_turns=3,
                               previous_response_id=one.last_response_id)
        assert isinstance(two.final_output, Trend)
        again = await client.responses.retrieve(two.last_response_id)
        assert again.previous_response_id == one.last_response_id
        assert again.usage.input_tokens_details.cached_tokens >= got.usage.input_tokens
        # a forced tool call through the chat model: the model calls it, the run completes
        forced = Agent(name="pricer", instructions=INSTR, tools=[price], model=chat,
                       model_settings=ModelSettings(max_tokens=16, tool_choice="price"),
                       tool_use_behavior="stop_on_first_tool")
        done = await Runner.run(forced, "Price of ACME?", max_turns=2)
        called = [o for o in done.raw_responses[0].output if o.type == "function_call"]
        assert [o.name for o in called] == ["price"] and isinstance(done.final_output, str)
        await client.close()

    asyncio.run(run())


# -- restart, and the chain sessions bounded ----------------------------------------------
def test_stored_responses_survive_a_restart_and_chains_are_bounded(model_dirs, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    srv = ServerProc(model_dirs["chatml"], tmp_path, "--response-sessions", "2",
                     journal=journal)
    model = model_dirs["chatml"].name
    with srv, sdk(srv, "unused") as c:
        r1 = c.responses.create(model=model, input="One?", instructions=INSTR,
                                max_output_tokens=3)
        r2 = c.responses.create(model=model, input="Two?", instructions=INSTR,
                                previous_response_id=r1.id, max_output_tokens=3)
        sid = ext(r2)["session_id"]
    with srv, sdk(srv, "unused") as c, httpx.Client(base_url=srv.url, timeout=60) as http:
        assert c.responses.retrieve(r2.id).to_dict() == r2.to_dict()
        r3 = c.responses.create(model=model, input="Three?", instructions=INSTR,
                                previous_response_id=r2.id, max_output_tokens=3)
        assert ext(r3)["session_id"] == sid  # the session, restored from the journal
        c.responses.delete(r1.id)  # its conversation lives on in its children
        others = [c.responses.create(model=model, input=f"Other {i}?", instructions=INSTR,
                                     max_output_tokens=2) for i in range(2)]
        listed = {s["id"] for s in http.get("/sessions").json()["data"]}
        assert listed == {ext(o)["session_id"] for o in others}  # two kept, the oldest gone
        r4 = c.responses.create(model=model, input="Four?", instructions=INSTR,
                                previous_response_id=r3.id, max_output_tokens=3)
        assert ext(r4)["session_id"] not in (sid, *listed)
        users = [m["content"] for m in held(http, ext(r4)["session_id"])
                 if m["role"] == "user"]
        assert users == ["One?", "Two?", "Three?", "Four?"]


def test_chain_sessions_give_way_to_every_other_request(model_dirs, tmp_path):
    """Chain sessions are kept on their clients' behalf: at the server's session limit, at a
    key's, and with the KV budget full of them, a named session, a stateless chat and another
    chain are each served, the least recently used chain giving way (the key's own first);
    a chain that gave way is continued from its stored conversation. A key's implicit
    sessions never count toward its limit. Named sessions are never closed for them."""
    args = ("--max-sessions", "3", "--max-sessions-per-key", "2", "--max-kv-cells", "700",
            *(a for k in KEYS for a in ("--api-key", k)))
    with ServerProc(model_dirs["chatml"], tmp_path, *args) as srv, \
            sdk(srv, KEYS[0]) as a, sdk(srv, KEYS[1]) as b:
        model = model_dirs["chatml"].name
        hs = {k: {"Authorization": f"Bearer {k}"} for k in KEYS}

        def chain(c, text, prev=None):
            return c.responses.create(model=model, input=text + " word" * 40, instructions=INSTR,
                                      previous_response_id=prev, max_output_tokens=3)

        def named(key):
            r = httpx.post(srv.url + "/sessions", headers=hs[key], timeout=60,
                           json={"kind": "agentic", "system": INSTR})
            assert r.status_code == 201, r.text
            return r.json()["id"]

        def listed(key):
            r = httpx.get(srv.url + "/sessions", headers=hs[key], timeout=60)
            return {s["id"] for s in r.json()["data"]}

        a1, a2 = chain(a, "One?"), chain(a, "Two?")
        for i in range(2):  # implicit sessions of key a, long enough to fill the KV budget
            r = a.chat.completions.create(model=model, max_tokens=3, messages=[
                {"role": "user", "content": f"Stateless {i}?" + " word" * 60}])
            assert r.choices[0].finish_reason in ("stop", "length")
        sa = named(KEYS[0])  # key a's limit: its least recently used chain gives way
        assert listed(KEYS[0]) == {sa, ext(a2)["session_id"]}
        b1 = chain(b, "Three?")
        sb = named(KEYS[1])  # the server's limit: key b's own chain first
        assert ext(b1)["session_id"] not in listed(KEYS[1])
        b2 = chain(b, "Four?")  # none of b's free: the least recently used of any key's
        assert listed(KEYS[0]) == {sa} and listed(KEYS[1]) == {sb, ext(b2)["session_id"]}
        a3 = chain(a, "Five?", prev=a1.id)  # a1's chain gave way: continued from the store
        assert listed(KEYS[0]) == {sa, ext(a3)["session_id"]} and listed(KEYS[1]) == {sb}
        users = [m["content"].split()[0] for m in held(
            httpx.Client(base_url=srv.url, headers=hs[KEYS[0]]), ext(a3)["session_id"])
            if m["role"] == "user"]
        assert users == ["One?", "Five?"]
        r = b.chat.completions.create(model=model, max_tokens=3, messages=[
            {"role": "user", "content": "Still served?" + " word" * 60}])
        assert r.choices[0].finish_reason in ("stop", "length")


def test_stored_responses_are_bounded_in_bytes_and_a_chain_keeps_its_history(model_dirs,
                                                                           tmp_path):
    """With --responses-bytes, the oldest responses go first (404 by id), the stored rows
    stay within the bound, and a chain whose first response went still continues from its
    whole conversation: the evicted one's messages are kept once, by reference, never
    copied into the responses that continue it."""
    from prepos.server.store.responses import ResponseStore

    journal = tmp_path / "journal.sqlite3"
    bound = 40_000
    srv = ServerProc(model_dirs["chatml"], tmp_path, "--response-sessions", "0",
                     "--responses-bytes", str(bound), journal=journal)
    model = model_dirs["chatml"].name
    with srv, sdk(srv, "unused") as c:
        chain = [c.responses.create(model=model, input="Turn 0?", instructions=INSTR,
                                    max_output_tokens=2)]
        for i in range(1, 4):
            chain.append(c.responses.create(model=model, input=f"Turn {i}?",
                                            previous_response_id=chain[-1].id,
                                            instructions=INSTR, max_output_tokens=2))
        copies = iter(range(10**6))

        def read() -> ResponseStore:  # the server holds its journal: read a copy of it
            copy = tmp_path / f"copy{next(copies)}.sqlite3"
            with sqlite3.connect(journal) as src, sqlite3.connect(copy) as dst:
                src.backup(dst)
            return ResponseStore(copy)

        store, others = read(), []
        while store.get(None, chain[0].id) is not None:
            assert len(others) < 100
            others.append(c.responses.create(model=model, input="Other? " + "pad " * 200,
                                             instructions=INSTR, max_output_tokens=2))
            store = read()
            assert store.used(None)[0] <= bound
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(chain[0].id)
        last = store.get(None, chain[3].id)
        assert last is not None and c.responses.retrieve(chain[3].id).id == chain[3].id
        assert [m["content"] for m in last.messages if m["role"] == "user"] == ["Turn 3?"]
        users = [m["content"] for m in store.conversation(last) if m["role"] == "user"]
        assert users == [f"Turn {i}?" for i in range(4)]
        nxt = c.responses.create(model=model, input="Turn 4?", instructions=INSTR,
                                 previous_response_id=chain[3].id, max_output_tokens=2)
        assert nxt.usage.input_tokens > chain[3].usage.input_tokens
        for _ in range(len(others) + 4):  # as many again: the oldest keep going
            c.responses.create(model=model, input="Other? " + "pad " * 200,
                               instructions=INSTR, max_output_tokens=2)
        store = read()
        used, live = store.used(None)
        assert used <= bound and store.get(None, others[0].id) is None


def test_chain_sessions_are_kept_by_memory_not_by_a_count(model_dirs, tmp_path):
    """With no count given, more stored conversations than the count that used to bound them
    (64), asked round robin, are each continued on the session that answered their first
    turn (under a count, LRU over a round robin larger than it would keep none)."""
    srv = ServerProc(model_dirs["chatml"], tmp_path, journal=tmp_path / "journal.sqlite3")
    model = model_dirs["chatml"].name
    with srv, sdk(srv, "unused") as c:
        first = [c.responses.create(model=model, input=f"Conversation {i}?", instructions=INSTR,
                                    max_output_tokens=1) for i in range(70)]
        later = [c.responses.create(model=model, input="And then?", instructions=INSTR,
                                    previous_response_id=r.id, max_output_tokens=1)
                 for r in first]
        assert [ext(r)["session_id"] for r in later] == [ext(r)["session_id"] for r in first]
        assert all(r.usage.input_tokens_details.cached_tokens > 0 for r in later)
