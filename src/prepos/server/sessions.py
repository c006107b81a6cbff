"""The session API: create, inspect, append, roll back, shift, query, agentic turn, tool
result, add a message, close, and the SSE event stream (standing-query pushes).

Every route looks the session up with the caller's key first (another key's session is
404), validates the whole body and the limits, and only then calls the engine, whose errors
are raised before any state changes: a refused request leaves the session as it was.
The query route calls the engine inline: on the fast path its stream is already finished,
so the answer is written without a thread hop; other paths wait off the event loop."""

from __future__ import annotations

import asyncio
import json
import math

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from prepos.entries import parse_tool_calls
from prepos.server import results, streaming
from prepos.server.errors import ApiError
from prepos.server.journal import is_ephemeral
from prepos.server.results import json_response
from prepos.server.routing import Routes
from prepos.server.schemas import (
    AddMessage,
    Append,
    CreateSession,
    Query,
    Rollback,
    SamplingFields,
    Shift,
    ToolResult,
    Turn,
)
from prepos.server.sse import HEADERS as SSE_HEADERS
from prepos.server.sse import event
from prepos.server.state import ServerState
from prepos.session import AGENTIC, STREAMING, TURN, SessionSpec, query_key

routes = Routes()


def _session(state: ServerState, request: Request, sid: str):
    eng = state.engine
    owner = state.owner(request)
    return eng, owner, state.session(eng, sid, owner)


def _sampling(state: ServerState, body: SamplingFields):
    return state.limits.sampling(body.max_tokens, body.temperature, body.top_k, body.top_p,
                                 body.seed, body.stop, top_logprobs=body.top_logprobs)


def _committed(eng, sid: str, version: int) -> dict:
    snap = eng.snapshot(sid, version)
    return {"session_id": sid, "version": version, "tokens": len(snap.tokens),
            "messages": len(snap.messages)}


# -- lifecycle ----------------------------------------------------------------------------
@routes.add("POST", "/sessions", 50)
async def create_session(request: Request):
    state = ServerState.of(request)
    eng = state.engine
    owner = state.owner(request)
    body = await state.body(request, CreateSession)
    lim = state.limits
    if not 1 <= body.push_max_tokens <= lim.max_tokens:
        raise ApiError(400, "invalid_request", f"push_max_tokens must be in [1, "
                       f"{lim.max_tokens}], got {body.push_max_tokens}", "push_max_tokens")
    if body.system is not None:
        lim.check_input(eng, body.system, "system")
    for q in body.standing_queries:
        lim.check_input(eng, q, "standing_queries")
    lim.check_input(eng, json.dumps(body.tools), "tools")
    state.check_new_session(eng, owner)
    spec = SessionSpec(body.kind, body.system, tuple(body.tools),
                       tuple(body.standing_queries), body.fast_path, body.preposition,
                       body.budget_cells, owner=owner)
    spec.validate()
    sid = eng.sessions.new_id()
    state.hub.push_tokens[sid] = body.push_max_tokens
    if state.journal is not None:
        state.journal.extras[sid] = {"push_max_tokens": body.push_max_tokens}
    try:
        await state.run(eng.restore_session, sid, spec)
    except BaseException:
        state.hub.push_tokens.pop(sid, None)
        if state.journal is not None:
            state.journal.extras.pop(sid, None)
        raise
    return json_response(_info(state, eng, sid, owner), 201, {"Location": f"/sessions/{sid}"})


def _info(state: ServerState, eng, sid: str, owner) -> dict:
    info = eng.info(sid, owner)
    s = eng.session(sid, owner)
    kept = list(eng.versions(sid))
    info["versions_kept"] = [kept[0], kept[-1]] if kept else []
    info["push_max_tokens"] = state.hub.push_tokens.get(sid, 1)
    info["preposition"] = s.spec.preposition and eng.config.preposition
    info["system"] = s.spec.system
    info["tools"] = list(s.spec.tools)
    return info


@routes.add("GET", "/sessions", 50)
async def list_sessions(request: Request):
    state = ServerState.of(request)
    eng = state.engine
    owner = state.owner(request)
    out = []
    for s in eng.sessions.all():
        if is_ephemeral(s.id) or (owner is not None and s.spec.owner != owner):
            continue
        snap = s.snap
        out.append({"id": s.id, "kind": s.kind, "version": snap.version,
                    "tokens": len(snap.tokens), "messages": len(snap.messages)})
    return json_response({"object": "list", "data": out})


@routes.add("GET", "/sessions/{sid}", 50)
async def inspect_session(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    raw = request.query_params.get("wait_ready")
    wait = 0.0
    if raw is not None:
        try:
            wait = float(raw)
        except ValueError:
            wait = -1.0
        if not 0.0 <= wait <= 60.0 or math.isnan(wait):
            raise ApiError(400, "invalid_request", f"wait_ready must be a number of seconds in "
                           f"[0, 60], got {raw!r}", "wait_ready")
    include = {x.strip() for x in request.query_params.get("include", "").split(",") if x}
    unknown = include - {"tokens", "messages"}
    if unknown:
        raise ApiError(400, "invalid_request", f"include takes tokens and messages, got "
                       f"{sorted(unknown)}", "include")
    info = _info(state, eng, sid, owner)
    if wait and info["preposition"]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while not (info["ready"]["done"] and info["ready"]["version"] == info["version"]):
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.002)
            info = _info(state, eng, sid, owner)
    if include:
        snap = eng.snapshot(sid)
        info["version"], info["tokens"] = snap.version, len(snap.tokens)  # one snapshot
        if "tokens" in include:
            info["token_ids"] = list(snap.tokens)
        if "messages" in include:
            info["message_list"] = list(snap.messages)
    return json_response(info)


