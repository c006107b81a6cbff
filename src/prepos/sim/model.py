"""The closed-form model of Section 2 (Eqs. 2-10, 13-14) as code.

Every latency is in milliseconds; `L_entry` and `delta` are in tokens. The prefill model is
the reference's: linear in the number of tokens processed, `T_prefill(k) = tau_p * k`
(HW-1 measures `tau_p` as the slope of prefill time against unique prompt lengths).

The functions accept numpy arrays where a sweep makes sense (`L_entry`, `h`, `rho`), so the
figures evaluate the same code the tests check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from prepos.stats import Z95, wilson  # noqa: F401  (the one implementation, re-exported)


@dataclass(frozen=True)
class Constants:
    """The measured constants the closed form is parameterized by (Table 1)."""

    tau_p: float  # prefill cost per token, ms/token (HW-1)
    T_decode: float  # one decode step, ms (HW-2)
    T_scan: float  # the fast path's vocabulary scan, L_fast of Eq. 3, ms (HW-2)
    T_restore: float  # constant-time restore of the pre-paid entry, ms (HW-2)
    L_entry: int  # the pre-positioned entry, tokens
    g: float  # probability the gate fires given a hit (coverage at the coded tau, HW-3)
    label: str = ""  # whose constants these are, for titles and JSON
    # where each value came from ("measured", "derived: ...", "assumed: ...")
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("tau_p", "T_decode", "T_scan", "T_restore"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.L_entry, (int, np.integer)) and self.L_entry >= 1):
            raise ValueError(f"L_entry must be an integer >= 1, got {self.L_entry!r}")
        if not (0.0 <= self.g <= 1.0):
            raise ValueError(f"g must be a probability in [0, 1], got {self.g!r}")

    def with_(self, **changes: Any) -> Constants:
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Constants:
        keys = {"tau_p", "T_decode", "T_scan", "T_restore", "L_entry", "g", "label", "sources"}
        missing = {"tau_p", "T_decode", "T_scan", "T_restore", "L_entry", "g"} - set(d)
        if missing:
            raise ValueError(f"constants are missing {sorted(missing)}")
        kw = {k: v for k, v in d.items() if k in keys}
        kw["L_entry"] = int(kw["L_entry"])
        for k in ("tau_p", "T_decode", "T_scan", "T_restore", "g"):
            kw[k] = float(kw[k])
        return cls(**kw)


#: The reference's own constants (Table 1: one H100, a 70B-class model at 4-bit, TP=1).
#: T_scan is the marginal vocabulary scan its Figure 4 uses (0.664 ms); the end-to-end fast
#: path, with the per-request floor, is REFERENCE_MEASURED["fast"] (1.01 ms P50).
REFERENCE = Constants(
    tau_p=0.843,
    T_decode=39.12,
    T_scan=0.664,
    T_restore=14.47,
    L_entry=18,
    g=0.9453,
    label="reference (Table 1: H100, 70B-class 4-bit)",
    sources={
        "tau_p": "measured: prefill slope (HW-1)",
        "T_decode": "measured: microbench (HW-2)",
        "T_scan": "derived: L_fast P50 1.01 ms minus the per-request floor (HW-2)",
        "T_restore": "derived: L_fall P50 minus T_decode (HW-2)",
        "L_entry": "measured: representative entry",
        "g": "measured: gate coverage at tau=2.0 (HW-3)",
    },
)

#: The reference's end-to-end first-token measurements (HW-5), P50 unless named, ms.
REFERENCE_MEASURED = {
    "cold": 53.1,
    "cold_p99": 66.9,
    "fall_delta0": 53.0,
    "fast": 1.01,
    "fast_p99": 1.35,
    "decode_step": 39.12,
}


# ---------------------------------------------------------------------------------------
# Section 2.2: critical-path latency


def T_prefill(c: Constants, k):
    """Time to process k tokens: tau_p * k (the linear model HW-1 measures)."""
    out = c.tau_p * np.asarray(k, dtype=float)
    return float(out) if out.ndim == 0 else out


def _entry(c: Constants, L_entry):
    return c.L_entry if L_entry is None else L_entry


def L_cold(c: Constants, L_entry=None):
    """Eq. 2: the stateful baseline prefills the entry on arrival, then decodes."""
    return T_prefill(c, _entry(c, L_entry)) + c.T_decode


def L_fast(c: Constants) -> float:
    """Eq. 3: the fast path is the vocabulary scan alone, independent of the entry."""
    return c.T_scan


def speedup(c: Constants, L_entry=None):
    """Eq. 4: S = L_cold / L_fast; grows with the entry length."""
    if c.T_scan <= 0:
        raise ValueError("the speedup needs T_scan > 0")
    return L_cold(c, L_entry) / c.T_scan


def L_fall(c: Constants, delta=0):
    """Eq. 5: restore the pre-paid entry, prefill only the delta, decode; 0 <= delta <= L_entry."""
    d = np.asarray(delta, dtype=float)
    if np.any(d < 0) or np.any(d > c.L_entry):
        raise ValueError(f"delta must lie in [0, L_entry={c.L_entry}], got {delta!r}")
    return c.T_restore + T_prefill(c, delta) + c.T_decode


# ---------------------------------------------------------------------------------------
# Section 2.3: amortization, hit rate, net benefit


def T_pp(c: Constants, L_entry=None):
    """Eq. 6: one pre-position is one forward over the entry."""
    return T_prefill(c, _entry(c, L_entry))


def amortized(c: Constants, I_idle) -> bool | np.ndarray:
    """Eq. 7: the pre-position is wall-clock-free when it fits the idle window (ms)."""
    out = T_pp(c) <= np.asarray(I_idle, dtype=float)
    return bool(out) if out.ndim == 0 else out


def hit_rate(rho):
    """Eq. 8's hit rate under Poisson queries and updates with instantaneous pre-positions:
    a pre-position is consumed iff the next event after its update is a query,
    h = lambda_q / (lambda_q + lambda_u) = rho / (1 + rho)."""
    r = np.asarray(rho, dtype=float)
    if np.any(r < 0):
        raise ValueError("rho must be >= 0")
    h = r / (1.0 + r)
    return float(h) if np.ndim(rho) == 0 else h


def wasted(rho):
    """Eq. 8: the wasted-work fraction w = 1 - h."""
    h = hit_rate(rho)
    return 1.0 - h


def served_latency(c: Constants, delta=0) -> float:
    """The served term of Eqs. 9-10: g L_fast + (1 - g) L_fall(delta)."""
    return c.g * L_fast(c) + (1.0 - c.g) * float(L_fall(c, delta))


def expected_latency(c: Constants, h, delta=0):
    """Eq. 9: E[L_pp] = h (g L_fast + (1 - g) L_fall) + (1 - h) L_cold, where h is the
    probability that a request finds a valid pre-position."""
    hh = np.asarray(h, dtype=float)
    if np.any(hh < 0) or np.any(hh > 1):
        raise ValueError("h must lie in [0, 1]")
    out = hh * served_latency(c, delta) + (1.0 - hh) * float(L_cold(c))
    return float(out) if np.ndim(h) == 0 else out


def net_benefit(c: Constants, delta=0) -> bool:
    """Eq. 10: pre-positioning lowers expected latency for every h > 0 iff
    g L_fast + (1 - g) L_fall < L_cold."""
    return served_latency(c, delta) < float(L_cold(c))


def g_break_even(c: Constants, delta=0) -> float:
    """The least gate-fire probability for which Eq. 10 holds (0 when even a fall-through
    beats the cold path; above 1 when nothing can)."""
    fall, cold, fast = float(L_fall(c, delta)), float(L_cold(c)), L_fast(c)
    if fall < cold:
        return 0.0
    if fast >= cold:
        return math.inf
    return (fall - cold) / (fall - fast)


def delta_break_even(c: Constants) -> float:
    """The largest delta for which the fall-through beats the cold path:
    L_fall - L_cold = T_restore - T_prefill(L_entry - delta) < 0."""
    if c.tau_p <= 0:
        return -math.inf
    return c.L_entry - c.T_restore / c.tau_p


# ---------------------------------------------------------------------------------------
# The whole answer: an exact match's N-token greedy answer pre-decoded in the idle window
# (Eq. 7's amortization with N - 1 decode steps after the pre-position)


def T_pd(c: Constants, N):
    """The pre-position and the N - 1 decode steps after its first token: the whole answer."""
    n = np.asarray(N, dtype=float)
    if np.any(n < 1):
        raise ValueError("N must be >= 1")
    out = T_pp(c) + (n - 1) * c.T_decode
    return float(out) if out.ndim == 0 else out


def amortized_whole(c: Constants, I_idle, N) -> bool | np.ndarray:
    """Eq. 7 for the whole answer: wall-clock-free when it fits the idle window (ms)."""
    out = T_pd(c, N) <= np.asarray(I_idle, dtype=float)
    return bool(out) if np.ndim(out) == 0 else out


def L_whole(c: Constants, N, I_idle):
    """Time to the whole N-token answer of an exact match asked I_idle ms after its update,
    pre-decoding on: the fast path once the idle window covered the pre-decode, else the
    scan plus what is left of it (the request takes what was decoded and decodes on)."""
    rest = np.maximum(0.0, T_pd(c, N) - np.asarray(I_idle, dtype=float))
    out = c.T_scan + rest
    return float(out) if np.ndim(out) == 0 else out


def L_whole_first_token(c: Constants, N):
    """The same with the first token alone cached (an idle window covering the pre-position):
    the scan, then N - 1 decode steps on the critical path."""
    out = c.T_scan + (np.asarray(N, dtype=float) - 1) * c.T_decode
    return float(out) if out.ndim == 0 else out


def L_whole_cold(c: Constants, N):
    """Nothing pre-positioned: the entry's prefill and N decode steps (Eq. 2's, N times)."""
    out = float(L_cold(c)) + (np.asarray(N, dtype=float) - 1) * c.T_decode
    return float(out) if out.ndim == 0 else out


def waste_tokens(rho, N, min_hit: float = 0.0):
    """Pre-decoded tokens never served, per update, under Eq. 8's Poisson race: the whole
    answer is thrown away when the next event is an update, N (1 - h(rho)); none where the
    policy does not pre-decode (h(rho) below `min_hit`)."""
    h = np.asarray(hit_rate(rho), dtype=float)
    out = np.where(h >= min_hit, np.asarray(N, dtype=float) * (1.0 - h), 0.0)
    return float(out) if out.ndim == 0 else out


# ---------------------------------------------------------------------------------------
# Section 2.4: the gate's risk-coverage trade (Eqs. 13-14) from (gap, correct) pairs


def _pairs(gaps: Sequence[float], correct: Sequence[bool], in_answers: Sequence[bool] | None):
    g = np.asarray(gaps, dtype=float)
    ok = np.asarray(correct, dtype=bool)
    a = np.ones_like(ok) if in_answers is None else np.asarray(in_answers, dtype=bool)
    if not (g.shape == ok.shape == a.shape) or g.ndim != 1:
        raise ValueError("gaps, correct and in_answers must be 1-d and of one length")
    return g, ok, a


def accepted(gaps: Sequence[float], tau: float,
             in_answers: Sequence[bool] | None = None) -> np.ndarray:
    """Eq. 12 per pair: gap > tau and argmax in A."""
    g = np.asarray(gaps, dtype=float)
    a = np.ones(g.shape, dtype=bool) if in_answers is None else np.asarray(in_answers, bool)
    return (g > tau) & a


def coverage(gaps: Sequence[float], tau: float,
             in_answers: Sequence[bool] | None = None) -> float:
    """Eq. 13: the fraction of requests the gate accepts (nan for no pairs)."""
    acc = accepted(gaps, tau, in_answers)
    return float(acc.mean()) if acc.size else math.nan


def false_accept(gaps: Sequence[float], correct: Sequence[bool], tau: float,
                 in_answers: Sequence[bool] | None = None) -> float:
    """Eq. 14: of the accepted, the fraction whose served token is wrong (nan if none)."""
    g, ok, a = _pairs(gaps, correct, in_answers)
    acc = accepted(g, tau, a)
    n = int(acc.sum())
    return float((~ok[acc]).sum() / n) if n else math.nan


def selective_curve(gaps: Sequence[float], correct: Sequence[bool], taus: Sequence[float],
                    in_answers: Sequence[bool] | None = None) -> list[dict]:
    """Eqs. 13-14 over a sweep of tau, with counts and Wilson 95% intervals."""
    g, ok, a = _pairs(gaps, correct, in_answers)
    out = []
    for tau in taus:
        acc = accepted(g, tau, a)
        n_acc, n_wrong = int(acc.sum()), int((~ok[acc]).sum())
        out.append({
            "tau": float(tau), "n": int(g.size), "accepted": n_acc, "false_accepts": n_wrong,
            "coverage": n_acc / g.size if g.size else math.nan,
            "coverage_ci": wilson(n_acc, int(g.size)),
            "false_accept": n_wrong / n_acc if n_acc else math.nan,
            "false_accept_ci": wilson(n_wrong, n_acc),
        })
    return out


# ---------------------------------------------------------------------------------------
# Statistics


# ---------------------------------------------------------------------------------------
# One table of the closed form at the constants


def summary(c: Constants, delta: float = 0) -> dict:
    """Every closed-form quantity at the constants' entry length, for JSON and tests."""
    return {
        "constants": c.label,
        "T_prefill_entry_ms": float(T_prefill(c, c.L_entry)),
        "L_cold_ms": float(L_cold(c)),
        "L_fast_ms": L_fast(c),
        "S": float(speedup(c)) if c.T_scan > 0 else math.inf,
        "L_fall_delta0_ms": float(L_fall(c, 0)),
        "L_fall_delta_entry_ms": float(L_fall(c, c.L_entry)),
        "L_fall_delta_ms": float(L_fall(c, delta)),
        "delta": delta,
        "T_pp_ms": float(T_pp(c)),
        "served_ms": served_latency(c, delta),
        "E_L_pp_h0_ms": expected_latency(c, 0.0, delta),
        "E_L_pp_h1_ms": expected_latency(c, 1.0, delta),
        "net_benefit_eq10": net_benefit(c, delta),
        "net_benefit_eq10_delta0": net_benefit(c, 0),
        "net_benefit_eq10_delta_entry": net_benefit(c, c.L_entry),
        "g": c.g,
        "g_break_even": g_break_even(c, delta),
        "delta_break_even_tokens": delta_break_even(c),
    }
