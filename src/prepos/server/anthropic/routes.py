"""Anthropic's Messages API: `POST /v1/messages` (also as `/v1/messages?beta=true`, as the
SDK's beta client and Claude Code send it), streamed or not, and `POST
/v1/messages/count_tokens`.

One more translation onto the one flow (`server/openai/flow.py`), as the Responses API is: a
Messages body becomes a `ConversationRequest` (`translate.py`) and is answered as a chat
request is: statelessly on the implicit session its conversation extends (a stock client
resending its whole conversation pays only its new messages), or on a named session; the
reply alone is Anthropic's (`events.py`). So `ANTHROPIC_BASE_URL=http://127.0.0.1:8000 claude`
and Anthropic's SDK work against prepos unchanged.

- Keys: `x-api-key` as well as `Authorization: Bearer` (the first is read as the second).
  `anthropic-version` and `anthropic-beta` are accepted; they change nothing.
- The model: the served model's name, or any `claude-...` name (Claude Code asks for its own
  models by name; the served model answers them all, and the message names it); another
  name is a 404 `not_found_error`.
- `max_tokens` is required, as Anthropic requires it; above the server's `--max-tokens`
  (Claude Code asks for 32,000) it is that limit, and an answer stops where the context has
  no more room (`max_tokens`) instead of being refused. `stop_sequences`, `temperature`,
  `top_p`, `top_k`, `tools` and `tool_choice` are honoured (`translate.py`); `cache_control`
  on any block is accepted: the kept conversation's KV is the cache.
- Accepted and ignored: `thinking` (this model does not think aloud; past `thinking` blocks
  are dropped), `context_management`, `output_config`, `service_tier`, `container`,
  `mcp_servers`, `betas`, `metadata`, a top-level `cache_control`, `speed`, `inference_geo`
  and any field these clients add later: never a 400. What a text-only model cannot honour is
  refused by name: an `image` or `document` block, a server tool (`web_search_...`).
- Claude Code's first system block, `x-anthropic-billing-header: cc_version=...;
  cc_entrypoint=...; cch=...;`, changes its `cch=` value every request: that field is left
  out before rendering, so consecutive requests share their prompt's prefix and the kept KV
  is found.
- A session named by `x-session-id`, or where none is sent by Claude Code's
  `X-Claude-Code-Session-Id` (`ClusterFront` reads them the same way): as the chat route's
  `session_id`, a session of the key's is answered on (an agentic one commits only
  the conversation's delta); any other name is the client's own, and the request is answered
  statelessly, its conversation found by its content.
- Usage: `input_tokens` is the prompt's part not found in kept KV, `cache_read_input_tokens`
  the part found there (the chat route's `cached_tokens`), `cache_creation_input_tokens` 0
  (keeping KV costs nothing); `count_tokens` counts the prompt as the chat template renders
  and the tokenizer splits it, which is their sum.
- Errors in Anthropic's shape and statuses (`errors.py`), on these routes only.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from prepos.chat.conversation import check_order, session_messages
from prepos.errors import InvalidInput
from prepos.server.conversation_request import ConversationRequest, tool_choice
from prepos.server.http.cluster_front import SESSION_ID
from prepos.server.http.errors import ApiError, as_api_error
from prepos.server.http.head import AGENT_HEADERS
from prepos.server.http.idempotency import idempotent, kept
from prepos.server.http.request_bodies import ChatMessage
from prepos.server.http.results import JSONBody
from prepos.server.http.routing import Routes
from prepos.server.http.state import ServerState
from prepos.server.openai.flow import ChatCall, _continuation_prompt, converse
from prepos.server.store.idempotency import KeyClaimed

from . import schema as S
from . import translate as T
from .errors import Renamer, error_response
from .events import MessageReply

routes = Routes()
MAX_STOPS = 16  # stop sequences a request may name (the server's bound)


def answered(fn):
    """A route whose every failure is answered in Anthropic's shape, messages named as the
    client named them (`Renamer`), and which takes an `Idempotency-Key` as every route that
    writes does (`http/idempotency.py`: the answer it records is the one sent, in this
    shape; a refusal it would not record, a 5xx, 408, 429 or busy session, is not)."""

    async def shaped(request: Request):
        rename = Renamer()
        try:
            return await fn(request, rename)
        except KeyClaimed:  # another attempt with its key wrote first: its answer is replayed
            raise
        except Exception as exc:
            err = rename(as_api_error(exc))
            if not kept(err.status, err.code):
                raise err from None
            return refused(request, err)

    shaped.__name__ = fn.__name__
    keyed = idempotent(shaped)

    async def route(request: Request):
        request = with_bearer(request)
        try:
            return await keyed(request=request)
        except Exception as exc:
            return refused(request, as_api_error(exc))

    route.__name__ = fn.__name__
    route.__doc__ = fn.__doc__
    route.idempotent = True  # documented with the header
    return route


def refused(request: Request, err: ApiError):
    """An error's response, counted as the app counts the errors it answers."""
    ServerState.of(request).metrics.refused(err)
    return error_response(err)


def with_bearer(request: Request) -> Request:
    """The request, its `x-api-key` (Anthropic's) read as `Authorization: Bearer`, where it
    has no Authorization header of its own."""
    raw = request.scope["headers"]
    key = None
    for name, value in raw:
        if name == b"authorization":
            return request
        if name == b"x-api-key":
            key = value
    if key is None:
        return request
    headers = [*raw, (b"authorization", b"Bearer " + key)]
    return Request({**request.scope, "headers": headers}, request.receive)


