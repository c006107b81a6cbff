"""A generation request on its way into the engine, counted from its arrival until the
engine entry it calls returns (its task submitted), so a step that would start from idle
waits for the requests sent with it (`Engine.arrival`, bounded by `--batch-wait-ms`).

Counted: POSTs to the chat, Responses and Messages routes, from the app's first sight of
them. The count ends where the request's work enters the engine (`entered`: in the thread
that runs the entry, once it returns), where it is handed to another node (`arrived`), or
when the app is done with the request, whichever is first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

KEY = "prepos.arrival"
PATHS = frozenset(("/v1/chat/completions", "/v1/responses", "/v1/messages"))


def _nothing() -> None:
    return None


def arriving(scope, engine) -> Callable[[], None]:
    """The request's arrival (kept on its scope), or nothing where it is not counted."""
    if engine is None or scope["method"] != "POST" or scope["path"] not in PATHS:
        return _nothing
    done = scope[KEY] = engine.arrival()
    return done


def arrived(scope) -> None:
    """The request's work is in the engine, or handed elsewhere."""
    scope.get(KEY, _nothing)()


def entered(scope, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, an engine entry, ending the request's arrival once it returns or fails."""
    done = scope.get(KEY, _nothing)

    def call(*args):
        try:
            return fn(*args)
        finally:
            done()
    return call
