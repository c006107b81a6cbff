"""`prepos simulate`: the closed form and the session simulator on measured constants.

Reads the constants from a JSON file (by default results/engine_paths.json, written by
benchmarks/engine_paths.py; or a file of Constants fields), or uses the reference's Table 1.
Simulates a session at each rho (Poisson updates and queries, >= 128 pre-positions per
point, seeded), checks that the closed-form hit rate lies inside each simulated point's
Wilson interval and the closed-form mean latency inside its interval, checks the
net-benefit condition (Eq. 10) on the constants and, with --predecode N (default 40), the
whole answer's: the closed-form time to the whole answer (N tokens pre-decoded, and the first
token alone) within 1% of each point's interval and its wasted tokens per update inside it;
writes results/simulate.json, Figures 4-6 and the whole answer's into docs/figures/ (ours and
the reference's), and prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from prepos.sim import figures
from prepos.sim import model as m
from prepos.sim.model import REFERENCE, REFERENCE_MEASURED, Constants
from prepos.sim.simulator import SimConfig, closed_form, sweep

RHOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
WHOLE_CHECKS = ("whole_in_ci", "first_token_only_in_ci", "waste_in_ci")
DEFAULT_PATHS = Path("results/engine_paths.json")
DEFAULT_CALIBRATION = Path("results/calibration/calibration.json")
# keys under which a prefill slope (ms/token, HW-1) may be recorded
SLOPE_KEYS = ("tau_p_ms_per_token", "prefill_ms_per_token", "slope_ms_per_token",
              "prefill_slope_ms_per_token", "tau_p_ms", "tau_p")


def _find(d: Any, keys: tuple[str, ...]) -> float | None:
    """The first numeric value under any of `keys`, searched depth-first."""
    if isinstance(d, dict):
        for k in keys:
            v = d.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                return float(v)
        for v in d.values():
            got = _find(v, keys)
            if got is not None:
                return got
    return None


def _cold_points(d: dict) -> list[tuple[float, float]]:
    """Measured (entry tokens, cold ms) pairs, if the file has an entry-length sweep:
    {"prefill": {"points": [[tokens, ms], ...]}} or [{"tokens": k, "ms": v}, ...]."""
    pre = d.get("prefill")
    pts = pre.get("points") if isinstance(pre, dict) else None
    out = []
    for p in pts or []:
        if isinstance(p, (list, tuple)) and len(p) == 2:
            out.append((float(p[0]), float(p[1])))
        elif isinstance(p, dict) and "tokens" in p and "ms" in p:
            out.append((float(p["tokens"]), float(p["ms"])))
    return out


def gate_from_calibration(path: Path) -> float | None:
    """The first (reference) model's coverage at its calibrated tau, from calibration.json
    or the `prepos calibrate` summary line."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    models = d.get("models") or {}
    for res in models.values():
        op = res.get("at_reference_tau") or res.get("operating_point") or res
        cov = op.get("coverage") if isinstance(op, dict) else None
        if isinstance(cov, (int, float)):
            return float(cov)
        break
    return None


