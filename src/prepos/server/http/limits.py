"""Limits: tokens per request and per session, sessions per server and per key. Every check
runs before the engine is called, so a refused request leaves every session as it was. A
request's head and body sizes are the front door's (`front.py`); backpressure is the
engine's (`Engine.admit`: 429 + Retry-After when the model worker's foreground queue is
full)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prepos.core import SamplingParams
from prepos.engine import check_context
from prepos.errors import InvalidSampling, OverBudget
from prepos.server.http.errors import ApiError

KNOWN_SAMPLINGS = 256


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_sessions: int = 100_000  # journalled; their KV moves down the tiers
    max_sessions_per_key: int | None = None  # None: the key's equal share (`share`)
    max_subscribers: int = 1024  # SSE subscriptions open at once
    max_subscribers_per_key: int | None = None  # None: the key's equal share
    max_tokens: int = 1024  # generated tokens per request (a request asking more gets this)
    default_max_tokens: int = 64
    max_input_tokens: int | None = None  # tokens of input text per request (None: the context)
    # refuse (400) a max_tokens over `max_tokens` or past the context, instead of answering up
    # to either and stopping there with finish_reason "length"
    strict_max_tokens: bool = False
    max_header_bytes: int = 64 * 1024  # a request's line and headers (431 beyond)
    # the sampling of each set of values asked for lately (a dashboard asks alike every time)
    _known: dict[tuple, SamplingParams] = field(default_factory=dict, init=False, repr=False,
                                                compare=False)

    def sampling(self, max_tokens: int | None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, stop=None, param: str = "max_tokens",
                 top_logprobs: int = 0, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None,
                 logit_bias: tuple[tuple[int, float], ...] = (),
                 fit: bool = False) -> SamplingParams:
        """A request's sampling, checked: 400 naming the field out of its range. max_tokens
        left out is `default_max_tokens`; with `fit` (the OpenAI and Anthropic routes) an
        answer stops at the context's end, its max_tokens left out taken as `max_tokens`, and
        one over `max_tokens` cut to it, as llama.cpp's server does (400 instead with
        `strict_max_tokens`). Remembered per distinct request (the fast path's are the same
        request again and again)."""
        key = (max_tokens, temperature, top_k, top_p, seed,
               tuple(stop) if isinstance(stop, list) else stop, param, top_logprobs,
               presence_penalty, frequency_penalty, logit_bias, fit)
        try:
            known = self._known.get(key)
        except TypeError:  # a value that cannot be a key: checked, not remembered
            return self._sampling(*key)
        if known is None:
            known = self._sampling(*key)
            if len(self._known) >= KNOWN_SAMPLINGS:
                self._known.clear()
            self._known[key] = known
        return known

    def _sampling(self, max_tokens, temperature, top_k, top_p, seed, stop, param: str,
                  top_logprobs: int, presence_penalty, frequency_penalty,
                  logit_bias, fit: bool) -> SamplingParams:
        n = self.default_max_tokens if max_tokens is None else max_tokens
        fit = fit and (max_tokens is None or not self.strict_max_tokens)
        if fit and (max_tokens is None or isinstance(n, int) and n > self.max_tokens):
            n = self.max_tokens
        if isinstance(n, int) and n > self.max_tokens:
            raise ApiError(400, "max_tokens_limit",
                           f"{param} {n} is over this server's limit of {self.max_tokens}",
                           param)
        if isinstance(stop, str):
            stop = (stop,)
        if stop is not None and len(stop) > 16:
            raise ApiError(400, "invalid_sampling", "at most 16 stop sequences", "stop")
        if temperature is not None and temperature > 100:
            raise ApiError(400, "invalid_sampling",
                           f"temperature must be <= 100, got {temperature}", "temperature")
        try:
            return SamplingParams(
                max_tokens=n, temperature=0.0 if temperature is None else float(temperature),
                top_k=top_k or 0, top_p=1.0 if top_p is None else float(top_p), seed=seed,
                stop=tuple(stop or ()), top_logprobs=top_logprobs,
                presence_penalty=float(presence_penalty or 0.0),
                frequency_penalty=float(frequency_penalty or 0.0), logit_bias=logit_bias,
                fit_context=fit)
        except InvalidSampling as exc:  # the field it names is the param
            first = str(exc).split(" ", 1)[0]
            name = param if first == "max_tokens" else first
            raise ApiError(400, "invalid_sampling", str(exc).replace("max_tokens", param, 1),
                           name if name.isidentifier() else None) from None

    def check_input(self, engine, text: str, what: str, context: bool = False) -> None:
        """At most `max_input_tokens` tokens; with `context` (OpenAI's routes), text over the
        model's context is refused as the engine would (400 `context_length_exceeded` there)
        whatever the limit. A byte-level token covers at least one byte, so text within the
        limit in bytes is never tokenized here."""
        limit = self.input_limit(engine)
        if len(text) <= limit and len(text.encode()) <= limit:
            return
        n = len(engine.fmt.encode(text))
        if context:
            try:
                check_context(n, 0, engine.max_context, what=what)
            except OverBudget as exc:
                raise ApiError(413, "over_budget", str(exc), what) from None
        if n > limit:
            raise ApiError(413, "input_too_large",
                           f"{what} is {n} tokens, over this server's limit of "
                           f"{limit} tokens per request", what)

    def input_limit(self, engine) -> int:
        return self.max_input_tokens or engine.max_context


def share(cap: int, per_key: int | None, keys: int) -> int | None:
    """What one API key may hold of `cap`: `per_key` where given, else an equal part for
    each of the server's `keys` keys, so that no key can take what the others are owed (None:
    no keys, one owner)."""
    if per_key is not None:
        return per_key
    return max(1, cap // keys) if keys else None
