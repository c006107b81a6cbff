"""The Messages routes' errors in Anthropic's shape, with its statuses, so Anthropic's SDK
raises its own exception classes:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

The server's errors (`ApiError`, an engine's `PreposError`) keep their status, but a 503 (the
model loading, the store away) is Anthropic's 529 `overloaded_error` (with its
`Retry-After`) and any other 5xx a 500 `api_error`; a conversation whose tool results do not
follow their calls, or over the context (`prompt is too long: ...`), is a 400. Messages that
name one of the chat route's messages (`messages[3]`) name the client's instead
(`messages.2`)."""

from __future__ import annotations

import re

from starlette.responses import Response

from prepos.engine import EPHEMERAL
from prepos.server.http.errors import SHAPES, ApiError, scrub
from prepos.server.http.results import json_bytes

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", 529: "overloaded_error"}
# a conversation's tool_use and tool_result blocks out of order: Anthropic's 400 (the chat
# route's 409)
MISORDERED = ("tool_result_awaited", "no_tool_result_awaited")
CHAT_INDEX = re.compile(r"messages\[(\d+)\]")
# a stateless request's session: never named
EPHEMERAL_ID = re.compile(r"session " + re.escape(EPHEMERAL) + r"\S+")


def error_body(err: ApiError) -> tuple[int, dict]:
    """The status and body of an error."""
    status = err.status
    if status == 503:
        status = 529
    elif status >= 500:
        status = 500
    kind = TYPES.get(status, "invalid_request_error")
    message = scrub(EPHEMERAL_ID.sub("the conversation", err.message))
    if err.code in ("over_budget", "context_length_exceeded"):
        kind, status = "invalid_request_error", 400
        message = f"prompt is too long: {message}"  # Claude Code compacts on these words
    elif err.code in MISORDERED:
        kind, status = "invalid_request_error", 400
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: ApiError) -> Response:
    status, body = error_body(err)
    return Response(json_bytes(body), status, headers=dict(err.headers),
                    media_type="application/json")


# the errors raised before a Messages route runs (a refused origin or key, a body too large)
# are in this shape too
SHAPES["/v1/messages"] = error_body


class Renamer:
    """An error of the chat flow, its messages' indices as the client's fields: `where[i]`
    is where the chat route's message i came from (`system`, `messages.j`)."""

    def __init__(self, where: list[str] | None = None):
        self.where = where or []

    def name(self, i: int) -> str:
        return self.where[i] if 0 <= i < len(self.where) else f"messages[{i}]"

    def __call__(self, err: ApiError) -> ApiError:
        if not self.where:
            return err

        def sub(text):
            return CHAT_INDEX.sub(lambda m: self.name(int(m.group(1))), text)
        return ApiError(err.status, err.code, sub(err.message),
                        sub(err.param) if err.param else err.param, err.headers)