def constants_from_json(path: str | Path, restore: str = "residual") -> tuple[Constants, dict,
                                                                             list]:
    """Constants, measured P50 markers (ms) and measured cold-by-entry points from a file.

    An engine_paths.json ("paths" of P50s) maps as follows:
      T_decode  = decode_step P50;   T_scan = fast_exact P50 (the whole in-process fast path);
      T_restore = fall_delta0 P50 - decode_step P50 (the reference's residual; restore="crop"
                  takes the measured KV crop, restore_crop P50, instead);
      tau_p     = the HW-1 prefill slope when the file has one, else bare_forward P50 /
                  entry_tokens (one forward over the entry, Eq. 6; labelled derived);
      g         = left at the reference's value here: the CLI sets it (--g, calibration).
    """
    d = json.loads(Path(path).read_text())
    if "paths" not in d:
        if "runs" in d:  # a results/simulate.json: its primary constants
            src = d["runs"][d.get("primary", next(iter(d["runs"])))]["constants"]
        else:
            src = d.get("constants", d)
        c = Constants.from_dict(src)
        return c, {}, _cold_points(d)
    p = d["paths"]

    def p50(name: str) -> float:
        if name not in p:
            raise ValueError(f"{path}: no '{name}' path")
        return float(p[name]["p50_ms"])

    L = int(d["entry_tokens"])
    src: dict[str, str] = {}
    slope = _find({k: v for k, v in d.items() if k != "paths"}, SLOPE_KEYS)
    if slope is not None:
        tau_p = slope
        src["tau_p"] = "measured: prefill slope (HW-1)"
    else:
        tau_p = p50("bare_forward") / L
        src["tau_p"] = (f"derived: bare forward over the {L}-token entry / {L} "
                        f"(no HW-1 slope in {Path(path).name}; includes per-forward overhead)")
    decode = p50("decode_step")
    if restore == "crop":
        t_restore = p50("restore_crop")
        src["T_restore"] = "measured: KV crop (restore_crop P50)"
    else:
        t_restore = max(0.0, p50("fall_delta0") - decode)
        src["T_restore"] = "derived: fall-through P50 at delta 0 minus decode_step P50"
    src["T_decode"] = "measured: one decode step P50 (HW-2)"
    src["T_scan"] = "measured: exact-match fast path P50, in process (whole path, no floor split)"
    src["L_entry"] = "measured: entry tokens of the benchmark"
    src["g"] = "assumed: the reference's 0.9453 (no calibration given)"
    model = str(d.get("model", "")).split("(")[0].strip().rstrip(",") or "our model"
    date = str((d.get("machine") or {}).get("date", ""))[:10]
    label = f"ours, measured ({model}; {Path(path).name} {date})".replace(" )", ")")
    c = Constants(tau_p=tau_p, T_decode=decode, T_scan=p50("fast_exact"), T_restore=t_restore,
                  L_entry=L, g=REFERENCE.g, label=label, sources=src)
    measured = {"cold": p50("cold"), "fast": p50("fast_exact"),
                "fall_delta0": p50("fall_delta0")}
    for name, key in (("cold", "cold_p99"), ("fast_exact", "fast_p99")):
        if "p99_ms" in p.get(name, {}):
            measured[key] = float(p[name]["p99_ms"])
    if "fall_delta_entry" in p:
        measured["fall_delta_entry"] = p50("fall_delta_entry")
    return c, measured, _cold_points(d)


def trace_points(path: str | Path) -> list[dict]:
    """Measured hit-rate points from a live trace file: {"points": [{"rho", "hits",
    "prepositions"} or {"rho", "hit_rate", "hit_rate_ci"}]}; Wilson intervals computed when
    counts are given."""
    d = json.loads(Path(path).read_text())
    rows = d.get("points", d) if isinstance(d, dict) else d
    out = []
    for r in rows:
        if "hits" in r and "prepositions" in r:
            k, n = int(r["hits"]), int(r["prepositions"])
            out.append({"rho": float(r["rho"]), "hit_rate": k / n if n else math.nan,
                        "hit_rate_ci": m.wilson(k, n), "prepositions": n})
        else:
            out.append({"rho": float(r["rho"]), "hit_rate": float(r["hit_rate"]),
                        "hit_rate_ci": tuple(r["hit_rate_ci"]),
                        "prepositions": int(r.get("prepositions", 0))})
    return out


