"""The closed form of Section 2 (Eqs. 2-10, 13-14), the session simulator, and `prepos simulate`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.sim import REFERENCE, Constants, SimConfig, closed_form, simulate, sweep
from prepos.sim import cli as sim_cli
from prepos.sim import model as m

RHOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
R = REFERENCE

# -- known values with the reference's Table 1 constants ------------------------------------


def test_reference_constants_are_table_1():
    assert (R.tau_p, R.T_decode, R.T_scan, R.T_restore, R.L_entry, R.g) == (
        0.843, 39.12, 0.664, 14.47, 18, 0.9453)


def test_eq2_to_eq6_known_values():
    assert m.T_prefill(R, 18) == pytest.approx(15.174)
    assert m.L_cold(R) == pytest.approx(0.843 * 18 + 39.12) == pytest.approx(54.294)
    assert m.L_cold(R, 0) == pytest.approx(39.12)
    assert m.L_fast(R) == 0.664
    assert m.speedup(R) == pytest.approx(54.294 / 0.664)  # ~81.8x on the marginal scan
    assert m.L_fall(R, 0) == pytest.approx(14.47 + 39.12)  # restore + decode
    assert m.L_fall(R, 18) == pytest.approx(54.294 + 14.47)  # L_cold + restore
    assert m.L_fall(R, 18) == pytest.approx(m.L_cold(R) + R.T_restore)
    assert m.T_pp(R) == pytest.approx(15.174)
    # L_fall - L_cold = T_restore - T_prefill(L_entry - delta)
    for d in (0, 5, 18):
        assert m.L_fall(R, d) - m.L_cold(R) == pytest.approx(R.T_restore - 0.843 * (18 - d))
    with pytest.raises(ValueError):
        m.L_fall(R, 19)
    with pytest.raises(ValueError):
        m.L_fall(R, -1)


def test_eq7_amortization():
    assert m.amortized(R, 15.174)
    assert m.amortized(R, 1000.0)
    assert not m.amortized(R, 15.0)
    assert list(m.amortized(R, np.array([1.0, 20.0]))) == [False, True]


def test_eq8_hit_rate_and_waste():
    assert m.hit_rate(1.0) == 0.5
    assert m.hit_rate(0.25) == pytest.approx(0.2)
    assert m.hit_rate(8.0) == pytest.approx(8 / 9)
    assert m.hit_rate(0.0) == 0.0
    assert m.wasted(4.0) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        m.hit_rate(-1.0)


def test_the_whole_answer_known_values():
    """Eq. 7 with N - 1 decode steps: T_pd = 0.843 * 18 + 39 * 39.12 = 1540.854 ms."""
    assert m.T_pd(R, 40) == pytest.approx(0.843 * 18 + 39 * 39.12)
    assert m.T_pd(R, 1) == pytest.approx(m.T_pp(R))
    assert m.amortized_whole(R, 1541.0, 40) and not m.amortized_whole(R, 1540.0, 40)
    assert m.L_whole(R, 40, 2000.0) == R.T_scan  # the window covered it: the scan alone
    assert m.L_whole(R, 40, 0.0) == pytest.approx(R.T_scan + m.T_pd(R, 40))
    assert m.L_whole(R, 40, 1000.0) == pytest.approx(R.T_scan + m.T_pd(R, 40) - 1000.0)
    assert m.L_whole_first_token(R, 40) == pytest.approx(R.T_scan + 39 * 39.12)
    assert m.L_whole_cold(R, 40) == pytest.approx(m.L_cold(R) + 39 * 39.12)
    assert m.waste_tokens(1.0, 40) == pytest.approx(20.0)
    assert m.waste_tokens(0.25, 40) == pytest.approx(32.0)
    assert m.waste_tokens(0.25, 40, min_hit=0.3) == 0.0  # the policy does not pre-decode
    assert list(m.waste_tokens(np.array([0.25, 4.0]), 40)) == pytest.approx([32.0, 8.0])
    with pytest.raises(ValueError):
        m.T_pd(R, 0)


def test_eq9_and_eq10_known_values():
    served = 0.9453 * 0.664 + (1 - 0.9453) * (14.47 + 39.12)
    assert m.served_latency(R) == pytest.approx(served) == pytest.approx(3.5591, abs=1e-4)
    assert m.expected_latency(R, 0.0) == pytest.approx(54.294)  # h = 0: the baseline
    assert m.expected_latency(R, 1.0) == pytest.approx(served)  # h = 1: the served term
    assert m.expected_latency(R, 0.5) == pytest.approx((54.294 + served) / 2)
    assert m.net_benefit(R)  # Eq. 10 holds at the reference's operating point
    assert m.net_benefit(R, delta=18)  # even at the worst-case delta, thanks to g
    # without the gate, the fall-through at delta 0 still beats cold (53.59 < 54.294) ...
    assert m.net_benefit(R.with_(g=0.0), delta=0)
    # ... but not at delta = L_entry (restore on top of a full prefill)
    assert not m.net_benefit(R.with_(g=0.0), delta=18)
    assert m.g_break_even(R, 0) == 0.0
    ge = m.g_break_even(R, 18)
    assert ge == pytest.approx(14.47 / (68.764 - 0.664))
    assert m.net_benefit(R.with_(g=ge + 1e-6), 18) and not m.net_benefit(R.with_(g=ge - 1e-6), 18)
    assert m.delta_break_even(R) == pytest.approx(18 - 14.47 / 0.843)


def test_summary_table():
    s = m.summary(R)
    assert s["L_cold_ms"] == pytest.approx(54.294)
    assert s["E_L_pp_h0_ms"] == pytest.approx(s["L_cold_ms"])
    assert s["E_L_pp_h1_ms"] == pytest.approx(s["served_ms"])
    assert s["net_benefit_eq10"] and s["net_benefit_eq10_delta_entry"]


def test_constants_validate_and_round_trip():
    with pytest.raises(ValueError):
        Constants(tau_p=-1, T_decode=1, T_scan=1, T_restore=1, L_entry=1, g=0.5)
    with pytest.raises(ValueError):
        Constants(tau_p=1, T_decode=1, T_scan=1, T_restore=1, L_entry=0, g=0.5)
    with pytest.raises(ValueError):
        Constants(tau_p=1, T_decode=1, T_scan=1, T_restore=1, L_entry=1, g=1.5)
    assert Constants.from_dict(json.loads(json.dumps(R.as_dict()))) == R


# -- Eqs. 13-14 from (gap, correct) pairs --------------------------------------------------


def test_coverage_and_false_accept_known_values():
    gaps = [0.5, 1.5, 2.5, 3.5]
    correct = [True, False, True, False]
    assert m.coverage(gaps, 0.0) == 1.0
    assert m.coverage(gaps, 2.0) == 0.5
    assert m.coverage(gaps, 3.5) == 0.0  # strictly greater than tau
    assert m.false_accept(gaps, correct, 0.0) == 0.5
    assert m.false_accept(gaps, correct, 3.0) == 1.0
    assert math.isnan(m.false_accept(gaps, correct, 4.0))  # nothing accepted
    # argmax outside the fast-answer set: never accepted (Eq. 12)
    in_a = [True, True, False, True]
    assert m.coverage(gaps, 2.0, in_a) == 0.25
    assert m.false_accept(gaps, correct, 2.0, in_a) == 1.0
    curve = m.selective_curve(gaps, correct, [0.0, 2.0])
    assert [p["accepted"] for p in curve] == [4, 2]
    assert curve[1]["false_accepts"] == 1
    assert curve[0]["coverage_ci"][0] < 1.0 == curve[0]["coverage_ci"][1]


def test_wilson_known_values():
    assert m.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert m.wilson(121, 128) == pytest.approx((0.891, 0.973), abs=6e-4)  # the reference's
    assert m.wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        m.wilson(3, 2)


# -- properties ------------------------------------------------------------------------------

pos = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)
nonneg = st.floats(min_value=0.0, max_value=1e3, allow_nan=False)
constants = st.builds(Constants, tau_p=pos, T_decode=nonneg, T_scan=pos, T_restore=nonneg,
                      L_entry=st.integers(1, 4096), g=st.floats(0.0, 1.0))


@given(constants, st.integers(1, 4096), st.integers(1, 4096))
def test_speedup_grows_with_entry_length(c, a, b):
    lo, hi = sorted((a, b))
    assert m.speedup(c, lo) <= m.speedup(c, hi)
    if lo < hi:
        assert m.speedup(c, lo) < m.speedup(c, hi)  # tau_p > 0: strictly


@given(constants, st.floats(0, 1), st.floats(0, 1))
def test_fall_through_grows_with_delta_and_stays_within_a_restore_of_cold(c, x, y):
    d1, d2 = sorted((x * c.L_entry, y * c.L_entry))
    assert m.L_fall(c, d1) <= m.L_fall(c, d2) + 1e-9
    assert m.L_fall(c, d2) <= m.L_cold(c) + c.T_restore + 1e-9


@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=60),
       st.floats(-60, 60), st.floats(-60, 60), st.data())
def test_coverage_non_increasing_in_tau(gaps, t1, t2, data):
    in_a = data.draw(st.lists(st.booleans(), min_size=len(gaps), max_size=len(gaps)))
    lo, hi = sorted((t1, t2))
    assert m.coverage(gaps, hi, in_a) <= m.coverage(gaps, lo, in_a)
    assert 0.0 <= m.coverage(gaps, lo, in_a) <= 1.0


@given(st.floats(0, 1e6), st.floats(0, 1e6))
def test_hit_rate_in_unit_interval_and_increasing_in_rho(a, b):
    lo, hi = sorted((a, b))
    assert 0.0 <= m.hit_rate(lo) <= m.hit_rate(hi) <= 1.0
    assert m.hit_rate(lo) + m.wasted(lo) == pytest.approx(1.0)
    if hi > lo and hi < 1e3:
        assert m.hit_rate(lo) < m.hit_rate(hi)


@given(constants, st.floats(0, 1), st.floats(0, 1))
def test_expected_latency_between_served_and_cold_and_monotone_when_eq10_holds(c, h1, h2):
    lo, hi = sorted((h1, h2))
    e_lo, e_hi = m.expected_latency(c, lo), m.expected_latency(c, hi)
    served, cold = m.served_latency(c), m.L_cold(c)
    assert min(served, cold) - 1e-9 <= e_lo <= max(served, cold) + 1e-9
    if m.net_benefit(c):
        assert e_hi <= e_lo + 1e-9  # more hits never hurt
        if hi * (cold - served) > 1e-9 * cold:  # any h > 0 beats the baseline (Eq. 10),
            assert e_hi < cold  # once the gain is above rounding


# -- the simulator agrees with the closed form ------------------------------------------------


@pytest.mark.parametrize("rho", RHOS)
def test_simulated_hit_rate_matches_rho_over_one_plus_rho(rho):
    """Instantaneous pre-positions: the per-pre-position hit rate is rho / (1 + rho)."""
    res = simulate(R, SimConfig(rho=rho, n_prepositions=4000, T_pp_ms=0.0, seed=7))
    assert res.prepositions == 4000
    assert res.closed_form["hit_rate"] == pytest.approx(rho / (1 + rho))
    lo, hi = m.wilson(res.hits, res.prepositions, z=3.29)  # 99.9%: no flaky seeds
    assert lo <= rho / (1 + rho) <= hi, (rho, res.hit_rate)
    assert res.wasted == pytest.approx(1 - res.hit_rate)
    assert res.incomplete == 0 and res.fits == res.prepositions
    assert res.paths["cold"] == 0  # every query finds a record ...
    assert res.ready_fraction == 1.0
    # ... so its latency is the served term: fast with probability g, else the fall-through
    assert res.paths["fast"] / res.queries == pytest.approx(R.g, abs=4 * math.sqrt(
        R.g * (1 - R.g) / res.queries))
    lo, hi = res.mean_latency_ci
    assert abs(res.mean_latency_ms - m.served_latency(R)) <= hi - lo  # ~4 standard errors


@pytest.mark.parametrize("early", ["cold", "partial"])
@pytest.mark.parametrize("rho", [0.5, 4.0])
def test_simulator_matches_its_closed_form_with_finite_preposition_time(rho, early):
    """T_pp = 400 ms at one update a second and 20% of pre-positions skipped by the budget."""
    cfg = SimConfig(rho=rho, n_prepositions=6000, T_pp_ms=400.0, skip=0.2, early=early,
                    seed=3)
    res = simulate(R, cfg)
    cf = closed_form(R, cfg)
    a = math.exp(-0.4)
    assert cf["hit_rate"] == pytest.approx((1 if early == "partial" else a) * rho / (1 + rho))
    assert cf["ready_fraction"] == pytest.approx(0.8 * a)
    assert cf["fits_fraction"] == pytest.approx(math.exp(-(1 + rho) * 0.4))
    n = res.prepositions
    se = math.sqrt(cf["hit_rate"] * (1 - cf["hit_rate"]) / n)
    assert abs(res.hit_rate - cf["hit_rate"]) < 4 * se
    assert abs(res.fits / n - cf["fits_fraction"]) < 4 * math.sqrt(0.25 / n)
    assert abs(res.incomplete / n - (1 - a)) < 4 * math.sqrt(0.25 / n)
    assert res.skipped / (res.skipped + n) == pytest.approx(0.2, abs=0.03)
    lo, hi = res.mean_latency_ci
    half = (hi - lo) / 2
    assert abs(res.mean_latency_ms - cf["mean_latency_ms"]) < 2 * half  # ~4 standard errors
    assert (res.paths["early"] > 0) == (early == "partial")


def test_wilson_intervals_cover_the_closed_form_about_95_percent_of_the_time():
    """Over many seeds at 128 pre-positions, the closed form falls outside the measured
    point's Wilson 95% interval about 5% of the time: the simulator is unbiased and the
    interval honest."""
    misses, lat_misses, n = 0, 0, 400
    for seed in range(n):
        res = simulate(R, SimConfig(rho=2.0, n_prepositions=128, seed=seed))
        misses += not res.agrees["hit_rate_in_wilson"]
        lat_misses += not res.agrees["latency_in_ci"]
    assert 0.01 <= misses / n <= 0.10
    assert lat_misses / n <= 0.12


def test_simulator_is_deterministic_and_the_budget_knob_skips():
    a = simulate(R, SimConfig(rho=1.0, n_prepositions=200, seed=5))
    b = simulate(R, SimConfig(rho=1.0, n_prepositions=200, seed=5))
    c = simulate(R, SimConfig(rho=1.0, n_prepositions=200, seed=6))
    assert a.as_dict() == b.as_dict()
    assert a.as_dict() != c.as_dict()
    skipped = simulate(R, SimConfig(rho=1.0, n_prepositions=200, skip=0.5, seed=5))
    assert skipped.prepositions == 200 and skipped.skipped > 100
    assert skipped.paths["cold"] > a.paths["cold"]
    # the sweep is per-point seeded: a point does not depend on the others in the sweep
    assert sweep(R, [1.0, 2.0], n_prepositions=200, seed=5)[0].as_dict() == a.as_dict()
    with pytest.raises(ValueError):
        SimConfig(rho=1.0, skip=1.0)
    with pytest.raises(ValueError):
        SimConfig(rho=-1.0)
    with pytest.raises(ValueError):
        SimConfig(rho=1.0, early="late")


def test_the_whole_answers_closed_form_meets_the_model_at_its_limits():
    """The simulated process's whole-answer closed form against model.py: idle windows far
    longer than the pre-decode give L_whole's fast path (and L_whole_first_token with the
    first token alone), far shorter ones L_whole at no idle time; instantaneous steps give
    waste_tokens' N (1 - h); a skipped update, the cold whole answer."""
    N = 40
    slow = closed_form(R, SimConfig(rho=1.0, update_rate=1e-8, predecode=N))
    assert slow["whole_ms"] == pytest.approx(m.L_whole(R, N, 1e12), abs=1e-3)
    assert slow["whole_first_token_only_ms"] == pytest.approx(m.L_whole_first_token(R, N),
                                                              abs=1e-3)
    assert slow["waste_tokens_per_update"] == pytest.approx(m.waste_tokens(1.0, N), rel=1e-4)
    fast = closed_form(R, SimConfig(rho=1.0, update_rate=1e6, predecode=N))
    assert fast["whole_ms"] == pytest.approx(m.L_whole(R, N, 0.0), rel=1e-4)
    assert fast["waste_tokens_per_update"] == pytest.approx(0.0, abs=1e-9)
    for rho in (0.25, 1.0, 4.0):
        inst = closed_form(R.with_(T_decode=0.0), SimConfig(rho=rho, T_pp_ms=0.0, predecode=N))
        assert inst["waste_tokens_per_update"] == pytest.approx(m.waste_tokens(rho, N))
        assert inst["waste_tokens_per_update_iid"] == pytest.approx(m.waste_tokens(rho, N))
        assert inst["whole_ms"] == pytest.approx(R.T_scan)
        h = m.hit_rate(rho)  # N tokens wasted with probability 1 - h, else none
        assert inst["waste_tokens_per_update_sd"] == pytest.approx(N * math.sqrt(h * (1 - h)))
    half = closed_form(R, SimConfig(rho=1.0, update_rate=1e-8, skip=0.5, predecode=N))
    assert half["whole_ms"] == pytest.approx((R.T_scan + m.L_whole_cold(R, N)) / 2, abs=1e-3)
    # the reference at one update a second: T_pd = 1540.854 ms, E[max(0, T_pd - A)] for
    # A ~ Exp(1/s) is T_pd - (1 - exp(-1.540854)) s
    ref = closed_form(R, SimConfig(rho=1.0, predecode=N))
    assert ref["whole_T_pd_ms"] == pytest.approx(m.T_pd(R, N))
    assert ref["whole_ms"] == pytest.approx(755.716, abs=1e-3)
    assert ref["whole_served_complete_fraction"] == pytest.approx(math.exp(-1.540854))
    assert "whole_ms" not in closed_form(R, SimConfig(rho=1.0))  # off by default


