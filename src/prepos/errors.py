"""Typed errors. Every one is raised before any state changes. No HTTP here: each carries a
stable machine-readable `code`, and the HTTP layer maps codes to statuses
(`server/http/errors.py`)."""


class PreposError(Exception):
    """Base class; `code` is a stable machine-readable name."""

    code = "prepos_error"


class InvalidInput(PreposError):
    code = "invalid_input"


class InvalidSampling(PreposError):
    code = "invalid_sampling"


class SessionNotFound(PreposError):
    code = "session_not_found"


class WrongSessionKind(PreposError):
    code = "wrong_session_kind"


class VersionNotFound(PreposError):
    code = "version_not_found"


class NoToolResultAwaited(PreposError):
    code = "no_tool_result_awaited"


class ToolResultAwaited(PreposError):
    code = "tool_result_awaited"


class OverBudget(PreposError):
    """Input that does not fit the context window or the KV cell budget."""

    code = "over_budget"


class TooManySessions(PreposError):
    """The engine (or its back end's KV) holds as many sessions as it can; retry later."""

    code = "too_many_sessions"


class EngineClosed(PreposError):
    code = "engine_closed"


class Overloaded(PreposError):
    """The model worker's foreground queue is full (`EngineConfig.max_queue`); `retry_after`:
    the seconds to wait, an estimate."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Conflict(PreposError):
    """The session changed under a request that meant to commit to it."""

    code = "conflict"


class SessionBusy(Conflict):
    """A turn is in flight on the session (one at a time): this request changed nothing."""

    code = "session_busy"


class InvalidResponseFormat(InvalidSampling):
    """A response_format prepos cannot enforce: an unknown type, a schema that is not an
    object, a keyword the grammar library does not implement."""

    code = "invalid_response_format"
    param = "response_format"
