"""What a session costs in the server's memory beside its KV: its committed conversation, the
versions it keeps for rollback, its entries and records (the issue "The KV cache is a cache":
thousands of idle sessions must cost little).

An engine on the bundled model (llama.cpp back end) holds --sessions streaming sessions, each
filled with price line sets (the many-sessions benchmark's workload) to about
--session-tokens tokens, or given --appends appends (a long-lived session: its window shifts
and it keeps up to `max_versions` versions). Commits do not wait for the KV and sessions do
not pre-position, so what is measured is the session's own state: the Python heap it takes
(tracemalloc, every allocation the sessions made) and the process's RSS growth, per session.

    python benchmarks/session_memory.py [--sessions 200] [--session-tokens 500]
        [--appends N]
The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, machine, write  # noqa: E402
from prepos.config import EngineConfig  # noqa: E402
from prepos.engine import Engine  # noqa: E402

SYSTEM = "You watch live prices. Answer briefly."
TICKERS = ("ACME", "BOLT", "CRUX")


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def line_set(rng: random.Random, price: dict) -> str:
    out = []
    for t in TICKERS:
        ps = []
        for _ in range(6):
            price[t] = max(1.0, price[t] + rng.gauss(0, 0.6))
            ps.append(f"{price[t]:.1f}")
        out.append(f"{t} " + " ".join(ps))
    return " ".join(out)


def fill(eng: Engine, n: int, tokens: int, appends: int | None, seed: int) -> dict:
    made, versions, toks = 0, 0, 0
    for i in range(n):
        rng = random.Random(seed + i)
        price = {t: rng.uniform(20, 90) for t in TICKERS}
        sid = eng.create_session("streaming", system=SYSTEM, preposition=False)
        k = 0
        while (k < appends) if appends is not None else \
                (len(eng.snapshot(sid).tokens) < tokens):
            eng.append(sid, line_set(rng, price), wait=False)
            k += 1
        made += 1
        versions += len(eng.versions(sid))
        toks += len(eng.snapshot(sid).tokens)
    return {"sessions": made, "versions_kept_mean": round(versions / max(1, made), 1),
            "tokens_mean": round(toks / max(1, made), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--session-tokens", type=int, default=500)
    ap.add_argument("--appends", type=int, default=None,
                    help="appends per session (instead of filling to --session-tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="session_memory")
    args = ap.parse_args(argv)
    eng = Engine.from_pretrained(ROOT / "models" / "trend-reader",
                                 EngineConfig(backend="llama.cpp", preposition=False))
    try:
        warm = fill(eng, 2, args.session_tokens, args.appends, 10_000_000)  # caches warmed
        del warm
        gc.collect()
        rss0 = rss_bytes()
        tracemalloc.start()
        t0 = time.perf_counter()
        out = fill(eng, args.sessions, args.session_tokens, args.appends, args.seed)
        secs = time.perf_counter() - t0
        gc.collect()
        heap, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss1 = rss_bytes()
    finally:
        eng.close()
    n = max(1, out["sessions"])
    summary = {"benchmark": "session_memory", "machine": machine(), **out,
               "appends": args.appends, "session_tokens_target": args.session_tokens,
               "heap_bytes_per_session": round(heap / n),
               "rss_bytes_per_session": round((rss1 - rss0) / n),
               "fill_seconds": round(secs, 2)}
    write(args.out, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
