"""The server's session places: how many persistent sessions it admits (its own and each key's
limit, 429 beyond), the places held for sessions being created and the ephemeral sessions of
stateless requests. What the engine keeps on a client's behalf (conversations, Responses
chains) gives way at a limit (`Engine.evict_conversation`, `Engine.evict_chain`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager, suppress
from typing import TypeVar

from prepos.decode.stream import Stream
from prepos.engine import EPHEMERAL, Engine, SessionSpec, is_ephemeral
from prepos.errors import PreposError, TooManySessions
from prepos.server.http.errors import ApiError
from prepos.server.http.limits import Limits, share
from prepos.server.http.metrics import Metrics

log = logging.getLogger("prepos.server")
T = TypeVar("T")


class SessionAdmission:
    """The one owner of the counts and lists above."""

    def __init__(self, limits: Limits, metrics: Metrics, keys: int = 0):
        self.limits, self.metrics = limits, metrics
        self.keys = keys  # the server's API keys: each has its share of the sessions
        self.session_cap = limits.max_sessions  # persistent sessions, once loaded
        self.key_cap = share(self.session_cap, limits.max_sessions_per_key, keys)
        self.creating: dict[str, str | None] = {}  # ids of sessions being created: owner

    def persistent_sessions(self, engine: Engine) -> int:
        return self._held(engine)

    @contextmanager
    def new_session(self, engine: Engine, owner: str | None, requested: str | None = None):
        """Check the session limits and hold a place for the session being created (its id
        is yielded) until the block ends: concurrent creations at the limit never overshoot
        it (the check and the reservation happen on the event loop, with no await between
        them)."""
        self.check_new_session(engine, owner)
        sid = requested or engine.new_session_id()
        self.creating[sid] = owner
        try:
            yield sid
        finally:
            del self.creating[sid]

    def _held(self, engine: Engine, owner: str | None = None, mine: bool = False) -> int:
        """The persistent sessions held or being created (with `mine`, `owner`'s), counted
        from one snapshot of the engine's sessions: a session a worker thread adds (or an
        ephemeral one it closes) while this counts is counted once, never missed."""
        snap = engine.all_sessions()
        creating = list(self.creating.items())
        ids = {s.id for s in snap} if creating else set()
        return sum(1 for s in snap if not is_ephemeral(s.id) and
                   (not mine or s.spec.owner == owner)) + sum(
            1 for sid, o in creating if sid not in ids and (not mine or o == owner))

    def cap(self, engine: Engine) -> None:
        """The persistent sessions this server admits (`session_cap`): --max-sessions, or fewer
        where the back end holds fewer sessions' KV, an eighth of those kept for stateless
        requests."""
        lim = self.limits
        held = engine.session_limit  # set when it was made (`ServerState`), or the back end's
        if held >= lim.max_sessions + engine.config.max_queue:
            self.session_cap = lim.max_sessions
            self.key_cap = share(self.session_cap, lim.max_sessions_per_key, self.keys)
            return
        self.session_cap = cap = min(lim.max_sessions, held - max(1, held // 8))
        self.key_cap = share(cap, lim.max_sessions_per_key, self.keys)
        log.warning("the %s back end holds the KV of %d sessions: at most %d persistent "
                    "sessions, the rest for stateless requests", engine.backend_name, held, cap)

    def check_new_session(self, engine: Engine, owner: str | None) -> None:
        """A 429 at the server's or the key's session limit, once no Responses chain session
        could give way (the least recently used free one: the key's own first, then, at the
        server's limit, any key's; its responses stay stored)."""
        while self._held(engine) >= self.session_cap:
            if engine.evict_chain(owner) or engine.evict_chain():
                continue
            self.metrics.rejected.labels("sessions").inc()
            raise ApiError(429, "too_many_sessions", f"this server holds its limit of "
                           f"{self.session_cap} sessions; close one first",
                           headers={"Retry-After": "60"})
        if self.key_cap is not None and owner is not None:
            while self._held(engine, owner, mine=True) >= self.key_cap:
                if engine.evict_chain(owner):
                    continue
                self.metrics.rejected.labels("sessions_per_key").inc()
                raise ApiError(429, "too_many_sessions", f"this key holds its share of "
                               f"{self.key_cap} sessions; close one first",
                               headers={"Retry-After": "60"})

    def new_ephemeral(self, engine: Engine, spec: SessionSpec, history=()) -> str:
        """A session for one stateless request: never journalled, never listed."""
        sid = f"{EPHEMERAL}{engine.new_session_id()}"
        self.with_room(engine, lambda: engine.restore_session(sid, spec, history))
        return sid

    def with_room(self, engine: Engine, create: Callable[[], T]) -> T:
        """`create()` a session, closing what the engine keeps on clients' behalf while it
        is full."""
        while True:
            try:
                return create()
            except TooManySessions:
                if not engine.evict_conversation():
                    raise

    def start_ephemeral(self, engine: Engine, spec: SessionSpec,
                        start: Callable[[str], Stream], history=()) -> tuple[str, Stream]:
        """`start(sid)` on a new ephemeral session, closed again if that fails."""
        sid = self.new_ephemeral(engine, spec, history)
        try:
            return sid, start(sid)
        except BaseException:
            self.close_ephemeral(engine, sid)
            raise

    def close_after(self, engine: Engine, stream: Stream, sid: str) -> None:
        """Close an ephemeral session once its stream has ended (`Stream.on_end`: on the
        producer's thread, no thread held waiting for it)."""
        stream.on_end(lambda: self.close_ephemeral(engine, sid))

    @staticmethod
    def close_ephemeral(engine: Engine, sid: str) -> None:
        with suppress(PreposError):
            engine.close_session(sid)
