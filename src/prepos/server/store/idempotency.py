"""Idempotency keys: every route that may change something (every method but GET, HEAD and
OPTIONS) takes `Idempotency-Key` and is then safe to retry.

The first attempt's result (status, headers, body: a streamed answer's events, all of them)
is recorded per API key and key, with a digest of the request (method, path and query,
`x-session-id`, body bytes). A retry with the same key and request is answered the recorded
result with `Idempotent-Replayed: true` and commits nothing, on any node (the records are in
the session store); the same key on another request is 422 `idempotency_key_reused`. A retry
that arrives while the first attempt still runs on this node waits for it, then replays it.

The key rides the request's first durable write, in that write's transaction, so the write
and its key are in the store together or not at all: a session's commit (the journal's
transaction inserts the record's row, `claim`; the request's `Attempt` is handed to the
engine as the change's origin, `Request.origin`, which the engine hands to the journal with
each commit, a turn's answer included), or a write of the Conversations API's store or the
stored responses' (the attempt passed to it, `claim_in`, where the records live in the same
store). An attempt
whose claim finds the row taken (a second attempt that got past the check, on another node
or after a takeover) fails its write, which changes nothing, and is answered what is
recorded. The result is written into the row when the request ends (`finish`); a row claimed
and not finished (its request runs on another node, or its node stopped) is 409
`idempotency_key_pending`, naming what was written. A request whose client left after its
write is finished as 409 `idempotency_key_interrupted`, naming what was written, as soon as
its answer stops: a retry learns at once what happened, never a day of `pending`.

What is recorded: every result of a request that wrote; else 2xx and 4xx, but for what a
retry may change (408, 429, 409 `session_busy` and `session_moved`); never a 5xx: a retry of a
failure that committed nothing runs again. Records are kept `ttl` seconds, at most `keep` and
`max_bytes` of them per API key (the oldest dropped first); a result larger than `max_bytes`
alone is recorded as 409 `idempotency_result_too_large`, naming what was written. Without a
journal, they are an in-memory SQLite table, lost with the sessions on a restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prepos.errors import PreposError
from prepos.server.names import public
from prepos.server.store.database import Database

log = logging.getLogger("prepos.server.idempotency")
HEADER = "Idempotency-Key"
TTL_S = 86400.0  # how long a result is kept
KEEP = 10000  # results kept per API key
MAX_BYTES = 64 << 20  # bytes of results kept per API key


class KeyClaimed(PreposError):
    """Another attempt with this key committed first: this one commits nothing."""

    code = "idempotency_key_claimed"


@dataclass(eq=False)
class Attempt:
    """One request with a key, while it runs: `sid`, the name of the session it mutates
    (None: the one it creates); `claimed` once its row is in the store with its first commit."""

    owner: str
    key: str
    digest: str
    sid: str | None
    records: Records
    done: asyncio.Future | None
    claimed: bool = False
    wrote: dict | None = None  # what its claiming write wrote (`claim`'s `where`)
    interrupted: bool = False  # its client left before its answer


def riding(origin: object, event: str, sid: str) -> Attempt | None:
    """The attempt whose key the journal's write of `event` on session `sid` claims: the
    request's (`origin`) own first commit of its session (or of the session it creates)."""
    a = origin if isinstance(origin, Attempt) else None
    if a is None or a.claimed or (a.sid != public(sid) if a.sid is not None
                                  else event != "create"):
        return None
    return a


@dataclass(frozen=True)
class Recorded:
    digest: str
    status: int | None  # None: claimed, not finished
    headers: str | None
    body: str


class Records:
    """The recorded results, in the `idempotency` table of `db` (the journal's store, or an
    in-memory SQLite), and the attempts running on this node."""

    def __init__(self, db: Database, ttl: float = TTL_S, keep: int = KEEP,
                 max_bytes: int = MAX_BYTES, clock: Callable[[], float] = time.time):
        self.db, self.ttl, self.keep, self.clock = db, ttl, keep, clock
        self.max_bytes = max_bytes
        self._swept = -float("inf")

    # -- the store (off the event loop) ----------------------------------------------------
    def get(self, owner: str, key: str) -> Recorded | None:
        try:
            row = self.db.q("SELECT digest, status, headers, body FROM idempotency WHERE "
                            "owner=? AND key=? AND created>=?",
                            (owner, key, self.clock() - self.ttl)).fetchone()
        except Exception as exc:  # the driver's: logged, a 503 naming the store
            log.error("idempotency: the %s store did not answer: %s", self.db.name, exc)
            raise self.db.unavailable() from None
        return None if row is None else Recorded(*row)

    def claim(self, db: Database, a: Attempt, where: dict) -> None:
        """In the transaction of the attempt's first write (on `db`, a connection to the
        records' store): its row, saying `where` it wrote, or KeyClaimed where another
        attempt's is there. The caller sets `a.claimed` once its transaction commits."""
        now = self.clock()
        db.q("DELETE FROM idempotency WHERE owner=? AND key=? AND created<?",
             (a.owner, a.key, now - self.ttl))
        text = json.dumps(where)
        cur = db.q("INSERT INTO idempotency VALUES (?, ?, ?, ?, NULL, NULL, ?, ?) ON CONFLICT "
                   "(owner, key) DO NOTHING", (a.owner, a.key, a.digest, now, text, len(text)))
        if cur.rowcount != 1:
            raise KeyClaimed(f"another request with this {HEADER} committed first")
        a.wrote = where

    def shares(self, db: Database) -> bool:
        """Whether `db` is a connection to the records' own store (not one in memory)."""
        return db.target is not None and db.target == self.db.target

    def finish(self, a: Attempt, status: int, headers: list, body: bytes) -> None:
        """The attempt's result in its row (inserted where no write claimed one), then the
        bounds kept (a result alone over `max_bytes` is the caller's to replace)."""
        now, hdrs, text = self.clock(), json.dumps(headers), body.decode()
        n = len(hdrs) + len(text)
        with self.db.tx():
            if a.claimed:
                self.db.q("UPDATE idempotency SET status=?, headers=?, body=?, bytes=? WHERE "
                          "owner=? AND key=?", (status, hdrs, text, n, a.owner, a.key))
            else:
                self.db.q("DELETE FROM idempotency WHERE owner=? AND key=? AND created<?",
                          (a.owner, a.key, now - self.ttl))
                self.db.q("INSERT INTO idempotency VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT "
                          "(owner, key) DO NOTHING",
                          (a.owner, a.key, a.digest, now, status, hdrs, text, n))
            if now - self._swept >= min(self.ttl / 10, 60.0):
                self._swept = now
                self.db.q("DELETE FROM idempotency WHERE created<?", (now - self.ttl,))
            row = self.db.q("SELECT created FROM idempotency WHERE owner=? ORDER BY created "
                            "DESC LIMIT 1 OFFSET ?", (a.owner, self.keep)).fetchone()
            if row is not None:
                self.db.q("DELETE FROM idempotency WHERE owner=? AND created<=?",
                          (a.owner, row[0]))
            # the newest first, as many as fit in the key's bytes (this one among them)
            self.db.q("DELETE FROM idempotency WHERE owner=? AND key IN (SELECT key FROM "
                      "(SELECT key, SUM(bytes) OVER (ORDER BY created DESC, key) AS total "
                      "FROM idempotency WHERE owner=?) newest WHERE total>?)",
                      (a.owner, a.owner, self.max_bytes))

    def used(self, owner: str) -> tuple[int, int]:
        """The results kept for `owner`, and their bytes."""
        n, size = self.db.q("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM idempotency WHERE "
                            "owner=?", (owner,)).fetchone()
        return int(n), int(size)
