"""OpenAI's Conversations API: `/v1/conversations` (create, retrieve, update its metadata,
delete) and `/v1/conversations/{id}/items` (add, list, retrieve, delete), each object as
OpenAI's (`openai.types.conversations`).

A conversation is the server's record of a client's history, persisted with the stored
responses (`conversation_store.py`, bounded per key with them by `--responses-bytes`).
Items are those `input` takes (`responses_input.py`: messages, function calls and their
outputs), checked as `input` is and kept with a new id each. A response made with
`conversation` (`responses_api.py`) answers from its items and adds its turn; it runs on a
chain session, which holds the conversation up to its last turn with the next entry
pre-positioned, so the next turn commits only its new items. Another key's conversation is
not found, as an unknown one.
"""

from __future__ import annotations

import re

from starlette.requests import Request

from prepos.server.http.idempotency import idempotent
from prepos.server.http.request_bodies import AddItems, CreateConversation, UpdateConversation
from prepos.server.http.results import JSONBody
from prepos.server.http.routing import QueryParam, Routes
from prepos.server.http.state import ServerState
from prepos.server.openai import responses_schema as RS
from prepos.server.openai.response_objects import new_id
from prepos.server.openai.responses import ResponsesApi
from prepos.server.openai.responses_input import (
    INCLUDABLE,
    bad,
    check_metadata,
    conversation_id,
    conversation_items,
    input_messages,
    unsupported,
)

routes = Routes()
MAX_ITEMS = 20  # items one request adds (OpenAI's bound)
MAX_LIMIT = 100  # items one page lists
ITEM_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
CONV = "/v1/conversations/{conversation_id}"
INCLUDE = QueryParam("include", {"type": "array", "items": {"type": "string"}},
                     "reasoning.encrypted_content alone, which adds nothing (there is no "
                     "reasoning); any other value is a 400")
TAGS = ("openai",)


async def _open(request: Request, conversation: str | None, model=None):
    c = await ServerState.open(request, model)
    cid = conversation_id(conversation, "conversation_id") if conversation is not None else None
    _include(request)
    return ResponsesApi.of(c.state, c.engine), c, cid


def _include(request: Request) -> None:
    q = request.query_params
    for value in q.getlist("include") + q.getlist("include[]"):
        if value not in INCLUDABLE:
            raise unsupported(f"include {value!r} is not supported", "include")


def _item_id(value: str, param: str) -> str:
    if ITEM_ID.fullmatch(value):
        return value
    raise bad(f"{param} must be an item id (letters, digits, _ and -), got {value!r:.80}",
              param)


def _items(raw: list[dict], calls: set[str]) -> list[dict]:
    """Items to add, checked as `input` is (a 400 naming `items[i]` and its field), each
    with a new id."""
    if len(raw) > MAX_ITEMS:
        raise bad(f"items holds {len(raw)} items, over the limit of {MAX_ITEMS} a request "
                  "adds", "items")
    if raw:
        input_messages(raw, calls, "items")
    return conversation_items(raw)


def _list(data: list[dict], has_more: bool = False) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


# -- conversations ----------------------------------------------------------------------------
@routes.add("POST", "/v1/conversations", 61, summary="Create a conversation",
            body=CreateConversation, response=RS.ConversationObject, tags=TAGS)
@idempotent
async def create_conversation(request: Request):
    api, c, _ = await _open(request, None)
    body = await c.state.parse(await request.body() or b"{}", CreateConversation)  # or none
    meta = check_metadata(body.metadata)
    items = _items(body.items or [], set())
    conv = await c.state.run(api.conversations.create, new_id("conv_"), c.owner, meta, items,
                             c.origin)
    return JSONBody(conv.object())


@routes.add("GET", CONV, 61, summary="Retrieve a conversation", response=RS.ConversationObject,
            errors=(400,), tags=TAGS)
