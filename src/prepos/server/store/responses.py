"""Stored responses (`store: true`), for `GET`, `DELETE` and `previous_response_id`: a
`responses` table in the session store beside the journal's (`server/store/database.py`: its SQLite
file or PostgreSQL database; SQLite in memory when the server has no journal), so they survive
a restart as the sessions do.

A row is one response: its owner (the API key), the response object as it was returned,
the session and version its answer committed (none where it ran on no kept session), its
parent (`previous_response_id`) and the messages it added to the conversation (its input
items and its answer, in the session's form). A response's conversation is its ancestors'
messages and its own, each stored once: a chain is continued from what is stored, whatever
became of its session.

Bounded per key: at most `keep` responses, `max_bytes` of rows (messages and objects, as
stored), none older than `ttl` seconds. Past a bound the oldest go first. A response that
goes (deleted, evicted or expired) while others continue it is *retired*: its object is gone
(`body` null: never found by id again) and its messages stay, referenced by its children,
never copied into them, until the last response continuing it goes. A response whose
conversation alone (its ancestors' messages and its own row) is over `max_bytes` is not
stored, and nothing else changes.
Every method does the store's I/O on the caller's thread: the server calls them off the
event loop.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prepos.server.store.database import Database
from prepos.server.store.idempotency import Attempt

SAME_OWNER = "owner IS NOT DISTINCT FROM ?"  # a key, or None (NULL) for an open server
KEEP = 10000  # stored responses per API key
MAX_BYTES = 256 << 20  # bytes of stored responses per API key
TTL_S = 30 * 86400.0  # how long a stored response is kept
RETIRED = "null"  # the body of a response gone whose messages its children still use
LIVE = f"body <> '{RETIRED}'"
RESYNC = 256  # puts of one key between recounts of its rows on a store other nodes write
BATCH = 64


@dataclass(frozen=True)
class Stored:
    id: str
    owner: str | None
    parent: str | None
    sid: str | None
    version: int | None
    messages: list[dict]
    body: dict


class ResponseStore:
    def __init__(self, target: str | Path | None, keep: int = KEEP,
                 max_bytes: int = MAX_BYTES, ttl: float = TTL_S,
                 clock: Callable[[], float] = time.time):
        self.keep, self.max_bytes, self.ttl = keep, max_bytes, ttl
        self.clock = clock
        self._db = Database(target)  # the table is the store's migrations'
        # a column's bytes: PostgreSQL's from the value's header, never reading it
        self._len = "octet_length({})".format if self._db.shared else "LENGTH({})".format
        self._lock = threading.Lock()
        # per owner: [bytes of its rows, its live responses, puts since they were counted]
        self._usage: dict[str | None, list[int]] = {}
        self._swept = -float("inf")
        self.evicted = 0  # responses that went for a bound (kept, expired), not deleted

    def put(self, row: Stored, key: Attempt | None = None) -> bool:
        """Store a response, then the bounds kept; False where it is not stored (its own
        conversation over `max_bytes`). `key`, an Idempotency-Key's attempt that has not
        written yet: claimed in the same transaction, where its records share this store."""
        messages, body = json.dumps(row.messages), json.dumps(row.body)
        size = len(messages) + len(body)  # ASCII (json.dumps escapes): characters are bytes
        claims = key is not None and not key.claimed and key.records.shares(self._db)
        with self._lock, self._undone(), self._db.tx():
            if size + self._ancestry(row.parent) > self.max_bytes:
                return False
            if claims:
                key.records.claim(self._db, key, {"response_id": row.id})
            now = self.clock()
            usage = self._count(row.owner)
            old = self._db.q(f"SELECT {self._size()}, {LIVE} FROM responses WHERE id=?",
                             (row.id,)).fetchone()
            if old is not None:
                usage[0] -= old[0]
                usage[1] -= bool(old[1])
            self._db.q("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) "
                       "DO UPDATE SET owner=excluded.owner, parent=excluded.parent, "
                       "sid=excluded.sid, version=excluded.version, created=excluded.created, "
                       "messages=excluded.messages, body=excluded.body",
                       (row.id, row.owner, row.parent, row.sid, row.version, now, messages,
                        body))
            usage[0] += size
            usage[1] += 1
            self._expire(now)
            self._evict(row.owner, row.id)
        if claims:
            key.claimed = True
        return True

    def get(self, owner: str | None, rid: str) -> Stored | None:
        """The caller's response `rid` (None for none, another key's, retired or expired)."""
        with self._lock:
            r = self._db.q("SELECT id, owner, parent, sid, version, messages, body FROM "
                           f"responses WHERE id=? AND {SAME_OWNER} AND created >= ? AND "
                           f"{LIVE}", (rid, owner, self.clock() - self.ttl)).fetchone()
        if r is None:
            return None
        return Stored(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), json.loads(r[6]))

    def conversation(self, row: Stored) -> list[dict]:
        """Every message of the response's conversation, its ancestors' first (never the
        instructions: each response has its own)."""
        parts = [row.messages]
        parent = row.parent
        with self._lock:
            while parent is not None:
                r = self._db.q("SELECT parent, messages FROM responses WHERE id=?",
                               (parent,)).fetchone()
                if r is None:
                    break
                parent = r[0]
                parts.append(json.loads(r[1]))
        return [m for part in reversed(parts) for m in part]

    def delete(self, owner: str | None, rid: str) -> bool:
        with self._lock, self._undone(), self._db.tx():
            r = self._db.q(f"SELECT 1 FROM responses WHERE id=? AND {SAME_OWNER} AND {LIVE} "
                           "AND created >= ?", (rid, owner, self.clock() - self.ttl)).fetchone()
            if r is None:
                return False
            self._retire(rid, owner)
        return True

    def used(self, owner: str | None) -> tuple[int, int]:
        """The bytes of `owner`'s rows and its live responses, as the store has them."""
        with self._lock:
            return self._recount(owner)

    # -- the bounds (under the lock, in a transaction) -----------------------------------------
    @contextmanager
    def _undone(self):
        """A transaction that fails leaves the counts unknown: counted again when needed."""
        try:
            yield
        except BaseException:
            self._usage.clear()
            raise

    def _size(self) -> str:
        return f"{self._len('messages')} + {self._len('body')}"

    def _count(self, owner: str | None) -> list[int]:
        """`owner`'s usage: counted once (and, where other nodes write, every RESYNC puts),
        kept up by every change since."""
        usage = self._usage.get(owner)
        if usage is None or (self._db.shared and usage[2] >= RESYNC):
            usage = self._usage[owner] = [*self._recount(owner), 0]
        usage[2] += 1
        return usage

    def _recount(self, owner: str | None) -> tuple[int, int]:
        n, live = self._db.q(f"SELECT COALESCE(SUM({self._size()}), 0), "
                             f"COALESCE(SUM(CASE WHEN {LIVE} THEN 1 ELSE 0 END), 0) FROM "
                             f"responses WHERE {SAME_OWNER}", (owner,)).fetchone()
        return int(n), int(live)

    def _ancestry(self, parent: str | None) -> int:
        """The least the ancestors from `parent` up take: their messages, their objects
        retired."""
        if parent is None:
            return 0
        return int(self._db.q(
            f"WITH RECURSIVE up(id, parent, n) AS (SELECT id, parent, {self._len('messages')} "
            f"FROM responses WHERE id = ? UNION ALL SELECT r.id, r.parent, "
            f"{self._len('r.messages')} FROM responses r JOIN up ON r.id = up.parent) "
            "SELECT COALESCE(SUM(n + ?), 0) FROM up",
            (parent, len(RETIRED))).fetchone()[0])

    def _evict(self, owner: str | None, new: str) -> None:
        """The oldest live responses but `new` retired while a bound is passed. Then only
        `new` and its ancestors are left at worst, which `put` checked fit."""
        usage = self._usage[owner]
        while usage[0] > self.max_bytes or usage[1] > self.keep:
            oldest = self._db.q(f"SELECT id FROM responses WHERE {SAME_OWNER} AND {LIVE} AND "
                                "id <> ? ORDER BY created LIMIT ?",
                                (owner, new, BATCH)).fetchall()
            for (rid,) in oldest:
                if usage[0] <= self.max_bytes and usage[1] <= self.keep:
                    break
                self._retire(rid, owner)
                self.evicted += 1
            if not oldest:
                break

    def _expire(self, now: float) -> None:
        """Responses older than `ttl` retired, every key's; at most once per tenth of it."""
        if now - self._swept < min(self.ttl / 10, 60.0):
            return
        self._swept = now
        while True:
            old = self._db.q(f"SELECT id, owner FROM responses WHERE created < ? AND {LIVE} "
                             "LIMIT ?", (now - self.ttl, BATCH)).fetchall()
            for rid, owner in old:
                self._retire(rid, owner)
                self.evicted += 1
            if len(old) < BATCH:
                return

    def _retire(self, rid: str, owner: str | None) -> None:
        """A response gone: its row deleted, or, where responses continue it, its object
        (their conversation still reads its messages); retired ancestors it was the last to
        continue go with it."""
        usage = self._usage.get(owner, [0, 0, 0])
        body = self._db.q(f"SELECT {self._len('body')} FROM responses WHERE id=?",
                          (rid,)).fetchone()[0]
        if self._db.q("SELECT 1 FROM responses WHERE parent=? LIMIT 1", (rid,)).fetchone():
            self._db.q("UPDATE responses SET body=?, sid=NULL, version=NULL WHERE id=?",
                       (RETIRED, rid))
            usage[0] -= body - len(RETIRED)
            usage[1] -= 1
            return
        usage[1] -= 1
        self._delete_up(rid, usage)

    def _delete_up(self, rid: str | None, usage: list[int]) -> None:
        """Delete `rid`'s row, then its retired ancestors that nothing continues now."""
        while rid is not None:
            parent, n = self._db.q(f"SELECT parent, {self._size()} FROM responses WHERE id=?",
                                   (rid,)).fetchone()
            self._db.q("DELETE FROM responses WHERE id=?", (rid,))
            usage[0] -= n
            if parent is None or self._db.q(
                    f"SELECT 1 FROM responses WHERE id=? AND NOT {LIVE} AND NOT EXISTS "
                    "(SELECT 1 FROM responses c WHERE c.parent=?)",
                    (parent, parent)).fetchone() is None:
                return
            rid = parent

    def sessions(self) -> list[tuple[str, str | None]]:
        """The sessions stored answers committed to, with their owners, least recently
        answered on first."""
        with self._lock:
            rows = self._db.q("SELECT sid, owner, MAX(created) AS t FROM responses "
                              "WHERE sid IS NOT NULL GROUP BY sid, owner ORDER BY t")
            return [(sid, owner) for sid, owner, _ in rows.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._db.close()
