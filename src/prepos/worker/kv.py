"""The KV caches: which tokens each one holds (`KVSequence`), every session's cache and the
engine-wide cell budget (`KVPool`), and what a task asks of the model worker (`Forward`).

Every path (cold, fall-through, pre-position, decode) is "bring this KV to hold this token
sequence": crop to the longest common prefix (the restore) and extend by the rest (the delta).
A task yields a `Forward`; the scheduler runs the forwards of several tasks as one batched
back-end call (`run_forwards`) and sends each task its `Advance`.

Owned by the model worker: only tasks touch a KV, and a session's tasks never run at once.
`KVPool.used` is a running count, readable from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from prepos.backends.base import Backend, Dist, Logits
from prepos.errors import OverBudget, TooManySessions
from prepos.worker.prefix import BLOCK, PrefixIndex, chain
from prepos.worker.tiers import Tiers


@dataclass
class Advance:
    """What one forward did: the restore and the delta it paid."""

    logits: Logits | None  # at the end of the target, once reached (see Forward.logits_from)
    kept: int  # tokens of the target found resident (the longest common prefix)
    prefilled: int  # tokens run through the model by this call
    restore_s: float
    forward_s: float

    @property
    def done(self) -> bool:
        return self.logits is not None


@dataclass
class Forward:
    """A task's request to the model worker: bring `kv` toward holding `target`, extending by
    at most `max_tokens` tokens (all of them when None). The task receives the `Advance`, or
    has the forward's exception (`Preempted` included) thrown in at its yield.

    `logits_from` (back ends with `verifies_drafts`, one whole forward: no `max_tokens`): the
    Advance's logits are a [len(target) - logits_from, vocab] tensor, the logits at every
    position from that index on, positions already resident re-run (verifying drafts)."""

    kv: KVSequence
    target: Sequence[int]
    max_tokens: int | None = None
    preemptible: bool = True  # idle work only: may stop between layers for a waiting request
    logits_from: int | None = None

    def plan(self) -> tuple[int, int, int]:
        """(kept, start, stop): the target's prefix resident now, where the delta starts (a
        target already fully resident re-runs its last token; with `logits_from`, every
        position from there) and where it stops; the forward runs `stop - start` tokens,
        its share of a batch."""
        if not self.target:
            raise ValueError("cannot advance to an empty sequence")
        kept = self.kv.common_prefix(self.target)
        start = min(kept, len(self.target) - 1)
        if self.logits_from is not None:
            if self.max_tokens is not None or not 0 <= self.logits_from < len(self.target):
                raise ValueError("logits_from needs one whole forward and a position in it")
            start = min(start, self.logits_from)
        n = len(self.target)
        return kept, start, n if self.max_tokens is None else min(n, start + self.max_tokens)


class KVSequence:
    """A KV cache and the exact token sequence it holds, indexed by its blocks (`index`,
    within its `scope`) so other KVs can start from its prefix."""

    def __init__(self, backend: Backend, key: str | None = None,
                 on_size: Callable[[int], None] | None = None, scope: str | None = None,
                 index: PrefixIndex | None = None,
                 residency: Callable[[KVSequence, bool], None] | None = None):
        self.backend = backend
        self.key = key
        # the back end's handle: on a back end that holds tiers, taken when first needed and
        # None while the KV is not resident (its state in a lower tier, `KVPool`)
        self.handle = None if backend.holds_tiers else backend.new_kv(key)
        self.tokens: list[int] = []  # what the KV holds, resident or not
        self.scope = scope
        self.index = index if backend.shares_prefixes else None
        self.hashes: list[int] = []  # the chain hash of each full block, while resident
        self._on_size = on_size or (lambda delta: None)
        self._residency = residency  # the pool's: brings a KV back into the back end

    def ensure(self, moves: bool = True) -> None:
        """Make the KV resident, on the worker, before any back-end call on it; `moves`:
        other sessions' KV may move down a tier for it (foreground work only)."""
        if self.handle is None:
            if self._residency is not None:
                self._residency(self, moves)
            else:
                self.handle = self.backend.new_kv(self.key)

    def __len__(self) -> int:
        return len(self.tokens)

    def common_prefix(self, target: Sequence[int]) -> int:
        n = min(len(self.tokens), len(target))
        toks = self.tokens
        i = 0
        # Compare in blocks first: sessions share long prefixes and Python loops are slow.
        while i + 64 <= n and toks[i : i + 64] == list(target[i : i + 64]):
            i += 64
        while i < n and toks[i] == target[i]:
            i += 1
        return i

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens (not resident: the state is cropped when loaded)."""
        if length < len(self.tokens):
            if self.handle is not None:
                self.backend.crop(self.handle, length)
                self._on_size(length - len(self.tokens))
            del self.tokens[length:]
            self._unindex(length // BLOCK)

    def reuse(self, target: Sequence[int]) -> int:
        """Start from the longest prefix of `target` another KV of this scope holds, where
        it is longer than this one's own (the back end shares or copies it); returns the
        tokens gained. Tasks call it before a prefill."""
        if self.index is None or len(target) - len(self.tokens) < BLOCK:
            return 0
        donor, n = self.index.longest(self, target)
        if donor is None:
            return 0
        gained = n - self.common_prefix(target)
        self.backend.copy_prefix(donor.handle, self.handle, n)
        self._on_size(n - len(self.tokens))
        self.tokens = donor.tokens[:n]
        self._unindex(0)
        self.hashes = donor.hashes[:n // BLOCK]
        self.index.add(self, self.hashes)
        self.index.hits += 1
        self.index.tokens += gained
        return gained

    def advance(self, target: Sequence[int], max_tokens: int | None = None) -> Advance:
        """Run one forward alone (see `run_forwards`)."""
        return run_forwards(self.backend, [Forward(self, target, max_tokens)])[0]

    def _grow(self, chunk: Sequence[int]) -> None:
        self.tokens.extend(chunk)
        self._on_size(len(chunk))
        if self.index is not None and len(self.tokens) >= (len(self.hashes) + 1) * BLOCK:
            new = chain(self.scope, self.tokens, len(self.hashes), self.hashes,
                        len(self.tokens) // BLOCK)
            self.hashes += new
            self.index.add(self, new)

    def _reindex(self) -> None:
        """Index every full block (the KV is resident again)."""
        if self.index is not None:
            self.hashes = chain(self.scope, self.tokens, 0, [], len(self.tokens) // BLOCK)
            self.index.add(self, self.hashes)

    def _unindex(self, blocks: int) -> None:
        """Forget the blocks from `blocks` on (they are no longer held whole)."""
        if self.index is not None and len(self.hashes) > blocks:
            self.index.remove(self, self.hashes[blocks:])
            del self.hashes[blocks:]

    def stream(self, target: Sequence[int], sampling, max_tokens: int,
               stop_ids: frozenset[int]) -> Iterator[tuple[int, Dist | None]]:
        """A back end that streams answers: generate up to `max_tokens` after `target` in one
        request, token by token; the mirror follows what the engine's cache holds (the target
        and every generated token but the last). Closing the iterator aborts the request."""
        self.ensure()
        self.crop(self.common_prefix(target))
        events = self.backend.stream_answer(self.handle, target, sampling, max_tokens, stop_ids)
        self._grow(target[len(self.tokens):])
        last = None
        try:
            for token, dist in events:
                if last is not None:
                    self._grow([last])
                last = token
                yield token, dist
        finally:
            events.close()

    def release(self) -> None:
        if self.handle is not None:
            self.backend.release(self.handle)
            self._on_size(-len(self.tokens))
            self.handle = None
        self.tokens = []
        self._unindex(0)


def run_forwards(backend: Backend, forwards: Sequence[Forward],
                 plans: Sequence[tuple[int, int, int]] | None = None,
                 moves: bool = True) -> list[Advance]:
    """Run several tasks' forwards (distinct KVs) as one batched back-end call: restore each
    to its common prefix, then extend each by its delta. A target already fully resident
    re-runs its last token, since a cache holds keys and values, not the output
    distribution. On an exception (Preempted included) each KV's `tokens` still say what its
    cache holds (the restored prefix). `plans`: the forwards' `plan()`s, where the caller
    has them already (the scheduler, which sized the batch with them). Each KV is made
    resident first (`moves`: others' KV may move down a tier for it; never for idle work)
    and starts from the longest prefix another KV of its scope holds."""
    t0 = time.perf_counter()
    away = [f.kv.handle is None for f in forwards]
    for f in forwards:
        f.kv.ensure(moves)
    if any([f.kv.reuse(f.target) for f in forwards]) or any(away) or plans is None:
        plans = [f.plan() for f in forwards]
    steps, done = [], []
    for f, (kept, start, stop) in zip(forwards, plans):
        f.kv.crop(start)
        chunk = list(f.target[start:stop])
        steps.append((f.kv.handle, f.kv.tokens, chunk))
        done.append((kept, chunk, stop == len(f.target), start))
    t1 = time.perf_counter()
    every = [f.logits_from is not None for f in forwards]
    outs = backend.extend_batch(steps, every if any(every) else None)
    t2 = time.perf_counter()
    result = []
    for f, (kept, chunk, reached, start), out in zip(forwards, done, outs):
        f.kv._grow(chunk)
        if f.logits_from is not None:  # the rows from logits_from on
            out = out[f.logits_from - start:]
        result.append(Advance(out if reached else None, kept, len(chunk), t1 - t0, t2 - t1))
    return result


class KVPool:
    """Every session's KV cache, the engine-wide budget of resident cells, and the tiers
    below it (`Tiers`: host RAM, disk; then recompute from the session's tokens) where the
    back end holds tiers. A KV that is needed comes back resident (`KVSequence.ensure`, in
    `run_forwards`): its state loaded from its tier, the least recently used idle resident
    KVs moved down to make room and a free handle. Nothing a task is using is moved
    (`reserve`/`release`: the scheduler's, which marks the sessions whose tasks run)."""

    def __init__(self, backend: Backend, engine_cells: int, tiers: Tiers | None = None,
                 reserve: Callable[[str], bool] = lambda key: True,
                 release: Callable[[str], None] = lambda key: None):
        self.backend = backend
        self.engine_cells = engine_cells
        self.tiers = tiers if backend.holds_tiers else None
        self.index = PrefixIndex()
        self._kv: dict[str, KVSequence] = {}
        self._scopes: dict[str, str | None] = {}  # a session's owner: its KVs' scope
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._reserve, self._release = reserve, release
        self._used = 0
        self._lock = threading.Lock()
        self.counts = {"restores": 0, "restore_s": 0.0, "recomputed_tokens": 0, "spills": 0}

    def claim(self, sid: str, scope: str | None) -> None:
        """The scope of `sid`'s KV (its owner): prefixes are shared within a scope only."""
        self._scopes[sid] = scope

    def _resize(self, delta: int) -> None:
        with self._lock:
            self._used += delta

    def get(self, sid: str) -> KVSequence:
        kv = self._kv.get(sid)
        if kv is None:
            kv = self._kv[sid] = KVSequence(self.backend, sid, self._resize,
                                            self._scopes.get(sid), self.index,
                                            self._bring_back if self.tiers else None)
        if kv.handle is not None and sid in self._resident:
            self._resident.move_to_end(sid)
        return kv

    def find(self, sid: str) -> KVSequence | None:
        return self._kv.get(sid)

    def tier(self, sid: str) -> str:
        """Where a session's KV is: resident, ram, disk, or none (recomputed when needed)."""
        kv = self._kv.get(sid)
        if kv is not None and kv.handle is not None:
            return "resident"
        return (self.tiers.where(sid) if self.tiers else None) or "none"

    def drop(self, sid: str) -> None:
        self._scopes.pop(sid, None)
        self._resident.pop(sid, None)
        if self.tiers is not None:
            self.tiers.discard(sid)
        kv = self._kv.pop(sid, None)
        if kv is not None:
            kv.release()

    @property
    def used(self) -> int:
        """Resident cells across all sessions (a running count: any thread may read it)."""
        return self._used

    def extra_cells(self, sid: str, target: Sequence[int]) -> int:
        """Resident cells `target` needs beyond what the session's cache holds there."""
        kv = self._kv.get(sid)
        if kv is None or kv.handle is None:
            return len(target)
        return max(0, len(target) - len(kv))

    def fits(self, sid: str, target: Sequence[int]) -> bool:
        """Whether `target` fits without moving anyone's KV (a KV not resident also needs
        a free handle)."""
        kv = self._kv.get(sid)
        if (kv is None or kv.handle is None) and self.backend.free_handles() == 0:
            return False
        return self.used + self.extra_cells(sid, target) <= self.engine_cells

    def make_room(self, sid: str, target: Sequence[int],
                  passes: Sequence[Callable[[str], int]]) -> None:
        """For a foreground request: crop other sessions' caches to the length each pass
        keeps of them (`passes`: first their committed length, dropping the speculative cells,
        pre-positioned entries and past answers; then less where the owner allows), then move
        idle sessions' KVs down a tier, until `target` fits. Without tiers what the last pass
        keeps is never evicted; if that is not enough the request is refused."""
        if self.fits(sid, target):
            return
        for keep in passes:
            for other, kv in list(self._kv.items()):
                if other != sid and self._reserve(other):  # never a cache a task is using
                    try:
                        kv.crop(min(len(kv), keep(other)))
                    finally:
                        self._release(other)
                if self.fits(sid, target):
                    return
        while self.used + self.extra_cells(sid, target) > self.engine_cells:
            if not self._spill_one(sid):
                raise OverBudget(f"the engine's KV budget of {self.engine_cells} cells is "
                                 f"full ({self.used} in use by committed session state)")

    # -- tiers (on the worker) -----------------------------------------------------------
    def _bring_back(self, kv: KVSequence, moves: bool) -> None:
        """`kv` resident again: room made (idle KVs moved down, where `moves`), its state
        loaded from its tier, or recomputed from its tokens where no tier holds it."""
        sid = kv.key
        t0 = time.perf_counter()
        data = self.tiers.take(sid) if kv.tokens else None  # before others move down past it
        try:
            while self.used + len(kv.tokens) > self.engine_cells:
                if not moves or not self._spill_one(sid):
                    raise OverBudget(f"the engine's KV budget of {self.engine_cells} cells "
                                     f"cannot hold session {sid}'s {len(kv.tokens)} tokens")
            while self.backend.free_handles() == 0:  # every handle taken: free the LRU one
                if not moves or not self._spill_one(sid):
                    raise TooManySessions(f"the {self.backend.name} back end holds no more "
                                          f"sessions' KV at once")
        except BaseException:
            if data is not None:
                self.tiers.put(sid, data)
            raise
        handle = self.backend.load(data, sid) if data is not None else self.backend.new_kv(sid)
        if handle is None:  # the state would not load: recompute it
            handle, data = self.backend.new_kv(sid), None
        if data is None:
            self.counts["recomputed_tokens"] += len(kv.tokens)
            kv.tokens = []
        else:
            self.backend.crop(handle, len(kv.tokens))  # cropped while it was away
            self.counts["restores"] += 1
            self.counts["restore_s"] += time.perf_counter() - t0
        kv.handle = handle
        self._resize(len(kv.tokens))
        kv._reindex()
        self._resident[sid] = None

    def _spill_one(self, keep: str) -> bool:
        """Move the least recently used idle resident KV (not `keep`'s) down a tier."""
        if self.tiers is None:
            return False
        for other in list(self._resident):
            if other != keep and self._reserve(other):
                try:
                    self._spill(self._kv[other])
                finally:
                    self._release(other)
                return True
        return False

    def _spill(self, kv: KVSequence) -> None:
        data = self.backend.save(kv.handle) if kv.tokens else None
        self.backend.release(kv.handle)
        kv.handle = None
        self._resize(-len(kv.tokens))
        kv._unindex(0)
        self._resident.pop(kv.key, None)
        self.counts["spills"] += 1
        if data is not None:  # a state that no tier can keep is recomputed when needed
            self.tiers.put(kv.key, data)

    def metrics(self) -> dict:
        resident = {"cells": self.used, "sessions": len(self._resident),
                    "budget": self.engine_cells}
        tiers = self.tiers.sizes() if self.tiers else {}
        return {"resident": resident, **tiers, **self.counts}

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
