"""The straight line: a standing query (`POST /sessions/{id}/query`), a data append
(`POST /sessions/{id}/append`) and a scrape (`GET /metrics`) handled in front of FastAPI's
stack (step 4 of the front door, `front.py`).

A standing query answered from its pre-positioned ready distribution costs the engine a few
tens of microseconds, a dashboard's data line a render and a tokenization, and a scrape the
text of a few hundred values; FastAPI's layers around each (its telemetry check, the
server-error, exception-telemetry, exception and exit-stack middlewares, the router's match,
Starlette's request and exception wrappers) cost as much again, on the cores the model
decodes on, while the dashboards append and the scraper scrapes through a stream's every
token. `FastRoute` takes such a request none of those layers would act on straight to the
route's own code (`sessions.ask`, `sessions.append_data`, `ServerState.scrape`), after the
same checks in the same order (503, 401, 404, 400, 409) and with the same error responses.
Every other request goes through the whole stack, and so does one of these whose body has
no Content-Length (a scrape: that has a body), that names a session in an `x-session-id`
header, or that carries an `Idempotency-Key` (the route's wrapper keeps its answer); so does
every request of a server with CORS on (its middleware adds headers to every response,
`Vary: Origin` at least). On a single node the line stands in front of `ClusterFront`: the
path names the session, and the line names it back in `x-session-id` as `ClusterFront`
would; in a cluster it runs behind `ClusterFront`, after the session's owner is settled."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from starlette.requests import ClientDisconnect
from starlette.responses import Response

from prepos.engine import STREAMING
from prepos.server.http.cluster_front import SESSION_ID
from prepos.server.http.errors import ApiError, as_api_error
from prepos.server.http.head import HEADER
from prepos.server.http.metrics import CONTENT_TYPE
from prepos.server.http.request_bodies import Append, Query
from prepos.server.http.sessions import append_data, ask
from prepos.server.http.state import ServerState

PREFIX = "/sessions/"
QUERY, APPEND = "/query", "/append"
METRICS = "/metrics"
KNOWN_BYTES = 1024  # query bodies up to this size are remembered parsed,
KNOWN_BODIES = 256  # this many at most


class FastRoute:
    def __init__(self, state: ServerState, respond: Callable[[ApiError], Response]):
        self.state = state
        self.respond = respond  # the error response the app's exception handlers give
        # bodies seen before, parsed, by the Authorization header that sent them: one key's
        # question is never found faster for another
        self.known: dict[tuple[str | None, bytes], Query] = {}

    def take(self, scope, head) -> tuple[str, str, str | None] | None:
        """The route (`QUERY` or `APPEND`, the path's suffix; `METRICS`), the session id
        (a scrape: none) and the Authorization header of a request this line handles; None
        for any other request. `head`: its `head.Head`, whose sizes the front door has
        checked."""
        path, method = scope["path"], scope["method"]
        if scope.get("root_path") or head.session is not None or head.idempotent:
            return None  # ClusterFront checks the header against the path's; the route's
            # wrapper keeps an idempotent request's answer
        if method == "GET" and path == METRICS:
            if head.length is not None or head.chunked:  # a scrape has no body
                return None
            route, sid = METRICS, ""
        elif method != "POST" or not path.startswith(PREFIX) or head.length is None:
            return None
        elif path.endswith(QUERY):
            route = QUERY
        elif path.endswith(APPEND):
            route = APPEND
        else:
            return None
        if route != METRICS:
            sid = path[len(PREFIX):-len(route)]
            if not SESSION_ID.fullmatch(sid):  # the route's {sid}, one path segment; else 404
                return None
        return route, sid, None if head.auth is None else head.auth.decode("latin-1")

    async def query_body(self, receive, auth: str | None) -> Query:
        """The query's body, parsed; a small one its key sent before is the body parsed then
        (a dashboard asks the same question the same way again and again; bodies are never
        changed once parsed)."""
        raw = await read_body(receive)
        seen = (auth, raw)
        body = self.known.get(seen)
        if body is None:
            body = await self.state.parse(raw, Query)
            if len(raw) <= KNOWN_BYTES:
                if len(self.known) >= KNOWN_BODIES:
                    self.known.clear()
                self.known[seen] = body
        return body

    async def append_body(self, receive) -> Append:
        return await self.state.parse(await read_body(receive), Append)

    async def answer(self, scope, receive, send, route: str, sid: str, auth: str | None,
                     tag: bool = False) -> None:
        """The query's answer, the append's commit or the scrape's text; with `tag`, the
        session named back in `x-session-id`."""
        query = route == QUERY
        try:
            if route == METRICS:
                response = Response(self.state.scrape(auth), media_type=CONTENT_TYPE)
            else:
                read = (partial(self.query_body, receive, auth) if query
                        else partial(self.append_body, receive))
                c = await self.state.call(auth, read, sid, STREAMING)
                response = await (ask(c, receive) if query else append_data(c))
        except Exception as exc:
            response = self.respond(as_api_error(exc), scope["path"])
        if tag and sid:
            response.raw_headers.append((HEADER, sid.encode()))
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
