"""The market-trend task: streamed prices, queries about them, and their ground truth.

A *stream* is a seeded price series for one ticker. It moves through regimes (up, down,
flat), each lasting a random number of ticks with its own drift, plus rounding noise; a
regime changes inside a decision window more often than not. The stream is cut into data
messages of a ticker and a handful of integer prices (``"ACME 41 43 44 47 48 50"``), which a
streaming session appends one by one.

The *trend* at a decision point is a property of the data alone: the least-squares slope of
the last :data:`HORIZON` prices (the last two messages), ``"up"`` above :data:`BAND` per
tick, ``"down"`` below ``-BAND``, ``"flat"`` otherwise. It is what the model is taught to say
at the bare assistant header (the question-independent decision point the engine
pre-positions), and the ground truth every query is answered from.

Queries come in three kinds, all answered by a single token:

* ``trend``: "Which way is ACME moving?" -> up / down / flat (the data state itself);
* ``polar``: "Is ACME rising?" -> yes / no, also negated ("Is ACME not rising?") and
  inverted ("Is it false that ACME is rising?");
* ``wording``: answers that turn on the wording rather than the data state ("If ACME
  reversed course, which way would it go?", "Ignore the prices: what is the opposite of
  down?"). Their answers lie in the fast-answer set but need not equal the
  question-independent token: they are where the relaxed fast path can be wrong.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

TRENDS: tuple[str, ...] = ("up", "down", "flat")
POLAR: tuple[str, ...] = ("yes", "no")
ANSWERS: tuple[str, ...] = TRENDS + POLAR  # every single-token answer: the fast-answer set A
TICKERS: tuple[str, ...] = ("ACME", "BOLT", "CRUX", "DYNA", "EMBR", "FLUX", "GRID", "HALO")
SYSTEM_PROMPT = "Live price feed. Answer in one word."

PRICES_PER_MESSAGE = 6
HORIZON = 12  # the trend is read over the last this many prices (two messages)
BAND = 0.5  # |slope| per tick at or below this is "flat"
WINDOW_MESSAGES = 4  # a decision window: this many data messages
PRICE_MIN, PRICE_MAX = 10, 99  # two-digit prices: each one a single token
SEGMENT_TICKS = (12, 40)  # a regime lasts this many ticks (inclusive range)
DRIFT = (1.0, 2.5)  # |drift| per tick of an up/down regime
NOISE = 0.8  # standard deviation of the per-tick noise, before rounding

# Seeds: training draws from [0, EVAL_SEED_BASE); calibration and tests hold out the rest.
EVAL_SEED_BASE = 1_000_000_000


# ---------------------------------------------------------------------------------------
# Ground truth


def slope(prices: Sequence[float]) -> float:
    """Least-squares slope of `prices` against their index (0.0 for fewer than two)."""
    n = len(prices)
    if n < 2:
        return 0.0
    xm = (n - 1) / 2
    ym = sum(prices) / n
    num = sum((i - xm) * (p - ym) for i, p in enumerate(prices))
    den = sum((i - xm) ** 2 for i in range(n))
    return num / den


def trend_of(prices: Sequence[float], horizon: int = HORIZON, band: float = BAND) -> str:
    """The trend of a series at its end: the slope of its last `horizon` prices."""
    if not prices:
        raise ValueError("trend_of needs at least one price")
    s = slope(list(prices)[-horizon:])
    if s > band:
        return "up"
    if s < -band:
        return "down"
    return "flat"


def opposite(trend: str) -> str:
    """The reversed trend; flat reverses to flat."""
    return {"up": "down", "down": "up", "flat": "flat"}[trend]


# ---------------------------------------------------------------------------------------
# Streams and data messages


def format_data(ticker: str, prices: Sequence[int]) -> str:
    """One data message: ``"ACME 41 43 44 47 48 50"``."""
    return " ".join([ticker, *(str(int(p)) for p in prices)])


def parse_data(text: str) -> tuple[str, list[int]]:
    """Inverse of :func:`format_data`."""
    ticker, *rest = text.split(" ")
    return ticker, [int(p) for p in rest]


@dataclass(frozen=True)
class Stream:
    """A price series for one ticker, with the latent regime at every tick."""

    ticker: str
    prices: tuple[int, ...]
    regimes: tuple[str, ...]
    per_message: int = PRICES_PER_MESSAGE

    def messages(self) -> list[str]:
        """The data messages, in order (a trailing partial message is dropped)."""
        k = self.per_message
        return [
            format_data(self.ticker, self.prices[i : i + k])
            for i in range(0, len(self.prices) - k + 1, k)
        ]

    def trend_after(self, n_messages: int) -> str:
        """Ground truth at the decision point after the first `n_messages` messages."""
        return trend_of(self.prices[: n_messages * self.per_message])


def generate_stream(
    rng: random.Random, n_prices: int, ticker: str | None = None, start: float | None = None
) -> Stream:
    """A seeded price series: regimes of random length and drift, noise, rounding.

    Prices stay within [PRICE_MIN, PRICE_MAX]: a regime heading out of range turns around
    (itself a regime change).
    """
    ticker = ticker if ticker is not None else rng.choice(TICKERS)
    level = start if start is not None else rng.uniform(35, 65)
    regime = rng.choice(TRENDS)
    left = rng.randint(*SEGMENT_TICKS)
    drift = rng.uniform(*DRIFT)
    prices: list[int] = []
    regimes: list[str] = []
    for _ in range(n_prices):
        if left <= 0:
            regime = rng.choice([r for r in TRENDS if r != regime])
            left = rng.randint(*SEGMENT_TICKS)
            drift = rng.uniform(*DRIFT)
        if regime == "up" and level > PRICE_MAX - 7:
            regime, left = "down", rng.randint(*SEGMENT_TICKS)
        elif regime == "down" and level < PRICE_MIN + 7:
            regime, left = "up", rng.randint(*SEGMENT_TICKS)
        level += {"up": drift, "down": -drift, "flat": 0.0}[regime]
        level = min(PRICE_MAX - 2.0, max(PRICE_MIN + 2.0, level))
        price = int(round(level + rng.gauss(0.0, NOISE)))
        prices.append(min(PRICE_MAX, max(PRICE_MIN, price)))
        regimes.append(regime)
        left -= 1
    return Stream(ticker, tuple(prices), tuple(regimes))


# ---------------------------------------------------------------------------------------
# Queries


@dataclass(frozen=True)
class Query:
    kind: str  # trend | polar | wording
    form: str  # which wording family, e.g. "trend", "positive", "negated", "reversed"
    text: str
    answer: str  # ground truth, given the data state


@dataclass(frozen=True)
class _Template:
    kind: str
    form: str
    text: str
    answer: Callable[[str], str]


def _yes(cond: bool) -> str:
    return "yes" if cond else "no"


_MOTION = {  # polar predicates: (phrase, trend it asserts)
    "rising": "up",
    "going up": "up",
    "climbing": "up",
    "falling": "down",
    "going down": "down",
    "sliding": "down",
    "flat": "flat",
    "holding steady": "flat",
    "moving sideways": "flat",
}

TREND_WORDINGS: tuple[str, ...] = (
    "Which way is {t} moving?",
    "What is the trend of {t}?",
    "Trend of {t} over the last two updates?",
    "Is {t} going up, down or flat?",
    "Direction of {t} right now?",
    "How is {t} trending: up, down or flat?",
    "Summarize {t} in one word: up, down or flat.",
    "Where is {t} heading?",
)


def _templates() -> list[_Template]:
    out = [_Template("trend", "trend", w, lambda tr: tr) for w in TREND_WORDINGS]
    for phrase, asserted in _MOTION.items():
        out.append(
            _Template(
                "polar", "positive", f"Is {{t}} {phrase}?", lambda tr, a=asserted: _yes(tr == a)
            )
        )
        out.append(
            _Template(
                "polar", "negated", f"Is {{t}} not {phrase}?", lambda tr, a=asserted: _yes(tr != a)
            )
        )
        out.append(
            _Template(
                "polar",
                "inverted",
                f"Is it false that {{t}} is {phrase}?",
                lambda tr, a=asserted: _yes(tr != a),
            )
        )
    out += [
        _Template(
            "wording", "reversed", "If {t} reversed course, which way would it go?", opposite
        ),
        _Template("wording", "reversed", "What is the opposite of the trend of {t}?", opposite),
        _Template("wording", "constant", "Ignore the prices: what is the opposite of down?",
                  lambda tr: "up"),
        _Template("wording", "constant", "Ignore the prices: what is the opposite of up?",
                  lambda tr: "down"),
        _Template("wording", "constant", "Ignore the prices: which word means no change?",
                  lambda tr: "flat"),
    ]
    return out


TEMPLATES: tuple[_Template, ...] = tuple(_templates())
KINDS: tuple[str, ...] = ("trend", "polar", "wording")


def queries(ticker: str, trend: str, kinds: Sequence[str] = KINDS) -> list[Query]:
    """Every query of the given kinds about `ticker`, with its answer for `trend`."""
    if trend not in TRENDS:
        raise ValueError(f"unknown trend {trend!r}")
    return [
        Query(t.kind, t.form, t.text.format(t=ticker), t.answer(trend))
        for t in TEMPLATES
        if t.kind in kinds
    ]


def sample_query(
    rng: random.Random, ticker: str, trend: str, weights: dict[str, float] | None = None
) -> Query:
    """One query: a kind drawn by `weights` (default: equal), then a wording within it."""
    weights = weights or {k: 1.0 for k in KINDS}
    kinds = [k for k in KINDS if weights.get(k, 0.0) > 0]
    kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
    return rng.choice(queries(ticker, trend, (kind,)))


def canonical_query(rng: random.Random, ticker: str, trend: str, wording_rate: float) -> Query:
    """The calibration query for one window: a trend question in one of its wordings, or
    with probability `wording_rate` a wording-dependent one (answers in the trend set)."""
    if rng.random() < wording_rate:
        return rng.choice(queries(ticker, trend, ("wording",)))
    return rng.choice(queries(ticker, trend, ("trend",)))


# ---------------------------------------------------------------------------------------
# Decision points


@dataclass(frozen=True)
class DecisionPoint:
    """One data window, the ground truth at its end, and the query asked there."""

    seed: int
    index: int  # window index within its stream
    ticker: str
    messages: tuple[str, ...]
    trend: str
    query: Query
    prices: tuple[int, ...] = field(repr=False, default=())


def decision_points(
    n: int,
    seed: int = EVAL_SEED_BASE,
    window: int = WINDOW_MESSAGES,
    windows_per_stream: int = 8,
    wording_rate: float = 0.1,
) -> list[DecisionPoint]:
    """`n` independent decision points: consecutive non-overlapping windows of
    `window` messages cut from seeded streams (stream j uses seed ``seed + j``), each with
    one canonical query. Each window is presented to its own fresh session."""
    out: list[DecisionPoint] = []
    j = 0
    while len(out) < n:
        rng = random.Random(seed + j)
        per = window * PRICES_PER_MESSAGE
        stream = generate_stream(rng, per * windows_per_stream, ticker=TICKERS[j % len(TICKERS)])
        msgs = stream.messages()
        for w in range(windows_per_stream):
            if len(out) >= n:
                break
            prices = stream.prices[w * per : (w + 1) * per]
            trend = trend_of(prices)
            q = canonical_query(rng, stream.ticker, trend, wording_rate)
            out.append(
                DecisionPoint(
                    seed + j,
                    w,
                    stream.ticker,
                    tuple(msgs[w * window : (w + 1) * window]),
                    trend,
                    q,
                    tuple(prices),
                )
            )
        j += 1
    return out


# ---------------------------------------------------------------------------------------
# Training examples


@dataclass(frozen=True)
class Example:
    """A training conversation: data messages, then a question (or none) and its answer.

    ``query is None`` is the question-independent decision point: the assistant header
    follows the data directly and the answer is the trend.
    """

    ticker: str
    messages: tuple[str, ...]
    trend: str
    query: Query | None

    @property
    def answer(self) -> str:
        return self.trend if self.query is None else self.query.answer

    def chat(self, system: str = SYSTEM_PROMPT) -> list[dict]:
        """The conversation up to (not including) the assistant's answer."""
        msgs = [{"role": "system", "content": system}]
        msgs += [{"role": "user", "content": m} for m in self.messages]
        if self.query is not None:
            msgs.append({"role": "user", "content": self.query.text})
        return msgs


