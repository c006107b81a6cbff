"""HW-4: the per-pre-position hit rate from a live session trace.

One streaming session on the engine, driven in real time by Poisson data updates (rate
lambda_u) and Poisson queries (rate rho * lambda_u) at rho in {0.25, 0.5, 1, 2, 4, 8}; every
update commits and triggers a pre-position at idle priority (Algorithm 1); a pre-position
is a hit when a query uses it before the next update invalidates it. The engine's own
counters decide (consumed vs invalidated); each point rests on >= --prepositions of them,
with a Wilson 95% interval, beside the closed form h = rho / (1 + rho).

    python benchmarks/hit_rate.py [--model DIR] [--prepositions 128] [--update-ms 40]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import machine, write  # noqa: E402
from prepos.config import EngineConfig  # noqa: E402
from prepos.core import Request, SamplingParams  # noqa: E402
from prepos.engine import Engine  # noqa: E402
from prepos.lab.task import market  # noqa: E402
from prepos.paths import DEFAULT_MODEL  # noqa: E402
from prepos.sim.model import wilson  # noqa: E402

RHOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
ONE = SamplingParams(max_tokens=1)


def trace_point(eng: Engine, rho: float, n_pp: int, update_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    ticker = rng.choice(market.TICKERS)

    def feed():
        while True:  # an endless seeded feed of data messages
            yield from market.generate_stream(rng, market.PRICES_PER_MESSAGE * 64,
                                              ticker=ticker).messages()

    msgs = feed()
    question = f"Which way is {ticker} moving?"
    sid = eng.create_session("streaming", system=market.SYSTEM_PROMPT, fast_path="relaxed")
    for _ in range(3):
        eng.append(sid, next(msgs))
    eng.wait_idle()
    c0 = dict(eng.prepositioner.counters.__dict__)
    lam_u, lam_q = 1.0 / update_s, rho / update_s
    t = time.perf_counter()
    next_u = t + rng.expovariate(lam_u)
    next_q = t + rng.expovariate(lam_q)
    updates = queries = 0
    while True:
        c = eng.prepositioner.counters
        settled = (c.consumed - c0["consumed"]) + (c.invalidated - c0["invalidated"])
        if settled >= n_pp:
            break
        if updates > 50 * n_pp:
            raise SystemExit(f"rho={rho}: pre-positions are not settling ({settled} of {n_pp})")
        now = time.perf_counter()
        due = min(next_u, next_q)
        if due > now:
            time.sleep(due - now)
        if next_u <= next_q:
            eng.append(sid, next(msgs), wait=False)
            updates += 1
            next_u += rng.expovariate(lam_u)
        else:
            eng.query(sid, question, Request(ONE)).result()
            queries += 1
            next_q += rng.expovariate(lam_q)
    eng.append(sid, next(msgs), wait=False)  # settle the last pre-position
    eng.wait_idle()
    c = eng.prepositioner.counters
    hits = c.consumed - c0["consumed"]
    wasted = c.invalidated - c0["invalidated"]
    superseded = c.superseded - c0["superseded"]
    n = hits + wasted
    n_all = n + superseded
    lo, hi = wilson(hits, n)
    lo_all, hi_all = wilson(hits, n_all)
    eng.close_session(sid)
    closed = rho / (1 + rho)
    return {"rho": rho, "hits": hits, "prepositions": n, "hit_rate": hits / n,
            "hit_rate_ci": [lo, hi], "closed_form": closed, "closed_form_in_ci": lo <= closed <= hi,
            # counting also the pre-positions an update superseded before they started
            "scheduled": n_all, "hit_rate_scheduled": hits / n_all,
            "hit_rate_scheduled_ci": [lo_all, hi_all],
            "wasted": wasted / n, "updates": updates, "queries": queries,
            "discarded_in_flight": c.discarded - c0["discarded"],
            "skipped": c.skipped - c0["skipped"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prepositions", type=int, default=128)
    ap.add_argument("--update-ms", type=float, default=100.0, help="mean update interval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a small model)")
    args = ap.parse_args(argv)
    eng = Engine.from_pretrained(args.model, EngineConfig(threads=args.threads))
    points = []
    try:
        for i, rho in enumerate(RHOS):
            p = trace_point(eng, rho, args.prepositions, args.update_ms / 1e3, args.seed + i)
            print(f"rho={rho:<5} h={p['hit_rate']:.3f} [{p['hit_rate_ci'][0]:.3f}, "
                  f"{p['hit_rate_ci'][1]:.3f}] closed form {p['closed_form']:.3f} "
                  f"(n={p['prepositions']}; {p['scheduled'] - p['prepositions']} superseded "
                  f"before starting)", file=sys.stderr)
            points.append(p)
    finally:
        eng.close()
    summary = {"benchmark": "hit_rate", "model": args.model, "machine": machine(),
               "update_interval_ms": args.update_ms, "points": points,
               "all_closed_form_in_ci": all(p["closed_form_in_ci"] for p in points)}
    write("hit_rate", summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
