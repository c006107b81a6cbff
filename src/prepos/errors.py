"""Typed errors. Every one is raised before any state changes."""


class PreposError(Exception):
    """Base class; `code` is a stable machine-readable name, `status` the HTTP status."""

    code = "prepos_error"
    status = 400


class InvalidInput(PreposError):
    code = "invalid_input"


class InvalidSampling(PreposError):
    code = "invalid_sampling"


class SessionNotFound(PreposError):
    code = "session_not_found"
    status = 404


class WrongSessionKind(PreposError):
    code = "wrong_session_kind"
    status = 409


class VersionNotFound(PreposError):
    code = "version_not_found"
    status = 404


class NoToolResultAwaited(PreposError):
    code = "no_tool_result_awaited"
    status = 409


class ToolResultAwaited(PreposError):
    code = "tool_result_awaited"
    status = 409


class OverBudget(PreposError):
    """Input that does not fit the context window or the KV cell budget."""

    code = "over_budget"
    status = 413


class TooManySessions(PreposError):
    """The engine (or its back end's KV) holds as many sessions as it can; retry later."""

    code = "too_many_sessions"
    status = 429


class EngineClosed(PreposError):
    code = "engine_closed"
    status = 503


class Conflict(PreposError):
    """The session changed under a request that meant to commit to it."""

    code = "conflict"
    status = 409


class SessionBusy(Conflict):
    """A turn is in flight on the session (one at a time): this request changed nothing."""

    code = "session_busy"


class InvalidResponseFormat(InvalidSampling):
    """A response_format prepos cannot enforce: an unknown type, a schema that is not an
    object, a keyword the grammar library does not implement."""

    code = "invalid_response_format"
    param = "response_format"
