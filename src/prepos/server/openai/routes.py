"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models and
/v1/models/{id}.

Without `session_id` a request is stateless: answered as its messages ask, a chat
conversation kept for its next turn and found again by its content (`engine/implicit.py`),
a completion on a session closed after it. A `session_id` (or `x-session-id`) that names no
session of the caller's key is the client's name for its conversation: accepted, and answered
statelessly the same way (the name keeps a router sending the conversation to one node; an
edited or regenerated history branches from the longest prefix any kept conversation of the
key holds). With the `session_id` of one of the key's sessions, the request maps onto it:

- agentic session, chat: the conversation must extend the session's committed history;
  only the delta is committed (client-held messages with `add_message`, then the last user
  message or tool result starts the turn, resuming from the pre-positioned entry). A
  conversation that diverges is refused with 409 `conversation_diverged`, or, with
  `"on_divergence": "rollback"`, the session is rolled back to the newest version the
  conversation extends. An empty delta after a committed user/tool message is the exact
  fast path.
- streaming session, chat (one user message) or completions (the prompt): a query.

Every response names the path that served it and its timing: headers `X-Prepos-Path` and
`Server-Timing` (streamed responses whose path is decided on the model worker carry it in
the last chunk instead), and the body's `prepos` extension field.

`logprobs` are the engine's per-token logprobs of the sampled tokens; `top_logprobs` (chat)
and `logprobs: N` (completions) list the N most likely tokens at each step, from the full
distribution in process (a remote top-k back end lists at most the k it returned).
/v1/completions without `session_id` continues the prompt as given (no chat template, the
tokenizer's own special tokens added; `echo` with `logprobs` lists the prompt's tokens
first, the first one's logprob null); with a streaming session's `session_id` the prompt is
that session's query. `max_tokens` left out is the rest of the context, up to the server's
`--max-tokens`.
"""

from __future__ import annotations

import re

from starlette.requests import Request

from prepos.chat.conversation import session_messages
from prepos.engine import EPHEMERAL
from prepos.errors import PreposError
from prepos.server.conversation_request import ConversationRequest
from prepos.server.http import response_bodies as R
from prepos.server.http.errors import ApiError
from prepos.server.http.idempotency import idempotent, named_session
from prepos.server.http.request_bodies import ChatCompletion, Completion
from prepos.server.http.results import JSONBody
from prepos.server.http.routing import Routes
from prepos.server.http.state import ServerState
from prepos.server.openai.chat_reply import ChatReply
from prepos.server.openai.checks import chat_sampling, completion_input, tool_specs
from prepos.server.openai.flow import ChatCall, complete, converse, named, prompt_text

EPHEMERAL_ID = re.compile(r"session " + re.escape(EPHEMERAL) + r"\S+")

routes = Routes()


def _model(state) -> dict:
    """The served model by its name (`id`, as OpenAI and vLLM answer; `root` the same):
    never the path it was loaded from."""
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "prepos", "root": state.model_name,
            "max_model_len": state.engine.max_context}


def _context_errors(fn):
    """A request over the context or a session's budget is OpenAI's 400
    `context_length_exceeded` (clients that trim and retry look for it), naming no
    internal session."""

    async def route(request: Request):
        try:
            return await fn(request)
        except (PreposError, ApiError) as exc:
            if getattr(exc, "code", None) not in ("over_budget", "context_length_exceeded"):
                raise
            message = EPHEMERAL_ID.sub("the conversation", str(exc))
            raise ApiError(400, "context_length_exceeded", message,
                           getattr(exc, "param", None) or "messages") from None

    route.__name__ = fn.__name__
    route.__doc__ = fn.__doc__
    return route


@routes.add("GET", "/v1/models", 60, summary="List the models", response=R.ModelList,
            tags=("openai",))
async def models(request: Request):
    state = ServerState.of(request)
    state.owner(request)
    return JSONBody({"object": "list", "data": [_model(state)]})


@routes.add("GET", "/v1/models/{model_id:path}", 60, summary="Retrieve a model",
            response=R.Model, tags=("openai",))
async def model(request: Request, model_id: str):
    state = ServerState.of(request)
    state.owner(request)
    if model_id != state.model_name:
        raise ApiError(404, "model_not_found", f"model {model_id!r} is not served here; this "
                       f"server serves {state.model_name!r}", "model")
    return JSONBody(_model(state))


@routes.add("POST", "/v1/chat/completions", 5, summary="Create a chat completion",
            body=ChatCompletion, response=R.ChatCompletionResponse, events=R.CHAT_EVENTS,
            errors=(404, 409, 422, 429), tags=("openai",))
@idempotent(session=named_session)  # the named session's commit claims the key
@_context_errors
async def chat_completions(request: Request):
    c = await ServerState.open(request, ChatCompletion)
    state, body = c.state, c.body
    sampling = chat_sampling(state, body)  # first: a request for another model is a 404
    conv = ConversationRequest(
        session_messages(body.messages), sampling, tool_specs(body),
        tools_sent=body.tools is not None, tool_choice=body.tool_choice,
        parallel=body.parallel_tool_calls is not False, name=body.session_id, n=body.n or 1,
        logprobs=bool(body.logprobs), fast_path=body.fast_path,
        rollback=body.on_divergence == "rollback", stream=bool(body.stream))
    call = ChatCall(state, conv, request, ChatReply(state, body))
    return await converse(call, request, c.engine, c.owner)


@routes.add("POST", "/v1/completions", 6, summary="Create a completion", body=Completion,
            response=R.CompletionResponse, events=R.COMPLETION_EVENTS,
            errors=(404, 409, 429), tags=("openai",))
@idempotent(session=named_session)
@_context_errors
async def completions(request: Request):
    c = await ServerState.open(request, Completion)
    state, eng, owner, body = c.state, c.engine, c.owner, c.body
    prompts, sampling = completion_input(state, body)
    s = named(state, eng, body.session_id, owner)
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if s is not None:  # a streaming session's query: its text
            prompts[i] = p = prompt_text(eng, p, where)
        if isinstance(p, str):
            await state.check_input(eng, p, where, context=True)
    return await complete(state, request.receive, eng, owner, body, prompts, sampling, s)
