"""HTTP errors: one JSON shape for every failure, OpenAI-style, naming the problem.

    {"error": {"message": "...", "type": "invalid_request_error", "code": "...", "param": ...}}

Engine errors (`PreposError`) carry their own code and HTTP status; the server adds its own
(`ApiError`) for what it checks before calling the engine: bodies, auth, limits, loading.
Anything else is a 500 whose body names a reference into the log, never the exception's
text (a path, a value) that the log has. No message shows a server-internal id: a keyed
session's id (`name~<its key's tag>`, `auth.scoped`) is shown as the name its client knows,
and a stateless conversation's kept session (`eph-...`) as "a kept conversation" (`scrub`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from prepos.errors import PreposError

log = logging.getLogger("prepos.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error",
         408: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error",
         431: "invalid_request_error", 503: "service_unavailable"}


# The HTTP status of each error the engine, its back ends and the store raise, by its code:
# they carry no HTTP themselves. A code not named here is the client's mistake (400); a test
# checks that every error class's code is named.
STATUS = {
    **dict.fromkeys(("invalid_input", "invalid_sampling", "invalid_response_format",
                     "invalid_request", "context_length_exceeded", "unknown_tool_call_id",
                     "prepos_error", "too_many_conversations"), 400),
    **dict.fromkeys(("session_not_found", "version_not_found", "conversation_not_found",
                     "item_not_found"), 404),
    **dict.fromkeys(("wrong_session_kind", "no_tool_result_awaited", "tool_result_awaited",
                     "conflict", "session_busy", "conversation_diverged", "abandoned",
                     "idempotency_key_claimed", "conversation_changed"), 409),
    **dict.fromkeys(("over_budget", "conversations_too_large"), 413),
    **dict.fromkeys(("too_many_sessions", "overloaded"), 429),
    "backend_error": 500,
    "remote_error": 502,
    **dict.fromkeys(("engine_closed", "backend_unavailable", "answer_interrupted",
                     "store_unavailable", "lease_lost"), 503),
}


def status_of(exc: PreposError) -> int:
    """The HTTP status of an engine, back-end or store error."""
    return STATUS.get(exc.code, 400)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}


# a keyed session's id as the server holds it (its key's tag after `~`), and the id of an
# ephemeral or kept stateless session (`engine/implicit.py`'s prefix)
_SCOPED = re.compile(r"~[0-9a-f]{8,64}\b")
_EPHEMERAL = re.compile(r"'?\beph-[A-Za-z0-9._:-]*'?")
_OWNER = re.compile(r"\bkey-[0-9a-f]{16}\b")  # an API key's owner id (`auth.owner_id`)


def scrub(message: str) -> str:
    """`message` with no server-internal id in it."""
    if "~" in message:
        message = _SCOPED.sub("", message)
    if "eph-" in message:
        message = _EPHEMERAL.sub("a kept conversation", message)
    if "key-" in message:
        message = _OWNER.sub("a key", message)
    return message


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": scrub(message), "type": kind,
                      "code": code, "param": param}}


# Error shapes other than OpenAI's, by the path prefix whose clients expect them: an API
# whose clients parse their own shape registers it (`server/anthropic/errors.py`), so an
# error raised before its route runs (a refused origin, a body too large, a bad key) is in
# that shape too. A shape maps an error to its status and body.
SHAPES: dict[str, Callable[[ApiError], tuple[int, dict]]] = {}


def shaped(err: ApiError, path: str = "") -> tuple[int, dict]:
    """The status and JSON body of `err` for a request to `path`."""
    for prefix, shape in SHAPES.items():
        if path.startswith(prefix):
            return shape(err)
    return err.status, error_body(err.status, err.code, err.message, err.param)


def error_response(err: ApiError, path: str = "") -> Response:
    status, body = shaped(err, path)
    return Response(json.dumps(body), status, headers=err.headers or None,
                    media_type="application/json")


def as_api_error(exc: BaseException) -> ApiError:
    """Any exception as the ApiError a client should see."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PreposError):
        wait = getattr(exc, "retry_after", None)  # Overloaded: the engine's estimate
        return ApiError(status_of(exc), exc.code, str(exc), getattr(exc, "param", None),
                        {"Retry-After": str(wait)} if wait is not None else None)
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    ref = uuid.uuid4().hex[:12]  # the log has the exception; the client, where to find it
    log.error("internal error %s", ref, exc_info=exc)
    return ApiError(500, "internal_error", f"internal error (reference {ref} in the server's "
                    "log)")


def validation_error(exc: ValidationError) -> ApiError:
    """A pydantic error as a 400 that names the field and the problem."""
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    if first.get("type") == "json_invalid":
        return ApiError(400, "malformed_json", f"the body is not valid JSON: {first['msg']}")
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return ApiError(400, "invalid_request", "; ".join(parts), param)


def install(app: FastAPI, on_error=None) -> Callable[[ApiError], Response]:
    """Exception handlers that turn every failure into the JSON error shape of the route's
    API; returned, the response they give an ApiError for a path (counted by `on_error`)."""

    def respond(err: ApiError, path: str = "") -> Response:
        if on_error is not None:
            on_error(err)
        return error_response(err, path)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return respond(exc, request.url.path)

    @app.exception_handler(PreposError)
    async def _engine(request: Request, exc: PreposError):
        return respond(as_api_error(exc), request.url.path)

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError):
        return respond(validation_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _request(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        msg = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                        for e in errs[:5])
        return respond(ApiError(400, "invalid_request", msg or "invalid request"),
                       request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return respond(ApiError(exc.status_code, code, message,
                                headers=dict(exc.headers or {})), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return respond(as_api_error(exc), request.url.path)

    return respond
