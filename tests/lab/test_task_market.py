"""The market task generator: ground truth on hand-made series, streams, queries, windows."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.lab.task import market as m

# -- ground truth on hand-made series ---------------------------------------------------


def test_slope_of_a_line_is_its_step():
    assert m.slope([10, 12, 14, 16]) == pytest.approx(2.0)
    assert m.slope([50, 49, 48]) == pytest.approx(-1.0)
    assert m.slope([42]) == 0.0


@pytest.mark.parametrize(
    "prices, trend",
    [
        ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], "up"),
        ([60, 58, 57, 55, 54, 52, 51, 49, 48, 46, 45, 43], "down"),
        ([50, 51, 50, 49, 50, 51, 50, 49, 50, 51, 50, 50], "flat"),
        ([50] * 12, "flat"),
        # noisy but clearly rising: net +11 over 12 ticks
        ([30, 32, 31, 33, 35, 34, 36, 38, 37, 39, 42, 41], "up"),
        # a down regime that turned up: only the last HORIZON (12) prices count
        ([70, 66, 62, 58, 54, 50, 46, 42, 40, 41, 43, 44, 46, 47, 49, 50, 52, 53, 55, 56], "up"),
        # an up regime that went flat six ticks before the end, read over two messages
        ([20, 22, 24, 26, 28, 30, 40, 41, 40, 41, 40, 41, 40, 41, 40, 41, 40, 41], "flat"),
        # a slope of exactly BAND is still flat; just above it is up
        ([10 + 0.5 * i for i in range(12)], "flat"),
        ([10 + 0.51 * i for i in range(12)], "up"),
    ],
)
def test_trend_of_hand_made_series(prices, trend):
    assert m.trend_of(prices) == trend


def test_trend_of_horizon_and_band_are_parameters():
    prices = [10, 11, 12, 13, 12, 11]
    assert m.trend_of(prices, horizon=3) == "down"
    assert m.trend_of(prices, horizon=4) == "flat"
    assert m.trend_of([10, 12, 14], band=2.5) == "flat"
    with pytest.raises(ValueError):
        m.trend_of([])


prices_st = st.lists(st.integers(10, 99), min_size=2, max_size=30)


@given(prices_st, st.integers(-5, 5))
def test_trend_is_invariant_to_a_level_shift(prices, shift):
    assert m.trend_of([p + shift for p in prices]) == m.trend_of(prices)


@given(prices_st)
def test_mirroring_the_series_swaps_up_and_down(prices):
    assert m.trend_of([-p for p in prices]) == m.opposite(m.trend_of(prices))


@given(st.integers(10, 40), st.lists(st.integers(1, 3), min_size=11, max_size=20))
def test_a_series_that_rises_every_tick_is_up(start, steps):
    prices = [start]
    for s in steps:
        prices.append(prices[-1] + s)
    assert m.trend_of(prices) == "up"
    assert m.trend_of(prices[::-1]) == "down"


# -- streams and messages -----------------------------------------------------------------


@given(st.integers(0, 2**32), st.integers(1, 200))
@settings(max_examples=50)
def test_streams_are_seeded_and_in_range(seed, n):
    a = m.generate_stream(random.Random(seed), n)
    b = m.generate_stream(random.Random(seed), n)
    assert a == b
    assert len(a.prices) == len(a.regimes) == n
    assert all(m.PRICE_MIN <= p <= m.PRICE_MAX for p in a.prices)
    assert set(a.regimes) <= set(m.TRENDS)
    assert a.ticker in m.TICKERS


def test_streams_change_regime_and_follow_it():
    s = m.generate_stream(random.Random(3), 2000)
    changes = sum(x != y for x, y in zip(s.regimes, s.regimes[1:]))
    assert changes > 2000 / m.SEGMENT_TICKS[1]
    # over whole regime runs the prices move the way the regime says
    runs: dict[str, list[float]] = {t: [] for t in m.TRENDS}
    start = 0
    for i in range(1, len(s.regimes) + 1):
        if i == len(s.regimes) or s.regimes[i] != s.regimes[start]:
            if i - start >= 12:
                runs[s.regimes[start]].append(m.slope(s.prices[start:i]))
            start = i
    assert min(runs["up"]) > 0.5 and max(runs["down"]) < -0.5
    assert all(abs(x) < 0.5 for x in runs["flat"])


@given(st.integers(0, 2**32))
@settings(max_examples=30)
def test_messages_round_trip(seed):
    s = m.generate_stream(random.Random(seed), 3 * m.PRICES_PER_MESSAGE + 2)
    msgs = s.messages()
    assert len(msgs) == 3  # the partial tail is dropped
    flat: list[int] = []
    for text in msgs:
        ticker, prices = m.parse_data(text)
        assert ticker == s.ticker and len(prices) == m.PRICES_PER_MESSAGE
        assert m.format_data(ticker, prices) == text
        flat += prices
    assert tuple(flat) == s.prices[: len(flat)]
    assert s.trend_after(3) == m.trend_of(flat)


# -- queries ------------------------------------------------------------------------------


@pytest.mark.parametrize("trend", m.TRENDS)
def test_query_answers_follow_the_trend_or_the_wording(trend):
    qs = m.queries("ACME", trend)
    assert {q.kind for q in qs} == set(m.KINDS)
    for q in qs:
        assert "ACME" in q.text or q.kind == "wording"
        assert q.answer in m.ANSWERS
        if q.kind == "trend":
            assert q.answer == trend
        elif q.kind == "polar":
            assert q.answer in m.POLAR
    by_text = {q.text: q.answer for q in qs}
    assert by_text["Is ACME rising?"] == ("yes" if trend == "up" else "no")
    assert by_text["Is ACME not falling?"] == ("no" if trend == "down" else "yes")
    assert by_text["Is it false that ACME is flat?"] == ("no" if trend == "flat" else "yes")
    assert by_text["If ACME reversed course, which way would it go?"] == m.opposite(trend)
    assert by_text["Ignore the prices: which word means no change?"] == "flat"


@pytest.mark.parametrize("trend", m.TRENDS)
def test_negated_and_inverted_polar_forms_flip_the_positive(trend):
    qs = m.queries("BOLT", trend, ("polar",))
    pos = {
        q.text.removeprefix("Is BOLT ").rstrip("?"): q.answer for q in qs if q.form == "positive"
    }
    for q in qs:
        if q.form == "negated":
            phrase = q.text.removeprefix("Is BOLT not ").rstrip("?")
        elif q.form == "inverted":
            phrase = q.text.removeprefix("Is it false that BOLT is ").rstrip("?")
        else:
            continue
        assert q.answer != pos[phrase]


def test_wording_queries_disagree_with_the_trend_somewhere():
    """The point of the wording kind: its answer is not the data state."""
    for trend in m.TRENDS:
        answers = {q.answer for q in m.queries("X", trend, ("wording",))}
        assert answers - {trend}


def test_unknown_trend_is_rejected():
    with pytest.raises(ValueError):
        m.queries("ACME", "sideways")


# -- decision points and training examples -----------------------------------------------


def test_decision_points_are_non_overlapping_seeded_windows():
    dps = m.decision_points(20, seed=123, windows_per_stream=8, wording_rate=0.0)
    assert len(dps) == 20
    assert dps == m.decision_points(20, seed=123, windows_per_stream=8, wording_rate=0.0)
    per = m.WINDOW_MESSAGES * m.PRICES_PER_MESSAGE
    for dp in dps:
        assert len(dp.messages) == m.WINDOW_MESSAGES and len(dp.prices) == per
        assert dp.trend == m.trend_of(dp.prices)
        assert dp.query.kind == "trend" and dp.query.answer == dp.trend
        assert [p for msg in dp.messages for p in m.parse_data(msg)[1]] == list(dp.prices)
    # consecutive windows of one stream tile it: no overlap
    first = [d for d in dps if d.seed == 123]
    assert [d.index for d in first] == list(range(8))
    assert len({d.prices for d in first}) == 8
    # the stream does not depend on the query mix
    mixed = m.decision_points(20, seed=123, wording_rate=0.5)
    assert [d.prices for d in mixed] == [d.prices for d in dps]
    assert any(d.query.kind == "wording" for d in mixed)


def test_held_out_seeds_are_disjoint_from_training():
    assert m.decision_points(1)[0].seed >= m.EVAL_SEED_BASE


def test_examples_render_as_chat():
    exs = list(m.examples(0, 50))
    assert exs == list(m.examples(0, 50))
    assert any(e.query is None for e in exs) and any(e.query is not None for e in exs)
    for e in exs:
        chat = e.chat()
        assert chat[0] == {"role": "system", "content": m.SYSTEM_PROMPT}
        assert all(c["role"] == "user" for c in chat[1:])
        assert e.answer in m.ANSWERS
        prices = [p for msg in e.messages for p in m.parse_data(msg)[1]]
        assert e.trend == m.trend_of(prices)
        if e.query is None:
            assert e.answer == e.trend and len(chat) == 1 + len(e.messages)
