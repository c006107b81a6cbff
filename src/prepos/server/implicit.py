"""Implicit sessions: a stateless client's conversation kept as a session, so its next turn
pays only its new messages.

A stock OpenAI client (the SDK, LangChain, an agent framework) sends the whole conversation
with every request and never names a session. After a stateless chat answer, the ephemeral
session that answered it is kept here instead of closed: the conversation it committed
(the client's messages and the answer) with its KV and its pre-position (the next user or
tool-result envelope). The next request whose conversation extends one of them, for the same
API key, system message and tools, continues that session as if it had named it: only the
delta is committed and prefilled, the rest is found in the KV.

The sessions are ephemeral (never journalled, listed or reachable by id) and implicit to the
engine (`SessionSpec.implicit`: their KV counts for no budget and a foreground request may
reclaim it whole; a reclaimed one is re-prefilled if it is continued). At most `capacity` are
kept, least recently used first to go. A kept session serves one request at a time (a lease);
a request that finds every match busy starts a new one. Never across API keys: a session is
found only for the key that made it, so no key's answer time depends on another key's text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

from prepos.chat.conversation import ConversationError, resume
from prepos.engine import Engine
from prepos.errors import PreposError


class ImplicitSessions:
    def __init__(self, capacity: int, close: Callable[[str], None],
                 count: Callable[[str], None] = lambda outcome: None):
        self.capacity = capacity
        self._close = close  # closes an ephemeral session (the server's, which counts them)
        self._count = count  # "continued", "started", "evicted"
        self._kept: OrderedDict[str, str | None] = OrderedDict()  # sid -> owner, LRU first
        self._leased: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def find(self, eng: Engine, owner: str | None, tools: Sequence[dict],
             msgs: list[dict]) -> str | None:
        """The kept session of this key, system message and tools whose conversation `msgs`
        extends by the most messages, leased to the caller (release it when its answer is
        done); None if there is none free."""
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        best, held = None, -1
        with self._lock:
            candidates = [sid for sid, o in reversed(self._kept.items())
                          if o == owner and sid not in self._leased]
        for sid in candidates:
            try:
                s = eng.session(sid)
                snap = eng.snapshot(sid)
            except PreposError:  # closed meanwhile
                continue
            if s.spec.system != system or s.spec.tools != tuple(tools):
                continue
            try:
                n = len(resume(sid, snap.version, snap.messages, msgs).held)
            except ConversationError:
                continue
            if n > held:
                best, held = sid, n
        with self._lock:
            if best is None or best not in self._kept or best in self._leased:
                return None
            self._leased.add(best)
            self._kept.move_to_end(best)
        self._count("continued")
        return best

    def keep(self, sid: str, owner: str | None) -> None:
        """Keep a new implicit session, leased to the request that made it; the least
        recently used free ones beyond the capacity are closed."""
        with self._lock:
            self._kept[sid] = owner
            self._leased.add(sid)
        self._count("started")
        self._trim(self.capacity)

    def release(self, sid: str) -> None:
        with self._lock:
            self._leased.discard(sid)

    def evict_one(self, owner: str | None | object = ...) -> bool:
        """Close the least recently used free session (to make room), of `owner` where one
        is given; False if none is."""
        if owner is ...:
            return self._trim(len(self._kept) - 1)
        with self._lock:
            sid = next((s for s, o in self._kept.items()
                        if o == owner and s not in self._leased), None)
            if sid is not None:
                del self._kept[sid]
        if sid is None:
            return False
        self._close(sid)
        self._count("evicted")
        return True

    def _trim(self, bound: int) -> bool:
        gone = []
        with self._lock:
            for sid in list(self._kept):
                if len(self._kept) <= max(bound, 0):
                    break
                if sid not in self._leased:
                    del self._kept[sid]
                    gone.append(sid)
        for sid in gone:
            self._close(sid)
            self._count("evicted")
        return bool(gone)

    def forget(self, sid: str) -> None:
        """A kept session was closed elsewhere (its answer failed)."""
        with self._lock:
            self._kept.pop(sid, None)
            self._leased.discard(sid)
