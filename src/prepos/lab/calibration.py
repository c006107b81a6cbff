"""`prepos calibrate`: the confidence gate's risk-coverage tradeoff, measured through the engine.

For each of N independent decision points (held-out seeds, one canonical query per
non-overlapping data window, each window in its own fresh streaming session) we record

* the pre-positioned, question-independent ready record at the generic assistant header
  (its top-2 gap and argmax token), exactly as the engine's relaxed fast path would see it;
* the model's own full-path answer to the window's canonical query (fast path off, greedy,
  one token) and the probability it gave that answer;
* the generator's ground truth.

Sweeping tau gives coverage c(tau) (Eq. 13: gap > tau and argmax in the fast-answer set A)
and false-accept rate r(tau) (Eq. 14: of the accepted, the fraction whose served token
differs from the full-path answer), both with Wilson 95% intervals. The calibrated tau is the
smallest tau >= tau_min with r(tau) <= r_max. False accepts are split as the reference does:
"full path itself unsure" (the full path is wrong against the ground truth, or gives its own
answer less than half the probability) versus "pre-commitment divergence" (the full path was
right and sure; the question-independent token disagreed with it).

Several models (by default the bundled one and its weak contrast) are measured in the same
run; the first is the reference whose calibrated tau the others are also read at.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from prepos.config import GateConfig
from prepos.core import Request
from prepos.errors import InvalidInput
from prepos.lab.calibration_plots import plot
from prepos.lab.task.market import ANSWERS, EVAL_SEED_BASE, SYSTEM_PROMPT, DecisionPoint
from prepos.stats import wilson  # the one implementation, shared with the online gate

# ---------------------------------------------------------------------------------------
# Statistics


@dataclass(frozen=True)
class Pair:
    """One decision point: the pre-positioned header record and the full-path answer."""

    seed: int
    index: int
    ticker: str
    trend: str  # ground truth of the data state
    kind: str  # query kind: trend | wording
    form: str
    question: str
    truth: str  # ground truth answer to the question
    gap: float  # top-2 logit gap of the pre-positioned header distribution (Eq. 11)
    token: str  # its argmax, decoded
    in_answers: bool  # argmax in the fast-answer set A
    full: str  # the full path's answer to the question
    full_prob: float  # the probability the full path gave its answer

    @property
    def agrees(self) -> bool:
        return self.token.strip() == self.full.strip()

    def accepted(self, tau: float) -> bool:
        return self.gap > tau and self.in_answers


@dataclass(frozen=True)
class Point:
    """The gate at one threshold."""

    tau: float
    n: int
    accepted: int
    false_accepts: int
    coverage: float
    coverage_ci: tuple[float, float]
    false_accept: float | None  # undefined when nothing is accepted
    false_accept_ci: tuple[float, float]
    wrong: float | None  # of the accepted, the fraction wrong against the ground truth


def at(pairs: Sequence[Pair], tau: float) -> Point:
    n = len(pairs)
    acc = [p for p in pairs if p.accepted(tau)]
    fa = sum(not p.agrees for p in acc)
    wrong = sum(p.token != p.truth for p in acc)
    return Point(
        tau=tau,
        n=n,
        accepted=len(acc),
        false_accepts=fa,
        coverage=len(acc) / n if n else 0.0,
        coverage_ci=wilson(len(acc), n),
        false_accept=fa / len(acc) if acc else None,
        false_accept_ci=wilson(fa, len(acc)),
        wrong=wrong / len(acc) if acc else None,
    )


def tau_grid(pairs: Sequence[Pair], step: float = 0.05, top: float | None = None) -> list[float]:
    """Thresholds from 0 to just past the largest gap (coverage only changes at gaps)."""
    hi = top if top is not None else max((p.gap for p in pairs), default=0.0) + step
    return [round(i * step, 10) for i in range(int(math.ceil(hi / step)) + 1)]


def sweep(pairs: Sequence[Pair], taus: Iterable[float]) -> list[Point]:
    """c(tau) (Eq. 13) and r(tau) (Eq. 14) at each threshold, with Wilson intervals."""
    return [at(pairs, t) for t in taus]


def choose_tau(curve: Sequence[Point], r_max: float, tau_min: float = 0.0) -> Point | None:
    """The smallest tau >= tau_min whose false-accept rate is within the risk budget
    (None when no threshold that accepts anything meets it)."""
    for pt in sorted(curve, key=lambda p: p.tau):
        if pt.tau < tau_min - 1e-12 or pt.accepted == 0:
            continue
        if pt.false_accept is not None and pt.false_accept <= r_max:
            return pt
    return None


def decompose(pairs: Sequence[Pair], tau: float, sure: float = 0.5) -> dict:
    """Split the false accepts at `tau`: the full path itself unsure (wrong against the
    ground truth, or its answer below `sure` probability) vs pre-commitment divergence (the
    full path right and sure, the question-independent token different)."""
    false = [p for p in pairs if p.accepted(tau) and not p.agrees]
    unsure = [p for p in false if p.full != p.truth or p.full_prob < sure]
    by_kind: dict[str, int] = {}
    for p in false:
        by_kind[p.kind] = by_kind.get(p.kind, 0) + 1
    return {
        "false_accepts": len(false),
        "full_path_unsure": len(unsure),
        "pre_commitment_divergence": len(false) - len(unsure),
        "by_query_kind": by_kind,
    }


def accuracy(pairs: Sequence[Pair], tau: float | None = None) -> dict:
    """Against the generator's ground truth: the full path on its query, the header token on
    the data trend, and (at `tau`) what the gated engine would answer."""
    n = len(pairs)

    def frac(k: int, m: int) -> dict:
        return {"k": k, "n": m, "rate": k / m if m else None, "ci": wilson(k, m)}

    out = {
        "full_path": frac(sum(p.full == p.truth for p in pairs), n),
        "header_vs_trend": frac(sum(p.token == p.trend for p in pairs), n),
        "full_path_trend_queries": frac(
            sum(p.full == p.truth for p in pairs if p.kind == "trend"),
            sum(p.kind == "trend" for p in pairs),
        ),
    }
    if tau is not None:
        served = [p.token if p.accepted(tau) else p.full for p in pairs]
        acc = [p for p in pairs if p.accepted(tau)]
        out["served"] = frac(sum(s == p.truth for s, p in zip(served, pairs)), n)
        out["fast_path_when_fired"] = frac(sum(p.token == p.truth for p in acc), len(acc))
    return out


# ---------------------------------------------------------------------------------------
# Measurement through the engine


def measure(engine, points: Sequence[DecisionPoint], system: str = SYSTEM_PROMPT,
            progress: bool = False) -> list[Pair]:
    """One fresh streaming session per decision point: append its window, let the engine
    pre-position, read the header record, then ask the full path (fast path off)."""
    from prepos.core import SamplingParams

    answer_ids = engine.gate.answer_ids
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    pairs = []
    for i, dp in enumerate(points):
        sid = engine.create_session("streaming", system=system, fast_path="relaxed")
        try:
            for msg in dp.messages:
                engine.append(sid, msg)
            engine.wait_idle()
            rec = engine.ready_header(sid)
            res = engine.query(sid, dp.query.text,
                               Request(greedy, fast_path="off", logprobs=True)).result()
        finally:
            engine.close_session(sid)
        if rec is None:  # skipped pre-position: the gate cannot fire
            gap, token, in_a = 0.0, "", False
        else:
            gap, token, in_a = float(rec.gap), rec.top_text, rec.argmax in answer_ids
        prob = math.exp(res.logprobs[0]) if res.logprobs else float("nan")
        pairs.append(
            Pair(dp.seed, dp.index, dp.ticker, dp.trend, dp.query.kind, dp.query.form,
                 dp.query.text, dp.query.answer, gap, token.strip(), in_a, res.text.strip(),
                 prob)
        )
        if progress and (i + 1) % 64 == 0:
            print(f"  {i + 1}/{len(points)} decision points", file=sys.stderr, flush=True)
    return pairs


def load_engine(model_dir: str | Path, answers: Sequence[str] = ANSWERS,
                threads: int | None = None):
    """An engine whose gate knows the fast-answer set; tau is irrelevant to the recording.
    `threads`: the back end's compute threads (default: every core)."""
    from prepos.config import EngineConfig
    from prepos.engine import Engine

    cfg = EngineConfig(gate=GateConfig(tau=0.0, answers=tuple(answers)), threads=threads)
    return Engine.from_pretrained(model_dir, cfg)


