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
from dataclasses import replace
from functools import partial

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from prepos.core import Request as EngineRequest
from prepos.engine import AGENTIC, STREAMING, TURN, SessionSpec, query_key
from prepos.server.cluster import check_new_id
from prepos.server.http import response_bodies as R
from prepos.server.http import results, streaming
from prepos.server.http.errors import ApiError
from prepos.server.http.idempotency import idempotent
from prepos.server.http.request_bodies import (
    AddMessage,
    Append,
    CreateSession,
    Query,
    Rollback,
    Shift,
    ToolResult,
    Turn,
)
from prepos.server.http.results import JSONBody
from prepos.server.http.routing import QueryParam, Routes
from prepos.server.http.sse import HEADERS as SSE_HEADERS
from prepos.server.http.sse import event
from prepos.server.http.state import RequestContext, ServerState
from prepos.server.names import public
from prepos.server.openai.checks import logit_bias

routes = Routes()


def _request(c: RequestContext, expected_version: int | None = None) -> EngineRequest:
    """The engine request of a /query, /turn or /tool_result body (the last two name their
    `expected_version`; a query's body has none, and asking pydantic for a field it lacks
    costs microseconds on the fast path)."""
    b = c.body
    sampling = c.state.limits.sampling(b.max_tokens, b.temperature, b.top_k, b.top_p, b.seed,
                                       b.stop, top_logprobs=b.top_logprobs,
                                       presence_penalty=b.presence_penalty,
                                       frequency_penalty=b.frequency_penalty,
                                       logit_bias=logit_bias(c.engine, b.logit_bias))
    if b.response_format is not None:  # checked here: a 400 naming it, before any commit
        sampling = replace(sampling, response_format=b.response_format)
    return EngineRequest(sampling, b.fast_path, b.logprobs,
                         expected_version=expected_version, origin=c.origin)


async def _commit(c: RequestContext, fn, *args, quick: bool = False) -> Response:
    """A mutation: backpressure if it waits for the KV, then the engine call, off the loop
    unless it is `quick` (it renders little and waits for nothing; `ServerState.committing`);
    the committed version."""
    if c.body.wait:
        c.engine.admit()
    fn = partial(fn, origin=c.origin)
    version = await (c.state.committing(fn, *args) if quick else c.state.run(fn, *args))
    snap = c.engine.snapshot(c.sid, version)
    return JSONBody({"session_id": public(c.sid), "version": version, "tokens": len(snap.tokens),
                          "messages": len(snap.messages)})


# -- lifecycle ----------------------------------------------------------------------------
@routes.add("POST", "/sessions", 50, summary="Create a session", body=CreateSession,
            response=R.SessionInfo, status=201, errors=(409, 422, 429))
@idempotent
async def create_session(request: Request):
    c = await ServerState.open(request, CreateSession)
    state, eng, owner, body = c.state, c.engine, c.owner, c.body
    lim = state.limits
    if not 1 <= body.push_max_tokens <= lim.max_tokens:
        raise ApiError(400, "invalid_request", f"push_max_tokens must be in [1, "
                       f"{lim.max_tokens}], got {body.push_max_tokens}", "push_max_tokens")
    answer_tokens, answer_stop = _answer_budget(body, lim.max_tokens)
    cells = body.budget_cells
    if cells is not None and not 1 <= cells <= eng.engine_cells:
        raise ApiError(400, "invalid_input", f"budget_cells must be in [1, "
                       f"{eng.engine_cells}] (the engine's KV budget), got {cells}",
                       "budget_cells")
    if body.tools and body.kind != AGENTIC:
        raise ApiError(409, "wrong_session_kind", "tools belong to agentic sessions; a "
                       "streaming session never calls one", "tools")
    if body.system is not None:
        await state.check_input(eng, body.system, "system")
    for q in body.standing_queries:
        await state.check_input(eng, q, "standing_queries")
    for q in body.relaxed_queries:
        await state.check_input(eng, q, "relaxed_queries")
    await state.check_input(eng, json.dumps(body.tools), "tools")
    spec = SessionSpec(body.kind, body.system, tuple(body.tools),
                       tuple(body.standing_queries), body.fast_path, body.preposition,
                       body.budget_cells, owner=owner,
                       relaxed_queries=tuple(body.relaxed_queries), r_max=body.r_max,
                       answer_tokens=answer_tokens, answer_stop=answer_stop,
                       push_tokens=body.push_max_tokens)
    spec.validate()
    requested = request.headers.get("x-session-id") or body.session_id  # the client's id
    if body.session_id is not None and body.session_id != requested:
        raise ApiError(400, "session_id_mismatch", "x-session-id and session_id differ",
                       "session_id")
    if requested is not None:  # in the caller's namespace: no other key's session is seen
        requested = check_new_id(state, eng, requested, owner)
    with state.admission.new_session(eng, owner, requested) as sid:
        await state.run(state.admission.with_room, eng, lambda: eng.restore_session(
            sid, spec, origin=c.origin))
    return JSONBody(_info(state, eng, sid), 201, {"Location": f"/sessions/{public(sid)}"})


