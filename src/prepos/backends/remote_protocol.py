"""The remote back end's vocabulary: its errors, what an engine request is (`HttpCall`) and
brings back (`TopK`, `EngineInfo`, a `StreamParser`'s tokens), and the `Adapter` interface
each engine's format implements (`remote_adapters`).

An adapter builds two kinds of request: one token's top-k logprobs for a prompt (`request`,
the pre-position and single-step path) and a streamed answer (`stream_request`), whose
server-sent events its `StreamParser` turns into (token id, top-k) pairs. `info_call` reads
the engine's own facts: its context length and, for llama.cpp, its slot count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from prepos.backends.base import Dist
from prepos.errors import PreposError


class RemoteError(PreposError):
    """The engine refused a request (a 4xx: the request, not the replica, is at fault)."""

    code = "remote_error"


class BackendUnavailable(PreposError):
    """No replica could serve the request."""

    code = "backend_unavailable"


class AnswerInterrupted(BackendUnavailable):
    """The replica streaming an answer failed after some of its tokens were delivered. The
    answer is not resumed on another replica (its sampler state, and so its continuation,
    would differ): the client gets the tokens it has and this error, never a splice. The
    session's next request is served by the next replica in its ranking."""

    code = "answer_interrupted"


class Abandoned(PreposError):
    """A background request was cancelled (its session moved on); its answer is discarded."""

    code = "abandoned"


class ReplicaFailure(Exception):
    """The replica, not the request, failed: connection refused or reset, timeout, 5xx."""


@dataclass
class TopK:
    """What one request (or one streamed token) brought back."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached_tokens: int | None = None  # prompt tokens the engine found in its prefix cache
    prompt_tokens: int | None = None
    slot: int | None = None

    def dist(self) -> Dist:
        if not self.ids:
            raise RemoteError("the engine returned no top-k logprobs")
        order = sorted(range(len(self.ids)), key=lambda i: (-self.logprobs[i], self.ids[i]))
        ids = tuple(self.ids[i] for i in order)
        lps = tuple(self.logprobs[i] for i in order)
        if len(ids) == 1:  # the Dist protocol wants two; a lone token holds all the mass
            ids, lps = ids + (-1,), lps + (-math.inf,)
        return Dist(None, ids, lps)


@dataclass
class HttpCall:
    """One HTTP request an adapter wants made."""

    method: str
    path: str
    json: dict | None = None
    headers: dict = field(default_factory=dict)


@dataclass
class EngineInfo:
    """The engine's own facts, read from it (`Adapter.info_call`)."""

    max_context: int | None = None
    n_slots: int | None = None


class StreamParser:
    """Turns one streamed answer's events (parsed JSON objects) into tokens. `feed` returns
    the new (token id, TopK | None) pairs of one event; `finished` is set once the engine
    said the answer ended; `cached_tokens`/`prompt_tokens` once it reported them."""

    def __init__(self) -> None:
        self.finished = False
        self.cached_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.slot: int | None = None
        self.n = 0  # tokens delivered

    def feed(self, event: Any) -> list[tuple[int, TopK | None]]:
        raise NotImplementedError


class Adapter:
    """The request and response format of one engine."""

    kind = "base"
    health_path = "/health"
    uses_slots = False
    # True where the engine itself stops on stop token ids (so a stream ends by itself and
    # its final event, with the cache report, can be read before the last token is handed on)
    stops_on_ids = True

    def __init__(self, model: str | None = None, background_priority: int | None = None):
        self.model = model
        # None: send no priority (the engine runs without priority scheduling)
        self.background_priority = background_priority

    def request(self, prompt: Sequence[int], k: int, *, rid: str, background: bool,
                slot: int | None = None) -> HttpCall:
        raise NotImplementedError

    def parse(self, body: Any) -> TopK:
        raise NotImplementedError

    def stream_request(self, prompt: Sequence[int], k: int, sampling: Any, max_tokens: int,
                       stop_ids: frozenset[int], *, rid: str, background: bool,
                       slot: int | None = None) -> HttpCall:
        raise NotImplementedError

    def stream_parser(self) -> StreamParser:
        raise NotImplementedError

    def abort(self, rid: str) -> HttpCall | None:
        """The request that aborts an in-flight one, where the engine has such an API."""
        return None

    def info_call(self) -> HttpCall | None:
        return None

    def parse_info(self, body: Any) -> EngineInfo:
        return EngineInfo()


def _lp(x: Any) -> float:
    return -math.inf if x is None else float(x)


def _log(p: Any) -> float:
    p = float(p)
    return math.log(p) if p > 0 else -math.inf


def _seed(sampling: Any) -> int | None:
    return None if sampling.greedy else sampling.seed


