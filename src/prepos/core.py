"""Plain data shared by every part: sampling parameters, ready records, paths and timings."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from prepos.errors import InvalidSampling


class Path(str, enum.Enum):
    FAST = "fast"  # answered from the ready distribution: no prefill, no decode (Eq. 3)
    FALL = "fall-through"  # restore to the pre-paid entry, prefill the delta, decode (Eq. 5)
    COLD = "cold"  # nothing pre-positioned: prefill the entry, decode (Eq. 2)


class Match(str, enum.Enum):
    EXACT = "exact"  # realized entry == pre-positioned entry: zero added risk
    RELAXED = "relaxed"  # question-independent header distribution, risk r(tau) (Eq. 14)
    NONE = "none"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # alternatives reported per generated token (0 to 20)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSampling(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSampling(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidSampling(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSampling(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSampling("stop sequences must be non-empty strings")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise InvalidSampling(f"top_logprobs must be an integer in [0, 20], got "
                                  f"{self.top_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ReadyRecord:
    """The ready distribution at one decision point (Section 3.3).

    Valid exactly while its session's version equals `version`; the session clears its
    records in the same critical section that bumps the version.
    """

    p: int  # decision point: n_s + L_entry (Eq. 1)
    entry: tuple[int, ...]  # the pre-positioned entry tokens
    logits: torch.Tensor | None  # full last-position logits (None where a back end gives top-k)
    top_ids: tuple[int, ...]  # descending; top_ids[0] is the argmax
    top_logprobs: tuple[float, ...]
    gap: float  # l1 - l2 (Eq. 11); equals the logprob gap
    version: int
    top_text: str  # the argmax token decoded, so the fast path does no tokenizer work

    @property
    def argmax(self) -> int:
        return self.top_ids[0]


@dataclass
class Timing:
    """Seconds spent on each part of a request's critical path."""

    queue: float = 0.0  # waiting for the model worker
    restore: float = 0.0  # KV crop back to the pre-paid point
    prefill: float = 0.0  # the forward over the delta, which yields the first token's logits
    ttft: float = 0.0  # arrival to first token
    total: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0  # entry tokens found resident (pre-paid)


@dataclass
class Result:
    path: Path
    match: Match
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # length | stop | eos | fast_path | cancelled
    gap: float | None = None
    version: int = 0  # the committed version the answer was computed from
    timing: Timing = field(default_factory=Timing)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens found in the KV cache
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each emitted token
    # per emitted token, the most likely (token, logprob) pairs, when sampling asked for them
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
