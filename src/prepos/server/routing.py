"""Plain Starlette routes for the API: no dependency injection per request, and the hot
routes (queries, turns, chat) first in the router, since routes are matched in order. The
fast path's budget over HTTP is about a millisecond; FastAPI's per-request machinery would
spend a tenth of it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route


class Routes:
    def __init__(self) -> None:
        self.routes: list[tuple[int, Route]] = []

    def add(self, method: str, path: str, rank: int = 50):
        """Register `fn(request, **path_params)`; lower ranks are matched first."""

        def register(fn):
            async def endpoint(request: Request):
                return await fn(request=request, **request.path_params)

            endpoint.__doc__ = fn.__doc__
            self.routes.append((rank, Route(path, endpoint, methods=[method],
                                            name=fn.__name__)))
            return fn

        return register

    def ordered(self) -> list[Route]:
        return [r for _, r in sorted(self.routes, key=lambda x: x[0])]
