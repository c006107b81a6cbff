"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is put in the chat route's terms (`responses_input.py`): its conversation is the
stored conversation of `previous_response_id` (`server/store/responses.py`) or the items of its
`conversation` (`server/store/conversations.py`), then its `input` items, after its own
`instructions` as the system message (a previous response's are not carried over, as OpenAI
documents). A response on a conversation adds its input and output items to it once it is
done (not if it failed or was cancelled, nor if the conversation changed meanwhile: a 409).
It becomes a `ConversationRequest`, answered by the one flow's dispatch (`flow.answer`) with
this API's reply (`response_objects.py`):

- `store: true` (the default): on a *chain session*, a persistent
  agentic session of the key (journalled, listed by the session API), the one of this key,
  instructions and tools whose conversation this one extends by the most messages: a
  continuation of its latest response (or turn of its conversation) commits only the new
  input items (a `function_call_output` is a tool result) and resumes from the
  pre-positioned entry; a client that resends its whole conversation without
  `previous_response_id` (the Agents SDK's default) continues it the same way. A
  conversation that extends none (a first response, a fork from an older response of a
  chain, other instructions) starts a new chain session holding it, its KV shared through
  the prefix index with the sessions it has in common. Chain sessions are kept as implicit
  ones are, by memory (while a tier holds their KV, within `--implicit-memory`; a count only
  with `--response-sessions`), least recently used closed first: a closed one's responses
  stay stored and are continued on a new session.
- `store: false`: the stateless chat path, on an implicit session; nothing is kept by id
  (a conversation's turn is added all the same).
- a forced tool call (`tool_choice` required or a function) is constrained by its grammar
  on either; on a back end that samples itself, it is the chat route's stateless
  continuation of the call's opening, stored as any response, on no session.

The response maps to its session and the version its answer committed (`prepos.version`
is the version it was computed from, as on every route).
"""

from __future__ import annotations

import logging
import weakref

from starlette.requests import Request

from prepos.chat.conversation import check_order
from prepos.engine import AGENTIC, Engine, SessionSpec
from prepos.errors import PreposError
from prepos.server.conversation_request import ConversationRequest
from prepos.server.http.errors import ApiError
from prepos.server.http.idempotency import attempt_of, idempotent
from prepos.server.http.request_bodies import ChatCompletion, CreateResponse
from prepos.server.http.results import JSONBody
from prepos.server.http.routing import QueryParam, Routes
from prepos.server.http.state import ServerState
from prepos.server.openai import responses_schema as RS
from prepos.server.openai.checks import chat_sampling
from prepos.server.openai.flow import ChatCall, answer
from prepos.server.openai.response_objects import Reply
from prepos.server.openai.responses_input import (
    Renamer,
    conversation_items,
    conversation_ref,
    function_tools,
    input_messages,
    output_calls,
    output_message,
    refuse_unsupported,
    text_format,
    tool_choice,
)
from prepos.server.store import idempotency
from prepos.server.store.conversations import ConversationStore, size
from prepos.server.store.responses import ResponseStore, Stored

log = logging.getLogger("prepos.server.responses")
routes = Routes()
_APIS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ResponsesApi:
    """A server's stored responses, its conversations and its chain sessions."""

    def __init__(self, state: ServerState, eng: Engine):
        self.state = state
        self.engine = eng
        config = state.config
        target = config.journal if state.journal is not None else None
        self.store = ResponseStore(target, max_bytes=config.responses_bytes,
                                   ttl=config.responses_ttl)
        self.conversations = ConversationStore(target, max_bytes=config.responses_bytes)
        for sid, owner in self.store.sessions():  # restored from the journal
            if eng.has_session(sid) and eng.session(sid).spec.owner == owner:
                eng.keep_chain(sid, owner)
                eng.release_chain(sid)

    @classmethod
    def of(cls, state: ServerState, eng: Engine) -> ResponsesApi:
        api = _APIS.get(state)
        if api is None:
            api = _APIS[state] = cls(state, eng)
        return api

    async def stored(self, owner, rid: str, param: str | None) -> Stored:
        row = await self.state.run(self.store.get, owner, rid)
        if row is None:
            raise ApiError(404, "response_not_found", f"no response {rid!r}", param)
        return row

    # -- chain sessions --------------------------------------------------------------------
    async def on_chain(self, call: ChatCall, eng, owner, system: str | None,
                       msgs: list[dict], tools: list[dict]):
        sid = eng.find_chain(owner, tools, msgs)
        if sid is None:
            sid = await self._new_chain(eng, owner, system, msgs, tools)
        try:
            return await answer(call, eng, owner, eng.session(sid),
                                cleanup=lambda stream: self._release_after(stream, sid))
        except BaseException:
            eng.release_chain(sid)
            raise

    async def _new_chain(self, eng, owner, system: str | None, msgs: list[dict],
                         tools: list[dict]) -> str:
        """A persistent session holding the conversation up to its last message (the
        answer's turn commits that one), held by the caller. At a session limit the least
        recently used chain session gives way (`SessionAdmission.check_new_session`). Its KV is a
        cache (`SessionSpec.implicit`: no budget, reclaimable whole), rebuilt from the
        committed conversation when needed, so no chain makes another request fail."""
        state = self.state
        spec = SessionSpec(AGENTIC, system, tuple(tools), (), "exact", True, None, owner=owner,
                           implicit=True)
        history = [(0, msgs[:-1])]
        with state.admission.new_session(eng, owner) as sid:
            await state.run(state.admission.with_room, eng,
                            lambda: eng.restore_session(sid, spec, history))
        eng.keep_chain(sid, owner)
        return sid

    def _release_after(self, stream, sid: str) -> None:
        # free for the next response at once
        stream.on_end(lambda: self.engine.release_chain(sid))


@routes.add("POST", "/v1/responses", 7, summary="Create a response", body=CreateResponse,
            response=RS.ResponseObject, events=RS.RESPONSE_EVENTS, errors=(404, 409, 429),
            tags=("openai",))
@idempotent  # claimed by its first write: a chain session made, its conversation's turn, or
# the response stored (each store's transaction)
async def create_response(request: Request):
    rename = Renamer()
    try:
        c = await ServerState.open(request, CreateResponse)
        return await _create(c, request, rename)
    except (ApiError, PreposError) as exc:
        raise rename(exc) from None


async def _create(c, request: Request, rename: Renamer):
    state, eng, owner, body = c.state, c.engine, c.owner, c.body
    api = ResponsesApi.of(state, eng)
    refuse_unsupported(body)
    check_sizes(body)
    tools, echo_tools, omitted = function_tools(body)
    choice, echo_choice = tool_choice(body)
    fmt, echo_text = text_format(body)
    chat = ChatCompletion.model_validate({
        "model": body.model, "messages": [], "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": bool(body.stream),
        "tools": tools or None, "tool_choice": choice, "response_format": fmt,
        "parallel_tool_calls": body.parallel_tool_calls, "user": body.user})
    sampling = chat_sampling(state, chat)
    prev, conv, history, calls = None, None, [], set()
    if body.previous_response_id is not None:
        prev = await api.stored(owner, body.previous_response_id, "previous_response_id")
        if prev.body.get("conversation"):
            raise ApiError(400, "invalid_request", f"response {prev.id!r} was made in "
                           f"conversation {prev.body['conversation']['id']!r}: continue it "
                           "with conversation", "previous_response_id")
        history = await state.run(api.store.conversation, prev)
        calls = output_calls(prev.body["output"])
    elif body.conversation is not None:
        conv, items = await state.run(api.conversations.items, owner,
                                      conversation_ref(body.conversation), "conversation")
        history = input_messages(items, calls, "conversation")[0] if items else []
    new, where = input_messages(body.input, calls)
    system = body.instructions if body.instructions and body.instructions.strip() else None
    head = [{"role": "system", "content": system}] if system else []
    msgs = head + history + new
    rename.where = ["instructions"] * len(head) + [
        "conversation" if conv else "previous_response_id"] * len(history) + where
    if msgs[-1]["role"] not in ("user", "tool"):
        raise ApiError(400, "invalid_request", "the conversation must end with a user message "
                       "or a function_call_output for the model to answer", "input")
    check_order([], msgs, 0)
    if system:
        await state.check_input(eng, system, "instructions")
    for m, at in zip(new, where):
        await state.check_input(eng, m["content"], at)
    turn = conversation_items(body.input) if conv else []  # the items it adds to conv
    if conv:
        await state.run(api.conversations.check_room, owner, sum(map(size, turn)), "input")
    store = body.store is not False
    echo = {"model": state.model_name, "instructions": body.instructions,
            "previous_response_id": body.previous_response_id, "tools": echo_tools,
            "tool_choice": echo_choice, "parallel_tool_calls": body.parallel_tool_calls
            is not False, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_output_tokens": body.max_output_tokens, "store": store,
            "metadata": omitted_tools(body.metadata or {}, omitted), "text": echo_text,
            "truncation": "disabled", "user": body.user,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "top_logprobs": 0, "conversation": {"id": conv.id} if conv else None}
    reply = Reply(state, echo, bool(body.stream))
    call = ChatCall(state, ConversationRequest(
        msgs, sampling, tools, tools_sent=bool(tools), tool_choice=choice,
        parallel=body.parallel_tool_calls is not False, stream=bool(body.stream)),
        request, reply)
    forced = call.choice not in ("auto", "none")

    async def save(obj: dict, res) -> None:
        """Stored off the event loop, before the client has the response (so its next
        request finds it): the turn in its conversation (or the request fails), then the
        response."""
        if res.finish_reason == "cancelled":
            return
        if conv:
            await state.run(api.conversations.append, owner, conv.id, turn + obj["output"],
                            "conversation", conv.version, attempt_of(request))
        if not store:
            return
        answer = output_message(obj["output"])
        sid = reply.sid
        row = Stored(obj["id"], owner, prev.id if prev else None, sid,
                     res.version + 1 if sid else None, new + ([answer] if answer else []), obj)
        try:
            if not await state.run(api.store.put, row, attempt_of(request)):
                log.warning("response %s not stored: its conversation is over the stored "
                            "responses' limit of %d bytes per key", obj["id"],
                            api.store.max_bytes)
        except idempotency.KeyClaimed:  # another attempt with its key wrote first
            raise
        except Exception as exc:  # the answer stands; only its retrieval by id is lost
            log.error("response %s not stored: %s", obj["id"], exc)

    reply.save = save
    on_session = not forced or call.constrains(eng)  # a forced call needs its grammar there
    if not store or not on_session or not api.engine.keeps_chains:
        reply.kept = on_session and eng.keeps_conversations
        return await answer(call, eng, owner, None)
    return await api.on_chain(call, eng, owner, system, msgs, tools)


def omitted_tools(metadata: dict[str, str], omitted: list[str]) -> dict[str, str]:
    """The response's metadata: the request's, and the tools left out of the prompt (names
    joined by commas, within metadata's 512 characters)."""
    if not omitted:
        return metadata
    return {**metadata, "prepos_tools_omitted": ",".join(dict.fromkeys(omitted))[:512]}


# the longest string fields a response stores besides its conversation (metadata's bounds
# are OpenAI's: responses_input.check_metadata)
MAX_CHARS = {"user": 256, "prompt_cache_key": 256}


def check_sizes(body: CreateResponse) -> None:
    """400 naming the field where a string the response stores is over its bound."""
    for name, most in MAX_CHARS.items():
        value = getattr(body, name)
        if value is not None and len(value) > most:
            raise ApiError(400, "string_too_long", f"{name} is {len(value)} characters, over "
                           f"the limit of {most}", name)


async def _api(request: Request):
    c = await ServerState.open(request)
    return ResponsesApi.of(c.state, c.engine), c.owner


@routes.add("GET", "/v1/responses/{response_id}", 60, summary="Retrieve a response",
            response=RS.ResponseObject, tags=("openai",),
            query=(QueryParam("stream", {"type": "boolean"},
                              "not supported (a stored response is returned whole)"),))
async def retrieve_response(request: Request, response_id: str):
    api, owner = await _api(request)
    raw = request.query_params.get("stream")
    if raw not in (None, "true", "false"):
        raise ApiError(400, "invalid_request", f"stream must be true or false, got {raw!r}",
                       "stream")
    if raw == "true":
        raise ApiError(400, "unsupported", "streaming a stored response is not supported: "
                       "prepos has no background responses", "stream")
    return JSONBody((await api.stored(owner, response_id, "response_id")).body)


@routes.add("DELETE", "/v1/responses/{response_id}", 60, summary="Delete a response",
            response=RS.ResponseDeleted, tags=("openai",))
@idempotent
async def delete_response(request: Request, response_id: str):
    """Forget a stored response. Its session is not closed, and the responses that continue
    it keep their conversation."""
    api, owner = await _api(request)
    if not await api.state.run(api.store.delete, owner, response_id):
        raise ApiError(404, "response_not_found", f"no response {response_id!r}",
                       "response_id")
    return JSONBody({"id": response_id, "object": "response.deleted", "deleted": True})