@pytest.mark.parametrize("t_pp,skip", [(None, 0.0), (400.0, 0.3)])
@pytest.mark.parametrize("rho", [0.25, 1.0, 4.0])
def test_simulated_whole_answer_matches_its_closed_form(rho, t_pp, skip):
    """Time to the whole 40-token answer (pre-decoded, and the first token alone) and the
    pre-decoded tokens wasted per update: the simulation within ~4 standard errors of the
    closed form, at Eq. 6's T_pp and at 400 ms with 30% of updates skipped."""
    cfg = SimConfig(rho=rho, n_prepositions=4000, T_pp_ms=t_pp, skip=skip, predecode=40,
                    seed=11)
    res = simulate(R, cfg)
    w, cf = res.whole, res.closed_form
    assert w["N"] == 40 and w["T_pd_ms"] == pytest.approx(cfg.t_pp(R) + 39 * R.T_decode)
    for k in ("whole_ms", "whole_first_token_only_ms", "waste_tokens_per_update"):
        lo, hi = w[k + "_ci"]
        assert 0 < hi - lo and abs(w[k] - cf[k]) < (hi - lo), (k, w[k], cf[k])
        assert res.agrees[{"whole_ms": "whole_in_ci", "waste_tokens_per_update": "waste_in_ci",
                           "whole_first_token_only_ms": "first_token_only_in_ci"}[k]]
    p = cf["whole_served_complete_fraction"]
    assert abs(w["served_complete"] / res.queries - p) < 4 * math.sqrt(p * (1 - p) / res.queries)
    # pre-decoding beats the first token alone; a wasted token is one nobody asked for
    assert w["whole_ms"] < w["whole_first_token_only_ms"]
    assert w["waste_tokens"] <= 40 * (res.prepositions - res.hits)
    assert w["waste_tokens_per_update"] < cf["waste_tokens_per_update_iid"]


