"""The journal: every committed version of every session, in the session store
(`server/store/database.py`: SQLite by default, PostgreSQL for several nodes), so a restarted server
restores them all, or, with a shared store, the node a session moves to loads it. Ready
records and KV caches are never persisted: a restored session's KV is rebuilt lazily by its
pre-position job at idle priority (a session moving to another node: there, at once).

Write-ahead: the engine calls the journal (`Engine.durable`) before a session is created, a
version is committed or a session is closed, and the change is made only once its row is in
the store (one transaction on the store's writer thread, the caller waiting for it). A write
that fails raises StoreUnavailable (503) and nothing changed: no one ever sees, in memory or
over SSE, a version the store does not hold, and an answered request survives a crash.
Rows are deltas against the session's previous version (slices of its messages plus new
ones), with a full checkpoint every `checkpoint_every` versions; rows older than the newest
checkpoint that still covers the `max_versions` the engine keeps for rollback are pruned.
With a shared store every write first checks, in its transaction, that this node still owns
the session (`fence`, server/store/lease.py): a write it refuses fails the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path

from prepos.engine import Session, SessionSpec, Snapshot, is_ephemeral
from prepos.errors import PreposError
from prepos.server.names import public
from prepos.server.store.database import TIMEOUT, Database
from prepos.server.store.idempotency import KeyClaimed, riding

log = logging.getLogger("prepos.server.journal")
Restored = tuple[str, SessionSpec, list[tuple[int, list[dict]]]]

UPSERT_VERSION = ('INSERT INTO versions VALUES (?, ?, ?, ?) ON CONFLICT (sid, version) DO '
                  'UPDATE SET "full"=excluded."full", ops=excluded.ops')


def diff(base: Sequence[dict], new: Sequence[dict]) -> list:
    """`new` as slices of `base` ([i, j]) and literal messages ({"m": message})."""
    nb, nn = len(base), len(new)
    p = 0
    while p < nb and p < nn and base[p] == new[p]:
        p += 1
    s = 0
    while s < nb - p and s < nn - p and base[nb - 1 - s] == new[nn - 1 - s]:
        s += 1
    ops: list = [[0, p]] if p else []
    ops += [{"m": m} for m in new[p:nn - s]]
    if s:
        ops.append([nb - s, nb])
    return ops


def apply(base: Sequence[dict], ops: list) -> list[dict]:
    out: list[dict] = []
    for op in ops:
        if isinstance(op, list):
            out.extend(base[op[0]:op[1]])
        else:
            out.append(op["m"])
    return out


def spec_to_json(spec: SessionSpec) -> str:
    d = asdict(spec)
    d["tools"] = list(spec.tools)
    d["standing"] = list(spec.standing)
    return json.dumps(d)


def spec_from_json(raw: str) -> SessionSpec:
    """A journalled spec; fields a newer SessionSpec no longer has are dropped."""
    known = {f.name for f in fields(SessionSpec)}
    d = {k: v for k, v in json.loads(raw).items() if k in known}
    d["tools"] = tuple(d.get("tools", ()))
    d["standing"] = tuple(d.get("standing", ()))
    d["relaxed_queries"] = tuple(d.get("relaxed_queries", ()))
    return SessionSpec(**d)


class Journal:
    def __init__(self, target: str | Path | Database, max_versions: int = 1024,
                 checkpoint_every: int = 64, metrics=None, timeout: float = TIMEOUT):
        self._db = target if isinstance(target, Database) else Database(target, timeout=timeout)
        self.db = self._db  # the store, for what rides its transactions (idempotency keys)
        self.shared = self._db.shared
        self.max_versions = max_versions
        self.checkpoint_every = checkpoint_every
        self.metrics = metrics
        # shared store: fence(db, sid) raises unless this node owns sid (inside the write's
        # transaction); a session closed here because it moved is left in the store
        self.fence: Callable[[Database, str], None] | None = None
        self.moving: set[str] = set()
        self._lock = threading.Lock()  # reads of the store (writes: on its writer thread)
        self._last: dict[str, tuple[int, tuple[dict, ...]]] = {}  # sid -> last row written
        self._since_full: dict[str, int] = {}
        self.errors = 0

    def attach(self, engine) -> None:
        """Journal every session of `engine`: its store calls `created`, `committed` and
        `closing` before each change."""
        engine.write_ahead(self)

    # -- meta ------------------------------------------------------------------------------
    def check_model(self, model: str) -> str | None:
        """Record the model; a different one from last time is allowed (sessions are kept as
        messages and re-rendered) and returned so the caller can say so."""
        with self._lock, self._db.tx():
            row = self._db.q("SELECT value FROM meta WHERE key='model'").fetchone()
            self._db.q("INSERT INTO meta VALUES ('model', ?) ON CONFLICT (key) DO UPDATE "
                       "SET value=excluded.value", (model,))
        return row[0] if row and row[0] != model else None

    # -- restore ---------------------------------------------------------------------------
    def load(self) -> list[Restored]:
        """Every journalled session: id, spec and the history the engine
        keeps ((version, messages), oldest first, the last current)."""
        with self._lock:
            rows = self._db.q("SELECT id, spec, extras FROM sessions ORDER BY created")
            found = [self._restored(*row) for row in rows.fetchall()]
        return [r for r in found if r is not None]

    def load_one(self, sid: str) -> Restored | None:
        """One journalled session, as `load` gives it; None where the store has none."""
        with self._lock:
            row = self._db.q("SELECT id, spec, extras FROM sessions WHERE id=?",
                             (sid,)).fetchone()
            return self._restored(*row) if row is not None else None

    def exists(self, sid: str) -> bool:
        with self._lock:
            return self._db.q("SELECT 1 FROM sessions WHERE id=?", (sid,)).fetchone() is not None

    def _restored(self, sid: str, spec_raw: str, extras_raw: str) -> Restored | None:
        try:
            spec = spec_from_json(spec_raw)
            history = self._replay(sid)
        except Exception as exc:  # a damaged row loses its session, not the server
            log.error("journal: cannot restore session %s: %s", sid, exc)
            return None
        if not history:
            return None
        legacy = json.loads(extras_raw or "{}")  # older journals kept it beside the spec
        if "push_max_tokens" in legacy and '"push_tokens"' not in spec_raw:
            spec.push_tokens = int(legacy["push_max_tokens"])
        self._last[sid] = (history[-1][0], tuple(history[-1][1]))
        self._since_full[sid] = 0
        return sid, spec, history

    def _replay(self, sid: str) -> list[tuple[int, list[dict]]]:
        rows = self._db.q('SELECT version, "full", ops FROM versions WHERE sid=? '
                          "ORDER BY version", (sid,)).fetchall()
        history: list[tuple[int, list[dict]]] = []
        messages: list[dict] | None = None
        for version, full, ops in rows:
            ops = json.loads(ops)
            if full:
                messages = [op["m"] for op in ops]
            elif messages is None:
                raise ValueError(f"version {version} is a delta with no base")
            else:
                messages = apply(messages, ops)
            history.append((version, messages))
        return history[-self.max_versions:]

    def forget(self, sid: str) -> None:
        """A journalled session that could not be restored: leave its rows, stop tracking."""
        with self._lock:
            self._last.pop(sid, None)

    # -- write-ahead, called by the engine before each change ------------------------------
    # `origin`: the request the change comes from (the engine's `Request.origin`), an
    # idempotency `Attempt` where the request has a key, claimed with its first write
    def created(self, s: Session, snap: Snapshot, origin: object = None) -> None:
        """Before a new session is admitted: its row and first version (none for a session
        loaded from this store)."""
        if is_ephemeral(s.id) or s.id in self._last:
            return
        self._write("create", s.id, lambda: self._create(s, snap), snap.version, origin)

    def committed(self, s: Session, snap: Snapshot, origin: object = None) -> None:
        """Before version `snap` of a journalled session is swapped in: its row."""
        if not is_ephemeral(s.id):
            self._write("commit", s.id, lambda: self._commit(s.id, snap), snap.version, origin)

    def closing(self, s: Session, origin: object = None) -> None:
        """Before a session is closed: its rows deleted (left in the store where the session
        moved to another node). On the event loop (a session evicted to make room) the
        delete is not waited for: a failed one leaves rows a restart restores."""
        if is_ephemeral(s.id):
            return
        if s.id in self.moving:  # closed here because another node owns it now
            self.moving.discard(s.id)
            self._forget(s.id)
            return
        if _on_loop():
            self._db.submit(lambda db: self._job("close", s.id, lambda: self._close(s.id)))
            return
        self._write("close", s.id, lambda: self._close(s.id), self._last.get(s.id, (None,))[0],
                    origin)

    def _write(self, event: str, sid: str, write: Callable[[], None], version,
               origin: object = None) -> None:
        """`write()` in one transaction on the writer thread, waited for; StoreUnavailable
        (or the fence's refusal) where it was not written. The request's idempotency key, if
        this is its first commit, is claimed in the same transaction (`riding`)."""
        if _on_loop():
            log.warning("journal: the %s of session %s waits for the store on the event loop",
                        event, sid)
        key = riding(origin, event, sid)
        try:
            self._db.submit(lambda db: self._job(event, sid, write, key, version)).result()
        except KeyClaimed:  # another attempt with its key committed: this one changed nothing
            raise
        except PreposError:
            self.errors += 1
            if self.metrics is not None:
                self.metrics.journal_errors.inc()
            raise

    def _job(self, event: str, sid: str, write: Callable[[], None], key=None,
             version: int | None = None) -> None:
        """On the writer thread (the only one that changes the rows and this journal's view
        of them): the fence, then `write()`, then `key`'s claim, one transaction; the view as
        before where the transaction failed."""
        before = self._last.get(sid), self._since_full.get(sid)
        try:
            with self._db.tx():
                if self.fence is not None:
                    self.fence(self._db, sid)
                write()
                if key is not None:
                    key.records.claim(self._db, key, {"session_id": public(sid),
                                                         "version": version})
            if key is not None:
                key.claimed = True
        except BaseException as exc:
            log.error("journal: %s of session %s not written: %s", event, sid, exc)
            for table, value in zip((self._last, self._since_full), before):
                if value is None:
                    table.pop(sid, None)
                else:
                    table[sid] = value
            raise

    def _create(self, s: Session, snap: Snapshot) -> None:
        self._db.q("INSERT INTO sessions VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                   "spec=excluded.spec, extras=excluded.extras, created=excluded.created",
                   (s.id, spec_to_json(s.spec), "{}", time.time()))  # extras: the spec's now
        self._db.q("DELETE FROM versions WHERE sid=?", (s.id,))
        self._full(s.id, snap.version, snap.messages)

    def _commit(self, sid: str, snap: Snapshot) -> None:
        last = self._last.get(sid)
        if last is None or snap.version <= last[0]:
            return  # not journalled (its create was not), or written already
        n = self._since_full.get(sid, 0) + 1
        if n >= self.checkpoint_every:
            self._full(sid, snap.version, snap.messages)
            self._prune(sid, snap.version)
            return
        self._db.q(UPSERT_VERSION, (sid, snap.version, 0, json.dumps(diff(last[1],
                                                                           snap.messages))))
        self._last[sid] = (snap.version, snap.messages)
        self._since_full[sid] = n
        self._count()

    def _full(self, sid: str, version: int, messages: Sequence[dict]) -> None:
        self._db.q(UPSERT_VERSION, (sid, version, 1, json.dumps([{"m": m} for m in messages])))
        self._last[sid] = (version, tuple(messages))
        self._since_full[sid] = 0
        self._count()

    def _prune(self, sid: str, version: int) -> None:
        oldest_kept = version - self.max_versions + 1
        row = self._db.q('SELECT MAX(version) FROM versions WHERE sid=? AND "full"=1 '
                         "AND version<=?", (sid, oldest_kept)).fetchone()
        if row and row[0] is not None:
            self._db.q("DELETE FROM versions WHERE sid=? AND version<?", (sid, row[0]))

    def _close(self, sid: str) -> None:
        self._db.q("DELETE FROM versions WHERE sid=?", (sid,))
        self._db.q("DELETE FROM sessions WHERE id=?", (sid,))
        self._forget(sid)

    def _forget(self, sid: str) -> None:
        self._last.pop(sid, None)
        self._since_full.pop(sid, None)

    def _count(self) -> None:
        if self.metrics is not None:
            self.metrics.journal_writes.inc()

    def close(self) -> None:
        self._db.close()


def _on_loop() -> bool:
    """Whether the caller runs on an event loop (which must never wait for the store)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
