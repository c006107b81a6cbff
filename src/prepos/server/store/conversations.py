"""Conversations of OpenAI's Conversations API (`server/openai/conversations_api.py`): a
conversation and its items, in the session store beside the journal's and the stored
responses' (`database.py`: its SQLite file or PostgreSQL database; SQLite in memory when the
server has no journal), so they survive a restart as the sessions do.

A conversation row is its id, owner (the API key), creation time and metadata, its
`version` (bumped by every change of its items: a response made on one version adds its
turn only to that version, so concurrent turns never interleave), `next` (the place its
next item takes) and `bytes` (its metadata and items, as stored). An item row is its id,
its conversation, its place there, the `call_id` of a function call (what a later
function_call_output answers) and the item as the API returns it.

A write made with an `Idempotency-Key` (`key`, the request's `Attempt`) claims the key in its
own transaction, where the records share this store (`Records.claim`).

Bounded per key: at most `keep` conversations and `max_bytes` of them. A change past a
bound is refused whole (nothing evicted: a conversation lives until it is deleted), with
one exception: a response's turn is added even where it takes the key past `max_bytes`
(the answer was given, its input checked to fit first), and the key's next addition is
refused. Another key's conversation is not found, as an unknown one is (the same 404).
Every method does the store's I/O on the caller's thread: the server calls them off the
event loop; each change is one transaction, and a driver's failure a 503 that changed
nothing (`StoreUnavailable`, the driver's text in the log only).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prepos.errors import PreposError
from prepos.server.store.database import Database
from prepos.server.store.idempotency import Attempt
from prepos.server.store.responses import MAX_BYTES, SAME_OWNER

log = logging.getLogger("prepos.server.conversations")
KEEP = 10000  # conversations per API key
CONV = "openai_conversations"
ITEMS = "openai_conversation_items"


@dataclass(frozen=True)
class Conversation:
    id: str
    created: int
    metadata: dict[str, str]
    version: int

    def object(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created,
                "metadata": self.metadata}


class ConversationStoreError(PreposError):
    """A refusal of the conversations' store, naming the request's field (`param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConversationNotFound(ConversationStoreError):
    code = "conversation_not_found"


class ItemNotFound(ConversationStoreError):
    code = "item_not_found"


class TooManyConversations(ConversationStoreError):
    code = "too_many_conversations"


class ConversationChanged(ConversationStoreError):
    code = "conversation_changed"


class ConversationsTooLarge(ConversationStoreError):
    code = "conversations_too_large"


def not_found(cid: str, param: str | None) -> ConversationNotFound:
    return ConversationNotFound(f"no conversation {cid!r}", param)


def item_not_found(cid: str, item: str, param: str | None) -> ItemNotFound:
    return ItemNotFound(f"no item {item!r} in conversation {cid!r}", param)


def size(obj) -> int:
    return len(json.dumps(obj))  # ASCII (json.dumps escapes): characters are bytes


class ConversationStore:
    def __init__(self, target: str | Path | None, keep: int = KEEP,
                 max_bytes: int = MAX_BYTES):
        self.keep, self.max_bytes = keep, max_bytes
        self._db = Database(target)  # the tables are the store's migrations'
        self._for_update = " FOR UPDATE" if self._db.shared else ""  # SQLite: one writer
        self._lock = threading.Lock()

    # -- conversations -----------------------------------------------------------------------
    def create(self, cid: str, owner: str | None, metadata: dict[str, str],
               items: list[dict], key: Attempt | None = None) -> Conversation:
        created = int(time.time())
        n = size(metadata) + sum(map(size, items))
        with self._io(tx=True, key=key, wrote={"conversation_id": cid}):
            count, used = self._usage(owner)
            if count >= self.keep:
                raise TooManyConversations(f"this key holds its limit of {self.keep} "
                                           "conversations; delete one first")
            self._check_room(used, n, "items")
            self._db.q(f"INSERT INTO {CONV} VALUES (?, ?, ?, ?, 0, ?, ?)",
                       (cid, owner, created, json.dumps(metadata), len(items), n))
            self._insert(cid, 0, items)
        return Conversation(cid, created, metadata, 0)

    def get(self, owner: str | None, cid: str, param: str | None) -> Conversation:
        with self._io():
            return self._conv(owner, cid, param)

    def update(self, owner: str | None, cid: str, metadata: dict[str, str],
               key: Attempt | None = None) -> Conversation:
        with self._io(tx=True, key=key, wrote={"conversation_id": cid}):
            conv = self._conv(owner, cid, "conversation_id", lock=True)
            grows = size(metadata) - size(conv.metadata)
            if grows > 0:
                self._check_room(self._usage(owner)[1], grows, "metadata")
            self._db.q(f"UPDATE {CONV} SET metadata=?, bytes=bytes+? WHERE id=?",
                       (json.dumps(metadata), grows, cid))
        return Conversation(conv.id, conv.created, metadata, conv.version)

    def delete(self, owner: str | None, cid: str, key: Attempt | None = None) -> None:
        with self._io(tx=True, key=key, wrote={"conversation_id": cid}):
            self._conv(owner, cid, "conversation_id", lock=True)
            self._db.q(f"DELETE FROM {ITEMS} WHERE conversation=?", (cid,))
            self._db.q(f"DELETE FROM {CONV} WHERE id=?", (cid,))

    def used(self, owner: str | None) -> tuple[int, int]:
        """The key's conversations and their bytes, as the store has them."""
        with self._io():
            return self._usage(owner)

    def check_room(self, owner: str | None, n: int, param: str) -> None:
        """A 413 naming the limit where `n` more bytes would take the key past it."""
        with self._io():
            self._check_room(self._usage(owner)[1], n, param)

    # -- items -------------------------------------------------------------------------------
    def items(self, owner: str | None, cid: str, param: str) -> tuple[Conversation, list[dict]]:
        """The conversation and every item of it, in order (for a response on it)."""
        with self._io():
            conv = self._conv(owner, cid, param)
            rows = self._db.q(f"SELECT body FROM {ITEMS} WHERE conversation=? ORDER BY seq",
                              (cid,)).fetchall()
        return conv, [json.loads(body) for (body,) in rows]

    def page(self, owner: str | None, cid: str, limit: int, order: str,
             after: str | None) -> tuple[list[dict], bool]:
        """Up to `limit` items in `order` ("asc" or "desc") from the one after `after` (an
        item id), and whether more follow."""
        asc = order == "asc"
        with self._io():
            self._conv(owner, cid, "conversation_id")
            start = -1 if asc else 1 << 62
            if after is not None:
                row = self._db.q(f"SELECT seq FROM {ITEMS} WHERE id=? AND conversation=?",
                                 (after, cid)).fetchone()
                if row is None:
                    raise item_not_found(cid, after, "after")
                start = row[0]
            rows = self._db.q(f"SELECT body FROM {ITEMS} WHERE conversation=? AND seq "
                              f"{'>' if asc else '<'} ? ORDER BY seq {'ASC' if asc else 'DESC'} "
                              "LIMIT ?", (cid, start, limit + 1)).fetchall()
        return [json.loads(body) for (body,) in rows[:limit]], len(rows) > limit

    def item(self, owner: str | None, cid: str, item: str) -> dict:
        with self._io():
            self._conv(owner, cid, "conversation_id")
            row = self._db.q(f"SELECT body FROM {ITEMS} WHERE id=? AND conversation=?",
                             (item, cid)).fetchone()
        if row is None:
            raise item_not_found(cid, item, "item_id")
        return json.loads(row[0])

    def calls(self, owner: str | None, cid: str) -> set[str]:
        """The call ids of the conversation's function calls."""
        with self._io():
            self._conv(owner, cid, "conversation_id")
            rows = self._db.q(f"SELECT call_id FROM {ITEMS} WHERE conversation=? AND call_id "
                              "IS NOT NULL", (cid,)).fetchall()
        return {c for (c,) in rows}

    def append(self, owner: str | None, cid: str, items: list[dict], param: str,
               version: int | None = None, key: Attempt | None = None) -> Conversation:
        """Add items at the end. `version`: a response's turn, made on that version of the
        conversation: refused (409) if the conversation changed since, never for bytes."""
        n = sum(map(size, items))
        with self._io(tx=True, key=key, wrote={"conversation_id": cid}):
            conv = self._conv(owner, cid, param, lock=True)
            if version is None:
                self._check_room(self._usage(owner)[1], n, "items")
            elif conv.version != version:
                raise ConversationChanged(f"conversation {cid!r} changed while this response "
                                          "was made (items added or deleted): its turn is not "
                                          "added; send it again", param)
            at = self._db.q(f"SELECT next FROM {CONV} WHERE id=?", (cid,)).fetchone()[0]
            self._insert(cid, at, items)
            self._db.q(f"UPDATE {CONV} SET version=version+1, next=next+?, bytes=bytes+? "
                       "WHERE id=?", (len(items), n, cid))
        return Conversation(conv.id, conv.created, conv.metadata, conv.version + 1)

    def delete_item(self, owner: str | None, cid: str, item: str,
                    key: Attempt | None = None) -> Conversation:
        with self._io(tx=True, key=key, wrote={"conversation_id": cid}):
            conv = self._conv(owner, cid, "conversation_id", lock=True)
            row = self._db.q(f"SELECT body FROM {ITEMS} WHERE id=? AND conversation=?",
                             (item, cid)).fetchone()
            if row is None:
                raise item_not_found(cid, item, "item_id")
            self._db.q(f"DELETE FROM {ITEMS} WHERE id=?", (item,))
            self._db.q(f"UPDATE {CONV} SET version=version+1, bytes=bytes-? WHERE id=?",
                       (len(row[0]), cid))
        return Conversation(conv.id, conv.created, conv.metadata, conv.version + 1)

    def close(self) -> None:
        with self._io():
            self._db.close()

    # -- under the lock ----------------------------------------------------------------------
    @contextmanager
    def _io(self, tx: bool = False, key: Attempt | None = None, wrote: dict | None = None):
        """The lock, a transaction where `tx`; a driver's failure is a 503 (logged), its
        transaction rolled back. `key`, an Idempotency-Key's attempt that has not written
        yet: claimed at the transaction's end, where its records share this store."""
        claims = key is not None and not key.claimed and key.records.shares(self._db)
        with self._lock:
            try:
                if tx:
                    with self._db.tx():
                        yield
                        if claims:
                            key.records.claim(self._db, key, wrote or {})
                    if claims:
                        key.claimed = True
                else:
                    yield
            except PreposError:
                raise
            except Exception as exc:
                log.error("conversations: the %s store failed: %s", self._db.name, exc)
                raise self._db.unavailable() from None

    def _conv(self, owner: str | None, cid: str, param: str | None,
              lock: bool = False) -> Conversation:
        row = self._db.q(f"SELECT created, metadata, version FROM {CONV} WHERE id=? AND "
                         f"{SAME_OWNER}{self._for_update if lock else ''}",
                         (cid, owner)).fetchone()
        if row is None:
            raise not_found(cid, param)
        return Conversation(cid, int(row[0]), json.loads(row[1]), int(row[2]))

    def _usage(self, owner: str | None) -> tuple[int, int]:
        count, used = self._db.q(f"SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM {CONV} "
                                 f"WHERE {SAME_OWNER}", (owner,)).fetchone()
        return int(count), int(used)

    def _check_room(self, used: int, n: int, param: str) -> None:
        if used + n > self.max_bytes:
            raise ConversationsTooLarge(f"this key's conversations would take {used + n} "
                                        f"bytes, over the limit of {self.max_bytes} "
                                        "(--responses-bytes); delete items or conversations "
                                        "first", param)

    def _insert(self, cid: str, at: int, items: list[dict]) -> None:
        for i, item in enumerate(items):
            call = item["call_id"] if item["type"] == "function_call" else None
            self._db.q(f"INSERT INTO {ITEMS} VALUES (?, ?, ?, ?, ?)",
                       (item["id"], cid, at + i, call, json.dumps(item)))
