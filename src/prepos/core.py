"""Plain data shared by every part: sampling parameters, ready records, paths and timings."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from prepos.errors import InvalidInput, InvalidSampling
from prepos.response_format import canonical


class AnswerPath(str, enum.Enum):
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
    # OpenAI's penalties over the tokens generated so far, and additive logit biases
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    # an OpenAI response_format (a dict or its JSON text), kept as its canonical JSON text
    # (prepos.response_format, checked once per distinct format); None for free text.
    # Constrains every token, the first included
    response_format: str | None = None
    # a grammar (llguidance's Lark) the answer must match instead, as a response_format
    # constrains it: a forced tool call's (the server writes it from the tools' schemas)
    grammar: str | None = None
    # max_tokens is a bound: an answer stops where the context (or the session's budget)
    # has no more room, instead of being refused (OpenAI's max_tokens left out)
    fit_context: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSampling(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(
                self.temperature) or self.temperature < 0:
            raise InvalidSampling(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidSampling(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidSampling(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise InvalidSampling(f"seed must be an integer in [-2**63, 2**64), got "
                                  f"{self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise InvalidSampling(f"{name} must be a number in [-2, 2], got {v!r}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or tok < 0:
                raise InvalidSampling(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise InvalidSampling(f"logit_bias values must be in [-100, 100], got "
                                      f"{bias!r} for token {tok}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSampling("stop sequences must be non-empty strings")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise InvalidSampling(f"top_logprobs must be an integer in [0, 20], got "
                                  f"{self.top_logprobs!r}")
        if self.response_format is not None:
            object.__setattr__(self, "response_format", canonical(self.response_format))
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or self.response_format is not None):
            raise InvalidSampling("grammar must be a string, and not beside a "
                                  "response_format")

    @cached_property
    def shaped(self) -> bool:
        """Whether penalties, biases or a response format's grammar change the logits
        before the choice."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.response_format or self.grammar)

    @cached_property
    def greedy(self) -> bool:
        """The raw argmax is the choice: temperature 0 and nothing shaping the logits."""
        return self.temperature == 0.0 and not self.shaped


FAST_MODES = ("exact", "relaxed", "off")


@dataclass(frozen=True)
class Request:
    """How a caller wants one answer served, apart from the text it sends: the engine's
    request methods (`query`, `turn`, `tool_result`, `complete`) each take one."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    fast_path: str | None = None  # one of FAST_MODES; None: the session's own
    logprobs: bool = False  # report the chosen token's logprob with each token
    # a raw completion's prompt tokens' own logprobs (`Result.prompt_logprobs`; back ends
    # that return the logits at every position)
    prompt_logprobs: bool = False
    expected_version: int | None = None  # refuse (Conflict) unless the session is there
    # the request the commits come from, opaque to the engine: handed to the write-ahead log
    # with each (the server's Idempotency-Key attempt, claimed with the first)
    origin: object = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidSampling(f"sampling must be SamplingParams, got "
                                  f"{type(self.sampling).__name__}")
        if self.fast_path is not None and self.fast_path not in FAST_MODES:
            raise InvalidInput(f"fast_path must be one of {FAST_MODES}, got "
                               f"{self.fast_path!r}")


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


@dataclass(slots=True)
class Timing:
    """Seconds spent on each part of a request's critical path."""

    queue: float = 0.0  # waiting for the model worker
    restore: float = 0.0  # KV crop back to the pre-paid point
    prefill: float = 0.0  # the forward over the delta, which yields the first token's logits
    ttft: float = 0.0  # arrival to first token
    total: float = 0.0
    prefill_tokens: int = 0
    # the request's own prompt tokens found resident: the entry's (pre-paid), or the whole
    # prompt's on a session kept for a client (`SessionSpec.implicit`)
    cached_tokens: int = 0


@dataclass(slots=True)
class Result:
    path: AnswerPath
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
    predecoded: int = 0  # of `tokens`, those served from the answer pre-decoded at idle
    # a relaxed answer's id: a `correction` event names it if verification disagrees
    answer_id: str | None = None
    # with Request.prompt_logprobs: each prompt token, its logprob (None for the first) and
    # the most likely tokens there (as top_logprobs)
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] = field(
        default_factory=list)