def test_whole_answer_intervals_cover_the_closed_form_about_95_percent_of_the_time():
    misses = {"whole_in_ci": 0, "waste_in_ci": 0}
    n = 200
    for seed in range(n):
        res = simulate(R, SimConfig(rho=2.0, n_prepositions=128, predecode=40, seed=seed))
        for k in misses:
            misses[k] += not res.agrees[k]
    assert 0.01 <= misses["whole_in_ci"] / n <= 0.12
    assert misses["waste_in_ci"] / n <= 0.12


def test_predecoding_leaves_the_first_token_simulation_as_it_was():
    off = simulate(R, SimConfig(rho=1.0, n_prepositions=300, T_pp_ms=300.0, seed=4))
    on = simulate(R, SimConfig(rho=1.0, n_prepositions=300, T_pp_ms=300.0, seed=4,
                               predecode=8))
    assert off.whole == {} and on.whole["N"] == 8
    assert (on.hits, on.paths, on.mean_latency_ms) == (off.hits, off.paths, off.mean_latency_ms)
    one = simulate(R, SimConfig(rho=1.0, n_prepositions=300, T_pp_ms=300.0, seed=4,
                                predecode=1)).whole
    assert one["whole_ms"] == pytest.approx(one["whole_first_token_only_ms"])  # N = 1: the same
    with pytest.raises(ValueError):
        SimConfig(rho=1.0, predecode=-1)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 20), st.floats(0, 2000), st.floats(0, 0.9), st.integers(0, 2**31))
