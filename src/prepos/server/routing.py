"""Plain Starlette routes for the API: no dependency injection per request, and the hot
routes (queries, turns, chat) first in the router, since routes are matched in order. The
fast path's budget over HTTP is about a millisecond; FastAPI's per-request machinery would
spend a tenth of it.

The methods of one path are one route, so a 405 (and an `OPTIONS` request) lists every
method the path takes in `Allow`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prepos.server.errors import ApiError

EVERY = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class Routes:
    def __init__(self) -> None:
        self.routes: list[tuple[int, str, str, object]] = []  # rank, method, path, fn

    def add(self, method: str, path: str, rank: int = 50):
        """Register `fn(request, **path_params)`; lower ranks are matched first."""

        def register(fn):
            self.routes.append((rank, method, path, fn))
            return fn

        return register

    def ordered(self) -> list[Route]:
        by_path: dict[str, dict[str, object]] = {}
        ranks: dict[str, int] = {}
        for rank, method, path, fn in self.routes:
            by_path.setdefault(path, {})[method] = fn
            ranks[path] = min(rank, ranks.get(path, rank))
        return [_route(path, by_path[path]) for path in sorted(by_path, key=ranks.__getitem__)]


def _route(path: str, fns: dict[str, object]) -> Route:
    methods = sorted(fns)
    if "GET" in fns:
        methods.append("HEAD")
    allow = ", ".join([*methods, "OPTIONS"])

    async def endpoint(request: Request):
        method = request.method
        fn = fns.get("GET" if method == "HEAD" else method)
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
