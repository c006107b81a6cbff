"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Without `session_id` a request is stateless: the server makes a session for it (agentic for
chat, with the request's tools; streaming for completions), answers on the cold path, and
closes it. With the `session_id` extension the request maps onto a live session:

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
tokenizer's own special tokens added); with a streaming session's `session_id` the prompt is
that session's query.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from prepos.core import Result
from prepos.entries import parse_tool_calls
from prepos.errors import InvalidInput, PreposError
from prepos.server import results
from prepos.server.errors import ApiError, as_api_error, error_body
from prepos.server.journal import EPHEMERAL
from prepos.server.routing import Routes
from prepos.server.schemas import ChatCompletion, ChatMessage, Completion, OpenAISampling
from prepos.server.sse import HEADERS as SSE_HEADERS
from prepos.server.sse import EventStream, event
from prepos.server.state import ServerState
from prepos.session import AGENTIC, STREAMING, TURN, SessionSpec, Snapshot, query_key

routes = Routes()
JSON = "application/json"
TOOL_MARKS = ("<tool_call>",)


def _state(request: Request) -> ServerState:
    return request.app.state.prepos


def _json(data, headers: dict | None = None) -> Response:
    return Response(json.dumps(data), 200, headers=headers, media_type=JSON)


@routes.add("GET", "/v1/models", 60)
async def models(request: Request):
    state = _state(request)
    state.owner(request)
    eng = state.ready
    return _json({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": int(time.time()),
         "owned_by": "prepos", "root": str(state.config.model),
         "max_model_len": eng.max_context}]})


# -- checks -------------------------------------------------------------------------------
def _check_common(state: ServerState, body: OpenAISampling) -> None:
    if body.model != state.model_name:
        raise ApiError(404, "model_not_found", f"model {body.model!r} is not served here; this "
                       f"server serves {state.model_name!r}", "model")
    if body.n not in (None, 1):
        raise ApiError(400, "unsupported", f"n must be 1, got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, "unsupported", f"{name} is not supported (must be 0)", name)
    if body.logit_bias:
        raise ApiError(400, "unsupported", "logit_bias is not supported", "logit_bias")
    if body.stop is not None and not isinstance(body.stop, str) and len(body.stop) > 4:
        raise ApiError(400, "invalid_request", "at most 4 stop sequences", "stop")


def _content(m: ChatMessage, i: int) -> str:
    c = m.content
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    parts = []
    for j, part in enumerate(c):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "unsupported", f"messages[{i}].content[{j}]: only text content "
                           "parts are supported", f"messages[{i}].content")
        parts.append(part["text"])
    return "".join(parts)


