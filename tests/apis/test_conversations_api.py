"""The Conversations API end to end, with the OpenAI SDK's `client.conversations` and the
Agents SDK's `OpenAIConversationsSession` against a real `prepos serve` process: create,
retrieve, update, delete; items added, listed page by page, retrieved, deleted; responses
made with `conversation`, each turn added to it and the next continuing the chain session
that holds it (its prompt cached); another key's conversations not found; bad input named
with nothing changed; the bounds, and conversations across a restart. The store's own
bounds and its refusal of a stale turn, on the store itself (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from prepos.errors import PreposError
from prepos.server.http.errors import as_api_error
from prepos.server.store.conversations import ConversationStore
from tests.support.openai_helpers import ext, held, openai_client
from tests.support.server_harness import ServerProc, sse_events

INSTR = "You are a market analyst. Answer in one word."
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    args = [a for k in KEYS for a in ("--api-key", k)]
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-conversations"),
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


def listed(c, cid: str) -> list[dict]:
    return [i.to_dict() for i in c.conversations.items.list(cid, order="asc")]


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


# -- conversations ------------------------------------------------------------------------
def test_create_retrieve_update_and_delete(c):
    conv = c.conversations.create(items=[user("Hello?")], metadata={"topic": "acme"})
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "acme"} and conv.created_at > 0
    assert c.conversations.retrieve(conv.id).to_dict() == conv.to_dict()
    [item] = listed(c, conv.id)
    assert item["id"].startswith("msg_") and item["type"] == "message"
    assert item["role"] == "user" and item["status"] == "completed"
    assert item["content"] == [{"type": "input_text", "text": "Hello?"}]
    updated = c.conversations.update(conv.id, metadata={"topic": "ibm", "n": "2"})
    assert updated.id == conv.id and updated.metadata == {"topic": "ibm", "n": "2"}
    assert c.conversations.retrieve(conv.id).metadata == {"topic": "ibm", "n": "2"}
    gone = c.conversations.delete(conv.id)
    assert gone.to_dict() == {"id": conv.id, "object": "conversation.deleted", "deleted": True}
    for call in (lambda: c.conversations.retrieve(conv.id),
                 lambda: c.conversations.items.list(conv.id),
                 lambda: c.conversations.delete(conv.id),
                 lambda: c.conversations.items.retrieve(item["id"], conversation_id=conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    empty = c.conversations.create()  # no items, no metadata
    assert empty.metadata == {} and listed(c, empty.id) == []


def test_items_added_listed_page_by_page_retrieved_and_deleted(c):
    conv = c.conversations.create()
    added = c.conversations.items.create(conv.id, items=[
        user("Price of ACME?"),
        {"type": "function_call", "call_id": "call_1", "name": "price",
         "arguments": '{"ticker": "ACME"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "41.5"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Up."}]},
        {"role": "developer", "content": "Be brief."}])
    ids = [i.id for i in added.data]
    assert added.object == "list" and added.has_more is False and len(set(ids)) == 5
    assert (added.first_id, added.last_id) == (ids[0], ids[-1])
    call, output, answer = (added.data[i].to_dict() for i in (1, 2, 3))
    assert call["type"] == "function_call" and call["call_id"] == "call_1"
    assert call["name"] == "price" and call["arguments"] == '{"ticker": "ACME"}'
    assert output["type"] == "function_call_output" and output["output"] == "41.5"
    assert answer["role"] == "assistant" and answer["content"][0]["type"] == "output_text"
    assert added.data[4].role == "developer"
    # pages: asc and desc (OpenAI's default), `after` the cursor, the SDK's auto-paging
    page = c.conversations.items.list(conv.id, limit=2, order="asc")
    assert [i.id for i in page.data] == ids[:2] and page.has_more is True
    assert page.first_id == ids[0] and page.last_id == ids[1]
    nxt = c.conversations.items.list(conv.id, limit=2, order="asc", after=page.last_id)
    assert [i.id for i in nxt.data] == ids[2:4] and nxt.has_more is True
    assert [i.id for i in c.conversations.items.list(conv.id, limit=2, order="asc")] == ids
    assert [i.id for i in c.conversations.items.list(conv.id).data] == ids[::-1]
    last = c.conversations.items.list(conv.id, limit=3, after=ids[2])
    assert [i.id for i in last.data] == [ids[1], ids[0]] and last.has_more is False
    # one item, then deleted: the conversation is returned
    assert c.conversations.items.retrieve(ids[3], conversation_id=conv.id).to_dict() == answer
    after = c.conversations.items.delete(ids[3], conversation_id=conv.id)
    assert after.object == "conversation" and after.id == conv.id
    assert [i["id"] for i in listed(c, conv.id)] == ids[:3] + ids[4:]
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.retrieve(ids[3], conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.delete(ids[3], conversation_id=conv.id)


# -- responses on a conversation ------------------------------------------------------------
def test_responses_on_a_conversation_add_their_turns_and_continue_its_session(c, http, model):
    conv = c.conversations.create(items=[user("ACME closed at 41.5.")])
    r1 = c.responses.create(model=model, conversation=conv.id, input="Is ACME up?",
                            instructions=INSTR, max_output_tokens=3)
    assert r1.conversation.id == conv.id and r1.status in ("completed", "incomplete")
    sid = ext(r1)["session_id"]
    items = listed(c, conv.id)
    assert [i["type"] for i in items] == ["message"] * 3
    assert [i["role"] for i in items] == ["user", "user", "assistant"]
    assert items[1]["content"] == [{"type": "input_text", "text": "Is ACME up?"}]
    assert items[2]["id"] == r1.output[0].id  # the output item, as the response returned it
    assert items[2]["content"][0]["text"] == r1.output_text
    http.get(f"/sessions/{sid}", params={"wait_ready": 30})
    # the second turn: the conversation's items, then the input, on the same chain session,
    # only the new input committed and prefilled (the first turn's prompt cached)
    raw = c.responses.with_raw_response.create(
        model=model, conversation={"id": conv.id}, input=[user("And MSFT?")],
        instructions=INSTR, max_output_tokens=3)
    r2 = raw.parse()
    assert r2.conversation.id == conv.id and ext(r2)["session_id"] == sid
    assert raw.headers["x-prepos-path"] == "fall-through"
    assert r2.usage.input_tokens > r1.usage.input_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    msgs = held(http, sid)
    assert [m["content"] for m in msgs if m["role"] == "user"] == [
        "ACME closed at 41.5.", "Is ACME up?", "And MSFT?"]
    assert [m["content"].strip() for m in msgs if m["role"] == "assistant"] == [
        r1.output_text.strip(), r2.output_text.strip()]
    # a streamed third turn: added once it completed
    events = list(c.responses.create(model=model, conversation=conv.id, input="And IBM?",
                                     instructions=INSTR, max_output_tokens=3, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    r3 = events[-1].response
    assert r3.conversation.id == conv.id and ext(r3)["session_id"] == sid
    items = listed(c, conv.id)
    assert len(items) == 7 and items[-1]["id"] == r3.output[0].id
    assert c.responses.retrieve(r3.id).conversation.id == conv.id
    # a response made in a conversation is continued with it, not previous_response_id
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=model, input="x", previous_response_id=r3.id)
    assert err.value.body["param"] == "previous_response_id"
    # store: false keeps no response (and runs on an implicit session), but the turn is
    # added all the same, and the chain session continues with it
    r4 = c.responses.create(model=model, conversation=conv.id, input="And HP?", store=False,
                            instructions=INSTR, max_output_tokens=3)
    assert len(listed(c, conv.id)) == 9 and ext(r4)["session_id"] is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r4.id)
    r5 = c.responses.create(model=model, conversation=conv.id, input="And AMD?",
                            instructions=INSTR, max_output_tokens=3)
    assert ext(r5)["session_id"] == sid
    assert [m["content"] for m in held(http, sid) if m["role"] == "user"][-2:] == [
        "And HP?", "And AMD?"]


def test_a_function_call_round_trip_on_a_conversation(c, model):
    tools = [{"type": "function", "name": "price", "description": "ACME's price", "parameters": {
        "type": "object", "properties": {"live": {"type": "boolean"}}, "required": ["live"],
        "additionalProperties": False}}]  # a short call: the tiny model finishes it
    conv = c.conversations.create()
    r1 = c.responses.create(model=model, conversation=conv.id, input="Price of ACME?",
                            instructions=INSTR, tools=tools, max_output_tokens=64,
                            tool_choice={"type": "function", "name": "price"})
    [call] = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed"  # the call whole, as the session committed it
    r2 = c.responses.create(model=model, conversation=conv.id, tools=tools,
                            instructions=INSTR, max_output_tokens=3, input=[
                                {"type": "function_call_output", "call_id": call.call_id,
                                 "output": "41.5"}])
    assert ext(r2)["session_id"] == ext(r1)["session_id"]
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    items = listed(c, conv.id)
    assert [i["type"] for i in items][:3] == ["message", "function_call",
                                              "function_call_output"]
    assert items[1]["call_id"] == call.call_id and items[2]["output"] == "41.5"


def test_the_agents_sdk_s_conversation_session_and_conversation_id(server, model):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIConversationsSession,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    set_tracing_disabled(True)

    class Trend(BaseModel):  # a structured answer: it ends within its budget
        up: bool

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS[0],
                                    max_retries=0)
        agent = Agent(name="analyst", instructions=INSTR, output_type=Trend,
                      model=OpenAIResponsesModel(model, client),
                      model_settings=ModelSettings(max_tokens=32))
        # the session: the SDK reads the conversation's items, resends them, adds the turn
        session = OpenAIConversationsSession(openai_client=client)
        one = await Runner.run(agent, "Is ACME up?", session=session)
        two = await Runner.run(agent, "And MSFT?", session=session)
        items = await session.get_items()
        msgs = [i for i in items if i.get("type", "message") == "message"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert msgs[0]["content"][0]["text"] == "Is ACME up?"
        assert msgs[2]["content"][0]["text"] == "And MSFT?"
        first = await client.responses.retrieve(one.last_response_id)
        second = await client.responses.retrieve(two.last_response_id)
        assert second.model_extra["prepos"]["session_id"] == \
            first.model_extra["prepos"]["session_id"]
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
        # conversation_id: the server keeps the conversation, the SDK sends only the turn
        conv = await client.conversations.create()
        three = await Runner.run(agent, "Is IBM up?", conversation_id=conv.id)
        four = await Runner.run(agent, "And HP?", conversation_id=conv.id)
        got = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        assert [i.role for i in got] == ["user", "assistant", "user", "assistant"]
        assert got[2].content[0].text == "And HP?"
        r3 = await client.responses.retrieve(three.last_response_id)
        r4 = await client.responses.retrieve(four.last_response_id)
        assert r4.conversation.id == conv.id
        assert r4.usage.input_tokens_details.cached_tokens >= r3.usage.input_tokens
        cid = session.session_id
        await session.clear_session()  # the conversation deleted
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(cid)
        await client.close()

    asyncio.run(run())


# -- keys, bad input ------------------------------------------------------------------------
def test_another_key_s_conversations_are_not_found(server, c, model):
    conv = c.conversations.create(items=[user("Mine?")], metadata={"k": "a"})
    [item] = listed(c, conv.id)
    with sdk(server, KEYS[1]) as other:
        for call in (lambda: other.conversations.retrieve(conv.id),
                     lambda: other.conversations.update(conv.id, metadata={"k": "b"}),
                     lambda: other.conversations.delete(conv.id),
                     lambda: other.conversations.items.list(conv.id),
                     lambda: other.conversations.items.create(conv.id, items=[user("x")]),
                     lambda: other.conversations.items.retrieve(item["id"],
                                                                conversation_id=conv.id),
                     lambda: other.conversations.items.delete(item["id"],
                                                              conversation_id=conv.id),
                     lambda: other.responses.create(model=model, conversation=conv.id,
                                                    input="x", max_output_tokens=2)):
            with pytest.raises(openai.NotFoundError) as err:
                call()
            assert "conv_" in err.value.body["message"]
    assert c.conversations.retrieve(conv.id).metadata == {"k": "a"}
    assert listed(c, conv.id) == [item]


C = "/v1/conversations"
BAD = [  # method, path ({cid}, {item}: a live conversation and item), body or query, status,
    # param
    ("POST", C, {"items": [{"role": "robot", "content": "x"}]}, 400, "items[0].role"),
    ("POST", C, {"items": [user("x")] * 21}, 400, "items"),
    ("POST", C, {"items": "x"}, 400, "items"),
    ("POST", C, {"items": [user("")]}, 400, "items[0].content"),
    ("POST", C, {"items": [{"type": "item_reference", "id": "x"}]}, 400, "items[0].type"),
    ("POST", C, {"items": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     400, "items[0].call_id"),
    ("POST", C, {"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ("POST", C, {"metadata": {"k": 5}}, 400, "metadata.k"),
    ("GET", C + "/nope", None, 400, "conversation_id"),
    ("GET", C + "/conv_nope", None, 404, "conversation_id"),
    ("POST", C + "/conv_nope", {"metadata": {}}, 404, "conversation_id"),
    ("DELETE", C + "/conv_nope", None, 404, "conversation_id"),
    ("POST", C + "/{cid}", {}, 400, "metadata"),
    ("POST", C + "/{cid}", {"metadata": {"k": "v" * 513}}, 400, "metadata"),
    ("POST", C + "/{cid}/items", {"items": []}, 400, "items"),
    ("POST", C + "/{cid}/items", {}, 400, "items"),
    ("POST", C + "/{cid}/items", {"items": [user("ok"), {"role": "user"}]}, 400,
     "items[1].content"),
    ("POST", C + "/{cid}/items", {"items": [{"type": "function_call_output",
                                             "call_id": "nope", "output": "x"}]},
     400, "items[0].call_id"),
    ("POST", C + "/conv_nope/items", {"items": [user("x")]}, 404, "conversation_id"),
    ("GET", C + "/{cid}/items", {"limit": "0"}, 400, "limit"),
    ("GET", C + "/{cid}/items", {"limit": "101"}, 400, "limit"),
    ("GET", C + "/{cid}/items", {"limit": "two"}, 400, "limit"),
    ("GET", C + "/{cid}/items", {"order": "up"}, 400, "order"),
    ("GET", C + "/{cid}/items", {"after": "msg_nope"}, 404, "after"),
    ("GET", C + "/{cid}/items", {"after": "a b"}, 400, "after"),
    ("GET", C + "/{cid}/items", {"include": "message.output_text.logprobs"}, 400, "include"),
    ("GET", C + "/{cid}/items/msg_nope", None, 404, "item_id"),
    ("GET", C + "/{cid}/items/a.b", None, 400, "item_id"),
    ("DELETE", C + "/{cid}/items/msg_nope", None, 404, "item_id"),
    ("GET", C + "/conv_nope/items/{item}", None, 404, "conversation_id"),
    ("POST", "/v1/responses", {"input": "x", "conversation": "conv_nope"}, 404, "conversation"),
    ("POST", "/v1/responses", {"input": "x", "conversation": "nope"}, 400, "conversation"),
    ("POST", "/v1/responses", {"input": "x", "conversation": 5}, 400, "conversation"),
    ("POST", "/v1/responses", {"input": "x", "conversation": {"id": 5}}, 400,
     "conversation.id"),
    ("POST", "/v1/responses", {"input": "x", "conversation": "{cid}",
                               "previous_response_id": "resp_x"}, 400, "conversation"),
    ("POST", "/v1/responses", {"input": [{"type": "function_call_output", "call_id": "nope",
                                          "output": "x"}], "conversation": "{cid}"},
     400, "input[0].call_id"),
    ("POST", "/v1/responses", {"input": "", "conversation": "{cid}"}, 400, "input"),
]


@pytest.fixture(scope="module")
def victim(server):
    """A conversation every bad request names, and its state: unchanged by all of them."""
    with sdk(server) as c:
        conv = c.conversations.create(items=[user("Keep me?")], metadata={"k": "v"})
        yield conv.id, listed(c, conv.id)


@pytest.mark.parametrize("method,path,body,status,param", BAD)
def test_bad_input_is_refused_by_name_and_changes_nothing(http, c, model, victim, method, path,
                                                         body, status, param):
    cid, items = victim
    path = path.format(cid=cid, item=items[0]["id"])
    if method == "GET":
        r = http.get(path, params=body)
    elif body is not None:
        body = {k: (v.format(cid=cid) if isinstance(v, str) else v) for k, v in body.items()}
        r = http.request(method, path, json={"model": model, **body}
                         if path == "/v1/responses" else body)
    else:
        r = http.request(method, path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["code"], r.text
    assert c.conversations.retrieve(cid).metadata == {"k": "v"}
    assert listed(c, cid) == items


# -- the store's bounds, and across a restart -----------------------------------------------
@pytest.fixture(params=["sqlite", "postgresql"])
def target(request):
    """The store's database: SQLite in memory, or a PostgreSQL server of its own."""
    if request.param == "sqlite":
        yield None
        return
    from tests.support.cluster_harness import Postgres, missing_postgres

    if reason := missing_postgres():
        pytest.skip(reason)
    pg = Postgres().start()
    yield pg.url
    pg.stop()


