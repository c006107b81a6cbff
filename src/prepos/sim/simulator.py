"""A seeded discrete-event session simulator, and the closed forms it is checked against.

One streaming session: data updates arrive as a Poisson process of rate lambda_u, queries as
an independent Poisson process of rate lambda_q = rho * lambda_u. Every update invalidates the
ready record and (unless the budget knob skips it) starts a pre-position that takes T_pp
(Eq. 6) and completes only if the next update does not come first. As in the engine's
streaming sessions, a query does not mutate the session: a completed record serves every query
until the next update, and a pre-position is a *hit* when at least one request used it before
it was invalidated (the engine's `consumed` counter; the reference's "fraction of
pre-positions consumed by a request before invalidation").

A query that finds a completed record takes the fast path with probability g (the gate of
Eq. 12) and otherwise falls through (Eq. 5, at `delta`); a query with no record takes the cold
path (Eq. 2). A query that arrives while the pre-position is still running takes the cold path
(`early="cold"`, the default) or, as the engine's longest-prefix restore does, restores the
part of the entry already computed and prefills the rest (`early="partial"`; that counts as
using the pre-position). Path latencies are the closed-form values of Eqs. 2, 3, 5; the model
worker's own occupancy by queries is not modelled.

Closed forms for this process (a = exp(-lambda_u T_pp), s = skip probability):

* per pre-position hit rate: h = a * rho / (1 + rho) (early="cold"), h = rho / (1 + rho)
  (early="partial"); for instantaneous pre-positions both are Eq. 8's rho / (1 + rho);
* the fraction of queries that find a completed record: q = (1 - s) a, independent of rho
  (a query's age since the last update is exponential with rate lambda_u);
* the per-query expected first-token latency: Eq. 9 with h replaced by q (plus, with
  early="partial", the early queries' partial fall-throughs);
* Eq. 7 holds (the pre-position completes before the next request and the next update) with
  probability exp(-(lambda_u + lambda_q) T_pp).

The whole answer (`predecode` = N > 0): after the pre-position the idle worker goes on decoding
the exact match's greedy answer, N - 1 more steps of T_decode, T_pd = T_pp + (N - 1) T_decode
in all, until the next update discards it. A query asked A after its update gets the whole
answer at T_scan + max(0, T_pd - A) (the model's L_whole: what was decoded at once, the rest
decoded on, whatever `early` says of the first token; the pre-decoded answer is the greedy
answer itself, so no gate), or, with the first token alone pre-positioned, at
T_scan + max(0, T_pp - A) + (N - 1) T_decode; after a skipped update, at L_whole_cold.
An update's pre-decoded tokens are wasted when no query came before the next update.
With A ~ Exp(lambda_u) and Lambda = lambda_u + lambda_q:

* E[max(0, T - A)] = T - (1 - exp(-lambda_u T)) / lambda_u, for T = T_pd or T_pp;
* wasted tokens per update: (1 - s) (1 - h_iid) sum_{j<N} exp(-Lambda (T_pp + j T_decode)),
  N (1 - rho / (1 + rho)) for instantaneous steps (the model's waste_tokens).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from prepos.sim import model as m
from prepos.sim.model import Constants

EARLY_MODES = ("cold", "partial")
#: The whole answer's mean times agree with the closed form when it lies inside the simulated
#: interval widened by this fraction of its value: with the first token alone, the time varies
#: only for the rare query asked during the pre-position, and a short trace that has none
#: has an interval of width 0 (the wasted tokens are checked on their score interval alone).
WHOLE_REL_TOL = 0.01


@dataclass(frozen=True)
class SimConfig:
    rho: float  # query-to-update ratio lambda_q / lambda_u
    update_rate: float = 1.0  # lambda_u, updates per second
    n_prepositions: int = 128  # executed pre-positions to simulate (skipped ones not counted)
    T_pp_ms: float | None = None  # None: Eq. 6 from the constants; 0: instantaneous
    skip: float = 0.0  # budget knob: probability an update's pre-position is skipped
    delta: float = 0.0  # fall-through delta on a gate miss, tokens (Eq. 5)
    early: str = "cold"  # a query during a running pre-position: "cold" or "partial"
    seed: int = 0
    z: float = m.Z95  # the intervals' normal quantile (a family-wise one for a sweep's check)
    predecode: int = 0  # N: the whole answer's tokens pre-decoded after each update; 0: off

    def __post_init__(self) -> None:
        if not (self.rho >= 0 and math.isfinite(self.rho)):
            raise ValueError(f"rho must be finite and >= 0, got {self.rho!r}")
        if not (self.update_rate > 0 and math.isfinite(self.update_rate)):
            raise ValueError(f"update_rate must be > 0, got {self.update_rate!r}")
        if self.n_prepositions < 1:
            raise ValueError("n_prepositions must be >= 1")
        if self.T_pp_ms is not None and not (self.T_pp_ms >= 0 and math.isfinite(self.T_pp_ms)):
            raise ValueError(f"T_pp_ms must be finite and >= 0, got {self.T_pp_ms!r}")
        if not (0.0 <= self.skip < 1.0):
            raise ValueError(f"skip must lie in [0, 1), got {self.skip!r}")
        if self.early not in EARLY_MODES:
            raise ValueError(f"early must be one of {EARLY_MODES}, got {self.early!r}")
        if not (isinstance(self.predecode, int) and self.predecode >= 0):
            raise ValueError(f"predecode must be an integer >= 0, got {self.predecode!r}")

    def t_pp(self, c: Constants) -> float:
        """The pre-position time in ms."""
        return float(m.T_pp(c)) if self.T_pp_ms is None else float(self.T_pp_ms)


@dataclass
class SimResult:
    rho: float
    seed: int
    T_pp_ms: float
    update_rate: float
    query_rate: float
    # per pre-position
    prepositions: int  # executed (started)
    skipped: int  # skipped by the budget knob
    hits: int  # used by at least one request before invalidation
    incomplete: int  # invalidated while still running
    fits: int  # completed before the next request and the next update (Eq. 7)
    hit_rate: float
    hit_rate_ci: tuple[float, float]  # Wilson 95%
    wasted: float  # 1 - hit_rate (Eq. 8)
    wasted_work_ms: float  # pre-position time spent on pre-positions nobody used
    # per query
    queries: int
    paths: dict[str, int]  # fast, fall, early (partial fall-through), cold
    ready_fraction: float  # queries that found a completed record
    mean_latency_ms: float
    mean_latency_ci: tuple[float, float]  # normal 95% on the mean
    simulated_s: float
    closed_form: dict = field(default_factory=dict)
    agrees: dict = field(default_factory=dict)
    whole: dict = field(default_factory=dict)  # the whole answer, when predecode > 0

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------
# Closed forms for the simulated process


def closed_form(c: Constants, cfg: SimConfig) -> dict:
    lam_u = cfg.update_rate
    lam_q = cfg.rho * lam_u
    T = cfg.t_pp(c) / 1e3  # seconds
    a = math.exp(-lam_u * T)
    s = cfg.skip
    h_iid = m.hit_rate(cfg.rho)
    h = h_iid if cfg.early == "partial" else a * h_iid
    q = (1 - s) * a
    served = m.served_latency(c, cfg.delta)
    cold = float(m.L_cold(c))
    if cfg.early == "partial" and T > 0 and a < 1:
        # a query whose update is A < T ago finds L_entry * A / T tokens computed
        mean_age = 1 / lam_u - T * a / (1 - a)  # E[A | A < T]
        early_ms = c.T_restore + c.T_decode + c.tau_p * c.L_entry * (1 - mean_age / T)
        p_early = (1 - s) * (1 - a)
    else:
        early_ms, p_early = cold, (1 - s) * (1 - a)
    latency = q * served + p_early * early_ms + s * cold
    return {
        "hit_rate": h,
        "hit_rate_iid": h_iid,  # Eq. 8, instantaneous pre-positions
        "wasted": 1 - h,
        "ready_fraction": q,
        "mean_latency_ms": latency,
        "eq9_at_ready_fraction_ms": m.expected_latency(c, q, cfg.delta),
        "eq9_at_hit_rate_ms": m.expected_latency(c, h_iid, cfg.delta),  # the reference's curve
        "fits_fraction": math.exp(-(lam_u + lam_q) * T),
        "L_cold_ms": cold,
        **(whole_closed_form(c, cfg) if cfg.predecode else {}),
    }


def _mean_excess(T_ms: float, lam_u: float) -> float:
    """E[max(0, T - A)] in ms for an age A ~ Exp(lam_u per second)."""
    T = T_ms / 1e3
    return 1e3 * (T + math.expm1(-lam_u * T) / lam_u)


def whole_closed_form(c: Constants, cfg: SimConfig) -> dict:
    """The whole answer's per-query means and per-update waste for the simulated process."""
    N, lam_u, s = cfg.predecode, cfg.update_rate, cfg.skip
    t_pp = cfg.t_pp(c)
    t_pd = t_pp + (N - 1) * c.T_decode
    cold = float(m.L_whole_cold(c, N))
    lam = lam_u * (1 + cfg.rho)
    starts = (t_pp + np.arange(N) * c.T_decode) / 1e3  # when each token is ready, s
    reach = (1 - s) * (1 - m.hit_rate(cfg.rho)) * np.exp(-lam * starts)  # P(token j wasted)
    # W = k 1[no query], k = #{j : t_j <= E}: E[W] = sum_j P_j, E[W^2] = sum_j (2j + 1) P_j
    mean_w = float(reach.sum())
    var_w = float(((2 * np.arange(N) + 1) * reach).sum()) - mean_w**2
    return {
        "whole_T_pd_ms": t_pd,
        "whole_ms": (1 - s) * (c.T_scan + _mean_excess(t_pd, lam_u)) + s * cold,
        "whole_first_token_only_ms": (1 - s) * (c.T_scan + _mean_excess(t_pp, lam_u)
                                                 + (N - 1) * c.T_decode) + s * cold,
        "whole_served_complete_fraction": (1 - s) * math.exp(-lam_u * t_pd / 1e3),
        "waste_tokens_per_update": mean_w,
        "waste_tokens_per_update_sd": math.sqrt(max(0.0, var_w)),  # one update's
        "waste_tokens_per_update_iid": float(m.waste_tokens(cfg.rho, N)),  # the model's
        "L_whole_cold_ms": cold,
    }


