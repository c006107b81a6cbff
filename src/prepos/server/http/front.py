"""The front door: every HTTP request's head read once (`head.Head`), then, before any route runs,
in this order:

1. what a web page may send (`cross_site.py`): Host, Origin and Content-Type (403, 415);
2. sizes: a head over `max_header_bytes` (431), a declared body over `max_body_bytes` (413),
   a Content-Length that is no number (400), each answered with the connection closed (a
   body sent without a length, chunked, is counted as FastAPI's routes read it: 413 once
   over);
3. the session the request names, and on a node of a cluster who serves it
   (`cluster_front.py`);
4. the straight line (`fast.py`) for the requests it takes: on one node before step 3
   (naming the session back itself), in a cluster after it;
5. every other request: FastAPI's routes, counted as arriving (`arrival.py`) while a chat,
   Responses or Messages request is read and turned into the engine's work.

A refusal at steps 1-3 changes nothing and carries no CORS headers.
"""

from __future__ import annotations

from fastapi import FastAPI

from prepos.server.http.arrival import arriving
from prepos.server.http.cluster_front import ClusterFront
from prepos.server.http.cross_site import CrossSite
from prepos.server.http.errors import ApiError
from prepos.server.http.fast import FastRoute
from prepos.server.http.head import Head, of


class Sizes:
    """Step 2: the head's size and the body's declared length, refused before anything is
    read; a body of no declared length counted as it is read."""

    def __init__(self, max_body: int, max_head: int):
        self.max_body, self.max_head = max_body, max_head

    def refusal(self, head: Head) -> ApiError | None:
        if head.size > self.max_head:
            return closing(431, "headers_too_large", f"the request line and headers are "
                           f"{head.size} bytes, over this server's limit of {self.max_head} "
                           "bytes")
        if head.length is None:
            return None
        if not head.length.isdigit():
            return closing(400, "invalid_request", "Content-Length is not a number")
        if int(head.length) > self.max_body:
            return closing(413, "body_too_large", f"the body is {int(head.length)} bytes, over "
                           f"this server's limit of {self.max_body} bytes")
        return None

    def counted(self, receive):
        """`receive`, raising 413 once the body read is over the limit (the app's error
        handler answers it)."""
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise ApiError(413, "body_too_large", f"the body is over this server's "
                                   f"limit of {self.max_body} bytes (read {seen})")
            return message
        return counted


def closing(status: int, code: str, message: str) -> ApiError:
    """A refusal of a request whose body is left unread: its connection is closed."""
    return ApiError(status, code, message, headers={"Connection": "close"})


class App(FastAPI):
    """prepos's FastAPI app with its front door (the module's doc) in front; wired by
    `app.create_app`."""

    fast_route: FastRoute | None = None
    front: ClusterFront | None = None
    cross_site: CrossSite | None = None
    sizes: Sizes | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.front is None:
            return await super().__call__(scope, receive, send)
        head = of(scope)
        refused = self.cross_site.check(scope, head) or self.sizes.refusal(head)
        if refused is not None:
            return await self.front.respond(refused, scope["path"])(scope, receive, send)
        line = self.fast_route
        if line is not None and self.front.cluster is None:
            taken = line.take(scope, head)
            if taken is not None:
                return await line.answer(scope, receive, send, *taken, tag=True)
        await self.front(scope, receive, send, self._serve)

    async def _serve(self, scope, receive, send) -> None:
        line = self.fast_route
        if line is not None:
            taken = line.take(scope, of(scope))
            if taken is not None:
                return await line.answer(scope, receive, send, *taken)
        if of(scope).length is None:
            receive = self.sizes.counted(receive)
        done = arriving(scope, self.state.prepos.loaded)
        try:
            await super().__call__(scope, receive, send)
        finally:
            done()
