"""The resident bound: how many cells to keep resident when many sessions exist, the rest of
their KV in the tiers below (the issue "The KV cache is a cache", item 3).

Two `prepos serve` processes on the bundled model, as `benchmarks/many_sessions.py` starts
them, the same but for `--kv-cells` (A: --cells-a, B: --cells-b), each filled with the same
--sessions streaming sessions of about --session-tokens tokens, the fills interleaved in
chunks of --chunk sessions (A then B, then B then A). Then, interleaved in one run:
  step     a resident session's cold query (1 token) and decode step (many_sessions part 2's
           round), --step-rounds rounds, the order alternating;
  hot      --hot-sessions hot sessions with Poisson updates and standing queries on each
           (many_sessions part 5's blocks), ABBA-ordered blocks of --hot-seconds: the
           standing queries' hit rate (answered on the fast path) and end-to-end latency.
Ratios are B over A.

    python benchmarks/resident_bound.py [--cells-a 16384] [--cells-b 4096] [--sessions 300]
The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import many_sessions as ms  # noqa: E402

from common import cpu_model, machine, write  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells-a", type=int, default=16384)
    ap.add_argument("--cells-b", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--session-tokens", type=int, default=500)
    ap.add_argument("--chunk", type=int, default=25, help="sessions per fill chunk")
    ap.add_argument("--kv-ram", default="256M")
    ap.add_argument("--client-threads", type=int, default=8)
    ap.add_argument("--step-rounds", type=int, default=32)
    ap.add_argument("--hot-sessions", type=int, default=50)
    ap.add_argument("--hot-tokens", type=int, default=500)
    ap.add_argument("--hot-rate", type=float, default=0.2)
    ap.add_argument("--hot-update-fraction", type=float, default=0.5)
    ap.add_argument("--hot-seconds", type=float, default=20.0)
    ap.add_argument("--hot-blocks", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="resident_bound")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    work = Path(tempfile.mkdtemp(prefix="resident-bound-"))
    srvs: dict[str, ms.Prepos] = {}
    summary: dict = {"benchmark": "resident_bound", "machine": {**machine(),
                                                               "cpu_model": cpu_model()},
                     "options": vars(args)}
    try:
        for k, cells in (("a", args.cells_a), ("b", args.cells_b)):
            srvs[k] = ms.Prepos(k, work, ["--kv-ram", args.kv_ram, "--kv-cells",
                                          str(cells)]).start()
        spec = {"system": ms.SYSTEM_PROMPT, "standing_queries": [ms.STANDING]}
        fills = {k: ms.Fill(srvs[k], spec, args.session_tokens, args.client_threads, 0)
                 for k in srvs}
        measured = {}
        for k in srvs:  # the measured session first: resident, not pre-positioning
            f = fills[k]
            f.run(1, label=f"{k} measured",
                  spec_of=lambda i: {"system": ms.SYSTEM_PROMPT, "preposition": False})
            measured[k] = f.sessions[0]["id"]
        done, turn = 1, 0
        while done < args.sessions:
            n = min(args.chunk, args.sessions - done)
            for k in (("a", "b") if turn % 2 == 0 else ("b", "a")):
                fills[k].run(n, start=done, label=f"{k} fill")
            done, turn = done + n, turn + 1
        summary["fill"] = {k: {"sessions": len(f.sessions), "seconds": round(f.seconds, 1),
                               "statuses": f.st.as_dict(),
                               "health": ms.kv_bytes(srvs[k].health())}
                           for k, f in fills.items()}
        for k in srvs:  # the measured session resident again, as a hot one would be
            ms.step_round(srvs[k], measured[k], 0)
        step = ms.step_compare(srvs["b"], measured["b"], srvs["a"], measured["a"],
                               args.step_rounds)
        summary["step"] = step
        hot = {k: ms.hot_sessions(srvs[k], args, 500_000) for k in srvs}
        blocks: dict[str, list] = {"a": [], "b": []}
        for b in range(args.hot_blocks):
            for k in (("a", "b") if b % 2 == 0 else ("b", "a")):
                srvs[k].wait_idle()
                ev = ms.schedule(args.seed + b, len(hot[k]), args.hot_seconds, args.hot_rate,
                                 args.hot_update_fraction)
                res = ms.hot_block(srvs[k], hot[k], ev, args.hot_seconds)
                blocks[k].append(res)
                ms.log(f"hot block {b} {k}: hit rate {res['hit_rate']} of {res['queries']}")
        summary["hot"] = blocks
        rate = {k: sum(x["fast"] for x in blocks[k]) / max(1, sum(x["queries"]
                                                                  for x in blocks[k]))
                for k in blocks}
        summary["headline"] = {
            "cells_a": args.cells_a, "cells_b": args.cells_b,
            "sessions": args.sessions,
            "fill_seconds_a": summary["fill"]["a"]["seconds"],
            "fill_seconds_b": summary["fill"]["b"]["seconds"],
            "cold_query_ratio_b_over_a": step["cold_server_ms_ratio_p50"],
            "decode_step_ratio_b_over_a": step["step_server_ms_ratio_p50"],
            "cold_query_p50_ms": {"a": step["b"]["cold_server_ms"]["p50_ms"],
                                  "b": step["a"]["cold_server_ms"]["p50_ms"]},
            "decode_step_p50_ms": {"a": step["b"]["step_server_ms"]["p50_ms"],
                                   "b": step["a"]["step_server_ms"]["p50_ms"]},
            "hot_hit_rate": rate, "hot_hit_ratio_b_over_a": ms.ratio(rate["b"], rate["a"]),
            "refused": sum(f.st.refused() for f in fills.values()),
            "server_errors": sum(f.st.server_errors() for f in fills.values())}
    finally:
        for srv in srvs.values():
            srv.stop()
        summary["seconds_at_end"] = time.strftime("%H:%M:%S")
        summary["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
        shutil.rmtree(work, ignore_errors=True)
    write(args.out, summary)
    print(json.dumps(summary.get("headline", {}) | {"machine": summary["machine"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