def _clean(x: Any) -> Any:
    """JSON-safe: tuples as lists, non-finite floats as null."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _override(c: Constants, args: argparse.Namespace, g_src: str) -> Constants:
    """Apply --g and the per-constant overrides, noting where each value came from."""
    changes = {k: getattr(args, k) for k in ("tau_p", "T_decode", "T_scan", "T_restore",
                                             "L_entry") if getattr(args, k) is not None}
    if args.g is not None:
        changes["g"] = args.g
    srcs = {**c.sources, "g": g_src, **{k: "given on the command line" for k in changes
                                         if k != "g"}}
    return c.with_(**changes, sources=srcs)


def run_one(c: Constants, args: argparse.Namespace) -> dict:
    """Closed form + simulation at every rho for one set of constants."""
    # "inside the interval at every rho" is one claim over all the points: each interval is
    # family-wise 95% (Bonferroni), so a correct closed form fails the check 5% of the time,
    # not 1 - 0.95**k
    z = NormalDist().inv_cdf(1 - 0.05 / (2 * len(args.rhos)))
    cfg = dict(update_rate=args.update_rate, n_prepositions=args.n,
               T_pp_ms=0.0 if args.instant else None, skip=args.skip, delta=args.delta,
               early=args.early, seed=args.seed, z=z, predecode=args.predecode)
    results = sweep(c, args.rhos, **cfg)
    pts = [r.as_dict() for r in results]
    grid = np.geomspace(0.1, 20.0, 60)
    finite = [closed_form(c, SimConfig(rho=float(r), **cfg)) for r in grid]
    whole = {}
    if args.predecode:
        whole = {f"{k}_all": all(r.agrees[k] for r in results) for k in WHOLE_CHECKS}
        whole["amortized_whole_eq7_at_mean_update_interval"] = bool(
            m.amortized_whole(c, 1e3 / args.update_rate, args.predecode))
    return {
        "constants": c.as_dict(),
        "closed_form": m.summary(c, args.delta),
        "points": pts,
        "finite_curve": {"rho": grid.tolist(), "hit_rate": [f["hit_rate"] for f in finite],
                         "waste": [f.get("waste_tokens_per_update") for f in finite]},
        "checks": {
            "hit_rate_in_wilson_all": all(r.agrees["hit_rate_in_wilson"] for r in results),
            "hit_rate_iid_in_wilson_all": all(r.agrees["hit_rate_iid_in_wilson"]
                                              for r in results),
            "latency_in_ci_all": all(r.agrees["latency_in_ci"] for r in results),
            "net_benefit_eq10": m.net_benefit(c, args.delta),
            "net_benefit_eq10_delta0": m.net_benefit(c, 0),
            "net_benefit_eq10_delta_entry": m.net_benefit(c, c.L_entry),
            "amortized_eq7_at_mean_update_interval": bool(
                m.amortized(c, 1e3 / args.update_rate)),
            **whole,
        },
    }


def draw(tag: str, c: Constants, res: dict, measured: dict, cold_points: list,
         trace: list[dict], out_dir: Path, args: argparse.Namespace) -> list[str]:
    T = 0.0 if args.instant else float(m.T_pp(c))
    what = "instantaneous" if T == 0 else f"T_pp = {figures._ms(T)}"
    finite = None
    if T > 0 and args.early == "cold":
        finite = {**res["finite_curve"],
                  "label": f"closed form with {what}, lambda_u = {args.update_rate:g}/s"}
    out = [
        figures.figure4(c, out_dir / f"fig4_latency_speedup_{tag}.png", measured, cold_points),
        figures.figure5(c, out_dir / f"fig5_cost_anatomy_{tag}.png", measured),
        figures.figure6(c, out_dir / f"fig6_hit_rate_latency_{tag}.png", res["points"], trace,
                        res["points"], finite),
    ]
    if N := args.predecode:
        curve = {**res["finite_curve"], "label": f"closed form with T_pd = "
                 f"{figures._ms(T + (N - 1) * c.T_decode)}, lambda_u = {args.update_rate:g}/s"}
        out.append(figures.figure_whole(c, out_dir / f"fig_whole_answer_{tag}.png", N,
                                        res["points"], curve))
    return [str(p) for p in out]


def table(tag: str, res: dict) -> str:
    lines = [f"[{tag}] rho   h (simulated) [Wilson, 95% family-wise]   closed form (iid)   in   "
             f"latency ms [95% family-wise]   closed form"]
    for p in res["points"]:
        cf = p["closed_form"]
        lo, hi = p["hit_rate_ci"]
        llo, lhi = p["mean_latency_ci"]
        lines.append(
            f"[{tag}] {p['rho']:<5g} {p['hit_rate']:.3f} [{lo:.3f}, {hi:.3f}]"
            f" (n={p['prepositions']})"
            f"   {cf['hit_rate']:.3f} ({cf['hit_rate_iid']:.3f})"
            f"   {'yes' if p['agrees']['hit_rate_in_wilson'] else 'NO '}"
            f"   {p['mean_latency_ms']:.4g} [{llo:.4g}, {lhi:.4g}]   {cf['mean_latency_ms']:.4g}")
    if res["points"] and res["points"][0]["whole"]:
        N = res["points"][0]["whole"]["N"]
        lines.append(f"[{tag}] rho   whole {N}-token answer ms: pre-decoded [95%] closed form"
                     f"   first token alone [95%] closed form   wasted tokens/update [95%] "
                     f"closed form   in")
        for p in res["points"]:
            w, cf = p["whole"], p["closed_form"]
            ok = all(p["agrees"][k] for k in WHOLE_CHECKS)
            lines.append(
                f"[{tag}] {p['rho']:<5g}" + "".join(
                    f"   {w[k]:.4g} [{w[k + '_ci'][0]:.4g}, {w[k + '_ci'][1]:.4g}] {cf[k]:.4g}"
                    for k in ("whole_ms", "whole_first_token_only_ms",
                              "waste_tokens_per_update"))
                + f"   {'yes' if ok else 'NO '}")
    return "\n".join(lines)


def _whole_summary(run: dict, N: int) -> dict | None:
    """The whole answer's simulated and closed-form values at each rho, for the summary."""
    if not N:
        return None
    pts = run["points"]
    out: dict[str, Any] = {"N": N, "T_pd_ms": pts[0]["whole"]["T_pd_ms"]}
    for k in ("whole_ms", "whole_first_token_only_ms", "waste_tokens_per_update"):
        out[k] = [round(p["whole"][k], 4) for p in pts]
        out[k + "_ci"] = [[round(x, 4) for x in p["whole"][k + "_ci"]] for p in pts]
        out[k + "_closed_form"] = [round(p["closed_form"][k], 4) for p in pts]
    out["waste_tokens_per_update_iid"] = [p["closed_form"]["waste_tokens_per_update_iid"]
                                          for p in pts]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prepos simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--constants", default=None,
                    help=f"JSON with the measured constants (default: {DEFAULT_PATHS} if it "
                         "exists, else the reference's)")
    ap.add_argument("--reference", action="store_true",
                    help="use only the reference's Table 1 constants")
    ap.add_argument("--g", type=float, default=None,
                    help="gate-fire probability (default: the calibration's coverage, else "
                         "the reference's 0.9453)")
    ap.add_argument("--calibration", default=str(DEFAULT_CALIBRATION),
                    help="calibration.json to take g from (if it exists)")
    ap.add_argument("--restore", choices=("residual", "crop"), default="residual",
                    help="T_restore: fall-through at delta 0 minus decode (the reference's "
                         "residual) or the measured KV crop")
    for flag, name in (("--tau-p", "tau_p"), ("--t-decode", "T_decode"),
                       ("--t-scan", "T_scan"), ("--t-restore", "T_restore")):
        ap.add_argument(flag, type=float, default=None, dest=name, help=f"override {name} (ms)")
    ap.add_argument("--l-entry", type=int, default=None, dest="L_entry",
                    help="override L_entry (tokens)")
    ap.add_argument("--rhos", type=float, nargs="+", default=list(RHOS))
    ap.add_argument("--n", type=int, default=2048, help="pre-positions per rho (>= 128)")
    ap.add_argument("--update-rate", type=float, default=1.0,
                    help="data updates per second, lambda_u")
    ap.add_argument("--instant", action="store_true",
                    help="instantaneous pre-positions (T_pp = 0) instead of Eq. 6's T_pp")
    ap.add_argument("--early", choices=("cold", "partial"), default="cold",
                    help="a query during a running pre-position: cold, or restore the part "
                         "computed and prefill the rest (counts as a hit, like the engine)")
    ap.add_argument("--skip", type=float, default=0.0,
                    help="budget knob: probability a pre-position is skipped")
    ap.add_argument("--delta", type=float, default=0.0,
                    help="fall-through delta on a gate miss, tokens (Eq. 5)")
    ap.add_argument("--predecode", type=int, default=40,
                    help="the whole answer: tokens pre-decoded after each update (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", default=None,
                    help="measured live-trace hit rates (HW-4) to overlay on Figure 6")
    ap.add_argument("--out", default="results/simulate.json")
    ap.add_argument("--figures", default="docs/figures", help="folder for the PNGs")
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless the checks hold on the primary constants")
    args = ap.parse_args(argv)
    if args.n < 128:
        print(f"prepos simulate: warning: --n {args.n} < 128 pre-positions per point",
              file=sys.stderr)
    if args.n < 1 or args.predecode < 0:
        ap.error("--n must be >= 1 and --predecode >= 0")

    # -- constants -----------------------------------------------------------------------
    sets: dict[str, tuple[Constants, dict, list]] = {}
    src_path = None
    if not args.reference:
        src_path = Path(args.constants) if args.constants else (
            DEFAULT_PATHS if DEFAULT_PATHS.is_file() else None)
        if args.constants and not src_path.is_file():
            ap.error(f"--constants {args.constants}: no such file")
    if src_path is not None:
        try:
            ours, measured, cold_pts = constants_from_json(src_path, args.restore)
        except (ValueError, KeyError, TypeError) as e:
            ap.error(f"{src_path}: {e}")
        g_src = ours.sources.get("g", "")
        if args.g is not None:
            ours, g_src = ours.with_(g=args.g), "given: --g"
        elif Path(args.calibration).is_file() and (
                cov := gate_from_calibration(Path(args.calibration))) is not None:
            ours, g_src = ours.with_(g=cov), f"measured: coverage at tau ({args.calibration})"
        sets["ours"] = (_override(ours, args, g_src), measured, cold_pts)
        sets["reference"] = (REFERENCE, dict(REFERENCE_MEASURED), [])
    else:
        ref = _override(REFERENCE, args, "given: --g" if args.g is not None else
                        REFERENCE.sources["g"])
        if ref != REFERENCE:
            ref = ref.with_(label=REFERENCE.label + ", modified on the command line")
        sets["reference"] = (ref, dict(REFERENCE_MEASURED), [])
    primary = next(iter(sets))

    # -- simulate, check, draw -----------------------------------------------------------
    trace = trace_points(args.trace) if args.trace else []
    t0 = time.perf_counter()
    runs = {tag: run_one(c, args) for tag, (c, _, _) in sets.items()}
    figs: list[str] = []
    if not args.no_figures:
        out_dir = Path(args.figures)
        for tag, (c, meas, pts) in sets.items():
            figs += draw(tag, c, runs[tag], meas, pts, trace if tag == primary else [],
                         out_dir, args)
    payload = {
        "command": "prepos simulate",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "source": str(src_path) if src_path else "reference Table 1",
        "settings": {"rhos": args.rhos, "n_prepositions": args.n,
                     "update_rate_per_s": args.update_rate, "instant": args.instant,
                     "early": args.early, "skip": args.skip, "delta": args.delta,
                     "seed": args.seed, "restore": args.restore,
                     "predecode": args.predecode},
        "primary": primary,
        "runs": runs,
        "measured_markers": {tag: meas for tag, (_, meas, _) in sets.items()},
        "trace_points": trace,
        "figures": figs,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(payload), indent=1) + "\n")

    for tag in runs:
        print(table(tag, runs[tag]))
    pr = runs[primary]
    cf = pr["closed_form"]
    summary = {
        "primary": primary,
        "constants": {k: v for k, v in pr["constants"].items() if k != "sources"},
        "T_pp_ms": 0.0 if args.instant else cf["T_pp_ms"],
        "update_rate_per_s": args.update_rate,
        "rho": [p["rho"] for p in pr["points"]],
        "h": [round(p["hit_rate"], 4) for p in pr["points"]],
        "h_wilson95": [[round(x, 4) for x in p["hit_rate_ci"]] for p in pr["points"]],
        "h_closed_form": [round(p["closed_form"]["hit_rate"], 4) for p in pr["points"]],
        "h_iid": [round(p["closed_form"]["hit_rate_iid"], 4) for p in pr["points"]],
        "prepositions": [p["prepositions"] for p in pr["points"]],
        "latency_ms": [round(p["mean_latency_ms"], 4) for p in pr["points"]],
        "latency_closed_form_ms": [round(p["closed_form"]["mean_latency_ms"], 4)
                                   for p in pr["points"]],
        "L_cold_ms": cf["L_cold_ms"], "L_fast_ms": cf["L_fast_ms"], "S": cf["S"],
        "served_ms": cf["served_ms"],
        "whole": _whole_summary(pr, args.predecode),
        "checks": pr["checks"],
        "reference_checks": runs["reference"]["checks"] if primary != "reference" else None,
        "json": str(out),
        "figures": figs,
    }
    print(json.dumps(_clean(summary)))
    gating = ("hit_rate_in_wilson_all", "latency_in_ci_all", "net_benefit_eq10",
              *(f"{k}_all" for k in WHOLE_CHECKS if args.predecode))
    if args.check and not all(pr["checks"][k] for k in gating):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