def _answer_budget(body: CreateSession, max_tokens: int) -> tuple[int | None, tuple[str, ...]]:
    """The answer budget its exact entries pre-decode: `answer_max_tokens`, at least a pushed
    answer's `push_max_tokens` (the answer a subscriber is shown is pre-decoded whole); None:
    the server's --predecode-tokens."""
    n, push = body.answer_max_tokens, body.push_max_tokens
    if n is not None and not 0 <= n <= max_tokens:
        raise ApiError(400, "invalid_request", f"answer_max_tokens must be in [0, "
                       f"{max_tokens}], got {n}", "answer_max_tokens")
    stop = body.answer_stop
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stop) > 4 or not all(stop):
        raise ApiError(400, "invalid_request", "answer_stop: at most 4 non-empty strings",
                       "answer_stop")
    if push > 1:
        n = max(n or 0, push)
    return n, stop


def _info(state: ServerState, eng, sid: str) -> dict:
    info = eng.info(sid)
    info["id"] = public(sid)
    s = eng.session(sid)
    kept = list(eng.versions(sid))
    info["versions_kept"] = [kept[0], kept[-1]] if kept else []
    info["push_max_tokens"] = s.spec.push_tokens
    budget = eng.predecoding(sid, TURN)[0]
    info["answer_max_tokens"] = budget.max_tokens if budget is not None else 0
    info["answer_stop"] = list(s.spec.answer_stop)
    info["preposition"] = s.spec.preposition and eng.config.preposition
    info["system"] = s.spec.system
    info["tools"] = list(s.spec.tools)
    info.update(_prepared(eng, s))
    return info


def _prepared(eng, s) -> dict:
    """What is prepared in a session, read-only: where its KV is, whether its current version
    is pre-positioned, the answer tokens pre-decoded for it, and h(rho), the chance a request
    comes before its next update (what its idle work goes by)."""
    snap, ready = s.current()
    answers = [ready.answer(k) for k in list(ready.records)]
    return {"kv": eng.kv_tier(s.id),
            "prepared": ready.valid and ready.done and ready.version == snap.version,
            "predecoded_tokens": sum(len(a.tokens) for a in answers if a is not None),
            "hit": round(eng.hit_rate(s.id), 4)}


@routes.add("GET", "/sessions", 50, summary="List the caller's sessions",
            response=R.SessionList)
async def list_sessions(request: Request):
    c = await ServerState.open(request)
    out = []
    for s in c.engine.all_sessions():
        if not c.state.visible(s, c.owner):
            continue
        snap, _ = s.current()
        out.append({"id": public(s.id), "kind": s.kind, "version": snap.version,
                    "tokens": len(snap.tokens), "messages": len(snap.messages),
                    **_prepared(c.engine, s)})
    return JSONBody({"object": "list", "data": out})


@routes.add("GET", "/sessions/{sid}", 50, summary="Inspect a session", response=R.SessionInfo,
            query=(QueryParam("wait_ready", {"type": "number", "minimum": 0, "maximum": 60},
                          "seconds to wait for the current version's pre-position to finish"),
                   QueryParam("include", {"type": "string", "pattern":
                                          r"^(\s*(tokens|messages)\s*)?"
                                          r"(,(\s*(tokens|messages)\s*)?)*$"},
                          "tokens, messages or both (comma-separated): add the token ids "
                          "(token_ids) and the messages (message_list)")))
async def inspect_session(sid: str, request: Request):
    c = await ServerState.open(request, sid=sid)
    state, eng, sid = c.state, c.engine, c.sid
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
    info = _info(state, eng, sid)
    if wait and info["preposition"]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while not (info["ready"]["done"] and info["ready"]["version"] == info["version"]):
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.002)
            info = _info(state, eng, sid)
    if include:
        snap = eng.snapshot(sid)
        info["version"], info["tokens"] = snap.version, len(snap.tokens)  # one snapshot
        if "tokens" in include:
            info["token_ids"] = list(snap.tokens)
        if "messages" in include:
            info["message_list"] = list(snap.messages)
    return JSONBody(info)


