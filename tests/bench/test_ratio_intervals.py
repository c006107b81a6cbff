"""`intervals` (benchmarks/common.py): the 95% bootstrap intervals of the pooled gap
ratios, turns drawn again with replacement (no timing: gaps given as numbers)."""

from benchmarks.common import intervals

KEYS = ("gap_p50_ratio", "gap_p99_ratio", "mean_gap_ratio")


def streams(turns: list[float], n: int = 50) -> list[dict]:
    """One stream a turn, its gaps spread around the turn's level."""
    return [{"gaps": [level * (1 + (i % 10) / 20) for i in range(n)]} for level in turns]


def test_the_same_gaps_give_a_point_at_one():
    a = streams([10.0, 12.0, 11.0, 15.0])
    assert intervals(a, a, 1)["ratio_ci95"] == {k: [1.0, 1.0] for k in KEYS}


def test_a_constant_factor_is_found_with_no_spread():
    levels = [10.0, 12.0, 11.0, 15.0, 9.0]
    got = intervals(streams([1.1 * x for x in levels]), streams(levels), 1)["ratio_ci95"]
    assert got == {k: [1.1, 1.1] for k in KEYS}


def test_turns_that_differ_give_an_interval_inside_their_range():
    levels = [10.0] * 20
    ours = streams([12.0 if i % 2 else 10.0 for i in range(20)])
    got = intervals(ours, streams(levels), 1)["ratio_ci95"]
    lo, hi = got["mean_gap_ratio"]
    assert 1.0 < lo < 1.1 < hi < 1.2
    assert intervals(ours, streams(levels), 1)["ratio_ci95"] == got  # seeded


def test_a_turn_of_four_streams_is_drawn_whole():
    # four streams a turn: a turn whose four are all slower moves the ratio as one draw
    ours = streams([10.0] * 4 + [20.0] * 4)
    theirs = streams([10.0] * 8)
    lo, hi = intervals(ours, theirs, 4)["ratio_ci95"]["mean_gap_ratio"]
    assert lo == 1.0 and hi == 2.0  # all of one turn, or all of the other


def test_one_turn_has_no_interval():
    assert intervals(streams([10.0]), streams([10.0]), 1) == {}