def _tool_call(call, i: int, j: int) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError(400, "invalid_request", f"{where}: a tool call needs function.name",
                       where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise ApiError(400, "invalid_request", f"{where}: arguments are not JSON: {exc}",
                           where) from None
    if not isinstance(args, dict):
        raise ApiError(400, "invalid_request", f"{where}: arguments must be a JSON object",
                       where)
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def normalize(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages as the session holds them: role, content, tool_calls."""
    if not messages:
        raise ApiError(400, "invalid_request", "messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, "invalid_request", f"messages[{i}].role must be system, user, "
                           f"assistant or tool, got {m.role!r}", f"messages[{i}].role")
        if role == "system" and i != 0:
            raise ApiError(400, "invalid_request", f"messages[{i}]: a system message must come "
                           "first", f"messages[{i}].role")
        content = _content(m, i)
        msg: dict = {"role": role, "content": content}
        if m.tool_calls:
            if role != "assistant":
                raise ApiError(400, "invalid_request", f"messages[{i}]: only assistant "
                               "messages carry tool_calls", f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(m.tool_calls)]
        elif role != "assistant" and not content.strip():
            raise ApiError(400, "invalid_request", f"messages[{i}].content must not be empty",
                           f"messages[{i}].content")
        out.append(msg)
    return out


def _awaits_tool(msgs) -> bool:
    return bool(msgs) and msgs[-1]["role"] == "assistant" and bool(msgs[-1].get("tool_calls"))


def _check_order(base: list[dict], delta: list[dict], offset: int) -> None:
    """The rules the session applies to each message, checked before any is committed."""
    msgs = list(base)
    for k, m in enumerate(delta):
        i = offset + k
        if m["role"] == "system":
            raise ApiError(400, "invalid_request", f"messages[{i}]: a system message must come "
                           "first", f"messages[{i}].role")
        if m["role"] == "tool" and not _awaits_tool(msgs):
            raise ApiError(409, "no_tool_result_awaited", f"messages[{i}] is a tool result, "
                           "but no tool call is awaiting one", f"messages[{i}]")
        if m["role"] == "user" and _awaits_tool(msgs):
            raise ApiError(409, "tool_result_awaited", f"messages[{i}] is a user message, but "
                           "a tool call awaits its result first", f"messages[{i}]")
        msgs.append(m)
    last = msgs[-1]["role"] if msgs else None
    if last not in ("user", "tool"):
        raise ApiError(400, "invalid_request", "the conversation must end with a user or tool "
                       "message for the model to answer", "messages")


def _same(a: dict, b: dict) -> bool:
    if a["role"] != b["role"]:
        return False
    ca, cb = a.get("content") or "", b.get("content") or ""
    if a["role"] == "assistant":  # whitespace around generated text is not the client's
        ca, cb = ca.strip(), cb.strip()
    return ca == cb and (a.get("tool_calls") or []) == (b.get("tool_calls") or [])


def _extends(history, msgs: list[dict]) -> int:
    """How many leading messages of `msgs` equal `history`; -1 if it does not extend it."""
    if len(msgs) < len(history):
        return -1
    for i, h in enumerate(history):
        if not _same(h, msgs[i]):
            return -1
    return len(history)


def _first_difference(history, msgs: list[dict]) -> int:
    for i, h in enumerate(history):
        if i >= len(msgs) or not _same(h, msgs[i]):
            return i
    return len(history)


def _fast_ready(s, key: tuple, mode: str | None, sampling) -> bool:
    if sampling.max_tokens != 1 or (mode or s.spec.fast_path) == "off":
        return False
    with s.lock:
        return s.ready.valid and key in s.ready.records


# -- chat ---------------------------------------------------------------------------------
@routes.add("POST", "/v1/chat/completions", 5)
async def chat_completions(request: Request):
    state = _state(request)
    eng = state.ready
    owner = state.owner(request)
    body = await state.body(request, ChatCompletion)
    _check_common(state, body)
    fmt = body.response_format
    if fmt and fmt.get("type") not in (None, "text"):
        raise ApiError(400, "unsupported", "response_format must be text", "response_format")
    if body.tool_choice not in (None, "auto") and not (body.tool_choice == "none"
                                                        and not body.tools):
        raise ApiError(400, "unsupported", "tool_choice must be 'auto' (the model decides)",
                       "tool_choice")
    top = body.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, "invalid_request", f"top_logprobs must be in [0, 20], got {top}",
                       "top_logprobs")
    if top and not body.logprobs:
        raise ApiError(400, "invalid_request", "top_logprobs needs logprobs: true",
                       "top_logprobs")
    limit_name = "max_completion_tokens" if body.max_completion_tokens is not None else \
        "max_tokens"
    sampling = state.limits.sampling(
        body.max_completion_tokens if body.max_completion_tokens is not None else
        body.max_tokens, body.temperature, body.top_k, body.top_p, body.seed, body.stop,
        param=limit_name, top_logprobs=top or 0)
    msgs = normalize(body.messages)
    for i, m in enumerate(msgs):
        state.limits.check_input(eng, m["content"], f"messages[{i}].content")
    tools = [_tool_spec(t, i) for i, t in enumerate(body.tools or [])]
    logprobs = bool(body.logprobs)
    call = ChatCall(state, body, sampling, logprobs, top or 0, request.receive)
    if body.session_id is None:
        return await call.stateless(eng, owner, msgs, tools)
    s = eng.session(body.session_id, owner) if not body.session_id.startswith(EPHEMERAL) \
        else None
    if s is None:
        raise ApiError(404, "session_not_found", f"no session {body.session_id!r}",
                       "session_id")
    if s.kind == STREAMING:
        return await call.streaming(eng, owner, s, msgs)
    if body.tools is not None and tools != list(s.spec.tools):
        raise ApiError(409, "tools_differ", f"the request's tools differ from those session "
                       f"{s.id} was created with; send the same tools or none", "tools")
    return await call.agentic(eng, owner, s, msgs)


def _tool_spec(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict) or \
            not isinstance(tool["function"].get("name"), str):
        raise ApiError(400, "invalid_request", f"tools[{i}] must be {{'type': 'function', "
                       "'function': {'name': ..., ...}}", f"tools[{i}]")
    return tool


class ChatCall:
    def __init__(self, state: ServerState, body: ChatCompletion, sampling, logprobs: bool,
                 top: int, receive):
        self.state = state
        self.receive = receive  # the request's: a client that leaves cancels its stream
        self.body = body
        self.sampling = sampling
        self.logprobs = logprobs
        self.top = top

    async def stateless(self, eng, owner, msgs: list[dict], tools: list[dict]) -> Response:
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        rest = msgs[1:] if system is not None else msgs
        _check_order([], rest, 1 if system is not None else 0)
        self.state.backpressure(eng)
        spec = SessionSpec(AGENTIC, system, tuple(tools), (), "off", False, None, owner=owner)

        def start():
            sid = self.state.new_ephemeral(eng, spec, [(0, msgs)])
            try:
                return sid, eng.turn_stream(sid, None, self.sampling, "off", self.logprobs,
                                            owner)
            except BaseException:
                self.state.close_ephemeral(sid)
                raise

        sid, stream = await self.state.run(start)
        return await self.respond(stream, None, agentic=True, tools=bool(tools),
                                  cleanup=lambda: self.state.close_after(stream, sid))

    async def streaming(self, eng, owner, s, msgs: list[dict]) -> Response:
        """A streaming session's query, asked as one user message."""
        asked = [m for m in msgs if m["role"] != "system"]
        if len(asked) != 1 or asked[0]["role"] != "user":
            raise ApiError(400, "invalid_request", f"session {s.id} is a streaming session: a "
                           "chat request asks one user message (the query); data is appended "
                           f"with POST /sessions/{s.id}/append", "messages")
        if msgs[0]["role"] == "system" and msgs[0]["content"] != (s.spec.system or ""):
            raise ApiError(409, "conversation_diverged", f"the system message differs from "
                           f"session {s.id}'s", "messages[0]")
        question = asked[0]["content"]
        mode = self.body.fast_path
        key = query_key(question)
        if not _fast_ready(s, key, mode, self.sampling):
            self.state.backpressure(eng)
        hold = self.state.hold_for(eng, s, key, mode, self.body.stream,
                                   self.sampling.max_tokens)
        try:
            stream = eng.query_stream(s.id, question, self.sampling, mode, self.logprobs, owner)
        except BaseException:
            _release(hold)
            raise
        return await self.respond(stream, s.id, agentic=False, tools=False, hold=hold)

    async def agentic(self, eng, owner, s, msgs: list[dict]) -> Response:
        """Delta-only: commit what the session lacks, then answer."""
        with s.lock:
            snap = s.snap
            history = {v: h for v, h in s.history.items()}
        held = list(snap.messages)
        if held and held[0]["role"] == "system" and msgs[0]["role"] != "system":
            msgs = [held[0], *msgs]  # the session's system prompt is implied
        n = _extends(held, msgs)
        target = None
        if n < 0:
            if self.body.on_divergence != "rollback":
                i = _first_difference(held, msgs)
                raise ApiError(409, "conversation_diverged", f"the conversation diverges from "
                               f"session {s.id} at message {i} (the session holds "
                               f"{len(held)} messages at version {snap.version}); send the "
                               "conversation as the session has it, or set on_divergence to "
                               "'rollback'", f"messages[{i}]")
            for v in sorted(history, reverse=True):
                h = history[v]
                old = h.messages if isinstance(h, Snapshot) else h
                k = _extends(list(old), msgs)
                if k >= 0:
                    target, held, n = v, list(old), k
                    break
            if target is None:
                raise ApiError(409, "conversation_diverged", f"the conversation extends none of "
                               f"the versions session {s.id} keeps", "messages")
        delta = msgs[n:]
        _check_order(held, delta, n)
        mode = self.body.fast_path
        if target is None and not delta and _fast_ready(s, TURN, mode, self.sampling):
            stream = eng.turn_stream(s.id, None, self.sampling, mode, self.logprobs, owner)
            return await self.respond(stream, s.id, agentic=True, tools=bool(s.spec.tools))
        if target is None and not delta:
            hold = self.state.hold_for(eng, s, TURN, mode, self.body.stream,
                                       self.sampling.max_tokens)
            if hold is not None:  # a streamed exact turn that decodes on
                try:
                    stream = eng.turn_stream(s.id, None, self.sampling, mode, self.logprobs,
                                             owner)
                except BaseException:
                    _release(hold)
                    raise
                return await self.respond(stream, s.id, agentic=True,
                                          tools=bool(s.spec.tools), hold=hold)
        self.state.backpressure(eng)
        if target is not None or len(delta) > 1:
            self._check_fits(eng, s, held + delta)

        def start():
            if target is not None:
                eng.rollback(s.id, target, wait=False, owner=owner)
            for m in delta[:-1]:
                eng.add_message(s.id, m["role"], m["content"], m.get("tool_calls"),
                                wait=False, owner=owner)
            last = delta[-1] if delta else None
            if last is None:
                return eng.turn_stream(s.id, None, self.sampling, mode, self.logprobs, owner)
            if last["role"] == "tool":
                return eng.tool_result_stream(s.id, last["content"], self.sampling, mode,
                                              self.logprobs, owner)
            return eng.turn_stream(s.id, last["content"], self.sampling, mode, self.logprobs,
                                   owner)

        stream = await self.state.run(start)
        return await self.respond(stream, s.id, agentic=True, tools=bool(s.spec.tools))

    def _check_fits(self, eng, s, msgs: list[dict]) -> None:
        """A multi-message delta is committed message by message: check the whole of it
        fits before the first, so a refusal leaves the session unchanged."""
        try:
            text = eng.fmt.render(msgs, s.spec.tools, generation_prompt=True)
        except InvalidInput as exc:
            raise ApiError(400, "invalid_input", str(exc), "messages") from None
        n = len(eng.fmt.encode(text))
        room = min(eng.max_context, s.budget(eng.config.budget.session_cells))
        need = n + max(self.sampling.max_tokens, eng.config.reserve_tokens)
        if need > room:
            raise ApiError(413, "over_budget", f"the conversation is {n} tokens; with "
                           f"max_tokens {self.sampling.max_tokens} it needs {need} of the "
                           f"{room} this session can hold", "messages")

    # -- responses ------------------------------------------------------------------------
    async def respond(self, stream, sid: str | None, agentic: bool, tools: bool,
                      cleanup=None, hold=None) -> Response:
        state, model = self.state, self.state.model_name
        rid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if not self.body.stream:
            _release(hold)
            try:
                res = await state.result(stream, self.receive)
            finally:
                if cleanup is not None:
                    cleanup()
            message, finish = _message(res, agentic)
            choice = {"index": 0, "message": message, "finish_reason": finish,
                      "logprobs": {"content": self._logprobs(res)} if self.logprobs else None}
            out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                   "choices": [choice], "usage": results.usage(res),
                   "system_fingerprint": None, "prepos": results.extension(res, sid)}
            return _json(out, results.headers(res, sid))

        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        fmt = state.engine.fmt

        def chunk(delta: dict, finish=None, logprobs=None, **extra) -> bytes:
            return event({"id": rid, "object": "chat.completion.chunk", "created": created,
                          "model": model, "system_fingerprint": None,
                          "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish}], **extra})

        async def chunks(source):
            first = True
            held = ""  # text withheld while it may be a tool call's markup
            sent = ""
            async for ev in source:
                delta: dict = {"role": "assistant"} if first else {}
                text = ev.text
                if tools:
                    held += text
                    safe = _safe_prefix(sent + held) - len(sent)
                    text, held = held[:max(safe, 0)], held[max(safe, 0):]
                lp = None
                if self.logprobs and ev.token >= 0 and ev.logprob is not None:
                    lp = {"content": [self._entry(fmt, ev.token, ev.logprob, ev.top)]}
                if not text and lp is None and not first:
                    continue
                delta["content"] = text
                sent += text
                first = False
                yield chunk(delta, logprobs=lp)
            res = stream.result()
            message, finish = _message(res, agentic)
            final: dict = {"role": "assistant"} if first else {}
            content = message.get("content") or ""
            if content.startswith(sent) and len(content) > len(sent):
                final["content"] = content[len(sent):]
            if message.get("tool_calls"):
                final["tool_calls"] = [{"index": i, **c}
                                       for i, c in enumerate(message["tool_calls"])]
            yield chunk(final, finish, prepos=results.extension(res, sid))
            if include_usage:
                yield event({"id": rid, "object": "chat.completion.chunk",
                             "created": created, "model": model, "choices": [],
                             "usage": results.usage(res)})

        return await _stream_response(stream, _guarded(chunks, cleanup), sid, hold)

    def _entry(self, fmt, token: int, logprob: float, top) -> dict:
        entry = _token_lp(fmt, token, logprob)
        entry["top_logprobs"] = ([_token_lp(fmt, t, lp) for t, lp in top] if top
                                 else [dict(entry)] if self.top else [])
        return entry

    def _logprobs(self, res: Result) -> list[dict]:
        fmt = self.state.engine.fmt
        tops = res.top_logprobs or [None] * len(res.tokens)
        return [self._entry(fmt, t, lp, top)
                for t, lp, top in zip(res.tokens, res.logprobs, tops)]


def _token_lp(fmt, token: int, logprob: float) -> dict:
    text = fmt.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _message(res: Result, agentic: bool) -> tuple[dict, str]:
    content, calls = parse_tool_calls(res.text) if agentic else (res.text, [])
    msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        msg["tool_calls"] = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"]["arguments"])}}
                             for c in calls]
        return msg, "tool_calls"
    return msg, "length" if res.finish_reason == "length" else "stop"


def _safe_prefix(text: str) -> int:
    """How much of `text` cannot be part of a tool call's markup: everything before the
    first mark (or a partial one at the end); nothing if it opens like a JSON call."""
    if text.lstrip().startswith("{"):
        return 0
    cut = len(text)
    for mark in TOOL_MARKS:
        i = text.find(mark)
        if i >= 0:
            cut = min(cut, i)
        for k in range(min(len(mark) - 1, len(text)), 0, -1):
            if text.endswith(mark[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


def _release(hold) -> None:
    if hold is not None:
        hold.set()


async def _released(source, hold):
    """The stream's events; the worker hold is released once the first is written (when
    the consumer comes back for the second)."""
    try:
        async for ev in source:
            yield ev
            hold.set()
    finally:
        hold.set()


def _guarded(chunks, cleanup):
    """OpenAI SSE framing around a chunk generator: an error event if it fails, `cleanup`
    either way, then `[DONE]`."""

    async def run(source):
        try:
            async for c in chunks(source):
                yield c
        except Exception as exc:
            err = as_api_error(exc)
            yield event(error_body(err.status, err.code, err.message, err.param))
        finally:
            if cleanup is not None:
                cleanup()
        yield b"data: [DONE]\n\n"

    return run


async def _stream_response(stream, chunks, sid: str | None, hold=None) -> Response:
    """A finished stream (the fast path) is written as one response with its path in the
    headers; otherwise the chunks are streamed as the model worker produces them."""
    if stream.done:
        _release(hold)
        async def done_source():
            for ev in stream:
                yield ev

        body = b"".join([c async for c in chunks(done_source())])
        try:
            res = stream.result()
            headers = results.headers(res, sid)
        except PreposError:
            headers = {}
        return Response(body, headers={**headers, **SSE_HEADERS},
                        media_type="text/event-stream")
    source = stream.aiter() if hold is None else _released(stream.aiter(), hold)
    return EventStream(chunks(source), headers={**results.pending_headers(sid), **SSE_HEADERS},
                       on_disconnect=stream.cancel)


# -- completions --------------------------------------------------------------------------
@routes.add("POST", "/v1/completions", 6)
async def completions(request: Request):
    state = _state(request)
    eng = state.ready
    owner = state.owner(request)
    body = await state.body(request, Completion)
    _check_common(state, body)
    if body.echo:
        raise ApiError(400, "unsupported", "echo is not supported", "echo")
    if body.best_of not in (None, 1):
        raise ApiError(400, "unsupported", "best_of must be 1", "best_of")
    if body.suffix:
        raise ApiError(400, "unsupported", "suffix is not supported", "suffix")
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "unsupported", "prompt must be one string", "prompt")
        prompt = prompt[0]
    if not prompt.strip():
        raise ApiError(400, "invalid_request", "prompt must not be empty", "prompt")
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise ApiError(400, "invalid_request", f"logprobs must be in [0, 5], got "
                       f"{body.logprobs}", "logprobs")
    sampling = state.limits.sampling(body.max_tokens, body.temperature, body.top_k,
                                     body.top_p, body.seed, body.stop,
                                     top_logprobs=body.logprobs or 0)
    state.limits.check_input(eng, prompt, "prompt")
    want_lp = body.logprobs is not None
    mode = body.fast_path
    cleanup = hold = None
    if body.session_id is not None:
        s = eng.session(body.session_id, owner) if not body.session_id.startswith(EPHEMERAL) \
            else None
        if s is None:
            raise ApiError(404, "session_not_found", f"no session {body.session_id!r}",
                           "session_id")
        if s.kind != STREAMING:
            raise ApiError(409, "wrong_session_kind", f"session {s.id} is agentic: drive it "
                           "with /v1/chat/completions", "session_id")
        key = query_key(prompt)
        if not _fast_ready(s, key, mode, sampling):
            state.backpressure(eng)
        sid = s.id
        hold = state.hold_for(eng, s, key, mode, body.stream, sampling.max_tokens)
        try:
            stream = eng.query_stream(sid, prompt, sampling, mode, want_lp, owner)
        except BaseException:
            _release(hold)
            raise
        shown = sid
    else:
        state.backpressure(eng)
        # stateless: the prompt is continued as given, no chat template (a raw completion)
        spec = SessionSpec(STREAMING, None, (), (), "off", False, None, owner=owner)

        def start():
            sid = state.new_ephemeral(eng, spec)
            try:
                return sid, eng.complete_stream(sid, prompt, sampling, want_lp, owner)
            except BaseException:
                state.close_ephemeral(sid)
                raise

        sid, stream = await state.run(start)
        shown = None

        def cleanup():
            state.close_after(stream, sid)

    return await _complete(state, request.receive, body, stream, shown, want_lp, cleanup, hold)


async def _complete(state: ServerState, receive, body: Completion, stream, sid, want_lp: bool,
                    cleanup, hold=None) -> Response:
    rid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    model = state.model_name
    fmt = state.engine.fmt
    top = body.logprobs or 0

    def lp_block(tokens, lps, tops, offset0: int) -> dict:
        texts = [fmt.decode([t]) for t in tokens]
        offsets, at = [], offset0
        for t in texts:
            offsets.append(at)
            at += len(t)
        listed = None
        if top:  # keyed by text (the legacy format): tokens of equal text keep the likeliest
            listed = []
            for t, lp, alt in zip(texts, lps, tops or [None] * len(texts)):
                step: dict[str, float] = {}
                for i, alt_lp in alt or [(None, lp)]:
                    step.setdefault(t if i is None else fmt.decode([i]), alt_lp)
                listed.append(step)
        return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": listed,
                "text_offset": offsets}

    if not body.stream:
        _release(hold)
        try:
            res = await state.result(stream, receive)
        finally:
            if cleanup is not None:
                cleanup()
        choice = {"index": 0, "text": res.text,
                  "finish_reason": "length" if res.finish_reason == "length" else "stop",
                  "logprobs": lp_block(res.tokens, res.logprobs, res.top_logprobs, 0)
                  if want_lp else None}
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [choice], "usage": results.usage(res),
               "prepos": results.extension(res, sid)}
        return _json(out, results.headers(res, sid))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text: str, finish=None, logprobs=None, **extra) -> bytes:
        return event({"id": rid, "object": "text_completion", "created": created,
                      "model": model, "choices": [{"index": 0, "text": text,
                                                   "logprobs": logprobs,
                                                   "finish_reason": finish}], **extra})

    async def chunks(source):
        at = 0
        async for ev in source:
            lp = None
            if want_lp and ev.token >= 0 and ev.logprob is not None:
                lp = lp_block([ev.token], [ev.logprob], [ev.top], at)
            if not ev.text and lp is None:
                continue
            at += len(ev.text)
            yield chunk(ev.text, logprobs=lp)
        res = stream.result()
        yield chunk("", "length" if res.finish_reason == "length" else "stop",
                    prepos=results.extension(res, sid))
        if include_usage:
            yield event({"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": [], "usage": results.usage(res)})

    return await _stream_response(stream, _guarded(chunks, cleanup), sid, hold)
