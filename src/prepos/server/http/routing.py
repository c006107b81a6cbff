"""Plain Starlette routes for the API: no dependency injection per request, and the hot
routes (queries, turns, chat) first in the router, since routes are matched in order. The
fast path's budget over HTTP is about a millisecond; FastAPI's per-request machinery would
spend a tenth of it.

The methods of one path are one route, so a 405 (and an `OPTIONS` request) lists every
method the path takes in `Allow`. Each registration also says what `/openapi.json` documents
of it (`Doc`: body, response, events, query parameters, errors); `server/http/openapi.py` writes
the document from these, so the routes and their documentation have one source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prepos.server.http.errors import ApiError

EVERY = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@dataclass(frozen=True)
class QueryParam:
    """A query parameter: its name, JSON schema and meaning."""

    name: str
    schema: Mapping[str, Any]
    description: str


@dataclass(frozen=True)
class Doc:
    """What the OpenAPI document says of one operation.

    `body`: the request body's model. `response`: the success body's model (or a JSON
    schema), as `media` (JSON unless said). `events`: for a server-sent event stream, each
    event's name and its data (a model, a schema, or a literal string such as `[DONE]`; a
    tuple for alternatives); with a `response` too, the body's `stream: true` picks the
    stream. `errors`: the error statuses the route itself may answer, besides those every
    route shares (`server/http/openapi.py`); `error_body`, their body's model where the
    route answers errors in another API's shape (the Messages API's)."""

    summary: str
    body: Any = None
    response: Any = None
    status: int = 200
    media: str = "application/json"
    events: Mapping[str, Any] | None = None
    others: Mapping[int, Any] | None = None  # other statuses' bodies (not the error shape)
    query: tuple[QueryParam, ...] = ()
    errors: tuple[int, ...] = ()
    public: bool = False  # no key needed and no engine: never 401 or 503
    error_body: Any = None  # the errors' body where it is not the one shape (ErrorBody)
    tags: tuple[str, ...] = ()
    description: str | None = None


@dataclass(frozen=True)
class Registered:
    rank: int
    method: str
    path: str
    fn: object
    doc: Doc = field(default_factory=lambda: Doc(summary=""))


class Routes:
    def __init__(self) -> None:
        self.routes: list[Registered] = []

    def add(self, method: str, path: str, rank: int = 50, *, summary: str = "", **doc):
        """Register `fn(request, **path_params)`; lower ranks are matched first. The keyword
        arguments are the operation's `Doc`."""

        def register(fn):
            text = summary or (fn.__doc__ or "").strip().split("\n")[0]
            self.routes.append(Registered(rank, method, path, fn, Doc(summary=text, **doc)))
            return fn

        return register

    def ordered(self) -> list[Route]:
        by_path: dict[str, dict[str, object]] = {}
        ranks: dict[str, int] = {}
        for r in self.routes:
            by_path.setdefault(r.path, {})[r.method] = r.fn
            ranks[r.path] = min(r.rank, ranks.get(r.path, r.rank))
        return [_route(path, by_path[path]) for path in sorted(by_path, key=ranks.__getitem__)]


def _route(path: str, fns: dict[str, object]) -> Route:
    methods = sorted(fns)
    if "GET" in fns:
        methods.append("HEAD")
    allow = ", ".join([*methods, "OPTIONS"])
    # a method that changes something and does not honour Idempotency-Key refuses it (never
    # ignored: a client that sends one counts on a retry being safe)
    unkeyed = {m for m, fn in fns.items() if m not in ("GET", "HEAD", "OPTIONS")
               and not getattr(fn, "idempotent", False)}

    async def endpoint(request: Request):
        method = request.method
        fn = fns.get("GET" if method == "HEAD" else method)
        if method in unkeyed and "idempotency-key" in request.headers:
            raise ApiError(400, "idempotency_key_unsupported", f"{method} {path} does not "
                           "take an Idempotency-Key: it is not safe to retry by one",
                           "Idempotency-Key")
        if fn is not None:
            return await fn(request=request, **request.path_params)
        if method == "OPTIONS":
            return Response(status_code=204, headers={"Allow": allow})
        raise ApiError(405, "method_not_allowed", f"Method {method} not allowed on {path}; "
                       f"it takes {allow}", headers={"Allow": allow})

    first = next(iter(fns.values()))
    endpoint.__doc__ = first.__doc__
    name = "_".join(getattr(f, "__name__", "route") for f in fns.values())
    return Route(path, endpoint, methods=EVERY, name=name)  # our 405 names what it takes
