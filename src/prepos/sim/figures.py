"""Figures 4, 5 and 6 of Section 5 and the whole answer's, from the closed form (and measured or
simulated points).

Each function draws one PNG for one set of constants (ours, measured on this machine, or the
reference's Table 1), says which in its title, and returns the path it wrote. Figure 7 is the
calibration module's (`prepos calibrate`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from prepos.sim import model as m
from prepos.sim.model import Constants

COLOURS = {"prefill": "#4C72B0", "decode": "#DD8452", "restore": "#55A868", "scan": "#C44E52"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ms(x: float) -> str:
    if x >= 100:
        return f"{x:.0f} ms"
    if x >= 1:
        return f"{x:.3g} ms"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} us"
    return f"{x:.2g} ms"


def _constants_line(c: Constants) -> str:
    return (f"tau_p={c.tau_p:.3g} ms/tok, T_decode={_ms(c.T_decode)}, T_scan={_ms(c.T_scan)}, "
            f"T_restore={_ms(c.T_restore)}, L_entry={c.L_entry}, g={c.g:.3g}")


def _below(ax, ncol: int = 1) -> None:
    """The legend under the axes, so it never hides a curve or a point."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol,
              frameon=False)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    _plt().close(fig)
    return path


def figure4(c: Constants, path: str | Path, measured: dict | None = None,
            cold_points: Sequence[tuple[float, float]] = (), L_max: int | None = None) -> Path:
    """(a) L_cold (Eq. 2) and L_fast (Eq. 3) vs entry length; (b) S (Eq. 4) vs entry length.

    measured: P50s in ms at L_entry ("cold", "fast", optionally "cold_p99", "fast_p99");
    cold_points: measured (entry tokens, cold first token ms) pairs at other entry lengths."""
    plt = _plt()
    measured = measured or {}
    top = L_max or max(64, 3 * c.L_entry)
    L = np.arange(1, top + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 6.0))

    a.plot(L, m.L_cold(c, L), color=COLOURS["prefill"], lw=2,
           label="L_cold = tau_p L_entry + T_decode (Eq. 2)")
    a.plot(L, np.full(L.shape, m.L_fast(c)), color=COLOURS["scan"], lw=2,
           label="L_fast = T_scan (Eq. 3)")
    if cold_points:
        xs, ys = zip(*cold_points)
        a.plot(xs, ys, "o", color="k", mfc="none", ms=6, label="measured cold, by entry length")
    for key, mark, lab in (("cold", "o", "measured cold P50"),
                           ("fast", "s", "measured fast P50")):
        if key in measured:
            hi = measured.get(f"{key}_p99")
            yerr = None if hi is None else [[0.0], [max(0.0, hi - measured[key])]]
            a.errorbar([c.L_entry], [measured[key]], yerr=yerr, fmt=mark, color="k", ms=7,
                       capsize=3, label=lab + (" (bar to P99)" if hi is not None else ""))
    a.axvline(c.L_entry, color="grey", ls="--", lw=1, label=f"L_entry = {c.L_entry}")
    a.set_yscale("log")
    a.set_xlabel("entry length L_entry (tokens)")
    a.set_ylabel("critical-path latency (ms, log scale)")
    a.set_title("(a) critical-path latency vs entry length")
    a.grid(alpha=0.3, which="both")
    _below(a)

    b.plot(L, m.speedup(c, L), color=COLOURS["prefill"], lw=2,
           label="S = L_cold / L_fast (Eq. 4)")
    if "cold" in measured and "fast" in measured and measured["fast"] > 0:
        s_meas = measured["cold"] / measured["fast"]
        b.plot([c.L_entry], [s_meas], "D", color="k", ms=7,
               label=f"measured cold/fast P50 = {s_meas:,.0f}x")
    s_at = float(m.speedup(c))
    b.plot([c.L_entry], [s_at], "o", color=COLOURS["prefill"], ms=7,
           label=f"closed form at L_entry = {s_at:,.0f}x")
    b.axvline(c.L_entry, color="grey", ls="--", lw=1)
    b.set_xlabel("entry length L_entry (tokens)")
    b.set_ylabel("fast-path speedup S (x)")
    b.set_title("(b) fast-path speedup vs entry length")
    b.set_ylim(bottom=0)
    b.grid(alpha=0.3)
    _below(b)

    fig.suptitle(f"Figure 4 - constants: {c.label}\n{_constants_line(c)}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def figure5(c: Constants, path: str | Path, measured: dict | None = None) -> Path:
    """Cost anatomy: cold, fall-through at delta 0 and at delta = L_entry, fast, as stacked
    components of Eqs. 2, 5, 3. measured: P50s in ms ("cold", "fall_delta0",
    "fall_delta_entry", "fast") drawn as markers beside the bars."""
    plt = _plt()
    measured = measured or {}
    pre = float(m.T_prefill(c, c.L_entry))
    bars = [
        ("cold\n(Eq. 2)", [("prefill", pre), ("decode", c.T_decode)], "cold"),
        ("fall-through\ndelta = 0 (Eq. 5)", [("restore", c.T_restore), ("decode", c.T_decode)],
         "fall_delta0"),
        (f"fall-through\ndelta = {c.L_entry} (Eq. 5)",
         [("restore", c.T_restore), ("prefill", pre), ("decode", c.T_decode)],
         "fall_delta_entry"),
        ("fast\n(Eq. 3)", [("scan", c.T_scan)], "fast"),
    ]
    fig, ax = plt.subplots(figsize=(9, 5.6))
    seen: set[str] = set()
    totals = []
    for i, (_, parts, _) in enumerate(bars):
        bottom = 0.0
        for name, v in parts:
            lab = {"prefill": "entry prefill tau_p x tokens", "decode": "one decode T_decode",
                   "restore": "restore T_restore", "scan": "vocabulary scan T_scan"}[name]
            ax.bar(i, v, bottom=bottom, width=0.6, color=COLOURS[name], edgecolor="white",
                   label=None if name in seen else lab)
            seen.add(name)
            bottom += v
        totals.append(bottom)
    meas_label = True
    for i, (_, _, key) in enumerate(bars):
        if key in measured:
            ax.plot(i + 0.38, measured[key], "D", color="k", ms=7,
                    label="measured P50" if meas_label else None)
            ax.annotate(_ms(measured[key]), (i + 0.38, measured[key]), textcoords="offset points",
                        xytext=(6, -3), fontsize=8)
            meas_label = False
    ymax = max(totals + [v for k, v in measured.items() if k in {b[2] for b in bars}])
    for i, t in enumerate(totals):
        ax.annotate(_ms(t), (i, t), textcoords="offset points", xytext=(0, 4), ha="center",
                    fontsize=9, fontweight="bold")
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set_xlim(-0.5, len(bars) - 0.2)
    ax.set_ylim(0, ymax * 1.15)
    ax.set_ylabel("critical-path latency to the first token (ms)")
    ax.set_title(f"Figure 5 - cost anatomy of the served paths at L_entry = {c.L_entry}\n"
                 f"constants: {c.label}\n{_constants_line(c)}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return _save(fig, path)


def figure6(c: Constants, path: str | Path, points: Sequence[dict] = (),
            trace_points: Sequence[dict] = (), latency_points: Sequence[dict] = (),
            finite: dict | None = None, rho_range: tuple[float, float] = (0.1, 20.0)) -> Path:
    """(a) hit rate h and wasted fraction w vs rho (Eq. 8); (b) E[L_pp] vs rho (Eq. 9) with
    the L_cold baseline.

    points: simulated per-pre-position hit rates, dicts with rho, hit_rate, hit_rate_ci;
    trace_points: the same measured from a live session trace (HW-4);
    latency_points: simulated per-query mean latency, dicts with rho, mean_latency_ms,
    mean_latency_ci, and closed_form["mean_latency_ms"];
    finite: {"hit_rate": [..], "rho": [..], "label": str}, the simulated process's closed form
    when pre-positions are not instantaneous."""
    plt = _plt()
    rho = np.geomspace(*rho_range, 200)
    h = m.hit_rate(rho)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 6.4))

    a.plot(rho, h, color=COLOURS["prefill"], lw=2, label="hit rate h = rho/(1+rho) (Eq. 8)")
    a.plot(rho, 1 - h, color=COLOURS["decode"], lw=2, label="wasted fraction w = 1 - h")
    if finite and finite.get("rho"):
        a.plot(finite["rho"], finite["hit_rate"], "--", color=COLOURS["prefill"], lw=1.3,
               label=finite.get("label", "closed form of the simulated process"))
    if points:
        x = [p["rho"] for p in points]
        y = [p["hit_rate"] for p in points]
        lo = [p["hit_rate"] - p["hit_rate_ci"][0] for p in points]
        hi = [p["hit_rate_ci"][1] - p["hit_rate"] for p in points]
        n = min(p.get("prepositions", 0) for p in points)
        a.errorbar(x, y, yerr=[lo, hi], fmt="o", color="k", ms=5, capsize=3,
                   label=f"simulated h, Wilson 95% family-wise (>= {n} pre-positions each)")
        a.plot(x, [1 - v for v in y], "x", color="k", ms=5, label="simulated w")
    if trace_points:
        x = [p["rho"] for p in trace_points]
        y = [p["hit_rate"] for p in trace_points]
        lo = [p["hit_rate"] - p["hit_rate_ci"][0] for p in trace_points]
        hi = [p["hit_rate_ci"][1] - p["hit_rate"] for p in trace_points]
        a.errorbar(x, y, yerr=[lo, hi], fmt="s", color=COLOURS["restore"], mec="k", ms=6,
                   capsize=3, label="measured h, live session trace (HW-4), Wilson 95%")
    a.set_xscale("log")
    a.set_ylim(-0.02, 1.02)
    a.set_xlabel("query-to-update ratio rho = lambda_q / lambda_u (log scale)")
    a.set_ylabel("fraction of pre-positions")
    a.set_title("(a) hit rate and wasted-work fraction vs rho")
    a.grid(alpha=0.3, which="both")
    _below(a)

    cold = float(m.L_cold(c))
    served = m.served_latency(c)
    b.plot(rho, m.expected_latency(c, h), color=COLOURS["prefill"], lw=2,
           label="E[L_pp] (Eq. 9) with h = rho/(1+rho), the reference's curve")
    b.axhline(cold, color="k", lw=1.5, label=f"baseline L_cold = {_ms(cold)} (Eq. 2)")
    b.axhline(served, color=COLOURS["scan"], lw=1, ls=":",
              label=f"served g L_fast + (1-g) L_fall = {_ms(served)}")
    if latency_points:
        x = [p["rho"] for p in latency_points]
        y = [p["mean_latency_ms"] for p in latency_points]
        lo = [max(0.0, p["mean_latency_ms"] - p["mean_latency_ci"][0]) for p in latency_points]
        hi = [p["mean_latency_ci"][1] - p["mean_latency_ms"] for p in latency_points]
        b.errorbar(x, y, yerr=[lo, hi], fmt="o", color="k", ms=5, capsize=3,
                   label="simulated mean first-token latency per query, 95%")
        b.plot(x, [p["closed_form"]["mean_latency_ms"] for p in latency_points], "--",
               color="grey", lw=1.2,
               label="per-query closed form of the simulated process (Eq. 9 with h = q)")
    b.set_xscale("log")
    if cold / max(served, 1e-12) > 20:
        b.set_yscale("log")
        b.set_ylabel("expected first-token latency (ms, log scale)")
    else:
        b.set_ylim(0, cold * 1.1)
        b.set_ylabel("expected first-token latency (ms)")
    b.set_xlabel("query-to-update ratio rho = lambda_q / lambda_u (log scale)")
    b.set_title("(b) effective first-token latency vs rho")
    b.grid(alpha=0.3, which="both")
    _below(b)

    fig.suptitle(f"Figure 6 - constants: {c.label}\n{_constants_line(c)}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def figure_whole(c: Constants, path: str | Path, N: int, points: Sequence[dict] = (),
                 finite: dict | None = None, rho_range: tuple[float, float] = (0.1, 20.0)) -> Path:
    """The whole answer of N tokens: (a) time to it against the idle window, pre-decoding
    against the first token alone, and the cold path; (b) pre-decoded tokens wasted per update
    vs rho (Eq. 8's race, the model's waste_tokens).

    points: simulated points, dicts with rho and whole["waste_tokens_per_update"(_ci)];
    finite: {"rho": [..], "waste": [..], "label": str}, the simulated process's closed form."""
    plt = _plt()
    t_pd = float(m.T_pd(c, N))
    idle = np.linspace(0.0, 1.4 * t_pd, 400)
    rest = (N - 1) * c.T_decode
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 6.4))
    a.plot(idle, m.L_whole(c, N, idle), color=COLOURS["scan"], lw=2,
           label=f"{N} tokens pre-decoded: T_scan + max(0, T_pd - I)")
    a.plot(idle, m.L_whole(c, 1, idle) + rest, color=COLOURS["decode"], lw=2,
           label=f"first token alone: T_scan + max(0, T_pp - I) + {N - 1} T_decode")
    a.axhline(float(m.L_whole_cold(c, N)), color="k", lw=1.5,
              label=f"cold: L_cold + {N - 1} T_decode = {_ms(float(m.L_whole_cold(c, N)))}")
    a.axvline(t_pd, color="grey", ls="--", lw=1,
              label=f"T_pd = T_pp + {N - 1} T_decode = {_ms(t_pd)} (Eq. 7, whole answer)")
    a.set_yscale("log")
    a.set_xlabel("idle window I: update to request (ms)")
    a.set_ylabel("time to the whole answer (ms, log scale)")
    a.set_title(f"(a) time to the whole {N}-token answer vs idle window")
    a.grid(alpha=0.3, which="both")
    _below(a)

    rho = np.geomspace(*rho_range, 200)
    b.plot(rho, m.waste_tokens(rho, N), color=COLOURS["prefill"], lw=2,
           label=f"N (1 - h), h = rho/(1+rho): instantaneous (Eq. 8), N = {N}")
    if finite and finite.get("rho"):
        b.plot(finite["rho"], finite["waste"], "--", color=COLOURS["prefill"], lw=1.3,
               label=finite.get("label", "closed form of the simulated process"))
    if points:
        x = [p["rho"] for p in points]
        y = [p["whole"]["waste_tokens_per_update"] for p in points]
        lo = [max(0.0, v - p["whole"]["waste_tokens_per_update_ci"][0])
              for v, p in zip(y, points)]
        hi = [p["whole"]["waste_tokens_per_update_ci"][1] - v for v, p in zip(y, points)]
        b.errorbar(x, y, yerr=[lo, hi], fmt="o", color="k", ms=5, capsize=3,
                   label="simulated, 95% family-wise")
    b.set_xscale("log")
    b.set_ylim(bottom=0)
    b.set_xlabel("query-to-update ratio rho = lambda_q / lambda_u (log scale)")
    b.set_ylabel("pre-decoded tokens never served, per update")
    b.set_title("(b) wasted tokens per update vs rho")
    b.grid(alpha=0.3, which="both")
    _below(b)

    fig.suptitle(f"The whole answer pre-decoded - constants: {c.label}\n{_constants_line(c)}",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