def test_the_store_bounds_each_key_and_refuses_a_stale_turn(target):
    store = ConversationStore(target, keep=2, max_bytes=1000)

    def item(i: int, text: str = "x") -> dict:
        return {"id": f"msg_{i}", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_text", "text": text}]}

    a = store.create("conv_a", "k1", {}, [item(1)])
    store.create("conv_b", "k1", {}, [])
    with pytest.raises(PreposError) as err:
        store.create("conv_c", "k1", {}, [])
    assert as_api_error(err.value).status == 400 and err.value.code == "too_many_conversations"
    assert store.used("k1")[0] == 2
    store.create("conv_c", "k2", {}, [])  # another key's bound is its own
    with pytest.raises(PreposError) as err:
        store.get("k2", "conv_a", "conversation_id")
    assert as_api_error(err.value).status == 404
    used = store.used("k1")[1]
    with pytest.raises(PreposError) as err:
        store.append("k1", "conv_a", [item(2, "y" * 1000)], "conversation_id")
    assert as_api_error(err.value).status == 413 and err.value.param == "items"
    assert store.used("k1")[1] == used and len(store.items("k1", "conv_a", "c")[1]) == 1
    # a turn made on version 0 joins it; one made on a version that moved on does not
    store.append("k1", "conv_a", [item(3)], "conversation", version=a.version)
    with pytest.raises(PreposError) as err:
        store.append("k1", "conv_a", [item(4)], "conversation", version=a.version)
    assert as_api_error(err.value).status == 409 and err.value.code == "conversation_changed"
    assert [i["id"] for i in store.items("k1", "conv_a", "c")[1]] == ["msg_1", "msg_3"]
    # a turn is never refused for bytes: the key's next addition is
    store.append("k1", "conv_a", [item(5, "z" * 1000)], "conversation", version=a.version + 1)
    assert store.used("k1")[1] > 1000
    with pytest.raises(PreposError) as err:
        store.append("k1", "conv_b", [item(6)], "conversation_id")
    assert as_api_error(err.value).status == 413
    store.delete_item("k1", "conv_a", "msg_5")
    assert store.used("k1")[1] == used + len(json.dumps(item(3)))
    store.close()


def test_conversations_are_bounded_and_survive_a_restart(model_dirs, tmp_path):
    srv = ServerProc(model_dirs["chatml"], tmp_path, "--responses-bytes", "10K",
                     journal=tmp_path / "journal.sqlite3")
    model = model_dirs["chatml"].name
    big = "pad " * 1000
    with srv, sdk(srv, "unused") as c, httpx.Client(base_url=srv.url, timeout=60) as http:
        small = c.conversations.create(metadata={"k": "v"})
        r1 = c.responses.create(model=model, conversation=small.id, input="One?",
                                instructions=INSTR, max_output_tokens=3)
        sid = ext(r1)["session_id"]
        conv = c.conversations.create(items=[user(big)])
        c.conversations.items.create(conv.id, items=[user(big)])
        before, msgs = listed(c, conv.id), held(http, sid)
        with pytest.raises(openai.APIStatusError) as err:
            c.conversations.items.create(conv.id, items=[user(big)])
        assert err.value.status_code == 413 and err.value.body["param"] == "items"
        assert "10240" in err.value.body["message"]
        with pytest.raises(openai.APIStatusError) as err:
            c.conversations.create(items=[user(big)])
        assert err.value.status_code == 413
        with pytest.raises(openai.APIStatusError) as err:  # checked before it is answered
            c.responses.create(model=model, conversation=small.id, input=big,
                               instructions=INSTR, max_output_tokens=3)
        assert err.value.status_code == 413 and err.value.body["param"] == "input"
        assert listed(c, conv.id) == before and held(http, sid) == msgs
        small_items = listed(c, small.id)
        assert len(small_items) == 2
    with srv, sdk(srv, "unused") as c:
        assert c.conversations.retrieve(small.id).metadata == {"k": "v"}
        assert listed(c, small.id) == small_items and listed(c, conv.id) == before
        r2 = c.responses.create(model=model, conversation=small.id, input="Two?",
                                instructions=INSTR, max_output_tokens=3)
        assert ext(r2)["session_id"] == sid  # the chain session, restored from the journal
        assert [i["role"] for i in listed(c, small.id)] == ["user", "assistant"] * 2
        c.conversations.delete(conv.id)  # room again
        c.conversations.items.create(small.id, items=[user(big)])


def test_sse_stream_of_a_conversation_turn(http, c, model):
    conv = c.conversations.create()
    r = http.post("/v1/responses", json={"model": model, "conversation": conv.id,
                                         "input": "Hi?", "stream": True,
                                         "max_output_tokens": 2})
    events = [data for _, data in sse_events(r.text)]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["conversation"] == {"id": conv.id}
    assert [i["role"] for i in listed(c, conv.id)] == ["user", "assistant"]
