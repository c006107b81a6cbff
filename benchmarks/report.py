"""Generate docs/RESULTS.md from the JSON every benchmark writes into results/: our Table 1
beside the reference's, row by row, each number with its sample count and source, measured
and derived quantities labelled, and the figures embedded.

One way only: each generated section is rebuilt from its benchmark's JSON when that JSON is in
results/ and kept as RESULTS.md has it otherwise, so a run of one benchmark rewrites its own
section and nothing else. The findings, from `# Findings behind the design` to the end, are
written by hand in RESULTS.md itself and kept as they stand.

    python benchmarks/report.py          write docs/RESULTS.md (and its figures)
    python benchmarks/report.py --check  exit 1 if regenerating it would change it
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
DOCS = ROOT / "docs"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def ms(x: float | None, digits: int = 3) -> str:
    return "not run" if x is None else f"{x:.{digits}f} ms"


def ttft_figure(ep: dict | None, http: dict | None, out: Path) -> Path | None:
    """First-token latency CDFs per path: in process (HW-2) and over HTTP (HW-5), log x."""
    panels = []
    if ep and "samples_ms" in ep:
        s = ep["samples_ms"]
        panels.append(("In process (HW-2)", [
            ("fast, exact", s["fast_exact"]), ("fast, relaxed", s["fast_relaxed"]),
            ("fall-through, Δ=0", s["fall_delta0"]), ("fall-through, Δ=entry",
                                                      s["fall_delta_entry"]),
            ("cold", s["cold"])]))
    if http and "samples_ms" in http["ttft"]["json"]:
        s = http["ttft"]["json"]["samples_ms"]
        panels.append(("HTTP, client-observed (HW-5)", [
            ("fast", s["fast"]), ("prefix-cache peer", s["peer"]),
            ("fall-through", s["fall-through"]), ("cold", s["cold"])]))
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for label, xs in series:
            xs = sorted(xs)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{label} (n={len(xs)})")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("First-token latency by path (timing model, seeded random weights, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def gpu_table(root: Path) -> str | None:
    """The GPU run's table (benchmarks/gpu.sh), one column per model size, or None."""
    sizes = sorted(d for d in root.glob("*") if (d / "prefill.json").is_file())
    if not sizes:
        return None

    def cell(d: Path, name: str, fmt) -> str:
        path = d / f"{name}.json"
        if not path.is_file():
            return "not run"
        try:
            return fmt(json.loads(path.read_text()))
        except (KeyError, TypeError, ZeroDivisionError) as e:
            return f"incomplete ({type(e).__name__})"

    def http(m: str):
        def f(h):
            c = h["ttft"]["json"]["client"][m]
            return f"{c['p50_ms']:.2f} / {c['p99_ms']:.2f} ms (n={c['n']})"
        return f

    rows = [
        ("Model", lambda d: cell(d, "prefill", lambda j: j["model"])),
        ("GPU", lambda d: cell(d, "prefill", lambda j: j["machine"].get("gpu", "none"))),
        ("τ_p prefill slope (HW-1)", lambda d: cell(
            d, "prefill", lambda j: f"{j['prefill']['slope_ms_per_token']:.4f} ms/tok")),
        ("T_decode at 512 (HW-1)", lambda d: cell(
            d, "prefill", lambda j: f"{j['decode_step_at_512']['p50_ms']:.2f} ms P50 "
                                    f"(n={j['decode_step_at_512']['n']})")),
        ("Cold / fast exact, in process (HW-2)", lambda d: cell(
            d, "engine_paths", lambda j: f"{j['paths']['cold']['p50_ms']:.2f} ms / "
            f"{j['paths']['fast_exact']['p50_ms'] * 1e3:.1f} µs = "
            f"{j['ratios']['cold_over_fast_exact_p50']:.0f}x (n={j['samples_per_path']})")),
        ("Restore (KV crop) (HW-2)", lambda d: cell(
            d, "engine_paths", lambda j: f"{j['derived']['restore_ms_measured_crop_p50']:.3f} "
                                         "ms P50")),
        ("HTTP cold P50/P99 (HW-5)", lambda d: cell(d, "http_ttft", http("cold"))),
        ("HTTP fall-through (HW-5)", lambda d: cell(d, "http_ttft", http("fall-through"))),
        ("HTTP prefix-cache peer (HW-5)", lambda d: cell(d, "http_ttft", http("peer"))),
        ("HTTP fast (HW-5)", lambda d: cell(d, "http_ttft", http("fast"))),
        ("HTTP cold / fast, peer / fast", lambda d: cell(
            d, "http_ttft", lambda h: f"{h['ttft']['json']['cold_over_fast_p50']:.0f}x, "
                                      f"{h['ttft']['json']['peer_over_fast_p50']:.0f}x")),
        ("Energy per pre-position (HW-6)", lambda d: cell(
            d, "energy", lambda e: f"{'**estimate** ' if e['estimate'] else ''}"
            f"{e['energy_per_preposition_j']:.2f} J (n={e['rounds']}); busy "
            f"{e['busy_power_w']:.0f} W, idle "
            f"{e['idle_power_w'] if e['idle_power_w'] is None else round(e['idle_power_w'])} W "
            f"({e['source'].split(':')[0]})")),
    ]
    head = "| Quantity | " + " | ".join(d.name for d in sizes) + " |"
    lines = [head, "|---" * (len(sizes) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f(d) for d in sizes) + " |" for name, f in rows]
    return "\n".join(lines)


