"""Implicit sessions: a stateless client's conversation kept as a session, so its next turn
pays only its new messages.

A stock OpenAI client (the SDK, LangChain, an agent framework) sends the whole conversation
with every request and never names a session. After a stateless chat answer, the ephemeral
session that answered it is kept here instead of closed: the conversation it committed
(the client's messages and the answer) with its KV and its pre-position (the next user or
tool-result envelope). The next request whose conversation extends one of them, for the same
API key and tools, continues that session as if it had named it: only the delta is
committed and prefilled, the rest is found in the KV.

Found by hash, not by a scan: each kept conversation is indexed under the chain hash of (API
key, tools, its messages in the session's form, `conversation.message_key`); a request
hashes the prefixes of its own messages and takes the longest one indexed, so finding a
conversation costs the same with ten kept as with ten thousand. `resume` then checks the
match message by message, as on a named session.

Kept by memory, not by a count: a kept session's KV is a cache like any other session's, so
under pressure it moves down the KV tiers (RAM, then disk) and comes back when continued; one
whose KV no tier holds any more saves nothing and is closed. What bounds the rest is the bytes
of their bookkeeping (tokens, rendered text, messages: `footprint`, an estimate) against
`memory`, and, where one is given, a count; least recently used goes first.

The sessions are ephemeral (never journalled, listed or reachable by id) and implicit to the
engine (`SessionSpec.implicit`: their KV counts for no budget and a foreground request may
move it down or reclaim it). A kept session serves one request at a time (held by it); a
request that finds its match busy starts a new one. Never across API keys: the key seeds the
hash, so a conversation is found only for the key that made it and no key's answer time
depends on another key's text.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from prepos.chat.conversation import ConversationError, message_key, resume
from prepos.engine.session import Snapshot
from prepos.engine.session_spec import SessionSpec
from prepos.engine.view import EngineView as Engine  # the `Engine` that keeps them
from prepos.errors import PreposError, TooManySessions

EPHEMERAL = "eph-"  # the id prefix of sessions made for one request or kept for a client


def is_ephemeral(sid: str) -> bool:
    """A session made for one stateless request, or kept as an implicit one: never
    journalled, listed or pushed to."""
    return sid.startswith(EPHEMERAL)


def conversation_keys(owner: str | None, tools: Sequence[dict],
                      msgs: Sequence[dict]) -> list[bytes]:
    """The chain hash of each prefix of `msgs` (key i covers msgs[:i + 1]), seeded by the
    API key and the tools."""
    h = hashlib.blake2b(json.dumps([owner, list(tools)], sort_keys=True).encode(),
                        digest_size=16).digest()
    keys = []
    for m in msgs:
        h = hashlib.blake2b(h + message_key(m), digest_size=16).digest()
        keys.append(h)
    return keys


def footprint(snap: Snapshot) -> int:
    """Bytes a kept session's bookkeeping holds, estimated: its token tuple (and each id
    Python does not share), rendered text and messages, and a fixed cost for the session's
    objects."""
    return (sys.getsizeof(snap.tokens) + 32 * sum(1 for t in snap.tokens if t > 256)
            + sys.getsizeof(snap.text) + sum(len(json.dumps(m)) for m in snap.messages)
            + 4096)


@dataclass
class KeptConversation:
    owner: str | None
    key: bytes | None = None  # the hash its conversation is indexed under (None: not yet)
    bytes: int = 0


class ImplicitSessions:
    def __init__(self, loaded: Callable[[], Engine | None], close: Callable[[str], None],
                 memory: int | None, sessions: int | None = None):
        self.memory = memory  # bookkeeping bytes of the kept sessions (None: no bound)
        self.sessions = sessions  # and how many (None: no bound)
        self._loaded = loaded
        self._close = close  # closes a kept session
        self.counts: Counter[str] = Counter()  # "continued", "started", "evicted"
        # least recently used first
        self._kept: OrderedDict[str, KeptConversation] = OrderedDict()
        self._index: dict[bytes, dict[str, None]] = {}  # conversation hash -> sids
        self._in_use: set[str] = set()
        self.used = 0  # bytes of the kept sessions' bookkeeping
        # told of every change of what a kept session is indexed under (sid, its hash, None
        # once it is gone): the cluster's directory (`server/store/directory.py`)
        self.publish: Callable[[str, bytes | None], None] | None = None
        self._lock = threading.Lock()

    @property
    def keeps(self) -> bool:
        """Whether conversations are kept at all."""
        return self.memory != 0 and self.sessions != 0

    def __len__(self) -> int:
        return len(self._kept)

    def holds(self, owner: str | None, tools: Sequence[dict], msgs: list[dict]) -> bool:
        """Whether a kept session, in use or not, holds a conversation `msgs` extends."""
        with self._lock:
            return any(k in self._index for k in conversation_keys(owner, tools, msgs))

    def find(self, eng: Engine, owner: str | None, tools: Sequence[dict],
             msgs: list[dict]) -> str | None:
        """The kept session of this key and tools whose conversation `msgs` extends by the
        most messages, held by the caller (release it when its answer is done); None if
        there is none free."""
        keys = conversation_keys(owner, tools, msgs)
        for n in range(len(keys), 0, -1):
            with self._lock:
                sids = [s for s in reversed(self._index.get(keys[n - 1], {}))
                        if s not in self._in_use]
                if not sids:
                    continue
                sid = sids[0]
                self._in_use.add(sid)
                self._kept.move_to_end(sid)
            if self._extends(eng, sid, msgs):
                self._count("continued")
                return sid
            self.release(sid)  # indexed under a stale hash: re-indexed from its snapshot
        return None

    @staticmethod
    def _extends(eng: Engine, sid: str, msgs: list[dict]) -> bool:
        try:
            snap = eng.snapshot(sid)
            resume(sid, snap.version, snap.messages, msgs)
        except (PreposError, ConversationError):  # closed meanwhile, or not a prefix
            return False
        return True

    def start(self, spec: SessionSpec) -> str:
        """A new kept session for a conversation (`spec`, implicit), held by the request
        that makes it; while the engine holds no more sessions, what it keeps on clients'
        behalf gives way (`Engine.evict_conversation`: the least recently used free kept
        conversation, else Responses chain)."""
        eng = self._loaded()
        sid = f"{EPHEMERAL}{eng.new_session_id()}"
        while True:
            try:
                eng.restore_session(sid, spec, prepare=False)  # its turn follows at once
                break
            except TooManySessions:
                if not eng.evict_conversation():
                    raise
        self.keep(sid, spec.owner)
        return sid

    def keep(self, sid: str, owner: str | None) -> None:
        """Keep a new session, held by the request that made it (indexed once released)."""
        with self._lock:
            self._kept[sid] = KeptConversation(owner)
            self._in_use.add(sid)
        self._count("started")
        self._trim()

    def release(self, sid: str) -> None:
        """The session's request is done: it is indexed under its conversation as committed
        now, and the kept sessions trimmed to their bounds."""
        eng = self._loaded()
        try:
            snap = eng.snapshot(sid) if eng is not None else None
            spec = eng.session(sid).spec if eng is not None else None
        except PreposError:  # closed meanwhile
            snap = spec = None
        with self._lock:
            self._in_use.discard(sid)
            kept = self._kept.get(sid)
            if kept is None:
                return
            self._unindex(sid, kept)
            if snap is not None and snap.messages:
                kept.key = conversation_keys(kept.owner, spec.tools, snap.messages)[-1]
                self._index.setdefault(kept.key, {})[sid] = None
                kept.bytes = footprint(snap)
                self.used += kept.bytes
            key = kept.key
        if self.publish is not None:
            self.publish(sid, key)
        self._trim()

    def evict_one(self, owner: str | None | object = ...) -> bool:
        """Close the least recently used free session (to make room), of `owner` where one
        is given; False if none is."""
        with self._lock:
            sid = next((s for s, k in self._kept.items()
                        if s not in self._in_use and (owner is ... or k.owner == owner)), None)
            if sid is not None:
                self._drop(sid)
        if sid is None:
            return False
        self._evicted([sid])
        return True

    def _trim(self) -> None:
        """Close the least recently used free session while its KV is gone from every tier
        (the tiers drop their oldest first) or the kept ones are over their bounds."""
        eng = self._loaded()
        gone: list[str] = []
        with self._lock:
            while (sid := next((s for s in self._kept if s not in self._in_use), None)) and (
                    self._over() or (eng is not None and not eng.kv_kept(sid))):
                self._drop(sid)
                gone.append(sid)
        self._evicted(gone)

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1

    def _over(self) -> bool:
        return ((self.memory is not None and self.used > self.memory)
                or (self.sessions is not None and len(self._kept) > self.sessions))

    def _evicted(self, sids: list[str]) -> None:
        for sid in sids:
            self._close(sid)
            self._count("evicted")
            if self.publish is not None:
                self.publish(sid, None)

    def _drop(self, sid: str) -> None:  # under the lock
        kept = self._kept.pop(sid)
        self._unindex(sid, kept)
        self._in_use.discard(sid)

    def _unindex(self, sid: str, kept: KeptConversation) -> None:  # under the lock
        if kept.key is not None:
            sids = self._index.get(kept.key, {})
            sids.pop(sid, None)
            if not sids:
                self._index.pop(kept.key, None)
            kept.key = None
        self.used -= kept.bytes
        kept.bytes = 0

    def forget(self, sid: str) -> None:
        """A kept session was closed elsewhere (its answer failed)."""
        with self._lock:
            if sid not in self._kept:
                return
            self._drop(sid)
        if self.publish is not None:
            self.publish(sid, None)