@routes.add("DELETE", "/sessions/{sid}", 50, summary="Close a session", response=R.Closed,
            query=(QueryParam("expected_version", {"type": "integer"}, "close only while the "
                              "session is at this version (else 409 conflict)"),),
            errors=(409, 422))
@idempotent
async def close_session(sid: str, request: Request):
    c = await ServerState.open(request, sid=sid)
    raw = request.query_params.get("expected_version")
    try:
        expected = None if raw is None else int(raw)
    except ValueError:
        raise ApiError(400, "invalid_request", f"expected_version must be an integer, got "
                       f"{raw!r}", "expected_version") from None
    await c.state.committing(c.engine.close_session, c.sid, expected,  # rows deleted first
                             c.origin)
    return JSONBody({"session_id": public(c.sid), "closed": True})


# -- mutations ----------------------------------------------------------------------------
@routes.add("POST", "/sessions/{sid}/append", 14, summary="Append data (streaming)",
            body=Append, response=R.Committed, errors=(409, 422, 429))
@idempotent
async def append(sid: str, request: Request):
    return await append_data(await ServerState.open(request, Append, sid, STREAMING))


async def append_data(c: RequestContext) -> Response:
    """An append, its context open (by the route, or by server/http/fast.py's straight
    line)."""
    b = c.body
    await c.check_input(b.data, "data")
    # one of a dashboard's data lines, sent through a stream's every token: on the event
    # loop where it waits for nothing, the thread hop there and back was a third of its CPU
    return await _commit(c, c.engine.append, c.sid, b.data, b.wait, b.expected_version,
                         quick=not b.wait and c.session.quick_append(b.data))


@routes.add("POST", "/sessions/{sid}/rollback", 50, summary="Roll back to a kept version",
            body=Rollback, response=R.Committed, errors=(409, 422, 429))
@idempotent
async def rollback(sid: str, request: Request):
    c = await ServerState.open(request, Rollback, sid)
    b = c.body
    if b.version == c.session.version and b.expected_version in (None, b.version):  # there
        snap = c.engine.snapshot(c.sid)
        return JSONBody({"session_id": public(c.sid), "version": snap.version,
                              "tokens": len(snap.tokens), "messages": len(snap.messages)})
    return await _commit(c, c.engine.rollback, c.sid, b.version, b.wait, b.expected_version)


@routes.add("POST", "/sessions/{sid}/shift", 50, summary="Drop the oldest data (streaming)",
            body=Shift, response=R.Committed, errors=(409, 422, 429))
@idempotent
async def shift(sid: str, request: Request):
    c = await ServerState.open(request, Shift, sid, STREAMING)
    return await _commit(c, c.engine.shift, c.sid, c.body.drop, c.body.wait,
                         c.body.expected_version)


@routes.add("POST", "/sessions/{sid}/messages", 16, summary="Add a message (agentic)",
            body=AddMessage, response=R.Committed, errors=(409, 422, 429))
@idempotent
async def add_message(sid: str, request: Request):
    c = await ServerState.open(request, AddMessage, sid, AGENTIC)
    b = c.body
    await c.check_input(b.content, "content")
    return await _commit(c, c.engine.add_message, c.sid, b.role, b.content, b.tool_calls, b.wait,
                         b.expected_version)


# -- requests -----------------------------------------------------------------------------
@routes.add("POST", "/sessions/{sid}/query", 0, summary="Ask a question (streaming)",
            body=Query, response=R.Answer, events=R.ANSWER_EVENTS, errors=(409, 429))
@idempotent  # commits nothing: its answer is recorded, a retry answered the same
async def query(sid: str, request: Request):
    c = await ServerState.open(request, Query, sid, STREAMING)
    return await ask(c, request.receive)


async def ask(c: RequestContext, receive) -> Response:
    """A query's answer, its context open (by the route, or by server/http/fast.py's straight
    line); `receive`, the request's ASGI receive."""
    eng, b, sid = c.engine, c.body, c.sid
    req = _request(c)
    await c.check_input(b.question, "question")
    stream = await c.state.start_exact(eng, sid, query_key(b.question), req,
                                       lambda: eng.query(sid, b.question, req), len(b.question))
    return await respond(c, receive, stream, agentic=False)


@routes.add("POST", "/sessions/{sid}/turn", 10, summary="Take a turn (agentic)", body=Turn,
            response=R.AgenticAnswer, events=R.AGENTIC_EVENTS, errors=(409, 422, 429))
