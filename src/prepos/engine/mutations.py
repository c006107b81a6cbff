"""`Engine`'s session part: sessions made, changed and closed. Every commit invalidates the
session's ready set in the same critical section (`Session._commit`), then `_committed`
settles the dropped pre-position, builds the KV where asked and queues the next pre-position
at idle.

A mixin of `Engine` (`facade.py`), whose `__init__` sets what it uses."""

from __future__ import annotations

import contextlib
import json
from typing import Sequence

from prepos.chat.format import normalize_tool_call
from prepos.engine.admission import check_session
from prepos.engine.ready import ReadySet
from prepos.engine.session import Session, Snapshot
from prepos.engine.session_spec import SessionSpec
from prepos.errors import InvalidInput, OverBudget
from prepos.worker.kv import Forward


class Mutations:
    # == sessions ==========================================================================
    def create_session(self, kind: str, system: str | None = None, tools: Sequence[dict] = (),
                       standing: Sequence[str] = (), fast_path: str = "exact",
                       preposition: bool = True, budget_cells: int | None = None,
                       owner: str | None = None, relaxed_queries: Sequence[str] = (),
                       r_max: float | None = None, answer_tokens: int | None = None,
                       answer_stop: Sequence[str] = (), origin: object = None) -> str:
        """A new session; `owner`: the API key that made it (journalled; the server checks it);
        `answer_tokens`, `answer_stop`: its exact entries' answer budget, pre-decoded at idle.
        `origin` (every mutation): the request it comes from, handed to the write-ahead log
        with the change (opaque here: the server's Idempotency-Key attempt)."""
        spec = SessionSpec(kind, system, tuple(tools), tuple(standing), fast_path, preposition,
                           budget_cells, owner=owner, relaxed_queries=tuple(relaxed_queries),
                           r_max=r_max, answer_tokens=answer_tokens,
                           answer_stop=tuple(answer_stop))
        return self.restore_session(self.sessions.new_id(), spec, origin=origin)

    def restore_session(self, sid: str, spec: SessionSpec, history: Sequence[tuple[int,
                        Sequence[dict]]] = (), warm: bool = False, origin: object = None,
                        prepare: bool = True) -> str:
        """A session with a given id, optionally from journalled history ((version, messages),
        the last current). Its KV is rebuilt by the pre-position job at idle priority (`warm`:
        first in the foreground, waited for); ready records are recomputed, never restored.
        `prepare=False`: no pre-position of the new session, whose first turn the caller
        starts at once (its prefill then starts from the longest prefix any KV holds, where
        an entry pre-positioned first would have taken the session's system part alone)."""
        check_session(spec, history, self.fmt)
        c = self.config
        self.pool.claim(sid, spec.owner)
        s = Session(sid, spec, self.fmt, self.max_context, c.max_versions, c.shift_keep,
                    c.reserve_tokens, history, check_commit=self.room.check_commit,
                    said_tokens=c.lookup_said_tokens if self.lookup.k else 0)
        self.sessions.add(s, origin)
        self._emit("create", s, s.snap)
        self._committed(s, s.snap, None, wait=warm, prepare=prepare)
        return s.id

    def close_session(self, sid: str, expected_version: int | None = None,
                      origin: object = None) -> None:
        with self.sessions.get(sid).expecting(expected_version):
            s = self.sessions.remove(sid, origin)
        s.invalidate()
        self.relaxed.gate.forget(s.id)
        self.chains.forget(s.id)  # closed by its owner, or its answer failed
        self.conversations.forget(s.id)
        self._emit("close", s, None)

        def drop():
            self.pool.drop(s.id)
            yield

        self.scheduler.submit(drop(), key=s.id)

    def trim(self, sid: str) -> None:
        """Drop the session's speculative KV cells (its commits and ready records kept); waits."""
        s = self.sessions.get(sid)

        def crop():
            self.pool.get(s.id).crop(len(s.snap.tokens))
            yield

        self._call(crop(), key=s.id)

    # == mutations =========================================================================
    def append(self, sid: str, text: str, wait=True, expected_version=None,
               origin: object = None) -> int:
        """Streaming: commit a data message (the window shifted when the context is full), with
        `wait` once in the KV. `expected_version` (any mutation): Conflict unless it is there."""
        s = self.sessions.get(sid)
        self.fmt.check_text(text, "data")
        with s.expecting(expected_version):
            snap, dropped = s.append(text, origin)
        self._committed(s, snap, dropped, wait)
        return snap.version

    def rollback(self, sid: str, version: int, wait=True, expected_version=None,
                 origin: object = None) -> int:
        s = self.sessions.get(sid)
        with s.expecting(expected_version):
            snap, dropped = s.rollback(version, origin)
        if dropped is not None:  # None: it was at that version already, nothing committed
            self._committed(s, snap, dropped, wait)
        return snap.version

    def shift(self, sid: str, drop: int | None = None, wait=True, expected_version=None,
              origin: object = None) -> int:
        s = self.sessions.get(sid)
        with s.expecting(expected_version):
            snap, dropped = s.shift(drop, origin)
        self._committed(s, snap, dropped, wait)
        return snap.version

    def add_message(self, sid: str, role: str, content: str,
                    tool_calls: Sequence[dict] | None = None, wait: bool = True,
                    expected_version: int | None = None, origin: object = None) -> int:
        """Agentic: commit a message without generating (user, tool, or a client's assistant)."""
        s = self.sessions.get(sid)
        self.fmt.check_text(content, "content")
        msg: dict = {"role": role, "content": content}
        if tool_calls:
            if role != "assistant":
                raise InvalidInput("only assistant messages carry tool_calls")
            msg["tool_calls"] = [normalize_tool_call(c) for c in tool_calls]
            self.fmt.check_text(json.dumps(msg["tool_calls"]), "tool_calls")
        snap, dropped = s.add_message(msg, expected_version=expected_version, origin=origin)
        self._committed(s, snap, dropped, wait)
        return snap.version

    def _committed(self, s: Session, snap: Snapshot, dropped: ReadySet | None, wait,
                   prepare: bool = True) -> None:
        """After every commit: settle the dropped pre-position, ingest, pre-position (unless
        not `prepare`)."""
        self.prepositioner.invalidated(dropped, s.id)
        if dropped is not None:
            self._emit("commit", s, snap)
        if wait and snap.tokens:  # the commit stands: its KV is a cache, rebuilt when needed
            with contextlib.suppress(OverBudget):
                self._call(self._ingest(s, snap), key=s.id)
        if prepare and self.config.preposition and s.spec.preposition:
            _, ready = s.current()
            if ready.version == snap.version and ready.valid:
                self.prepositioner.scheduled(ready)
                self.scheduler.submit(self.prepositioner.job(s, snap, ready), idle=True,
                                      key=s.id, priority=self.prepositioner.worth(s))

    def _ingest(self, s: Session, snap: Snapshot):
        kv = self.pool.get(s.id)
        if kv.common_prefix(snap.tokens) < len(snap.tokens):
            yield Forward(kv, snap.tokens)
