"""A version's ready set: the ready records one pre-position (Algorithm 1) recorded for a
committed version, and where that pre-position stands."""

from __future__ import annotations

import threading

from prepos.core import ReadyRecord


class ReadySet:
    """The ready records of one committed version (one pre-position, Algorithm 1) and where
    its pre-position stands. It is its own one writer: every change is a method below, under
    its lock; the others only read. The session invalidates it in the critical section that
    commits the next version (`Session._commit`), so a record is stored only while valid."""

    def __init__(self, version: int):
        self.version = version
        self.records: dict[tuple, ReadyRecord] = {}  # written by `record` alone
        self.valid = True
        self.consumed = False  # a request used it (a record, or its pre-paid KV)
        self.wasted = False  # invalidated before any request used it
        self.scheduled = False  # a background job was queued for it
        self.started = False  # the background job began its first forward
        self.done = False  # the background job finished (recorded, skipped or discarded)
        self._lock = threading.Lock()

    def record(self, key: tuple, rec: ReadyRecord) -> bool:
        """Store a ready record, only while the set is valid (its version current)."""
        with self._lock:
            if self.valid:
                self.records[key] = rec
            return self.valid

    def invalidate(self) -> None:
        with self._lock:
            self.valid = False

    def mark(self, scheduled: bool = False, started: bool = False, done: bool = False) -> None:
        """Its pre-position job was queued / began / finished."""
        with self._lock:
            self.scheduled |= scheduled
            self.started |= started
            self.done |= done

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
