"""A KV cache and the exact token sequence it holds (`KVSequence`), what a task asks of the
model worker for it (`Forward`) and what it gets back (`Advance`).

Every path (cold, fall-through, pre-position, decode) is "bring this KV to hold this token
sequence": crop to the longest common prefix (the restore) and extend by the rest (the delta).
A task yields a `Forward`; the scheduler runs the forwards of several tasks as one batched
back-end call (`run_forwards`) and sends each task its `Advance`. Owned by the model
worker: only tasks touch a KV, and a session's tasks never run at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

from prepos.backends.base import Backend, Dist, Logits
from prepos.worker.prefix import BLOCK, PrefixIndex, chain


class Residency(Protocol):
    """What a KV whose state may sit in a lower tier asks of its pool (`KVPool`)."""

    def bring_back(self, kv: KVSequence, moves: bool, keep: set[str],
                   spare: Sequence[KVSequence], extra: int) -> None: ...

    def admit(self, forwards: Sequence[Forward],
              plans: Sequence[tuple[int, int, int]] | None,
              moves: bool) -> list[tuple[int, int, int] | BaseException | None]: ...


@dataclass
class Advance:
    """What one forward did: the restore and the delta it paid."""

    logits: Logits | None  # at the end of the target, once reached (see Forward.logits_from)
    kept: int  # tokens of the target found resident (the longest common prefix)
    prefilled: int  # tokens run through the model by this call
    restore_s: float
    forward_s: float
    # a `Forward.greedy` forward's greedy choice at the end of the target, where the back end
    # gave it in place of the logits (which are then None)
    choice: int | None = None

    @property
    def done(self) -> bool:
        return self.logits is not None or self.choice is not None


@dataclass
class Forward:
    """A task's request to the model worker: bring `kv` toward holding `target`, extending by
    at most `max_tokens` tokens (all of them when None). The task receives the `Advance`, or
    has the forward's exception (`Preempted` included) thrown in at its yield.

    `logits_from` (back ends with `verifies_drafts`, one whole forward: no `max_tokens`): the
    Advance's logits are a [len(target) - logits_from, vocab] tensor, the logits at every
    position from that index on, positions already resident re-run (verifying drafts).

    `greedy`: the task wants only the greedy choice at the end (no logprobs, nothing shaping
    the logits); a back end that can take it without copying the logits out gives it as the
    Advance's `choice` instead (`Backend.extend_batch`)."""

    kv: KVSequence
    target: Sequence[int]
    max_tokens: int | None = None
    preemptible: bool = True  # idle work only: may stop between layers for a waiting request
    logits_from: int | None = None
    greedy: bool = False

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
                 index: PrefixIndex | None = None, pool: Residency | None = None):
        self.backend = backend
        self.key = key
        # the back end's handle: on a back end that holds tiers, taken when first needed and
        # None while the KV is not resident (its state in a lower tier, `KVPool`)
        self.handle = None if backend.holds_tiers else backend.new_kv(key)
        self.tokens: list[int] = []  # what the KV holds, resident or not
        self.scope = scope
        self.index = index if backend.shares_prefixes else None
        self.hashes: list[int] = []  # the chain hash of each full block, while resident
        # the prefix of `tokens` a tier's copy of this KV holds as they are (its pool's: the
        # copy is clean up to here, so moving the KV down to it saves nothing)
        self.clean = 0
        self._on_size = on_size or (lambda delta: None)
        self.pool = pool  # where its state goes while not resident (None: it stays)

    def ensure(self, moves: bool = True) -> None:
        """Make the KV resident, on the worker, before any back-end call on it; `moves`:
        other sessions' KV may move down a tier for it (foreground work only)."""
        if self.handle is None:
            if self.pool is not None:
                self.pool.bring_back(self, moves, {self.key}, [], 0)
            else:
                self.handle = self.backend.new_kv(self.key)

    def __len__(self) -> int:
        return len(self.tokens)

    def common_prefix(self, target: Sequence[int]) -> int:
        n = min(len(self.tokens), len(target))
        toks = self.tokens
        if toks[:n] == list(target[:n]):  # the usual case (a step, a delta): one C compare
            return n
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
            self.clean = min(self.clean, length)
            self._unindex(length // BLOCK)

    def reuse(self, target: Sequence[int],
              load: Callable[[KVSequence], object] | None = None) -> int:
        """Start from the longest prefix of `target` another KV of this scope holds, where
        it is longer than this one's own: a resident one's shared or copied by the back end,
        one in a lower tier's loaded (`load`: a new handle holding the donor's saved state,
        or None where it cannot be had); returns the tokens gained. Tasks call it before a
        prefill."""
        if self.index is None or len(target) - len(self.tokens) < BLOCK:
            return 0
        donor, n = self.index.longest(self, target)
        if donor is None:
            return 0
        gained = n - self.common_prefix(target)
        if donor.handle is not None:
            self.backend.copy_prefix(donor.handle, self.handle, n)
        else:
            handle = load(donor) if load is not None else None
            if handle is None:
                return 0
            if self.handle is not None:  # else given up for the donor's (`KVPool._load`)
                self.backend.release(self.handle)
            self.handle = handle
            self.backend.crop(handle, n)
        self._on_size(n - len(self.tokens))
        self.tokens = donor.tokens[:n]
        self.clean = 0  # other cells now: no tier's copy holds them
        self._unindex(0)
        self.hashes = donor.hashes[:n // BLOCK]
        self.index.add(self, self.hashes)
        self.index.hits += 1
        self.index.tokens += gained
        return gained

    def advance(self, target: Sequence[int], max_tokens: int | None = None) -> Advance:
        """Run one forward alone (see `run_forwards`)."""
        out = run_forwards(self.backend, [Forward(self, target, max_tokens)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def _grow(self, chunk: Sequence[int]) -> None:
        self.tokens.extend(chunk)
        self._on_size(len(chunk))
        if self.index is not None and len(self.tokens) >= (len(self.hashes) + 1) * BLOCK:
            new = chain(self.scope, self.tokens, len(self.hashes), self.hashes,
                        len(self.tokens) // BLOCK)
            self.hashes += new
            self.index.add(self, new)

    def _unindex(self, blocks: int) -> None:
        """Forget the blocks from `blocks` on (they are no longer held whole)."""
        if self.index is not None and len(self.hashes) > blocks:
            self.index.remove(self, self.hashes[blocks:])
            del self.hashes[blocks:]

    def stream(self, target: Sequence[int], sampling, max_tokens: int,
               stop_ids: frozenset[int], dists: bool = True
               ) -> Iterator[tuple[int, Dist | None]]:
        """A back end that streams answers: generate up to `max_tokens` after `target` in one
        request, token by token (with each one's distribution unless `dists` is False); the
        mirror follows what the engine's cache holds (the target and every generated token
        but the last). Closing the iterator aborts the request."""
        self.ensure()
        self.crop(self.common_prefix(target))
        events = self.backend.stream_answer(self.handle, target, sampling, max_tokens, stop_ids,
                                            dists)
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
        self.clean = 0
        self._unindex(0)


def run_forwards(backend: Backend, forwards: Sequence[Forward],
                 plans: Sequence[tuple[int, int, int]] | None = None,
                 moves: bool = True) -> list[Advance | BaseException | None]:
    """Run several tasks' forwards (distinct KVs) as one batched back-end call: restore each
    to its common prefix, then extend each by its delta. A target already fully resident
    re-runs its last token, since a cache holds keys and values, not the output
    distribution. On an exception (Preempted included) each KV's `tokens` still say what its
    cache holds (the restored prefix). `plans`: the forwards' `plan()`s, where the caller
    has them already (the scheduler, which sized the batch with them).

    First the batch is admitted (`KVPool.admit`, where the KVs are a pool's): each KV made
    resident, started from the longest prefix another KV of its scope holds, and room made
    for the cells the whole batch adds (`moves`: others' KV may move down a tier for it;
    never for idle work). Each forward's result is its Advance; None for a forward that did
    not run for want of room (run it again later: the scheduler runs it first next quantum);
    an error for the one forward that could not run even alone (the rest then wait)."""
    t0 = time.perf_counter()
    pool = next((f.kv.pool for f in forwards if f.kv.pool is not None), None)
    if pool is not None:
        admitted = pool.admit(forwards, plans, moves)
    else:
        for f in forwards:
            f.kv.ensure(moves)
        if any([f.kv.reuse(f.target) for f in forwards]) or plans is None:
            plans = [f.plan() for f in forwards]
        admitted = list(plans)
    run = [(i, f, p) for i, (f, p) in enumerate(zip(forwards, admitted)) if isinstance(p, tuple)]
    steps, done = [], []
    for _, f, (kept, start, stop) in run:
        f.kv.crop(start)
        chunk = list(f.target[start:stop])
        steps.append((f.kv.handle, f.kv.tokens, chunk))
        done.append((kept, chunk, stop == len(f.target), start))
    t1 = time.perf_counter()
    every = [f.logits_from is not None for _, f, _ in run]
    greedy = [f.greedy for _, f, _ in run]
    outs = backend.extend_batch(steps, every if any(every) else None,
                                greedy if any(greedy) else None) if steps else []
    t2 = time.perf_counter()
    result: list[Advance | BaseException | None] = [
        p if isinstance(p, BaseException) else None for p in admitted]
    for (i, f, _), (kept, chunk, reached, start), out in zip(run, done, outs):
        f.kv._grow(chunk)
        if isinstance(out, int):  # the greedy choice, in place of the logits
            result[i] = Advance(None, kept, len(chunk), t1 - t0, t2 - t1,
                                choice=out if reached else None)
            continue
        if f.logits_from is not None:  # the rows from logits_from on
            out = out[f.logits_from - start:]
        result[i] = Advance(out if reached else None, kept, len(chunk), t1 - t0, t2 - t1)
    return result
