"""The back-end protocol, and the one place that knows which tokens a KV cache holds.

A back end extends a KV cache by some tokens and returns the next-token distribution at the
last one, and crops a cache back to a prefix. That is all the engine needs: every path
(cold, fall-through, pre-position, decode) is "bring this KV to hold this token sequence",
done by `KVSequence.advance`, which crops to the longest common prefix (the restore) and
extends by the rest (the delta). An in-process back end keeps real tensors; a remote engine
keeps its prefix cache and the handle only mirrors the tokens it was sent.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass
class Dist:
    """Next-token distribution at one position.

    `logits` is the full vocabulary vector where the back end has it; `top_ids`/`top_logprobs`
    (descending, at least two) are always present, so a remote top-k back end fits.
    """

    logits: torch.Tensor | None
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int = 8) -> Dist:
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        vals, ids = torch.topk(logprobs, k=min(k, logits.shape[-1]))
        return cls(logits, tuple(ids.tolist()), tuple(vals.tolist()))

    @property
    def gap(self) -> float:
        """l1 - l2 (Eq. 11). The log-softmax shift cancels, so the logprob gap is the logit gap."""
        return self.top_logprobs[0] - self.top_logprobs[1]


_work = threading.local()


class Preempted(Exception):
    """An idle forward gave way to foreground work part way through; the KV holds exactly
    what it held before the call, and the caller redoes the chunk later."""


@contextlib.contextmanager
def idle_work(idle: bool = True, should_yield: Callable[[], bool] | None = None):
    """Mark the back-end calls made in this block, on this thread, as idle (background)
    work; the scheduler wraps idle steps in it. Remote back ends send such work at the
    engine's background priority and cap it per replica. In-process back ends stop such a
    forward between layers once `should_yield()` (foreground work is waiting) and raise
    Preempted, so a request waits for one layer, not one chunk."""
    old = getattr(_work, "idle", False), getattr(_work, "should_yield", None)
    _work.idle, _work.should_yield = idle, should_yield if idle else None
    try:
        yield
    finally:
        _work.idle, _work.should_yield = old


@contextlib.contextmanager
def unpreemptible():
    """Run this block's idle forwards to the end even if a request is waiting: the
    pre-position's guarantee of progress after it has given way (prepositioner.MAX_YIELDS)."""
    old = getattr(_work, "should_yield", None)
    _work.should_yield = None
    try:
        yield
    finally:
        _work.should_yield = old


def in_idle_work() -> bool:
    return getattr(_work, "idle", False)


def check_preempt(*_) -> None:
    """Raise Preempted if this thread runs idle work and foreground work is waiting (a
    forward pre-hook on each decoder layer)."""
    should_yield = getattr(_work, "should_yield", None)
    if should_yield is not None and should_yield():
        raise Preempted


class Backend(abc.ABC):
    """Executes forwards. Every method is called from the one model worker thread only."""

    name: str = "backend"
    vocab_size: int
    full_distribution: bool = True  # False where only top-k logprobs come back
    max_context: int

    @abc.abstractmethod
    def new_kv(self, key: str | None = None) -> Any:
        """A fresh, empty KV handle; `key` (the session id) pins it where that matters."""

    @abc.abstractmethod
    def extend(self, kv: Any, past: Sequence[int], tokens: Sequence[int]) -> torch.Tensor | Dist:
        """Run `tokens` after the `past` the handle holds; return the last position's logits
        (a 1-D tensor) or, for top-k back ends, a Dist."""

    @abc.abstractmethod
    def crop(self, kv: Any, length: int) -> None:
        """Drop every cached position at index >= length."""

    def release(self, kv: Any) -> None:
        """Free what the handle holds. Default: nothing to free."""


@dataclass
class Advance:
    """What one `KVSequence.advance` did: the restore and the delta it paid."""

    logits: torch.Tensor | Dist | None  # at the end of the target, once reached
    kept: int  # tokens of the target found resident (the longest common prefix)
    prefilled: int  # tokens run through the model by this call
    restore_s: float
    forward_s: float

    @property
    def done(self) -> bool:
        return self.logits is not None


class KVSequence:
    """A KV cache and the exact token sequence it holds. Owned by the model worker."""

    def __init__(self, backend: Backend, key: str | None = None):
        self.backend = backend
        self.handle = backend.new_kv(key)
        self.tokens: list[int] = []

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
        if length < len(self.tokens):
            self.backend.crop(self.handle, length)
            del self.tokens[length:]

    def advance(self, target: Sequence[int], max_tokens: int | None = None) -> Advance:
        """Bring the cache toward holding exactly `target`: restore to the common prefix, then
        extend by at most `max_tokens` tokens (all of them when None). Returns the logits at
        the end of `target` once it is reached. A target already fully resident re-runs its
        last token, since a cache holds keys and values, not the output distribution."""
        if not target:
            raise ValueError("cannot advance to an empty sequence")
        t0 = time.perf_counter()
        kept = self.common_prefix(target)
        start = min(kept, len(target) - 1)
        self.crop(start)
        t1 = time.perf_counter()
        stop = len(target) if max_tokens is None else min(len(target), start + max_tokens)
        chunk = list(target[start:stop])
        out = self.backend.extend(self.handle, self.tokens, chunk)
        self.tokens.extend(chunk)
        t2 = time.perf_counter()
        return Advance(out if stop == len(target) else None, kept, len(chunk), t1 - t0, t2 - t1)

    def release(self) -> None:
        self.backend.release(self.handle)
        self.tokens = []