def check_model(state, model: str) -> None:
    if model == state.model_name or model.startswith("claude"):
        return
    raise ApiError(404, "model_not_found", f"model {model!r} is not served here; this server "
                   f"serves {state.model_name!r} (and answers claude-... names with it)",
                   "model")


class Translated:
    """A Messages body in no API's terms (`request`: a `ConversationRequest`)."""

    def __init__(self, body: S.AnthropicCountTokens, rename: Renamer):
        sent, rename.where = T.conversation(body)
        self.tools = T.function_tools(body.tools)
        self.sent_tools = body.tools is not None  # a session's own are used where none are
        self.choice, self.parallel = T.tool_choice(body.tool_choice)
        self.messages = [ChatMessage.model_validate(m) for m in sent]
        self.msgs = session_messages(self.messages)

    def request(self, sampling, name: str | None, stream: bool) -> ConversationRequest:
        return ConversationRequest(self.msgs, sampling, self.tools, tools_sent=self.sent_tools,
                                   tool_choice=self.choice, parallel=self.parallel, name=name,
                                   stream=stream)


@routes.add("POST", "/v1/messages", 8, summary="Create a message (Anthropic's Messages API)",
            body=S.AnthropicMessages, response=S.AnthropicMessage, events=S.MESSAGE_EVENTS,
            errors=(404, 409, 422, 429, 529), error_body=S.AnthropicError, tags=("anthropic",))
@answered
async def create_message(request: Request, rename: Renamer):
    c = await ServerState.open(request, S.AnthropicMessages)
    state, eng, owner, body = c.state, c.engine, c.owner, c.body
    check_model(state, body.model)
    if body.max_tokens < 1:
        raise T.bad(f"max_tokens must be at least 1, got {body.max_tokens}", "max_tokens")
    t = Translated(body, rename)
    stops = tuple(body.stop_sequences or ())
    if len(stops) > MAX_STOPS:
        raise T.bad(f"at most {MAX_STOPS} stop sequences", "stop_sequences")
    if any(not s for s in stops):
        raise T.bad("a stop sequence must not be empty", "stop_sequences")
    # Claude Code asks for 32,000 tokens: answered up to the server's limit and the context's
    # end, unless the server refuses such requests (--strict-max-tokens)
    sampling = state.limits.sampling(body.max_tokens, body.temperature, body.top_k,
                                     body.top_p, None, stops, param="max_tokens", fit=True)
    reply = MessageReply(state, state.model_name, bool(body.stream), stops, rename=rename)
    conv = t.request(sampling, session_name(request), bool(body.stream))
    return await converse(ChatCall(state, conv, request, reply), request, eng, owner)


def session_name(request: Request) -> str | None:
    """The session a request names in its headers: `x-session-id`, else the first valid name
    of the headers coding agents name their conversation in (Claude Code's
    `x-claude-code-session-id`), as `ClusterFront` reads them (`http/cluster_front.py`)."""
    value = (request.headers.get("x-session-id") or "").strip()
    if value:
        return value
    for name in AGENT_HEADERS:
        value = (request.headers.get(name.decode()) or "").strip()
        if SESSION_ID.fullmatch(value):
            return value
    return None


@routes.add("POST", "/v1/messages/count_tokens", 9, summary="Count a message's input tokens",
            body=S.AnthropicCountTokens, response=S.AnthropicTokenCount,
            errors=(404, 409, 422, 529), error_body=S.AnthropicError, tags=("anthropic",))
@answered
async def count_tokens(request: Request, rename: Renamer):
    """The prompt's tokens, as `POST /v1/messages` with the same body would place them:
    rendered by the chat template (the tools too, unless `tool_choice` is `none`) and
    tokenized."""
    c = await ServerState.open(request, S.AnthropicCountTokens)
    state, eng, body = c.state, c.engine, c.body
    check_model(state, body.model)
    t = Translated(body, rename)
    msgs = t.msgs
    for i, m in enumerate(msgs):
        await state.check_input(eng, m["content"], f"messages[{i}].content", context=True)
    tool_choice(t.choice, t.tools)  # refused as a create refuses it: a tool none of them is
    tools = [] if t.choice == "none" else t.tools
    check_order([], msgs, 0, continue_final=True)
    n = await asyncio.get_running_loop().run_in_executor(state.cpu, prompt_tokens, eng,
                                                         msgs, tools)
    return JSONBody({"input_tokens": n})


def prompt_tokens(eng, msgs: list[dict], tools: list[dict]) -> int:
    """The prompt's length in tokens: the conversation rendered for the answer; one that
    ends with an assistant message, up to its text (continued, as the chat flow does)."""
    fmt = eng.fmt
    try:
        if msgs[-1]["role"] != "assistant":
            return len(fmt.encode(fmt.render(msgs, tools, generation_prompt=True)))
        full = fmt.render(msgs, tools)
        content = msgs[-1]["content"]
        content = fmt.defuse(content.strip() if fmt.trims_content else content)
        at = full.rfind(content) if content else -1
        text = (fmt.render(msgs[:-1], tools, generation_prompt=True) if at < 0
                else full[:at + len(content)])
        return len(fmt.encode_prompt(_continuation_prompt(fmt, text)))
    except InvalidInput as exc:
        raise ApiError(400, "invalid_input", str(exc), "messages") from None
