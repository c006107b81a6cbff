"""Stateless conversations across nodes: which node keeps each one (the hop to it is
`server/http/forwarding.hop`).

A stock client names no session, so a router in front of several nodes cannot know which
node holds its conversation. Each node publishes its kept conversations
(`engine/implicit.py`) in the shared store: the conversation's hash (the chain hash
of API key, tools and messages) and the node keeping it, written by one writer thread, off
the request. A stateless chat request that no kept conversation of this node extends looks
up the hashes of its message prefixes there (one query) and, where a live other node keeps
the longest, is answered by that node: forwarded once, the answer streamed back as it comes.
A forwarded request is never forwarded again; an owner that is dead (its node row expired)
or does not answer is skipped and the conversation is answered here, its prompt prefilled
once, and published as this node's from then on.

The directory is a cache's index: a lost write costs one re-prefill, never an answer, so
writes are best effort and a failed lookup serves here. Never across API keys: the key
seeds the hash.
"""

from __future__ import annotations

import logging
import queue
import threading

from prepos.server.store.database import Database

log = logging.getLogger("prepos.server.conversations")


class Directory:
    """This node's view of the store's `conversations` table: publish its own, find
    another live node's."""

    def __init__(self, db: Database, node: str):
        self.db, self.node = db, node
        db.q("DELETE FROM conversations WHERE node=?", (node,))  # an earlier run's: gone
        self.hops = 0  # requests answered by the node keeping their conversation
        self.published = 0
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="prepos-conversations",
                                        daemon=True)
        self._thread.start()

    def publish(self, sid: str, key: bytes | None) -> None:
        """`sid` now keeps the conversation hashed `key` (None: it keeps none any more)."""
        self._writes.put((sid, key))

    def _write(self) -> None:
        while (item := self._writes.get()) is not None:
            sid, key = item
            try:
                with self.db.tx():
                    self.db.q("DELETE FROM conversations WHERE sid=? AND node=?",
                              (sid, self.node))
                    if key is not None:
                        self.db.q("INSERT INTO conversations VALUES (?, ?, ?) ON CONFLICT "
                                  "(key) DO UPDATE SET sid=excluded.sid, node=excluded.node",
                                  (key.hex(), sid, self.node))
                self.published += 1
            except Exception as exc:  # a cache's index: the conversation is re-prefilled
                log.warning("conversation of %s not published: %s", sid, exc)

    def owner(self, keys: list[bytes]) -> str | None:
        """The URL of the live node, not this one, keeping the longest of `keys`' prefixes
        (None where no other live node keeps any)."""
        if not keys:
            return None
        marks = ", ".join("?" for _ in keys)
        rows = self.db.q(f"SELECT c.key, n.url FROM conversations c JOIN nodes n ON "
                         f"n.node = c.node WHERE c.key IN ({marks}) AND c.node <> ? AND "
                         f"n.expires > NOW", [k.hex() for k in keys] + [self.node]).fetchall()
        found = dict(rows)
        return next((found[k.hex()] for k in reversed(keys) if k.hex() in found), None)

    def close(self) -> None:
        self._writes.put(None)
        self._thread.join(timeout=5)
        self.db.close()
