"""The back-end protocol.

A back end extends KV caches by some tokens and returns the next-token distribution at the
last one of each, and crops a cache back to a prefix. That is all the engine needs: every
path (cold, fall-through, pre-position, decode) is "bring this KV to hold this token
sequence" (`prepos.worker.kv`). An in-process back end keeps real caches and runs the steps of
several sessions as one batched forward (`extend_batch`); a remote engine keeps its prefix
cache, the handle only mirrors the tokens it was sent, and it streams a whole answer in one
request (`stream_answer`).
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

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


Logits = torch.Tensor | Dist  # a full vocabulary vector, or a top-k back end's Dist
Step = tuple[Any, Sequence[int], Sequence[int]]  # (KV handle, tokens it holds, tokens to run)

_work = threading.local()


class Preempted(Exception):
    """An idle forward gave way to foreground work part way through; the KV holds exactly
    what it held before the call, and the caller redoes the chunk later."""


class idle_work:  # noqa: N801 (used as a function: `with idle_work(...)`)
    """Mark the back-end calls made in this block, on this thread, as idle (background)
    work; the scheduler wraps idle steps in it. Remote back ends send such work at the
    engine's background priority and cap it per replica. In-process back ends stop such a
    forward between layers once `should_yield()` (foreground work is waiting) and raise
    Preempted, so a request waits for one layer, not one chunk. (A class, not a generator:
    the scheduler enters it twice a quantum, a quantum being as short as one token.)"""

    __slots__ = ("idle", "should_yield", "old")

    def __init__(self, idle: bool = True, should_yield: Callable[[], bool] | None = None):
        self.idle, self.should_yield = idle, should_yield if idle else None

    def __enter__(self) -> None:
        self.old = getattr(_work, "idle", False), getattr(_work, "should_yield", None)
        _work.idle, _work.should_yield = self.idle, self.should_yield

    def __exit__(self, *exc) -> None:
        _work.idle, _work.should_yield = self.old


def in_idle_work() -> bool:
    return getattr(_work, "idle", False)


def check_preempt(*_) -> None:
    """Raise Preempted if this thread runs idle work and foreground work is waiting (a
    forward pre-hook on each decoder layer)."""
    should_yield = getattr(_work, "should_yield", None)
    if should_yield is not None and should_yield():
        raise Preempted


class Backend(abc.ABC):
    """Executes forwards. Every method is called from model worker threads only, never on
    one KV from two threads at once."""

    name: str = "backend"
    vocab_size: int
    full_distribution: bool = True  # False where only top-k logprobs come back
    max_context: int
    kv_cells: int | None = None  # cells of a fixed-size KV cache, where the back end has one
    max_sessions: int | None = None  # sessions whose KV it holds at once, where that is bounded
    logit_tolerance: float = 1e-3  # how far logits may move with the batch they ran in
    # sequences one `extend_batch` runs as one forward; 1: no batching, so the scheduler's
    # workers run steps side by side instead (remote engines)
    max_batch: int = 1
    # True where an answer's tokens after the first come from one streamed request
    streams_answers: bool = False
    # True where `extend`/`extend_batch` return the logits at every new position on request
    # (`all_logits`), so a greedy answer can verify drafted tokens in one forward
    verifies_drafts: bool = False
    # True where `copy_prefix` works: one KV's prefix taken into another (a shared prefix)
    shares_prefixes: bool = False
    # True where `save`/`load` work: a KV's state moved out of the back end and back
    holds_tiers: bool = False
    # True where every forward reads every resident cell, other sessions' too (llama.cpp's
    # unified layout): idle KVs left resident slow everyone's forwards
    scans_resident: bool = False

    @abc.abstractmethod
    def new_kv(self, key: str | None = None) -> Any:
        """A fresh, empty KV handle; `key` (the session id) pins it where that matters."""

    @abc.abstractmethod
    def extend(self, kv: Any, past: Sequence[int], tokens: Sequence[int]) -> Logits:
        """Run `tokens` after the `past` the handle holds; return the last position's logits
        (a 1-D tensor) or, for top-k back ends, a Dist."""

    def extend_batch(self, steps: Sequence[Step], all_logits: Sequence[bool] | None = None,
                     greedy: Sequence[bool] | None = None) -> list[Logits | int]:
        """Several KVs' extensions (distinct KVs) as one forward where the back end can batch;
        the logits at the last token of each, or, for a step flagged in `all_logits` (back
        ends with `verifies_drafts` only), a [len(tokens), vocab] tensor of the logits at
        every token it ran. A step flagged in `greedy` wants only the greedy choice (the
        first index of the largest logit): a back end may give that token id, an int, in
        place of the logits, where it saves copying them out. Default: the logits, from one
        `extend` after another."""
        if all_logits is None or not any(all_logits):
            return [self.extend(kv, past, tokens) for kv, past, tokens in steps]
        return [self.extend(kv, past, tokens, all_logits=flag)  # type: ignore[call-arg]
                for (kv, past, tokens), flag in zip(steps, all_logits)]

    def stream_answer(self, kv: Any, prompt: Sequence[int], sampling: Any, max_tokens: int,
                      stop_ids: frozenset[int], dists: bool = True
                      ) -> Iterator[tuple[int, Dist | None]]:
        """Back ends with `streams_answers`: one request that continues `prompt` (the whole
        sequence; the engine's prefix cache pays only what it does not hold) by up to
        `max_tokens` tokens, sampled by the engine itself with `sampling` (temperature,
        top_k, top_p, seed), stopping after a token in `stop_ids`. Yields each token with
        its distribution (top-k where that is all the engine returns), or, where `dists` is
        False, with None where the engine can leave the distribution out (it costs the
        engine a top-k over the vocabulary a token). Closing the generator aborts the
        request at the engine."""
        raise NotImplementedError(f"the {self.name} back end does not stream answers")

    @abc.abstractmethod
    def crop(self, kv: Any, length: int) -> None:
        """Drop every cached position at index >= length."""

    def free_handles(self) -> int | None:
        """How many more KV handles `new_kv` can give now (None: no bound)."""
        return None

    def copy_prefix(self, src: Any, dst: Any, length: int) -> None:
        """Back ends with `shares_prefixes`: make `dst` hold the first `length` positions
        `src` holds, exactly as `src` holds them (what `dst` held is dropped)."""
        raise NotImplementedError(f"the {self.name} back end does not share prefixes")

    def save(self, kv: Any) -> bytes:
        """Back ends with `holds_tiers`: the state `kv` holds, as bytes (or a bytearray) `load`
        takes."""
        raise NotImplementedError(f"the {self.name} back end keeps its KV itself")

    def load(self, data: bytes, key: str | None = None) -> Any | None:
        """A new handle holding the state `save` gave (None where it cannot be loaded)."""
        raise NotImplementedError(f"the {self.name} back end keeps its KV itself")

    def release(self, kv: Any) -> None:
        """Free what the handle holds. Default: nothing to free."""
