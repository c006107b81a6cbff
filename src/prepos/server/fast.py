"""The straight line: `POST /sessions/{id}/query` answered in front of FastAPI's stack.

A standing query answered from its pre-positioned ready distribution costs the engine a few
tens of microseconds; FastAPI's layers around it (its telemetry check, the server-error,
exception-telemetry, body-limit, exception and exit-stack middlewares, prepos's `BodyLimit`,
the router's match, Starlette's request and exception wrappers) cost as much again. `App`
takes a query whose head none of those layers would act on straight to the route's own code
(`sessions.ask`), after the same checks in the same order (503, 401, 404, 400, 409) and with
the same error responses; any other request, and a query with a head over the limit, a
body without a Content-Length or over the limit, or a browser's Origin where CORS is on,
goes through the whole stack as before."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from fastapi import FastAPI
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from prepos.server.errors import ApiError, as_api_error
from prepos.server.schemas import Query
from prepos.server.sessions import ask
from prepos.server.state import ServerState
from prepos.session import STREAMING

PREFIX, SUFFIX = "/sessions/", "/query"


class StraightLine:
    def __init__(self, state: ServerState, respond: Callable[[ApiError], Response],
                 cors: bool):
        self.state = state
        self.respond = respond  # the error response the app's exception handlers give
        self.cors = cors
        self.max_body = state.limits.max_body_bytes
        self.max_head = state.limits.max_header_bytes

    def take(self, scope) -> tuple[str, str | None] | None:
        """The session id and Authorization header of a query this line answers; None for
        any other request."""
        path = scope["path"]
        if scope["method"] != "POST" or not path.endswith(SUFFIX) or \
                not path.startswith(PREFIX) or scope.get("root_path"):
            return None
        sid = path[len(PREFIX):-len(SUFFIX)]
        if not sid or "/" in sid:  # the route's {sid}: one path segment
            return None
        head = len(scope["raw_path"]) + len(scope["query_string"])  # as BodyLimit counts
        length = auth = None
        for name, value in scope["headers"]:
            head += len(name) + len(value) + 4
            if name == b"content-length":
                length = value if length is None else length
            elif name == b"authorization":
                auth = value if auth is None else auth
            elif name == b"origin" and self.cors:
                return None
        if head > self.max_head or length is None or not length.isdigit() or \
                int(length) > self.max_body:
            return None
        return sid, None if auth is None else auth.decode("latin-1")

    async def answer(self, scope, receive, send, sid: str, auth: str | None) -> None:
        try:
            c = await self.state.call(auth, partial(read_body, receive), Query, sid, STREAMING)
            response = await ask(c, receive)
        except Exception as exc:
            response = self.respond(as_api_error(exc))
        await response(scope, receive, send)


async def read_body(receive) -> bytes:
    """The request's body, as Starlette's `Request.body` reads it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class App(FastAPI):
    """prepos's FastAPI app, the straight line (`straight`, once set) in front."""

    straight: StraightLine | None = None

    async def __call__(self, scope, receive, send) -> None:
        line = self.straight
        if line is not None and scope["type"] == "http":
            taken = line.take(scope)
            if taken is not None:
                return await line.answer(scope, receive, send, *taken)
        await super().__call__(scope, receive, send)
