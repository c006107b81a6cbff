"""Stored responses (`store: true`), for `GET`, `DELETE` and `previous_response_id`: a
`responses` table in the session store beside the journal's (`server/store.py`: its SQLite
file or PostgreSQL database; SQLite in memory when the server has no journal), so they survive
a restart as the sessions do.

A row is one response: its owner (the API key), the response object as it was returned,
the session and version its answer committed (none where it ran on no kept session), its
parent (`previous_response_id`) and the messages it added to the conversation (its input
items and its answer, in the session's form). A response's conversation is its ancestors'
messages and its own, so a chain is continued from what is stored, whatever became of its
session. Deleting a response hands its messages down to its children, so they keep their
conversation and the deleted one's content is gone. At most `keep` responses per key, the
oldest forgotten first.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prepos.server.store import Database

SAME_OWNER = "owner IS NOT DISTINCT FROM ?"  # a key, or None (NULL) for an open server
KEEP = 10000  # stored responses per API key


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
    def __init__(self, target: str | Path | None, keep: int = KEEP):
        self.keep = keep
        self._db = Database(target)  # the table is the store's migrations'
        self._lock = threading.Lock()

    def put(self, row: Stored) -> None:
        with self._lock, self._db.tx():
            self._db.q("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) "
                       "DO UPDATE SET owner=excluded.owner, parent=excluded.parent, "
                       "sid=excluded.sid, version=excluded.version, created=excluded.created, "
                       "messages=excluded.messages, body=excluded.body",
                       (row.id, row.owner, row.parent, row.sid, row.version, time.time(),
                        json.dumps(row.messages), json.dumps(row.body)))
            n = self._db.q(f"SELECT COUNT(*) FROM responses WHERE {SAME_OWNER}",
                           (row.owner,)).fetchone()[0]
            if n > self.keep:
                old = self._db.q(f"SELECT id FROM responses WHERE {SAME_OWNER} ORDER BY "
                                 "created LIMIT ?", (row.owner, n - self.keep)).fetchall()
                for (rid,) in old:
                    self._remove(rid)

    def get(self, owner: str | None, rid: str) -> Stored | None:
        """The caller's response `rid` (None for none, or another key's)."""
        with self._lock:
            r = self._db.q("SELECT id, owner, parent, sid, version, messages, body FROM "
                           f"responses WHERE id=? AND {SAME_OWNER}", (rid, owner)).fetchone()
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
        with self._lock, self._db.tx():
            if self._db.q(f"SELECT 1 FROM responses WHERE id=? AND {SAME_OWNER}",
                          (rid, owner)).fetchone() is None:
                return False
            self._remove(rid)
        return True

    def _remove(self, rid: str) -> None:
        """Delete a row; its children take its messages and its parent."""
        parent, messages = self._db.q("SELECT parent, messages FROM responses WHERE id=?",
                                      (rid,)).fetchone()
        mine = json.loads(messages)
        children = self._db.q("SELECT id, messages FROM responses WHERE parent=?",
                              (rid,)).fetchall()
        for cid, theirs in children:
            self._db.q("UPDATE responses SET parent=?, messages=? WHERE id=?",
                       (parent, json.dumps(mine + json.loads(theirs)), cid))
        self._db.q("DELETE FROM responses WHERE id=?", (rid,))

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
