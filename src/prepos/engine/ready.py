"""A version's ready set: the ready records one pre-position (Algorithm 1) recorded for a
committed version, the answers pre-decoded after them, and where that pre-position stands."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from prepos.core import ReadyRecord


@dataclass(frozen=True)
class Predecoded:
    """A greedy answer decoded at idle after an exact entry's ready record (the record's argmax
    first), as far as it got: each token with its logprob and the likeliest tokens there, so
    a request is answered from it as it would have been decoded. `finish` is None while it
    is being decoded, else why it ended: "end" (the end of turn, its last token), "stop" (a
    stop sequence of its budget), "length" (its budget), "room" (no cells for more). A
    request that needs more decodes the rest live."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    tops: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]  # (ids, logprobs) per token
    finish: str | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None


class ReadySet:
    """The ready records of one committed version (one pre-position, Algorithm 1) and where
    its pre-position stands. It is its own one writer: every change is a method below, under
    its lock; the others only read. The session invalidates it in the critical section that
    commits the next version (`Session._commit`), so a record is stored only while valid."""

    def __init__(self, version: int):
        self.version = version
        self.records: dict[tuple, ReadyRecord] = {}  # written by `record` and `strip` alone
        self.answers: dict[tuple, Predecoded] = {}  # written by `predecoded` alone
        self.served: dict[tuple, int] = {}  # per answer, the most of its tokens one request used
        self.taken: set[tuple] = set()  # answers a request decodes on from: pre-decode stops
        self._settled = False  # its unserved pre-decoded tokens were counted
        self.valid = True
        self.consumed = False  # a request used it (a record, or its pre-paid KV)
        self.wasted = False  # invalidated before any request used it
        self.scheduled = False  # a background job was queued for it
        self.started = False  # the background job began its first forward
        self.done = False  # the background job finished (recorded, skipped or discarded)
        self.prepared = False  # the job brought every entry into the KV (and recorded it)
        self._lock = threading.Lock()

    def record(self, key: tuple, rec: ReadyRecord) -> bool:
        """Store a ready record, only while the set is valid (its version current)."""
        with self._lock:
            if self.valid:
                self.records[key] = rec
            return self.valid

    def strip(self, key: tuple) -> bool:
        """The record at `key` keeps its top tokens only (`prepos.engine.logits`); True if it
        had its full vector."""
        with self._lock:
            rec = self.records.get(key)
            if rec is None or rec.logits is None:
                return False
            self.records[key] = replace(rec, logits=None)
            return True

    def predecoded(self, key: tuple, answer: Predecoded) -> bool:
        """Store (or extend) the pre-decoded answer of a recorded entry, only while the set
        is valid and no request has taken over decoding it; False: stop pre-decoding it."""
        with self._lock:
            ok = self.valid and key in self.records and key not in self.taken
            if ok:
                self.answers[key] = answer
            return ok

    def answer(self, key: tuple) -> Predecoded | None:
        """The pre-decoded answer at `key` so far, while the set is valid."""
        with self._lock:
            return self.answers.get(key) if self.valid else None

    def serve(self, key: tuple, n: int, live: bool) -> None:
        """A request used `n` tokens of the answer at `key`; with `live` it decodes on from
        there, so the pre-decode of that answer stops."""
        with self._lock:
            self.served[key] = max(self.served.get(key, 0), n)
            if live:
                self.taken.add(key)

    def unserved(self) -> int:
        """Pre-decoded tokens no request used: the set's waste, counted once, when a mutation
        invalidated it."""
        with self._lock:
            if self._settled:
                return 0
            self._settled = True
            return sum(max(0, len(a.tokens) - self.served.get(k, 0))
                       for k, a in self.answers.items())

    def invalidate(self) -> None:
        with self._lock:
            self.valid = False

    def mark(self, scheduled: bool = False, started: bool = False, done: bool = False,
             prepared: bool = False) -> None:
        """Its pre-position job was queued / began / finished / prepared its entries."""
        with self._lock:
            self.scheduled |= scheduled
            self.started |= started
            self.done |= done
            self.prepared |= prepared

    def consume(self) -> bool:
        """A request used it; True the first time (a hit to count), unless already wasted."""
        with self._lock:
            hit = not self.consumed and not self.wasted
            self.consumed |= hit
            return hit

    def waste(self) -> str | None:
        """A mutation cleared it before any request used it: "invalidated" if its job had
        started, "superseded" if it was only queued, None if it was used or already counted
        (or had no job)."""
        with self._lock:
            if self.consumed or self.wasted:
                return None
            self.wasted = True
            return "invalidated" if self.started else "superseded" if self.scheduled else None