def test_simulator_accounting_is_consistent(rho, t_pp, skip, seed):
    res = simulate(R, SimConfig(rho=rho, n_prepositions=64, T_pp_ms=t_pp, skip=skip,
                                seed=seed))
    assert res.prepositions == 64
    assert 0 <= res.hits <= res.prepositions
    assert res.incomplete + res.fits <= res.prepositions
    assert sum(res.paths.values()) == res.queries
    assert res.hit_rate_ci[0] <= res.hit_rate <= res.hit_rate_ci[1]
    assert res.paths["early"] == 0  # early="cold" by default
    if res.queries:
        assert m.L_fast(R) - 1e-9 <= res.mean_latency_ms <= m.L_cold(R) + 1e-9


# -- the CLI -------------------------------------------------------------------------------------


def engine_paths_json(tmp_path):
    paths = {name: {"n": 32, "p50_ms": v, "p99_ms": 2 * v} for name, v in {
        "cold": 300.0, "fast_exact": 0.05, "decode_step": 70.0, "fall_delta0": 80.0,
        "restore_crop": 0.2, "bare_forward": 180.0, "fall_delta_entry": 400.0}.items()}
    f = tmp_path / "engine_paths.json"
    f.write_text(json.dumps({"benchmark": "engine_paths", "model": "timing model: test (x)",
                             "entry_tokens": 18, "paths": paths,
                             "machine": {"date": "2026-01-02 03:04:05 UTC"}}))
    return f