# ---------------------------------------------------------------------------------------
# Report and figures


def summarize(pairs: Sequence[Pair], r_max: float, tau_min: float,
              reference_tau: float | None) -> dict:
    top = max([p.gap for p in pairs] + [tau_min, reference_tau or 0.0]) + 0.1
    curve = sweep(pairs, tau_grid(pairs, top=top))
    chosen = choose_tau(curve, r_max, tau_min)
    if chosen is None:  # no threshold meets the budget: a gate that never fires
        never = math.ceil(max((p.gap for p in pairs), default=0.0) + 1.0)
        tau = float(max(never, tau_min, reference_tau or 0.0))
        chosen_pt = at(pairs, tau)
    else:
        tau = chosen.tau
        chosen_pt = chosen
    gaps = sorted(p.gap for p in pairs)
    out = {
        "n": len(pairs),
        "tau": tau,
        "budget_met": chosen is not None,
        "operating_point": asdict(chosen_pt),
        "decomposition": decompose(pairs, tau),
        "accuracy": accuracy(pairs, tau),
        "gap": {
            "min": gaps[0], "p10": gaps[len(gaps) // 10], "median": gaps[len(gaps) // 2],
            "p90": gaps[(9 * len(gaps)) // 10], "max": gaps[-1],
        },
        "agreement_all": sum(p.agrees for p in pairs) / len(pairs),
        "curve": [asdict(p) for p in curve],
        "pairs": [asdict(p) for p in pairs],
    }
    if reference_tau is not None:
        out["at_reference_tau"] = asdict(at(pairs, reference_tau))
    return out


def model_name(spec: str | Path) -> str:
    """A model's display name: the directory's name, or a GGUF's stem without its
    quantization tag (`smollm2` -> SmolLM2-135M-Instruct)."""
    import re

    from prepos.engine.loading import resolve_model

    path = resolve_model(spec)
    if path.suffix != ".gguf":
        return path.name
    return re.sub(r"[.-](I?Q\d\w*|BF16|F16|F32)$", "", path.stem, flags=re.IGNORECASE)


def gate_home(spec: str | Path) -> Path | None:
    """Where `gate.json` may be written for a model: its directory, or beside a GGUF the
    user named by path; None for a known model's name or anything inside an installed
    package (site-packages is not the user's to write into)."""
    import sysconfig

    from prepos.engine.loading import ALIASES, resolve_model

    if str(spec) in ALIASES and not Path(spec).exists():
        return None
    path = resolve_model(spec).resolve()
    home = path.parent if path.suffix == ".gguf" else path
    for key in ("purelib", "platlib"):
        lib = Path(sysconfig.get_paths()[key]).resolve()
        if home == lib or lib in home.parents:
            return None
    return home


def _load_1m() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return None


def run(models: Sequence[str], n: int, seed: int, r_max: float, tau_min: float,
        wording_rate: float, out_dir: Path, write_gate: bool, figures: bool = True,
        progress: bool = True, threads: int | None = None) -> dict:
    from collections import Counter

    from prepos.engine.loading import resolve_model
    from prepos.lab.task.market import decision_points

    points = decision_points(n, seed=seed, wording_rate=wording_rate)
    results: dict = {
        "n": n, "seed": seed, "r_max": r_max, "tau_min": tau_min, "wording_rate": wording_rate,
        "answers": list(ANSWERS), "models": {},
        # the machine may be shared: when this ran, and what else was running as it began
        "machine": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "loadavg_1m_at_start": _load_1m(), "threads": threads},
    }
    ref_tau = None
    for model in models:
        name = model_name(model)
        t0 = time.perf_counter()
        engine = load_engine(model, threads=threads)
        try:
            pairs = measure(engine, points, progress=progress)
            counters = engine.metrics()["prepositions"]
        finally:
            engine.close()
        res = summarize(pairs, r_max, tau_min, ref_tau)
        res["model_dir"] = str(model)
        res["model_file"] = str(resolve_model(model))
        res["header_tokens"] = Counter(p.token for p in pairs).most_common(5)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        res["engine_prepositions"] = counters
        if ref_tau is None:
            ref_tau = res["tau"]
            res["at_reference_tau"] = res["operating_point"]
        results["models"][name] = res
        home = gate_home(model) if write_gate else None
        if home is not None:
            GateConfig(tau=res["tau"], answers=tuple(ANSWERS)).save(home / "gate.json")
            res["gate_written"] = str(home / "gate.json")
        elif write_gate:
            print(f"{name}: no gate.json written ({model} is not a directory of yours; pass "
                  f"a local model directory or .gguf path to keep its gate)", file=sys.stderr)
    results["reference_tau"] = ref_tau
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(results, indent=1) + "\n")
    results["figures"] = []
    if figures:
        try:
            results["figures"] = [str(p) for p in plot(results, out_dir)]
        except ImportError:  # matplotlib is the optional `plot` extra
            print("matplotlib is not installed: no figures (pip install 'prepos[plot]')",
                  file=sys.stderr)
    return results