@idempotent
async def turn(sid: str, request: Request):
    c = await ServerState.open(request, Turn, sid, AGENTIC)
    eng, b, sid = c.engine, c.body, c.sid
    req = _request(c, b.expected_version)
    if b.user is None:
        stream = await c.state.start_exact(eng, sid, TURN, req, lambda: eng.turn(sid, None, req),
                                           commits=True)
    else:
        stream = await _committing(c, eng.turn, b.user, "user", req)
    return await respond(c, request.receive, stream, agentic=True)


@routes.add("POST", "/sessions/{sid}/tool_result", 12, summary="Send a tool result (agentic)",
            body=ToolResult, response=R.AgenticAnswer, events=R.AGENTIC_EVENTS,
            errors=(409, 422, 429))
@idempotent
async def tool_result(sid: str, request: Request):
    c = await ServerState.open(request, ToolResult, sid, AGENTIC)
    stream = await _committing(c, c.engine.tool_result, c.body.content, "content",
                               _request(c, c.body.expected_version))
    return await respond(c, request.receive, stream, agentic=True)


async def _committing(c: RequestContext, start, text: str, what: str, req: EngineRequest):
    """An agentic request that commits `text` first: behind backpressure, off the loop."""
    await c.check_input(text, what)
    c.engine.admit()
    return await c.state.run(start, c.sid, text, req)


def _token(ev) -> dict:
    out = {"text": ev.text, "token": ev.token, "logprob": ev.logprob}
    if ev.top is not None:
        out["top_logprobs"] = ev.top
    return out


async def respond(c: RequestContext, receive, stream, agentic: bool) -> Response:
    """The answer as JSON or SSE; a client that leaves before the end cancels the stream."""
    state, sid, logprobs, streamed = c.state, c.sid, c.body.logprobs, c.body.stream

    def final(res) -> dict:
        if res.finish_reason == "cancelled" and c.origin is not None:  # its client left: its
            c.origin.interrupted = True  # answer was cancelled, its result is not recorded
        content = state.engine.fmt.parse_tool_calls(res.text)[0] if agentic else None
        return results.session_result(res, sid, logprobs, agentic, content)

    if not streamed:
        res = await streaming.result(state, stream, receive)
        return JSONBody(final(res), headers=results.headers(res, sid))
    if stream.done:
        stream.result()  # a finished stream that failed answers with its error, not events

    async def chunks(source):
        async for ev in source:
            yield event(_token(ev), "token")
        yield event(final(stream.result()), "result")

    return await streaming.stream_response(stream, streaming.guarded(chunks, error_event="error"),
                                           sid, state.metrics.token_stages, direct=True)


# -- events -------------------------------------------------------------------------------
@routes.add("GET", "/sessions/{sid}/events", 50, summary="Subscribe to a session's events",
            events=R.SESSION_EVENTS, errors=(400, 409, 429))
async def events(sid: str, request: Request):
    """SSE: `hello` (the session's state), `commit` (each committed version), `ready` (each
    recorded ready distribution), `answer` (each standing query, answered from its record
    before anyone asks), `correction` (a relaxed answer its verification disagreed with:
    answer id, served and full-path tokens), `close` (the session was closed) and `end` (the
    stream ends, the session lives on: its `reason`; subscribe again). Each event's `id` is
    the version of the last commit the stream sent: with the header `Last-Event-ID` set to
    it, a new subscription is sent every commit after that one, once (409 `cannot_resume`
    where the session no longer keeps them)."""
    c = await ServerState.open(request, sid=sid)
    state = c.state
    after = last_event_id(request)
    if after is not None:
        await state.run(state.subscriptions.check_resume, c.session.id, after)
    sub = state.subscriptions.subscribe(c.session, after)

    async def stream():
        try:
            async for item in sub.items():
                yield item
        finally:
            state.subscriptions.unsubscribe(sub)

    return StreamingResponse(stream(), headers=SSE_HEADERS, media_type="text/event-stream")


def last_event_id(request: Request) -> int | None:
    """The version a subscription resumes after (`Last-Event-ID`; none where it is absent or
    empty); 400 where it is not one."""
    raw = request.headers.get("last-event-id", "").strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise ApiError(400, "invalid_last_event_id", "Last-Event-ID must be the id of an event "
                       f"of this stream (a version: a non-negative integer), got {raw[:40]!r}",
                       "Last-Event-ID")
    return int(raw)
