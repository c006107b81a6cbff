"""`Idempotency-Key` on the routes that write: the request side of the recorded results
(`server/store/idempotency.py`, which says what is recorded and for how long).

A route wrapped in `idempotent` looks its key up first: a recorded result is replayed (422
where the request differs), a result still running on this node is waited for, else the
route runs with its `Attempt` current (its first write claims the key) and its result,
streamed or not, is recorded as the request ends."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from functools import wraps

from starlette.responses import Response

from prepos.errors import PreposError
from prepos.server.http.errors import ApiError, as_api_error, error_body
from prepos.server.http.forwarding import Relayed
from prepos.server.store.idempotency import (
    HEADER,
    Attempt,
    KeyClaimed,
    Recorded,
    Records,
)

log = logging.getLogger("prepos.server.idempotency")
TRANSIENT = frozenset({"session_busy", "session_moved", "idempotency_key_pending"})
UNKEPT = (b"content-length", b"transfer-encoding")  # headers a replay makes anew
PARAMETER = {"name": HEADER, "in": "header", "required": False,  # in /openapi.json
             "schema": {"type": "string", "minLength": 1, "maxLength": 255,
                        "pattern": "^[ -~]+$"},
             "description": "makes the request safe to retry: a retry with the same key and "
                            "request is answered the first result (Idempotent-Replayed: true) "
                            "and commits nothing"}
ATTEMPT = "prepos.attempt"  # the scope's key of a request's attempt


def attempt_of(request) -> Attempt | None:
    """The request's `Attempt` (None: it sent no key): the origin it hands to every write it
    makes, the engine's (`Request.origin`) and the stores', so its first write claims the key."""
    return request.scope.get(ATTEMPT)


class KeyedRequests:
    """The requests with a key: each answered from `records`, or run once and recorded; the
    attempts running on this node, which a retry that arrives meanwhile waits for."""

    def __init__(self, records: Records):
        self.records = records
        self._running: dict[tuple[str, str], Attempt] = {}
        self.waited = 0  # retries that waited for their first attempt here

    async def serve(self, state, owner: str, key: str, digest: str, sid: str | None,
                    run: Callable[[Attempt], Awaitable[Response]]) -> Response:
        """The recorded result, or `run(attempt)`'s, recorded."""
        slot = (owner, key)
        while (first := self._running.get(slot)) is not None:  # running here: wait for it
            if first.digest != digest:
                raise reused()
            self.waited += 1
            await asyncio.shield(first.done)
        a = Attempt(owner, key, digest, sid, self.records,
                    asyncio.get_running_loop().create_future())
        self._running[slot] = a
        handed = False  # to a stream, which ends the attempt when it ends
        try:
            found = await state.run(self.records.get, owner, key)
            if found is not None:
                return replay(found, digest)
            try:
                response = await run(a)
            except KeyClaimed:
                found = await state.run(self.records.get, owner, key)
                if found is None:
                    raise ApiError(409, "idempotency_key_pending", f"another request with "
                                   f"this {HEADER} is running", HEADER,
                                   {"Retry-After": "1"}) from None
                return replay(found, digest)
            except Exception as exc:
                err = as_api_error(exc)  # logged once, here, where it is a 500
                if a.claimed or kept(err.status, err.code):
                    body = json.dumps(error_body(err.status, err.code, err.message, err.param))
                    headers = [["content-type", "application/json"],
                               *([k.lower(), v] for k, v in err.headers.items())]
                    await self._finish(a, err.status, headers, body.encode())
                raise err from None
            if isinstance(response, Relayed):  # the node running it holds and records the key
                return response
            if getattr(response, "chunks", None) is not None:  # an sse.EventStream
                response.chunks = self._relay(state, a, response, response.chunks)
                response.direct = None  # recorded as it goes: written on the event loop
                left = response.on_disconnect

                def gone() -> None:  # its client left: the answer cancelled, not recorded
                    a.interrupted = True
                    if left is not None:
                        left()

                response.on_disconnect = gone
                handed = True
                return response
            if a.interrupted:
                await self._interrupted(a)
            elif a.claimed or kept(response.status_code, None):
                await self._finish(a, response.status_code, _headers(response),
                                   bytes(response.body))
            return response
        finally:
            if not handed:
                self._end(a)

    async def _relay(self, state, a: Attempt, response, chunks):
        """The stream's chunks as they go; recorded whole at its end, unless its client left
        (its answer cancelled)."""
        parts: list[bytes] = []
        try:
            async for chunk in chunks:
                parts.append(chunk)
                yield chunk
            if not a.interrupted:
                await self._finish(a, response.status_code, _headers(response),
                                   b"".join(parts))
        finally:
            if a.interrupted:  # its answer stopped with its client: say what it wrote
                await asyncio.shield(self._interrupted(a))
            self._end(a)

    async def _interrupted(self, a: Attempt) -> None:
        """The record of an attempt whose client left: nothing where it wrote nothing (a
        retry runs again), else 409 naming what it wrote."""
        if a.claimed:
            status, hdrs, body = said(a, 409, "idempotency_key_interrupted", "its client "
                                      "left before its answer, which was cancelled: read "
                                      "what it wrote (an empty /turn answers a turn cut off "
                                      "at its user message)")
            await self._finish(a, status, json.loads(hdrs), body.encode())

    async def _finish(self, a: Attempt, status: int, headers: list, body: bytes) -> None:
        """`finish`, on the store's writer thread (after the commits it follows), of what is
        kept of the result (`kept_result`)."""
        result = kept_result(a, status, headers, body, self.records.max_bytes)
        if result is None:
            return
        try:
            await asyncio.wrap_future(self.records.db.submit(
                lambda db: self.records.finish(a, *result)))
        except PreposError as exc:  # the answer stands; a retry finds the key pending
            log.error("idempotency: the result for a key was not recorded: %s", exc)

    def _end(self, a: Attempt) -> None:
        if self._running.get((a.owner, a.key)) is a:
            del self._running[(a.owner, a.key)]
        if not a.done.done():
            a.done.set_result(None)