def headline(results: dict) -> dict:
    """The numbers a person reads: per model, at the reference (first model's) tau."""
    out = {"reference_tau": results["reference_tau"], "n": results["n"], "models": {}}
    for name, res in results["models"].items():
        op = res["at_reference_tau"]
        out["models"][name] = {
            "own_tau": res["tau"],
            "budget_met": res["budget_met"],
            "coverage": op["coverage"],
            "coverage_ci": [round(x, 3) for x in op["coverage_ci"]],
            "false_accept": op["false_accept"],
            "false_accept_ci": [round(x, 3) for x in op["false_accept_ci"]],
            "accepted": op["accepted"],
            "false_accepts": op["false_accepts"],
            "decomposition": decompose_from(res, op["tau"]),
            "accuracy_full_path": res["accuracy"]["full_path"]["rate"],
            "accuracy_header_vs_trend": res["accuracy"]["header_vs_trend"]["rate"],
            "gap_median": res["gap"]["median"],
        }
    return out


def decompose_from(res: dict, tau: float) -> dict:
    return decompose([Pair(**p) for p in res["pairs"]], tau)


def checks(results: dict, min_coverage: float = 0.9, max_false: float = 0.15,
           weak_max_coverage: float = 0.02) -> dict:
    """The issue's claims: the first model covers >= 0.9 at <= 0.15 false accepts at its
    tau; every other model essentially never fires there."""
    names = list(results["models"])
    out = {}
    first = results["models"][names[0]]["at_reference_tau"]
    out[names[0]] = bool(
        first["coverage"] >= min_coverage
        and first["false_accept"] is not None
        and first["false_accept"] <= max_false
    )
    for name in names[1:]:
        out[name] = results["models"][name]["at_reference_tau"]["coverage"] <= weak_max_coverage
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prepos calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+",
                    default=["models/trend-reader", "models/trend-reader-weak"],
                    help="models: HF directories, .gguf files, or a known model's name "
                         "(smollm2); the first is the reference whose tau is chosen")
    ap.add_argument("--model", action="append", default=[], metavar="MODEL",
                    help="one more model after --models (or the defaults); repeatable, e.g. "
                         "--model smollm2")
    ap.add_argument("--n", type=int, default=256, help="decision points (>= 128)")
    ap.add_argument("--seed", type=int, default=EVAL_SEED_BASE, help="first held-out seed")
    ap.add_argument("--r-max", type=float, default=0.15, help="risk budget on r(tau)")
    ap.add_argument("--tau-min", type=float, default=1.0,
                    help="the least gap the gate may call decisive (top-1 e times the "
                         "runner-up at 1.0); the search for tau starts here")
    ap.add_argument("--wording-rate", type=float, default=0.1,
                    help="fraction of canonical queries whose answer turns on the wording")
    ap.add_argument("--out", default="results/calibration", help="output folder")
    ap.add_argument("--no-write-gate", action="store_true",
                    help="do not write gate.json into the model directories (it is never "
                         "written for a known model's name or inside an installed package)")
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless the issue's claims hold")
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads of the back end (torch intra-op, llama.cpp); on a "
                         "busy machine 1 can be several times faster than oversubscribing")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be >= 1")
    models = [*args.models, *args.model]
    try:
        names = [model_name(m) for m in models]
    except InvalidInput as e:
        ap.error(str(e))
    if len(set(names)) < len(names):
        ap.error(f"two models share a name: {names}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = run(models, args.n, args.seed, args.r_max, args.tau_min, args.wording_rate,
                  Path(args.out), not args.no_write_gate, not args.no_figures,
                  threads=args.threads)
    summary = headline(results)
    summary["checks"] = checks(results)
    summary["figures"] = results["figures"]
    summary["json"] = str(Path(args.out) / "calibration.json")
    print(json.dumps(summary))
    if args.check and not all(summary["checks"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