def _agentic(r: dict, name: str, prefix: str) -> str:
    """One answer workload: with prompt-lookup drafts from the context, without drafts, and
    with drafts from the session's earlier answers too."""
    w = r["agentic"][name]
    lk = w.get("lookup", {})

    def pq(x: dict) -> str:
        return f"{x['p50_ms']:.0f} / {x['p99_ms']:.0f} (n={x['n']})"

    def drafts(setting: str) -> str:
        d = lk.get(setting, {})
        return (f"accepted {d.get('accepted')} of {d.get('proposed')} in "
                f"{d.get('verify_steps')} verifying forwards")

    d, p, sd = w["drafts"], w["plain"], w["said"]
    target = " (target <= 0.9)" if name == "prose" else ""
    return (f"{pq(d['prepos'])} vs {pq(d['peer'])} ({d['tokens_mean']:.0f} tokens): "
            f"**{r[f'{prefix}_ratio_vs_llama_server']:.3f}x**{target}, drafts "
            f"(up to {r['lookup_tokens']} per forward) {drafts('drafts')}; without "
            f"drafts {pq(p['prepos'])} vs {pq(p['peer'])}: "
            f"{r[f'{prefix}_ratio_no_lookup']:.3f}x; drafting from the session's earlier "
            f"answers too {pq(sd['prepos'])} vs {pq(sd['peer'])}: "
            f"**{r[f'{prefix}_ratio_said']:.3f}x**, {drafts('said')}")


def structured_table() -> str | None:
    """`benchmarks/structured.py`: a json_schema answer, first token fast vs cold."""
    r = load("structured.json")
    if r is None:
        return None
    res, m, lib, ratios = r["results"], r["machine"], r["library"], r["ratios"]

    def pq(key: str) -> str:
        d = res[key]
        return f"{d['p50_ms']:.3f} ms | {d['p99_ms']:.3f} ms"

    rows = [("structured, fast path, time to first token", pq("fast_ttft")),
            ("structured, cold path, time to first token", pq("cold_ttft")),
            ("unconstrained fast path, time to first token", pq("plain_fast_ttft")),
            ("structured answer end to end, fast", pq("fast_total")),
            ("structured answer end to end, cold", pq("cold_total"))]
    lines = ["| | P50 | P99 |", "|---|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    libs = "; ".join(f"{k} compile {v['compile']['p50_ms']:.3f} ms, mask per token "
                     f"{v['mask']['p50_ms']:.4f} ms (P50, {lib['tokenizer_vocab']}-token "
                     f"vocabulary)" for k, v in lib.items()
                     if isinstance(v, dict) and "compile" in v)
    return (f"A `json_schema` answer ({r['answer_tokens_p50']} tokens, `{r['answer']}`) on "
            f"{r['model']} with {r['state_tokens']} tokens of state, its first token from the "
            f"exact fast path (the cached logits, masked by the grammar) vs the same answer "
            f"cold, interleaved, n={r['samples_per_path']} each (`cd benchmarks && python "
            f"structured.py`; {m['date']}, load {m['loadavg_1m_at_start']} at start on "
            f"{m['cpus']} cores). Fast and cold answers differing: "
            f"{r['fast_cold_token_mismatches']}.\n\n" + "\n".join(lines)
            + f"\n\n`structured_cold_over_fast_p50` = "
            f"**{ratios['structured_cold_over_fast_p50']:.0f}x**; the grammar's cost on a fast "
            f"first token: {ratios['structured_fast_over_plain_fast_ttft_p50']:.1f}x the "
            f"unconstrained fast path." + (f" Library: {libs}." if libs else ""))