async def retrieve_conversation(request: Request, conversation_id: str):
    api, c, cid = await _open(request, conversation_id)
    conv = await c.state.run(api.conversations.get, c.owner, cid, "conversation_id")
    return JSONBody(conv.object())


@routes.add("POST", CONV, 61, summary="Update a conversation's metadata",
            body=UpdateConversation, response=RS.ConversationObject, tags=TAGS)
@idempotent
async def update_conversation(request: Request, conversation_id: str):
    api, c, cid = await _open(request, conversation_id, UpdateConversation)
    meta = check_metadata(c.body.metadata)
    conv = await c.state.run(api.conversations.update, c.owner, cid, meta, c.origin)
    return JSONBody(conv.object())


@routes.add("DELETE", CONV, 61, summary="Delete a conversation",
            response=RS.ConversationDeleted, errors=(400,), tags=TAGS)
@idempotent
async def delete_conversation(request: Request, conversation_id: str):
    """Delete a conversation and its items. The responses made on it stay stored."""
    api, c, cid = await _open(request, conversation_id)
    await c.state.run(api.conversations.delete, c.owner, cid, c.origin)
    return JSONBody({"id": cid, "object": "conversation.deleted", "deleted": True})


# -- items ------------------------------------------------------------------------------------
@routes.add("POST", CONV + "/items", 61, summary="Add items to a conversation", body=AddItems,
            response=RS.ConversationItemList, query=(INCLUDE,), tags=TAGS)
@idempotent
async def create_conversation_items(request: Request, conversation_id: str):
    api, c, cid = await _open(request, conversation_id, AddItems)
    calls = await c.state.run(api.conversations.calls, c.owner, cid)
    if not c.body.items:
        raise bad("items must not be empty", "items")
    items = _items(c.body.items, calls)
    await c.state.run(api.conversations.append, c.owner, cid, items, "conversation_id", None,
                      c.origin)
    return JSONBody(_list(items))


LIST_QUERY = (
    QueryParam("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
               f"items on one page (1 to {MAX_LIMIT}, default 20)"),
    QueryParam("order", {"type": "string", "enum": ["asc", "desc"]},
               "oldest first (asc) or newest first (desc, the default)"),
    QueryParam("after", {"type": "string"}, "the id of the item the page starts after"),
    INCLUDE)


@routes.add("GET", CONV + "/items", 61, summary="List a conversation's items",
            response=RS.ConversationItemList, query=LIST_QUERY, tags=TAGS)
async def list_conversation_items(request: Request, conversation_id: str):
    api, c, cid = await _open(request, conversation_id)
    q = request.query_params
    raw = q.get("limit", "20")
    limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 4 else 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad(f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw!r:.40}", "limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad(f"order must be asc or desc, got {order!r:.40}", "order")
    after = q.get("after")
    if after is not None:
        after = _item_id(after, "after")
    data, more = await c.state.run(api.conversations.page, c.owner, cid, limit, order, after)
    return JSONBody(_list(data, more))


@routes.add("GET", CONV + "/items/{item_id}", 61, summary="Retrieve a conversation's item",
            response=RS.ConversationItem, query=(INCLUDE,), tags=TAGS)
async def retrieve_conversation_item(request: Request, conversation_id: str, item_id: str):
    api, c, cid = await _open(request, conversation_id)
    item = await c.state.run(api.conversations.item, c.owner, cid, _item_id(item_id, "item_id"))
    return JSONBody(item)


@routes.add("DELETE", CONV + "/items/{item_id}", 61, summary="Delete a conversation's item",
            response=RS.ConversationObject, errors=(400,), tags=TAGS)
@idempotent
async def delete_conversation_item(request: Request, conversation_id: str, item_id: str):
    """Delete an item; the conversation as it is now."""
    api, c, cid = await _open(request, conversation_id)
    conv = await c.state.run(api.conversations.delete_item, c.owner, cid,
                             _item_id(item_id, "item_id"), c.origin)
    return JSONBody(conv.object())