def kept(status: int, code: str | None) -> bool:
    """Whether the result of a request that committed nothing is recorded."""
    return status < 500 and status not in (408, 429) and code not in TRANSIENT


def replay(found: Recorded, digest: str) -> Response:
    if found.digest != digest:
        raise reused()
    if found.status is None:
        raise ApiError(409, "idempotency_key_pending", f"a request with this {HEADER} "
                       f"wrote ({wrote_text(json.loads(found.body))}) and its result is not "
                       "recorded: it still runs on another node, or its node stopped before "
                       "its answer; retry shortly, or read what it wrote",
                       HEADER, {"Retry-After": "1"})
    response = Response(found.body.encode(), found.status)
    response.raw_headers = [*(h for h in response.raw_headers if h[0] == b"content-length"),
                            *((k.encode("latin-1"), v.encode("latin-1"))
                              for k, v in json.loads(found.headers)),
                            (b"idempotent-replayed", b"true")]
    return response


def reused() -> ApiError:
    return ApiError(422, "idempotency_key_reused", f"this {HEADER} was used for another "
                    "request (method, path or body): a key names one request; send a new key "
                    "with a new request", HEADER)


def _headers(response: Response) -> list:
    return [[k.decode("latin-1"), v.decode("latin-1")] for k, v in response.raw_headers
            if k not in UNKEPT]


def check(key: str) -> None:
    if not 1 <= len(key) <= 255 or not all(" " <= ch <= "~" for ch in key):
        raise ApiError(400, "invalid_idempotency_key", f"{HEADER} must be 1 to 255 printable "
                       "ASCII characters", HEADER)


def named_session(raw: bytes) -> str | None:
    """A chat request's `session_id` (None: a stateless one, which no key records)."""
    try:
        sid = json.loads(raw).get("session_id")
    except (ValueError, AttributeError):
        return None
    return sid if isinstance(sid, str) else None


def idempotent(fn=None, *, session: Callable[[bytes], str | None] | None = None):
    """A route made safe to retry with `Idempotency-Key`. The session whose commit claims the
    key is the path's `sid`, or `session(body)`'s (None: the one the request creates, if any;
    the route hands `attempt_of(request)` to the writes it makes)."""

    def wrap(fn):
        @wraps(fn)
        async def route(request, **params):
            key = request.headers.get("idempotency-key")
            if key is None:
                return await fn(request=request, **params)
            state = request.app.state.prepos
            state.engine  # 503 while loading
            owner = state.keys.owner_of(request.headers.get("authorization"))  # 401
            check(key)
            raw = await request.body()
            sid = session(raw) if session is not None else params.get("sid")
            h = hashlib.sha256()
            for part in (request.method, request.url.path, request.url.query,
                         request.headers.get("x-session-id", "")):
                h.update(part.encode() + b"\0")
            h.update(raw)
            def run(attempt: Attempt):
                request.scope[ATTEMPT] = attempt
                return fn(request=request, **params)

            return await state.idempotency.serve(state, owner or "", key, h.hexdigest(), sid,
                                                 run)

        route.idempotent = True  # documented with the header
        return route

    return wrap if fn is None else wrap(fn)


def kept_result(a: Attempt, status: int, headers: list, body: bytes, max_bytes: int
                ) -> tuple[int, list, bytes] | None:
    """What is recorded of attempt `a`'s result: the result itself; where it alone is over
    the bytes kept per key, a 409 naming what the attempt wrote, or nothing where it wrote
    nothing (a retry runs again)."""
    size = len(json.dumps(headers)) + len(body.decode())
    if size <= max_bytes:
        return status, headers, body
    if not a.claimed:
        return None
    status, hdrs, text = said(a, 409, "idempotency_result_too_large", f"its result, {size} "
                              f"bytes, is over the {max_bytes} bytes of results kept per API "
                              "key: read what it wrote instead")
    return status, json.loads(hdrs), text.encode()


def said(a: Attempt, status: int, code: str, why: str) -> tuple[int, str, str]:
    """A recorded error result for attempt `a`, which wrote: status, headers and body."""
    body = error_body(status, code, f"the request with this {HEADER} wrote "
                      f"({wrote_text(a.wrote or {})}), and {why}", HEADER)
    return status, json.dumps([["content-type", "application/json"]]), json.dumps(body)


def wrote_text(where: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ').removesuffix(' id')} {v}" for k, v in where.items()
                     if v is not None) or "a change"