def relaxed_table() -> str | None:
    """`benchmarks/relaxed_risk.py`: the relaxed path's online risk gate, its targets; one
    column per run (relaxed_risk.json, the default start, and relaxed_risk_*.json)."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("relaxed_risk*.json"))]
    if not runs:
        return None

    def cell(r: dict, value: str, key: str) -> str:
        return value + ("" if r["targets_met"].get(key) else " (**not met**)")

    def col(r: dict) -> list[str]:
        v = r["verification_on"]
        return [
            cell(r, f"{r['served_false_accept']:.3f} ({r['served_false_accept_upper']:.3f})",
                 "served_false_accept_upper"),
            cell(r, f"{r['ineligible_served_relaxed']} (in warm-up: "
                    f"{v['ineligible_served_relaxed_total']})", "ineligible_served_relaxed"),
            cell(r, f"{r['eligible_coverage_ratio']:.2f}", "eligible_coverage_ratio"),
            cell(r, f"{r['p99_cold_ratio_verification_on_off']:.2f}",
                 "p99_cold_ratio_verification_on_off"),
            cell(r, f"{r['corrections_sent']} / {r['disagreements_found']}",
                 "corrections_equal_disagreements"),
            f"{v['correction_delay']['p50_ms']:.0f} / {v['correction_delay']['p99_ms']:.0f}",
        ]

    names = [f"served false-accept rate after warm-up (Wilson 95% upper; target <= "
             f"{runs[0]['r_max']})", "ineligible questions served relaxed after warm-up "
             "(target 0)", "relaxed coverage on the eligible class / offline calibration's "
             "(target >= 0.9)", "P99 of cold requests, verification on / off (target <= 1.1)",
             "corrections sent / disagreements found (target equal)",
             "correction after its answer, ms P50 / P99"]
    cols = [col(r) for r in runs]
    head = "| | " + " | ".join(f"new classes start `{r['start']}` ({r['machine']['date']}, "
                               f"load {r['machine']['loadavg_1m_at_start']})"
                               for r in runs) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(c[i] for c in cols) + " |" for i, n in enumerate(names)]
    r = runs[0]
    mix = ", ".join(f"{k} {v:.0%}" for k, v in r["mix"].items())
    return (f"The bundled model in process, {r['sessions']} sessions, a mixed workload "
            f"({mix}), {r['verification_on']['queries']} questions of which "
            f"{r['verification_on']['warmup_queries']} warm-up, every relaxed answer also "
            f"checked against the full path untimed (`python benchmarks/relaxed_risk.py "
            f"[--start cold]`, {r['machine']['cpus']} cores).\n\n" + "\n".join(lines))


def _throughput(tp: dict | None, ratio: float | None) -> str:
    """One throughput figure of `native_decode.py`: prepos vs llama-server -np 16."""
    if tp is None:
        return "not measured"
    return (f"{tp['prepos_tokens_s_median']:.0f} vs {tp['peer_tokens_s_median']:.0f} tokens/s "
            f"(median of {len(tp['prepos_tokens_s'])} rounds; mean batch "
            f"{tp['mean_batch']:.1f}): **{ratio:.2f}x**")


def native_table() -> str | None:
    """`benchmarks/native_decode.py`, one column per model it ran on."""
    runs = [(p.stem.removeprefix("native_decode_"), json.loads(p.read_text()))
            for p in sorted(RESULTS.glob("native_decode_*.json"))]
    if not runs:
        return None

    def pq(d: dict) -> str:
        return f"{d['p50_ms']:.2f} / {d['p99_ms']:.2f} (n={d['n']})"

    def col(r: dict) -> list[str]:
        de, tp = r["decode_entry"], r["throughput"]
        iw = r.get("idle_wait")
        return [
            f"{pq(de['decode_prepos'])} vs {pq(de['decode_peer'])}: "
            f"**{r['decode_ratio_vs_llama_server']:.3f}x** (target <= 1.1)",
            f"{pq(de['entry_prepos'])} vs {pq(de['entry_peer'])} "
            f"({de['entry_tokens_mean']:.0f} tokens): "
            f"**{r['entry_ratio_vs_llama_server']:.3f}x** (target <= 1.1)",
            (f"torch {pq(r['decode_torch'])}: **{r['decode_speedup_vs_torch']:.2f}x** "
             "(expected >= 3)") if "decode_torch" in r else "not measured",
            _throughput(tp, r["throughput_ratio_vs_llama_server"]) + " (target >= 0.9)",
            _throughput(r.get("throughput_streams"),
                        r.get("throughput_streams_ratio_vs_llama_server")),
            f"**{r['fast_p50_us']:.1f} us** P50, {r['fast']['p99_ms'] * 1e3:.1f} us P99 "
            f"(n={r['fast']['n']}; target <= 100 us)",
            _agentic(r, "prose", "agentic_prose"),
            _agentic(r, "tool_chain", "agentic_tool_chain"),
            _agentic(r, "standing", "standing_query"),
            (f"{pq(iw['request_wait'])}, {iw['prepositions_preempted']} idle chunks of "
             f"{iw['idle_chunk_tokens']} tokens stopped") if iw else "not measured",
        ]

    names = ["decode per token, ms P50 / P99: prepos vs llama-server",
             "entry on cached state to first token, ms",
             "decode, torch back end / llama.cpp back end",
             "16 sessions x 32 tokens at once, aggregate (unified cache)",
             "the same, streams cache (a stream per session, as llama-server's slots)",
             "exact fast path, first token",
             "agentic answer after a tool result (prose), end to end, ms P50 / P99: "
             "prepos vs llama-server",
             "agentic answer after a tool result (a chained tool call copying it)",
             "a dashboard's standing query after a data update (prose), end to end",
             "a request's wait behind continuous pre-positioning, ms"]
    cols = [col(r) for _, r in runs]
    head = "| | " + " | ".join(r["model"] for _, r in runs) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    for i, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(c[i] for c in cols) + " |")
    first = runs[0][1]
    when = "; ".join(f"{name} {r['machine']['date']} (load {r['machine']['loadavg_1m_at_start']})"
                     for name, r in runs)
    return (f"prepos on its in-process llama.cpp back end, prepos on torch, and llama.cpp's "
            f"`llama-server` built from the same llama.cpp with the same flags, on the same "
            f"GGUF, {first['threads']} threads, {first['state_tokens']} tokens of state, "
            f"measured in one run, prepos and llama-server interleaved round by round "
            f"(`python benchmarks/native_decode.py --model MODEL`). Every figure but the "
            f"answers end to end (agentic and standing query) runs without prompt-lookup "
            f"drafts (a decode step's own time). "
            f"Throughput runs on both layouts of the KV cache, each against its own "
            f"llama-server run: the default unified one (one pool of cells) and streams "
            f"(`--kv-layout streams`: a stream per session, as llama-server's `-np 16` slots "
            f"hold theirs). "
            f"The agentic answers follow a tool result in a session of a watchlist and "
            f"questions about it; the prose one is asked to explain the quote, the other "
            f"(asked to check the ticker) is a new tool call that copies the result's fields: "
            f"what greedy SmolLM2-135M-Instruct writes for each. The standing query asks a "
            f"streaming session of price readings which way they move, after each update: "
            f"prepos answers from the entry it pre-positioned after the update, llama-server "
            f"has the state before the update in its prompt cache. Each answer is measured "
            f"64 times in one session, rolled back to the same point with another tool "
            f"result or update each time; drafting from the session's earlier answers uses "
            f"the answers before it. Each setting's series is interleaved with its own "
            f"llama-server series, whose median moves by several percent between series on "
            f"this shared machine: across settings, compare prepos's own times as well as the "
            f"ratios. The timing model has random "
            f"weights: its answers repeat, which drafts copy perfectly, so its agentic "
            f"figures with drafts are upper bounds, not forecasts. "
            f"Runs: {when}. llama.cpp: "
            f"{first['llama_cpp'].get('system_info', '')}\n\n" + "\n".join(lines))


def remote_table() -> str | None:
    """`benchmarks/remote_decode.py`: prepos in front of each engine vs the engine alone."""
    r = load("remote_decode.json")
    if not r:
        return None
    lines = ["| engine | decode per token after the first, P50 (prepos / engine) | "
             "32-token answer end to end | engine's cached first token / prepos fast |",
             "|---|---|---|---|"]
    for name, e in r["engines"].items():
        lat = e["latency"]
        ver = r["versions"].get(name, "").splitlines()[0]
        lines.append(
            f"| {name} ({ver}) | **{e['decode_ratio_vs_engine']:.3f}x** "
            f"({lat['prepos_decode']['p50_ms']:.1f} ms; target <= 1.1; P99 ratio "
            f"{e['p99_ratios']['decode']:.2f}) | **{e['answer32_ratio_vs_engine']:.3f}x** "
            f"(target <= 1.0; P99 ratio {e['p99_ratios']['answer32']:.2f}) | "
            f"**{e['fast_over_engine_cached_first_token']:.0f}x** (target >= 20) |")
    m = r["machine"]
    return (f"prepos in front of each engine that runs here, one run, model {r['model']}, "
            f"n={r['samples']} per figure, {r['max_tokens']}-token answers "
            f"(`cd benchmarks && python remote_decode.py`; {m['date']}, load "
            f"{m['loadavg_1m_at_start']}; at n={r['samples']} a P99 is the worst "
            f"sample).\n\n" + "\n".join(lines))


def _sidecar_load(folder: Path, name: str) -> tuple[str, str] | None:
    """(1-minute load, date) from a `cat /proc/loadavg; date -u` file written beside a run."""
    path = folder / name
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    return lines[0].split()[0], (lines[1] if len(lines) > 1 else "")


def real_models_gate(folder: Path | None = None) -> str | None:
    """`prepos calibrate` on the market task with a real model beside the bundled pair: per
    model, the gate at the reference (first model's) tau with Wilson 95% intervals, its own
    tau, the header's gap and argmax, and the full path's accuracy; the figure it drew."""
    folder = folder or RESULTS / "calibration-smollm2"
    cal = load(str((folder / "calibration.json").relative_to(RESULTS)))
    if not cal:
        return None
    ref = cal["reference_tau"]

    def ci(lo_hi) -> str:
        return f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]"

    lines = ["| model | at τ={:g} (reference): coverage | false-accept | own τ | header gap "
             "median (p10, p90) | header argmax (most common of {}) | full-path accuracy | "
             "header token = data trend |".format(ref, cal["n"]),
             "|---|---|---|---|---|---|---|---|"]
    for name, m in cal["models"].items():
        op, acc = m["at_reference_tau"], m["accuracy"]
        fa = (f"{op['false_accept']:.3f} {ci(op['false_accept_ci'])} "
              f"({op['false_accepts']} of {op['accepted']})" if op["accepted"]
              else "undefined: nothing accepted")
        own = (f"{m['tau']:g}" if m["budget_met"] else
               f"none meets r_max={cal['r_max']:g} (never fires: {m['tau']:g})")
        g = m["gap"]
        tokens = Counter(pr["token"] for pr in m["pairs"]).most_common(3)
        top = ", ".join(f"{t!r} {k}" for t, k in tokens) or "?"
        fp, ht = acc["full_path"], acc["header_vs_trend"]
        lines.append(
            f"| {name} | {op['coverage']:.3f} {ci(op['coverage_ci'])} ({op['accepted']}/"
            f"{op['n']}) | {fa} | {own} | {g['median']:.2f} ({g['p10']:.2f}, {g['p90']:.2f}) | "
            f"{top} | {fp['rate']:.3f} {ci(fp['ci'])} | {ht['rate']:.3f} {ci(ht['ci'])} |")
    models = " ".join(m["model_dir"] for m in cal["models"].values())
    threads = (cal.get("machine") or {}).get("threads")
    cmd = (f"prepos calibrate --models {models} --out {folder.relative_to(ROOT)} "
           f"--no-write-gate" + (f" --threads {threads}" if threads else ""))
    if (folder / "command.txt").is_file():  # the command as run, where the run kept it
        cmd = (folder / "command.txt").read_text().strip().removeprefix(".venv/bin/")
    if "machine" in cal:
        when = f"{cal['machine']['date']}, load {cal['machine']['loadavg_1m_at_start']} at start"
    else:
        before, after = (_sidecar_load(folder, f"loadavg_{w}.txt") for w in ("before", "after"))
        when = ", ".join(filter(None, [before and f"started {before[1]} (load {before[0]})",
                                       after and f"ended {after[1]} (load {after[0]})"]))
    took = ", ".join(f"{name} {m['seconds']:.0f} s" for name, m in cal["models"].items())
    never = [name for name, m in cal["models"].items() if not m["at_reference_tau"]["accepted"]]
    verdict = (f" At τ={ref:g}, {' and '.join(never)} never "
               f"{'fires' if len(never) == 1 else 'fire'}." if never else "")
    for name in never:
        m = cal["models"][name]
        k = sum(pr["in_answers"] for pr in m["pairs"])
        verdict += (f" {name}'s header argmax is in the answer set at {k} of {m['n']} points"
                    + (": it cannot fire at any τ." if k == 0 else "."))
    fig = folder / "coverage_vs_tau.png"
    figure = ""
    if fig.is_file():
        dest = DOCS / "figures" / f"fig7_coverage_vs_tau_{folder.name.split('-')[-1]}.png"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(fig, dest)
        figure = (f"\n\n![coverage and false-accept vs tau, with {list(cal['models'])[-1]}]"
                  f"(figures/{dest.name})")
    return (f"The market task's {cal['n']} held-out decision points (seed {cal['seed']}, "
            f"wording rate {cal['wording_rate']:g}), one run, every model read at the first "
            f"model's calibrated τ (`{cmd}`; {when or 'date not recorded'}; {took}). "
            f"Coverage is Eq. 13 (gap > τ and "
            f"the header's argmax in the answer set {', '.join(cal['answers'])}), false-accept "
            f"Eq. 14 against the model's own full path; intervals are Wilson 95%. The header "
            f"argmax column counts the header token of each decision point.{verdict}\n\n"
            + "\n".join(lines) + figure)


def whole_answer_table(name: str = "whole_answer.json", model: str = "smollm2") -> str | None:
    """`benchmarks/whole_answer.py`: the standing answer pre-decoded, against llama-server;
    the time to the whole answer against the idle window, its figure and the timing model's
    closed form beside it."""
    r = load(name)
    if not r or "standing" not in r:
        return None
    st, m = r["standing"], r["machine"]

    def pp(x: dict) -> str:
        return f"{x['p50_ms']:.1f} / {x['p99_ms']:.1f} (n={x['n']})"

    lines = ["| | ms P50 / P99 | ratio (P50) |", "|---|---|---|",
             f"| prepos, pre-decoded, asked after the push | {pp(st['on'])} | "
             f"**{r['standing_answer_ratio_vs_llama_server']}x** vs llama-server (target "
             f"<= 0.02) |",
             f"| prepos, first token only (pre-decoding off) | {pp(st['off'])} | "
             f"{r['first_token_only_ratio_vs_llama_server']}x vs llama-server; pre-decoded / "
             f"this **{r['standing_answer_ratio_vs_first_token_only']}x** |",
             f"| llama-server, the state before the update in its prompt cache | "
             f"{pp(st['peer'])} | 1 |",
             f"| idle window needed: update to the whole answer pushed | "
             f"{pp(st['idle_needed'])} | |"]
    if "idle_after_commit" in st:
        lines.append(f"| the same from the update's commit (where a window starts) | "
                     f"{pp(st['idle_after_commit'])} | |")
    cold = r.get("cold")
    if cold:
        lines.append(f"| an unrelated cold request (8 tokens) during the update's pre-decode "
                     f"/ with pre-decoding off | {pp(cold['on'])} / {pp(cold['off'])} | "
                     f"P99 **{r['p99_cold_ratio_predecode_on_off']}x** (target <= 1.1), P50 "
                     f"{r['p50_cold_ratio_predecode_on_off']}x |")
    if cold and "server_queue" in cold:
        q, tot, stop = cold["server_queue"], cold["server_total"], cold["stopped_an_idle_chunk"]
        lines.append(f"| its wait for the model worker, as the server timed it, on / off | "
                     f"{pp(q['on'])} / {pp(q['off'])} | |")
        lines.append(f"| its time in the server, on / off | {pp(tot['on'])} / {pp(tot['off'])} "
                     f"| |")
        lines.append("| of those, the ones that stopped an idle chunk, on / off | " + " / ".join(
            pp(stop[k]) if stop[k]["n"] else "none" for k in ("on", "off")) + " | |")
    out = (f"A {r['answer_budget']}-token standing answer after each data update, time to the "
           f"whole answer over HTTP (one JSON response), model {r['model']}, "
           f"{r['threads']} thread per server, three servers interleaved round by round "
           f"(`python benchmarks/whole_answer.py --model {model}`; {m['date']}, "
           f"{m.get('cpu_model')}, load {m['loadavg_1m_at_start']} at the start, "
           f"{r.get('loadavg_1m_at_end', '?')} at the end).\n\n" + "\n".join(lines))
    win, cf = r.get("window"), r.get("closed_form")
    if win:
        rows = ["| idle window (ms) | prepos, pre-decoding on | tokens of it pre-decoded "
                "(P50) | prepos, first token only | llama-server | on / llama-server | "
                "timing model (closed form) |", "|---|---|---|---|---|---|---|"]
        for i, p in enumerate(win["points"]):
            model_ms = f"{cf['whole_ms'][i]:.0f}" if cf else ""
            rows.append(f"| {p['window_ms']:.0f} | {pp(p['on'])} | "
                        f"{p['predecoded_served_p50']} of {p['answer_tokens_p50']} | "
                        f"{pp(p['off'])} | {pp(p['peer'])} | {p['ratio_vs_llama_server']}x "
                        f"| {model_ms} |")
        out += (f"\n\nTime to the whole answer (ms, P50 / P99) against the idle window, from "
                f"the update's commit to the request, {win['samples_per_point']} rounds per "
                f"window, the three interleaved in each round (llama-server, told of the "
                f"update only by the request, is asked without the wait)")
        if "machine" in win:  # a run of its own (`--only window`), merged into this file
            wm = win["machine"]
            out += (f", a run of its own (`--only window`; {wm['date']}, load "
                    f"{wm['loadavg_1m_at_start']} at the start, {wm.get('loadavg_1m_at_end')} "
                    f"at the end)")
        if cf:
            out += (f"; the timing model is `prepos.sim.model.L_whole` (T_scan + what is left "
                    f"of T_pp + (N - 1) T_decode when the window closes) on constants from "
                    f"the standing rows above: T_scan {cf['T_scan_ms']} ms, T_decode "
                    f"{cf['T_decode_ms']} ms, T_pp {cf['T_pp_ms']} ms")
        out += ".\n\n" + "\n".join(rows)
        if str(r.get("figure", "")).startswith("docs/"):
            out += (f"\n\n![time to the whole answer against the idle window]"
                    f"({Path(r['figure']).relative_to('docs')})")
    waste = r.get("waste")
    if waste:
        rows = ["| rho (queries per update) | waste tokens per update | hit rate | with the "
                "policy (min h 0.2): waste / served tokens per update |", "|---|---|---|---|"]
        for rho, w in waste.items():
            pol = r.get("waste_policy", {}).get(rho, {})
            served = pol.get("served_tokens", 0) / max(1, pol.get("updates", 1))
            rows.append(f"| {rho} | {w['waste_tokens_per_update']} | {w['hit_rate']} | "
                        f"{pol.get('waste_tokens_per_update')} / {served:.1f} |")
        out += "\n\n" + "\n".join(rows)
    sim = load(name.replace(".json", "_simulate.json"))  # `prepos simulate --out` there
    if sim and sim.get("settings", {}).get("predecode"):
        run, settings = sim["runs"][sim["primary"]], sim["settings"]
        rows = ["| rho | whole answer, pre-decoded: simulated [95%] / closed form | first token "
                "only: simulated / closed form | waste tokens per update: simulated [95%] / "
                "closed form |", "|---|---|---|---|"]
        for p in run["points"]:
            w, c = p["whole"], p["closed_form"]
            lo, hi = w["whole_ms_ci"]
            wlo, whi = w["waste_tokens_per_update_ci"]
            rows.append(f"| {p['rho']} | {w['whole_ms']:.0f} [{lo:.0f}, {hi:.0f}] / "
                        f"{c['whole_ms']:.0f} | {w['whole_first_token_only_ms']:.0f} / "
                        f"{c['whole_first_token_only_ms']:.0f} | "
                        f"{w['waste_tokens_per_update']:.2f} [{wlo:.2f}, {whi:.2f}] / "
                        f"{c['waste_tokens_per_update']:.2f} |")
        checks = run["checks"]
        out += (f"\n\nThe timing model's simulator on the same constants (`prepos simulate "
                f"--constants results/{name.replace('.json', '_constants.json')} --predecode "
                f"{settings['predecode']} --update-rate {settings['update_rate_per_s']} --check "
                f"--out results/{name.replace('.json', '_simulate.json')}`: Poisson updates "
                f"and queries, {settings['n_prepositions']} pre-positions per rho; a query "
                f"during the pre-position is cold, one during the pre-decode takes what is "
                f"decoded; T_pd "
                f"{run['points'][0]['whole']['T_pd_ms']:.0f} ms). Its checks: "
                + ", ".join(f"{k} {checks.get(k)}" for k in
                            ("whole_in_ci_all", "first_token_only_in_ci_all", "waste_in_ci_all",
                             "amortized_whole_eq7_at_mean_update_interval"))
                + ".\n\n" + "\n".join(rows))
    return out


def table_one() -> str | None:
    """The header and Table 1 beside the reference's, with the ratios under it: rebuilt when
    HW-2's JSON (`benchmarks/engine_paths.py`, the core of `prepos bench`) is in results/."""
    ep, pf, hr = load("engine_paths.json"), load("prefill.json"), load("hit_rate.json")
    if ep is None:
        return None
    http, cal = load("http_ttft.json"), load("calibration/calibration.json")
    rows = []

    def row(q, sym, ref, ours, source):
        rows.append(f"| {q} | {sym} | {ref} | {ours} | {source} |")

    slope = pf and pf["prefill"]["slope_ms_per_token"]
    n_pf = pf and pf["samples_per_length"]
    row("Prefill cost per token", "τ_p", "0.843 ms/tok",
        f"{slope:.3f} ms/tok (slope over {len(pf['prefill']['points'])} unique lengths, "
        f"{n_pf} samples each)" if pf else "not run", "measured, HW-1 `benchmarks/prefill.py`")
    dec = ep and ep["paths"]["decode_step"]
    row("Single-step decode (512-token state)", "T_decode", "39.12 ms",
        f"{dec['p50_ms']:.2f} ms P50 (n={dec['n']})" if ep else "not run",
        "measured, HW-2 `benchmarks/engine_paths.py`")
    if ep:
        fe, fr = ep["paths"]["fast_exact"], ep["paths"]["fast_relaxed"]
        fast = (f"exact {fe['p50_ms'] * 1e3:.0f} µs / relaxed {fr['p50_ms'] * 1e3:.1f} µs P50 "
                f"in process (n={fe['n']})")
    else:
        fast = "not run"
    row("Fast path", "L_fast", "1.01 ms (scan 0.664)", fast, "measured, HW-2 in process")
    if ep:
        d = ep["derived"]
        restore = (f"KV crop measured alone {d['restore_ms_measured_crop_p50']:.3f} ms P50; "
                   f"derived as the reference does (fall-through at Δ=0 minus a decode step) "
                   f"{d['restore_ms_fall0_minus_decode_p50']:.2f} ms, a difference of two "
                   f"~{ep['paths']['decode_step']['p50_ms']:.0f} ms P50s, so within their "
                   f"noise")
    else:
        restore = "not run"
    row("State restore", "T_restore", "14.47 ms (derived)", restore, "derived / measured, HW-2")
    if cal:
        names = list(cal["models"])
        default = cal["models"][names[0]]
        op = default["operating_point"]

        def at(model: dict, tau: float) -> dict | None:
            return next((c for c in model["curve"] if abs(c["tau"] - tau) < 1e-9), None)

        gate = (f"τ={op['tau']:.1f}: cover. {op['coverage']:.3f} "
                f"[{op['coverage_ci'][0]:.3f}, {op['coverage_ci'][1]:.3f}], f.a. "
                f"{op['false_accept']:.3f} [{op['false_accept_ci'][0]:.3f}, "
                f"{op['false_accept_ci'][1]:.3f}] (n={op['n']})")
        two = at(default, 2.0)
        if two and two["false_accept"] is not None:
            gate += f"; at τ=2.0: cover. {two['coverage']:.3f}, f.a. {two['false_accept']:.3f}"
        if len(names) > 1:
            wop = at(cal["models"][names[1]], op["tau"])
            if wop:
                gate += (f"; weak model at τ={op['tau']:.1f}: cover. {wop['coverage']:.3f} "
                         f"[{wop['coverage_ci'][0]:.3f}, {wop['coverage_ci'][1]:.3f}]")
    else:
        gate = "not run"
    row("Gate", "c, r", "τ=2.0: cover. 0.945, f.a. 0.132 (n=128)", gate,
        "measured pairs, HW-3 `prepos calibrate`")
    if hr:
        pts = hr["points"]
        hit = ", ".join(f"ρ={p['rho']:g}: {p['hit_rate']:.2f} [{p['hit_rate_ci'][0]:.2f}, "
                        f"{p['hit_rate_ci'][1]:.2f}] (n={p['prepositions']})" for p in pts)
    else:
        hit = "not run"
    row("Hit rate", "h(ρ)", "0.13 to 0.78", hit, "live trace, HW-4 `benchmarks/hit_rate.py`")
    if http:
        c = http["ttft"]["json"]["client"]
        ttft = (f"cold {c['cold']['p50_ms']:.1f}/{c['cold']['p99_ms']:.1f}; fall-through "
                f"{c['fall-through']['p50_ms']:.1f}/{c['fall-through']['p99_ms']:.1f}; fast "
                f"{c['fast']['p50_ms']:.2f}/{c['fast']['p99_ms']:.2f} ms (n={c['fast']['n']} each)")
    else:
        ttft = "not run"
    row("First-token latency, HTTP, client-observed", "P50/P99", "cold 53.1/66.9; fast "
        "1.01/1.35 ms", ttft, "measured, HW-5 `benchmarks/http_ttft.py`")
    en = load("energy.json")
    if en:
        label = "**estimate**: " if en["estimate"] else ""
        energy = (f"{label}{en['energy_per_preposition_j']:.2f} J per pre-position "
                  f"(n={en['rounds']}); busy {en['busy_power_w']:.1f} W"
                  + (f", idle {en['idle_power_w']:.1f} W" if en["idle_power_w"] else "")
                  + f" ({en['source']})")
    else:
        energy = "not run"
    row("Energy per pre-position", "E_pp", "63.8 J", energy, "HW-6 `benchmarks/energy.py`")

    ratios = ""
    if ep:
        r = ep["ratios"]
        ratios = (f"- In process, one run: cold / fast (exact) = "
                  f"{r['cold_over_fast_exact_p50']:.0f}x; engine cold / bare transformers "
                  f"forward = {r['engine_cold_over_bare_forward_p50']:.2f}x; P99 cold with "
                  f"pre-positioning on / off under the same updates = "
                  f"{r['cold_p99_preposition_on_over_off']:.2f}x; most idle chunks a request "
                  f"waited behind: {ep['derived']['max_idle_chunks_waited']}.\n")
    if http:
        j = http["ttft"]["json"]
        ratios += f"- Over HTTP, one run: cold / fast = {j['cold_over_fast_p50']:.0f}x (P50)."
        pc = j["client"]
        if pc["peer"]["n"]:
            ratios += (f" Prefix-cache peer in the same run (the entry's KV resident, the cached "
                       f"distribution unused, so the first token costs one decode): "
                       f"{pc['peer']['p50_ms']:.1f}/{pc['peer']['p99_ms']:.1f} ms P50/P99 vs fast "
                       f"{pc['fast']['p50_ms']:.2f}/{pc['fast']['p99_ms']:.2f} ms: "
                       f"{j['peer_over_fast_p50']:.0f}x (n={pc['peer']['n']} each; the "
                       f"reference: 39x).")
        run = http.get("load")
        if run:
            ratios += (f" Load run: {run['sessions']} sessions, {run['operations']} "
                       f"operations, {run['errors']} errors, {run['stale']} stale answers.")
        ratios += "\n"
    rt = load("remote_ttft_timing.json")
    if rt:
        t = rt["ttft"]
        ratios += (
            f"- A real serving engine's prompt cache as the peer (llama.cpp `llama-server`, the "
            f"same timing model converted to GGUF, {rt['state_tokens']} tokens of state, "
            f"`benchmarks/remote_ttft.py --model timing`, n={t['fast']['n']} each, P50/P99): "
            f"its prompt cache holding the state, the entry costs "
            f"{t['engine_entry']['p50_ms']:.1f}/{t['engine_entry']['p99_ms']:.1f} ms; holding "
            f"the whole prompt, {t['engine_hit']['p50_ms']:.1f}/{t['engine_hit']['p99_ms']:.1f} "
            f"ms. prepos on that engine: cold {t['cold']['p50_ms']:.1f}/"
            f"{t['cold']['p99_ms']:.1f}, fall-through {t['fall']['p50_ms']:.1f}/"
            f"{t['fall']['p99_ms']:.1f}, fast {t['fast']['p50_ms']:.3f}/"
            f"{t['fast']['p99_ms']:.3f} ms (in process, no HTTP in front): the engine's full "
            f"prompt-cache hit / prepos fast = "
            f"{t['engine_hit']['p50_ms'] / t['fast']['p50_ms']:.0f}x at P50.\n")
    sc = load("stock_clients.json")
    if sc:
        tr, cf = sc["turn_ratio_vs_llama_server"], sc["cached_fraction"]
        sv, rr = sc["stateless_vs_session_ratio"], sc["responses_turn_ratio_vs_chat"]
        ratios += (
            f"- A stock OpenAI client's 8-turn agent conversation (`benchmarks/stock_clients.py`"
            f", {sc['conversations']} conversations, {sc['threads']} thread(s) each, load "
            f"{sc['machine']['loadavg_1m_at_start']} at start): time per turn after the first, "
            f"prepos / llama-server = {tr['value']} (P50 {tr['prepos']['p50_ms']:.0f} vs "
            f"{tr['llama_server']['p50_ms']:.0f} ms, n={tr['prepos']['n']}); cached fraction "
            f"prepos {cf['prepos']}, llama-server {cf['llama_server']} (at most "
            f"{cf.get('cacheable', {}).get('prepos')} cacheable); stateless / named session = "
            f"{sv['value']}; Responses / chat = "
            f"{rr['value'] if rr else 'not run (no /v1/responses)'}.\n")
    machine = (ep or pf or {}).get("machine", {})
    dated = [("HW-1", pf), ("HW-2", ep), ("HW-4", hr), ("HW-5", http),
             ("llama-server peer", rt), ("HW-6", en)]
    runs = "; ".join(
        f"{name} {d['machine']['date']}"
        + (f" (load {d['machine']['loadavg_1m_at_start']})"
           if "loadavg_1m_at_start" in d["machine"] else "")
        for name, d in dated if d and "machine" in d) or "none"
    http_state = http["ttft"]["state_tokens"] if http else "?"
    http_entry = http["ttft"]["entry_tokens"] if http else "?"
    return f"""
Generated by `python benchmarks/report.py` from the JSON in `results/`; every number below
was printed by the command named in its row on this machine (`prepos bench` runs them all).
Reference: Table 1 of the paper *Speculative Pre-Positioning: Decoding Stateful Sessions to
the Next Decision Point Off the Critical Path* (one H100, a 70B-class model at 4-bit,
2026-06-28). The measurement ids HW-1..HW-6 and the timing model are defined under
"Findings behind the design" below, with the findings the design rests on (written by
hand below the generated sections).

Runs (when each wrote its results; the 1-minute load average at its start, if recorded):
{runs}

**Ours**: {machine.get('platform', 'unknown machine')}, {machine.get('cpus', '?')} CPUs, torch
{machine.get('torch', '?')}, {machine.get('date', '')}. Latency rows use the timing model, a
~125M-parameter Llama with **seeded random weights** (a timing model: its outputs mean nothing),
512 tokens of state and an 18-token entry (the HTTP run: {http_state} tokens of state, a
{http_entry}-token entry). Gate and hit-rate rows use the bundled trained model
`models/trend-reader` (0.94M parameters).

| Quantity | Symbol | Reference (H100, 70B-class) | Ours (CPU) | Source |
|---|---|---|---|---|
{chr(10).join(rows)}

{ratios.rstrip()}"""


def whole_answers() -> str | None:
    tables = [whole_answer_table(), whole_answer_table(
        "whole_answer_timing.json", "timing --out results/whole_answer_timing.json")]
    return "\n\n".join(t for t in tables if t) if tables[0] else None


def figures() -> str:
    """The benchmarks' figures in docs/figures (tracked; the console's screenshots are the
    console page's), each embedded: always rebuilt."""
    return "\n".join(f"![{png.stem}](figures/{png.name})"
                     for png in sorted((DOCS / "figures").glob("*.png"))
                     if not png.name.startswith("console-"))


def draw_figures() -> None:
    """The figures drawn from results/ (only what is there) into docs/figures."""
    (DOCS / "figures").mkdir(parents=True, exist_ok=True)
    ep, http = load("engine_paths.json"), load("http_ttft.json")
    if ep or http:
        ttft_figure(ep, http, DOCS / "figures" / "ttft_cdf_ours.png")
    for src in sorted((RESULTS / "calibration").glob("*.png")):
        shutil.copy(src, DOCS / "figures" / f"fig7_{src.name}")


# RESULTS.md's generated sections in order, by heading: each rebuilt from results/ where its
# benchmark's JSON is there (the builder returns its text), kept as written where it is not
SECTIONS = (
    ("# Results", table_one),
    ("## Every token at the engine's speed (`benchmarks/native_decode.py`)", native_table),
    ("## In front of real engines (`benchmarks/remote_decode.py`)", remote_table),
    ("## The whole answer, pre-decoded (`benchmarks/whole_answer.py`)", whole_answers),
    ("## Structured output (`benchmarks/structured.py`)", structured_table),
    ("## The gate on a real model (`prepos calibrate`)", real_models_gate),
    ("## The relaxed path's online risk bound (`benchmarks/relaxed_risk.py`)", relaxed_table),
    ("## GPU run (`benchmarks/gpu.sh`)", lambda: gpu_table(RESULTS / "gpu")),
    ("## Figures", figures),
)
FINDINGS_HEADING = "# Findings behind the design"  # from here to the end: written by hand


def written_sections(doc: str) -> dict[str, str]:
    """The generated part of a RESULTS.md, by heading: each section's text, heading first."""
    head = doc.split("\n" + FINDINGS_HEADING, 1)[0]
    return {block.split("\n", 1)[0]: block for block in re.split(r"\n(?=## )", head)}


def findings(doc: str) -> str:
    """The hand-written part of a RESULTS.md, its heading first, as it stands."""
    at = doc.find("\n" + FINDINGS_HEADING + "\n")
    return doc[at + 1:] if at >= 0 else FINDINGS_HEADING + "\n"


def build(old: str) -> tuple[str, list[str]]:
    """RESULTS.md as regenerated now from `old` (the file as it stands), and the headings of
    the sections rebuilt from results/ (the others kept)."""
    kept, blocks, rebuilt = written_sections(old), [], []
    for heading, make in SECTIONS:
        body = make()
        if body is None:
            blocks.append(kept.get(heading, f"{heading}\nNot run yet.\n"))
        else:
            blocks.append(f"{heading}\n{body}\n")
            rebuilt.append(heading)
    return "\n".join(blocks) + "\n" + findings(old), rebuilt


def main() -> int:
    if sys.argv[1:2] == ["--gpu-summary"]:  # benchmarks/gpu.sh: its own table only
        root = Path(sys.argv[2])
        table = gpu_table(root) or "no GPU results"
        (root / "summary.md").write_text(table + "\n")
        print(table)
        return 0
    path = DOCS / "RESULTS.md"
    old = path.read_text() if path.is_file() else ""
    if sys.argv[1:2] == ["--check"]:
        text, rebuilt = build(old)
        same = text == old
        print(json.dumps({"unchanged": same, "rebuilt": rebuilt}))
        return 0 if same else 1
    draw_figures()
    text, rebuilt = build(old)
    path.write_text(text)
    print(json.dumps({"written": str(path), "rebuilt": rebuilt,
                      "kept": [h for h, _ in SECTIONS if h not in rebuilt]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