def test_constants_from_engine_paths(tmp_path):
    f = engine_paths_json(tmp_path)
    c, measured, pts = sim_cli.constants_from_json(f)
    assert c.L_entry == 18
    assert c.T_decode == 70.0 and c.T_scan == 0.05
    assert c.T_restore == pytest.approx(10.0)  # fall at delta 0 minus decode (residual)
    assert c.tau_p == pytest.approx(10.0)  # bare forward / entry tokens: no slope in the file
    assert "derived" in c.sources["tau_p"]
    assert measured["cold"] == 300.0 and measured["fast"] == 0.05 and measured["cold_p99"] == 600
    assert pts == []
    assert sim_cli.constants_from_json(f, restore="crop")[0].T_restore == 0.2
    # a prefill slope (HW-1) and an entry-length sweep, when the file has them
    d = json.loads(f.read_text())
    d["prefill"] = {"slope_ms_per_token": 1.5, "points": [[8, 90.0], [32, 120.0]]}
    f.write_text(json.dumps(d))
    c, _, pts = sim_cli.constants_from_json(f)
    assert c.tau_p == 1.5 and "measured" in c.sources["tau_p"]
    assert pts == [(8.0, 90.0), (32.0, 120.0)]


def test_simulate_cli_end_to_end(tmp_path, capsys):
    f = engine_paths_json(tmp_path)
    out = tmp_path / "simulate.json"
    figs = tmp_path / "figures"
    rc = sim_cli.main(["--constants", str(f), "--g", "0.9", "--out", str(out),
                       "--figures", str(figs), "--n", "128", "--check"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert rc == 0, summary["checks"]
    assert summary["primary"] == "ours" and summary["rho"] == list(RHOS)
    assert summary["constants"]["g"] == 0.9
    assert all(n >= 128 for n in summary["prepositions"])
    for h, (lo, hi), cf in zip(summary["h"], summary["h_wilson95"], summary["h_closed_form"]):
        assert lo <= h <= hi and lo <= cf <= hi
    assert summary["checks"]["net_benefit_eq10"]
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"ours", "reference"}
    assert len(data["runs"]["ours"]["points"]) == len(RHOS)
    w = summary["whole"]  # the whole 40-token answer, on by default
    assert w["N"] == 40 and len(w["whole_ms"]) == len(RHOS)
    for k in ("whole_in_ci_all", "first_token_only_in_ci_all", "waste_in_ci_all"):
        assert summary["checks"][k]
    assert all(a < b for a, b in zip(w["whole_ms"], w["whole_first_token_only_ms"]))
    names = sorted(p.name for p in figs.iterdir())
    assert names == sorted([f"fig{i}_{what}_{tag}.png" for tag in ("ours", "reference")
                            for i, what in ((4, "latency_speedup"), (5, "cost_anatomy"),
                                            (6, "hit_rate_latency"))]
                           + [f"fig_whole_answer_{tag}.png" for tag in ("ours", "reference")])
    assert all((figs / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    # the written file's constants can be read back as constants
    c, _, _ = sim_cli.constants_from_json(out)
    assert c.g == 0.9 and c.T_decode == 70.0


def test_simulate_cli_reference_only(tmp_path, capsys):
    rc = sim_cli.main(["--reference", "--instant", "--no-figures", "--n", "128",
                       "--predecode", "0", "--out", str(tmp_path / "s.json")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert summary["whole"] is None and "waste_in_ci_all" not in summary["checks"]
    assert summary["primary"] == "reference" and summary["figures"] == []
    assert summary["h_closed_form"] == pytest.approx([r / (1 + r) for r in RHOS], abs=1e-4)
    assert summary["L_cold_ms"] == pytest.approx(54.294)


def test_gate_from_calibration_and_trace_points(tmp_path):
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"models": {
        "trend-reader": {"at_reference_tau": {"tau": 2.0, "coverage": 0.93}},
        "trend-reader-weak": {"at_reference_tau": {"tau": 2.0, "coverage": 0.0}}}}))
    assert sim_cli.gate_from_calibration(cal) == 0.93
    assert sim_cli.gate_from_calibration(tmp_path / "missing.json") is None
    tr = tmp_path / "trace.json"
    tr.write_text(json.dumps({"points": [
        {"rho": 1.0, "hits": 64, "prepositions": 128},
        {"rho": 2.0, "hit_rate": 0.6, "hit_rate_ci": [0.5, 0.7], "prepositions": 128}]}))
    pts = sim_cli.trace_points(tr)
    assert pts[0]["hit_rate"] == 0.5 and pts[0]["hit_rate_ci"] == m.wilson(64, 128)
    assert pts[1]["hit_rate_ci"] == (0.5, 0.7)
    f = engine_paths_json(tmp_path)
    rc = sim_cli.main(["--constants", str(f), "--calibration", str(cal), "--trace", str(tr),
                       "--no-figures", "--out", str(tmp_path / "s.json")])
    assert rc == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["runs"]["ours"]["constants"]["g"] == 0.93
    assert "calibration" in data["runs"]["ours"]["constants"]["sources"]["g"]
    assert len(data["trace_points"]) == 2
