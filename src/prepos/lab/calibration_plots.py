"""The calibration's figures: risk-coverage, and coverage and false-accept rate against tau,
per model, with Wilson bands (`prepos calibrate` draws them from its results)."""

from __future__ import annotations

from pathlib import Path

MIN_SERVED = 10  # figures draw r(tau) only where at least this many were served


def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    ref_tau = results["reference_tau"]
    paths = []

    # (a) risk-coverage
    fig, ax = plt.subplots(figsize=(7.0, 5.6))
    top = results["r_max"]
    for (name, res), col in zip(results["models"].items(), colours):
        pts = [p for p in res["curve"] if p["accepted"] >= MIN_SERVED]
        ax.plot([p["coverage"] for p in pts], [p["false_accept"] for p in pts], "-o", ms=2.5,
                lw=1.2, color=col, label=f"{name}: r(tau) against its own full path")
        ax.plot([p["coverage"] for p in pts], [p["wrong"] for p in pts], ":x", ms=3, lw=1.2,
                color=col, label=f"{name}: served token wrong against ground truth")
        top = max([top, *(p["wrong"] for p in pts), *(p["false_accept"] for p in pts)])
        op = res["at_reference_tau"] if "at_reference_tau" in res else res["operating_point"]
        if op["false_accept"] is not None:
            c, r = op["coverage"], op["false_accept"]
            xerr = [[c - op["coverage_ci"][0]], [op["coverage_ci"][1] - c]]
            yerr = [[r - op["false_accept_ci"][0]], [op["false_accept_ci"][1] - r]]
            ax.errorbar([c], [r], xerr=xerr, yerr=yerr, fmt="*", ms=15, color=col, mec="k",
                        capsize=3, zorder=5,
                        label=f"{name} at tau={op['tau']:g}: c={c:.3f}, r={r:.3f} (Wilson 95%)")
        else:
            ax.plot([op["coverage"]], [0.0], "X", ms=13, color=col, mec="k", zorder=5,
                    clip_on=False,
                    label=f"{name} at tau={op['tau']:g}: never fires (c=0 of {op['n']})")
    ax.axhline(results["r_max"], color="grey", ls="--", lw=0.8,
               label=f"risk budget r_max = {results['r_max']}")
    ax.set_xlabel("coverage c(tau) (Eq. 13): fraction of decision points served fast")
    ax.set_ylabel("false-accept rate r(tau) (Eq. 14)")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(0, min(1.0, top + 0.08))
    ax.set_title(f"Risk-coverage of the confidence gate ({results['n']} decision points; "
                 f"points with >= {MIN_SERVED} served)", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    paths.append(_save(fig, ax, out_dir / "risk_coverage.png"))

    # (b) coverage and false-accept vs tau
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for (name, res), col in zip(results["models"].items(), colours):
        taus = [p["tau"] for p in res["curve"]]
        ax.plot(taus, [p["coverage"] for p in res["curve"]], "-", color=col,
                label=f"{name}: coverage c(tau)")
        ax.fill_between(taus, [p["coverage_ci"][0] for p in res["curve"]],
                        [p["coverage_ci"][1] for p in res["curve"]], color=col, alpha=0.15)
        pts = [p for p in res["curve"] if p["accepted"] >= MIN_SERVED]
        ax.plot([p["tau"] for p in pts], [p["false_accept"] for p in pts], "--", color=col,
                label=f"{name}: false-accept r(tau) (>= {MIN_SERVED} served)")
        ax.fill_between([p["tau"] for p in pts], [p["false_accept_ci"][0] for p in pts],
                        [p["false_accept_ci"][1] for p in pts], color=col, alpha=0.08)
    ax.axvline(ref_tau, color="k", ls=":", label=f"calibrated tau = {ref_tau:g}")
    ax.axhline(results["r_max"], color="grey", ls=":", lw=0.8)
    ax.set_xlabel("gate threshold tau (top-2 logit gap)")
    ax.set_ylabel("rate (Wilson 95% bands)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Coverage and false-accept rate vs tau")
    ax.legend(fontsize=7, loc="center right")
    paths.append(_save(fig, ax, out_dir / "coverage_vs_tau.png"))
    return paths


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