# ---------------------------------------------------------------------------------------
# The simulator


def _epochs(rng: np.random.Generator, cfg: SimConfig) -> tuple[np.ndarray, np.ndarray]:
    """Inter-update times (s) and whether each update's pre-position ran, until exactly
    n_prepositions have run."""
    lengths, ran = [], []
    done = 0
    while done < cfg.n_prepositions:
        left = cfg.n_prepositions - done
        k = int(left / (1 - cfg.skip) * 1.2) + 16
        e = rng.exponential(1.0 / cfg.update_rate, k)
        x = rng.random(k) >= cfg.skip
        cum = done + np.cumsum(x)
        if cum[-1] >= cfg.n_prepositions:
            cut = int(np.searchsorted(cum, cfg.n_prepositions)) + 1
            e, x = e[:cut], x[:cut]
        lengths.append(e)
        ran.append(x)
        done += int(x.sum())
    return np.concatenate(lengths), np.concatenate(ran)


def simulate(c: Constants, cfg: SimConfig) -> SimResult:
    """Run one session trace; deterministic in (constants, cfg)."""
    rng = np.random.default_rng([cfg.seed, int(round(cfg.rho * 1e6))])
    lam_u, lam_q = cfg.update_rate, cfg.rho * cfg.update_rate
    T = cfg.t_pp(c) / 1e3
    E, ran = _epochs(rng, cfg)
    n_ep = E.size

    # queries: a Poisson process, laid out epoch by epoch (offsets from the epoch's update)
    k = rng.poisson(lam_q * E)
    ep = np.repeat(np.arange(n_ep), k)
    off = rng.random(ep.size) * E[ep]
    fires = rng.random(ep.size) < c.g

    q_ran = ran[ep]
    ready = q_ran & (off >= T)
    early = q_ran & (off < T)
    fast = ready & fires
    fall = ready & ~fires

    cold_ms = float(m.L_cold(c))
    lat = np.full(ep.size, cold_ms)
    lat[fast] = m.L_fast(c)
    lat[fall] = float(m.L_fall(c, cfg.delta))
    partial = early if cfg.early == "partial" and T > 0 else np.zeros_like(early)
    if partial.any():
        computed = c.L_entry * off[partial] / T  # entry tokens already pre-positioned
        lat[partial] = c.T_restore + c.T_decode + c.tau_p * (c.L_entry - computed)

    # per pre-position outcomes
    used = ready | partial
    hit_ep = np.zeros(n_ep, dtype=bool)
    hit_ep[ep[used]] = True
    hit_ep &= ran
    first = np.full(n_ep, np.inf)
    np.minimum.at(first, ep, off)
    fits = ran & (E >= T) & (first >= T)
    incomplete = ran & (E < T)
    n_pp = int(ran.sum())
    hits = int(hit_ep.sum())
    waste_ms = float(np.minimum(E[ran & ~hit_ep], T).sum() * 1e3)

    nq = int(ep.size)
    mean, ci = _clustered_mean(lat, ep, n_ep, cfg.z)
    h = hits / n_pp
    res = SimResult(
        rho=cfg.rho, seed=cfg.seed, T_pp_ms=T * 1e3, update_rate=lam_u, query_rate=lam_q,
        prepositions=n_pp, skipped=int((~ran).sum()), hits=hits,
        incomplete=int(incomplete.sum()), fits=int(fits.sum()),
        hit_rate=h, hit_rate_ci=m.wilson(hits, n_pp, cfg.z), wasted=1 - h, wasted_work_ms=waste_ms,
        queries=nq,
        paths={"fast": int(fast.sum()), "fall": int(fall.sum()),
               "early": int(partial.sum()), "cold": int(nq - fast.sum() - fall.sum()
                                                         - partial.sum())},
        ready_fraction=float(ready.mean()) if nq else math.nan,
        mean_latency_ms=mean, mean_latency_ci=ci, simulated_s=float(E.sum()),
    )
    cf = closed_form(c, cfg)
    res.closed_form = cf
    lo, hi = res.hit_rate_ci
    res.agrees = {
        "hit_rate_in_wilson": lo <= cf["hit_rate"] <= hi,
        "hit_rate_iid_in_wilson": lo <= cf["hit_rate_iid"] <= hi,
        "latency_in_ci": _inside(cf["mean_latency_ms"], ci),
    }
    if cfg.predecode:
        res.whole = _whole(c, cfg, E, ran, ep, off, cf["waste_tokens_per_update_sd"])
        for key, cf_key, rel in (("whole", "whole_ms", WHOLE_REL_TOL),
                                 ("first_token_only", "whole_first_token_only_ms", WHOLE_REL_TOL),
                                 ("waste", "waste_tokens_per_update", 0.0)):
            res.agrees[f"{key}_in_ci"] = _inside(cf[cf_key], res.whole[f"{cf_key}_ci"],
                                                 rel * abs(cf[cf_key]))
    return res