@routes.add("DELETE", "/sessions/{sid}", 50)
async def close_session(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, _ = _session(state, request, sid)
    eng.close_session(sid, owner)
    return json_response({"session_id": sid, "closed": True})


# -- mutations ----------------------------------------------------------------------------
@routes.add("POST", "/sessions/{sid}/append", 14)
async def append(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    body = await state.body(request, Append)
    s.require(STREAMING)
    state.limits.check_input(eng, body.data, "data")
    if body.wait:
        state.backpressure(eng)
    version = await state.run(eng.append, sid, body.data, body.wait, owner)
    return json_response(_committed(eng, sid, version))


@routes.add("POST", "/sessions/{sid}/rollback", 50)
async def rollback(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    body = await state.body(request, Rollback)
    if body.wait:
        state.backpressure(eng)
    version = await state.run(eng.rollback, sid, body.version, body.wait, owner)
    return json_response(_committed(eng, sid, version))


@routes.add("POST", "/sessions/{sid}/shift", 50)
async def shift(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    body = await state.body(request, Shift)
    s.require(STREAMING)
    if body.wait:
        state.backpressure(eng)
    version = await state.run(eng.shift, sid, body.drop, body.wait, owner)
    return json_response(_committed(eng, sid, version))


@routes.add("POST", "/sessions/{sid}/messages", 16)
async def add_message(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    body = await state.body(request, AddMessage)
    s.require(AGENTIC)
    state.limits.check_input(eng, body.content, "content")
    if body.wait:
        state.backpressure(eng)
    version = await state.run(lambda: eng.add_message(sid, body.role, body.content,
                                                      body.tool_calls, body.wait, owner))
    return json_response(_committed(eng, sid, version))


# -- requests -----------------------------------------------------------------------------
@routes.add("POST", "/sessions/{sid}/query", 0)
async def query(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    body = await state.body(request, Query)
    s.require(STREAMING)
    sampling = _sampling(state, body)
    state.limits.check_input(eng, body.question, "question")
    stream, hold = state.start_exact(
        eng, sid, query_key(body.question), body.fast_path, sampling, body.stream,
        lambda: eng.query_stream(sid, body.question, sampling, body.fast_path, body.logprobs,
                                 owner))
    return await respond(state, request, stream, sid, body.stream, body.logprobs,
                         agentic=False, hold=hold)


@routes.add("POST", "/sessions/{sid}/turn", 10)
async def turn(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    body = await state.body(request, Turn)
    s.require(AGENTIC)
    sampling = _sampling(state, body)
    hold = None
    if body.user is None:
        stream, hold = state.start_exact(
            eng, sid, TURN, body.fast_path, sampling, body.stream,
            lambda: eng.turn_stream(sid, None, sampling, body.fast_path, body.logprobs, owner))
    else:
        state.limits.check_input(eng, body.user, "user")
        state.backpressure(eng)
        stream = await state.run(lambda: eng.turn_stream(sid, body.user, sampling,
                                                         body.fast_path, body.logprobs, owner))
    return await respond(state, request, stream, sid, body.stream, body.logprobs,
                         agentic=True, hold=hold)


@routes.add("POST", "/sessions/{sid}/tool_result", 12)
async def tool_result(sid: str, request: Request):
    state = ServerState.of(request)
    eng, owner, s = _session(state, request, sid)
    body = await state.body(request, ToolResult)
    s.require(AGENTIC)
    sampling = _sampling(state, body)
    state.limits.check_input(eng, body.content, "content")
    state.backpressure(eng)
    stream = await state.run(lambda: eng.tool_result_stream(sid, body.content, sampling,
                                                            body.fast_path, body.logprobs,
                                                            owner))
    return await respond(state, request, stream, sid, body.stream, body.logprobs,
                         agentic=True)


def _token(ev) -> dict:
    out = {"text": ev.text, "token": ev.token, "logprob": ev.logprob}
    if ev.top is not None:
        out["top_logprobs"] = ev.top
    return out


async def respond(state: ServerState, request: Request, stream, sid: str, streamed: bool,
                  logprobs: bool, agentic: bool, hold=None) -> Response:
    """The answer as JSON or SSE; a client that leaves before the end cancels the stream."""
    def final(res) -> dict:
        content = parse_tool_calls(res.text)[0] if agentic else None
        return results.session_result(res, sid, logprobs, agentic, content)

    if not streamed:
        res = await streaming.result(state, stream, request.receive, hold)
        return json_response(final(res), headers=results.headers(res, sid))
    if stream.done:
        stream.result()  # a finished stream that failed answers with its error, not events

    async def chunks(source):
        async for ev in source:
            yield event(_token(ev), "token")
        yield event(final(stream.result()), "result")

    return await streaming.stream_response(stream, streaming.guarded(chunks, error_event="error"),
                                           sid, hold)


# -- events -------------------------------------------------------------------------------
@routes.add("GET", "/sessions/{sid}/events", 50)
async def events(sid: str, request: Request):
    """SSE: `hello` (the session's state), `commit` (each committed version), `ready` (each
    recorded ready distribution), `answer` (each standing query, answered from its record
    before anyone asks) and `close`."""
    state = ServerState.of(request)
    _, _, s = _session(state, request, sid)
    sub = state.hub.subscribe(s)

    async def stream():
        try:
            async for item in sub.items():
                yield item
        finally:
            state.hub.unsubscribe(sub)

    return StreamingResponse(stream(), headers=SSE_HEADERS, media_type="text/event-stream")
