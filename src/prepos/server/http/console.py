"""The web console at `/ui`: one page, its script and its style, served from the package's
`ui/` folder (package data) as they are: no build step, nothing loaded from elsewhere.

The files hold no data, so they need no key (a browser's navigation sends none); the page
asks for the API key once, keeps it in its session storage and sends it in `Authorization`
on every API call it makes, so it sees what that key sees and nothing more. The
Content-Security-Policy lets it load and call only this server. The fast path never reaches
these routes: they sit last in the route table, and `server/http/fast.py` answers queries before
the router."""

from __future__ import annotations

import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from prepos.server.http.routing import Routes

routes = Routes()

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _files() -> dict[str, tuple[bytes, str]]:
    """The console's files by name, read once: (content, media type)."""
    out = {}
    for f in resources.files("prepos.server.http").joinpath("ui").iterdir():
        suffix = f.name[f.name.rfind("."):]
        if f.is_file() and suffix in TYPES:
            out[f.name] = (f.read_bytes(), TYPES[suffix])
    return out


def _route(name: str, body: bytes, media: str) -> None:
    """`GET /ui` for the page, `GET /ui/<name>` for each other file."""
    page = name == "index.html"

    async def serve(request: Request) -> Response:
        return Response(body, media_type=media, headers=HEADERS)

    serve.__name__ = "console" if page else "console_" + re.sub(r"\W", "_", name)
    routes.add("GET", "/ui" if page else f"/ui/{name}", 90,
               summary="The web console" if page else f"The web console's {name}",
               response={"type": "string"}, media=media.split(";")[0], public=True)(serve)


for _name, (_body, _media) in sorted(_files().items()):
    _route(_name, _body, _media)