def _inside(x: float, ci: tuple[float, float], tol: float = 0.0) -> bool:
    return bool(ci[0] - tol - 1e-9 <= x <= ci[1] + tol + 1e-9)


def _whole(c: Constants, cfg: SimConfig, E: np.ndarray, ran: np.ndarray, ep: np.ndarray,
           off: np.ndarray, waste_sd: float) -> dict:
    """The whole answer on the same trace: each query's time to it with N tokens pre-decoded
    and with the first token alone, and each update's pre-decoded tokens nobody was served.
    The waste's interval is a score interval (Wilson's kind): the standard deviation is the
    closed form's, `waste_sd`, since at high rho a short trace holds only a few wasted
    updates, whose own spread is no measure of the mean's."""
    N, n_ep = cfg.predecode, E.size
    t_pp = cfg.t_pp(c)
    t_pd = t_pp + (N - 1) * c.T_decode
    age = off * 1e3  # ms since the query's update
    q_ran = ran[ep]
    on = np.full(ep.size, float(m.L_whole_cold(c, N)))
    first = on.copy()
    on[q_ran] = c.T_scan + np.maximum(0.0, t_pd - age[q_ran])
    first[q_ran] = c.T_scan + np.maximum(0.0, t_pp - age[q_ran]) + (N - 1) * c.T_decode
    # tokens ready when the next update came: the first at T_pp, then one per T_decode
    E_ms = E * 1e3
    if c.T_decode > 0:
        done = np.floor((E_ms - t_pp) / c.T_decode) + 1
    else:
        done = np.full(n_ep, float(N))
    done = np.where(E_ms >= t_pp, np.clip(done, 0, N), 0.0)
    asked = np.bincount(ep, minlength=n_ep) > 0
    waste = np.where(ran & ~asked, done, 0.0)
    w_mean = float(waste.mean())
    w_se = waste_sd / math.sqrt(n_ep)
    on_mean, on_ci = _clustered_mean(on, ep, n_ep, cfg.z)
    first_mean, first_ci = _clustered_mean(first, ep, n_ep, cfg.z)
    return {
        "N": N, "T_pd_ms": t_pd,
        "whole_ms": on_mean, "whole_ms_ci": on_ci,
        "whole_first_token_only_ms": first_mean, "whole_first_token_only_ms_ci": first_ci,
        "served_complete": int((q_ran & (age >= t_pd)).sum()),
        "waste_tokens": int(waste.sum()), "updates": int(n_ep),
        "waste_tokens_per_update": w_mean,
        "waste_tokens_per_update_ci": (w_mean - cfg.z * w_se, w_mean + cfg.z * w_se),
    }


def _clustered_mean(lat: np.ndarray, ep: np.ndarray, n_ep: int, z: float = m.Z95):
    """The mean per-query latency and its interval (normal quantile z). Queries of one epoch
    share its update's fate (skipped or not, its age), so they are not independent: the
    standard error is the cluster-robust one of a ratio estimator over epochs."""
    if lat.size == 0:
        return math.nan, (math.nan, math.nan)
    mean = float(lat.mean())
    sums = np.bincount(ep, weights=lat, minlength=n_ep)
    counts = np.bincount(ep, minlength=n_ep).astype(float)
    resid = sums - mean * counts
    if n_ep < 2:
        return mean, (-math.inf, math.inf)
    se = math.sqrt(float((resid**2).sum()) * n_ep / (n_ep - 1)) / float(counts.sum())
    return mean, (mean - z * se, mean + z * se)


def sweep(c: Constants, rhos, **cfg) -> list[SimResult]:
    """simulate() at each rho with the same settings (each point has its own stream)."""
    return [simulate(c, SimConfig(rho=float(r), **cfg)) for r in rhos]