DEFAULT_MIX = {"header": 0.4, "trend": 0.25, "polar": 0.25, "wording": 0.1}


def sample_example(
    rng: random.Random,
    min_messages: int = 2,
    max_messages: int = WINDOW_MESSAGES + 1,
    mix: dict[str, float] | None = None,
    max_burn: int = 160,
) -> Example:
    """One training conversation: a window of a seeded stream, and a question (or none)."""
    mix = mix or DEFAULT_MIX
    n_msgs = rng.randint(min_messages, max_messages)
    # A window cut from a running stream, like the calibration windows: a burn-in lets the
    # level wander over the whole price range and start the window mid-regime.
    burn = rng.randint(0, max_burn)
    stream = generate_stream(rng, burn + n_msgs * PRICES_PER_MESSAGE)
    prices = stream.prices[burn:]
    trend = trend_of(prices)
    kinds = list(mix)
    kind = rng.choices(kinds, [mix[k] for k in kinds])[0]
    query = None if kind == "header" else rng.choice(queries(stream.ticker, trend, (kind,)))
    msgs = Stream(stream.ticker, prices, stream.regimes[burn:]).messages()
    return Example(stream.ticker, tuple(msgs), trend, query)


def examples(seed: int, n: int, **kw) -> Iterator[Example]:
    rng = random.Random(seed)
    for _ in range(n):
        yield sample_example(rng, **kw)


def corpus(seed: int = 0, n: int = 4000) -> Iterator[str]:
    """Plain text of the task (data, queries, answers, system prompt) for tokenizer training."""
    rng = random.Random(seed)
    yield SYSTEM_PROMPT
    for t in TEMPLATES:
        for ticker in TICKERS:
            yield t.text.format(t=ticker)
    for _ in range(n):
        ex = sample_example(rng)
        yield from ex.messages
        if ex.query is not None:
            yield ex.query.text
        yield ex.answer
    # Every price and answer word, as they appear in messages and replies.
    for ticker in TICKERS:
        yield format_data(ticker, range(PRICE_MIN, PRICE_MAX + 1))
    for a in ANSWERS:
        yield a
