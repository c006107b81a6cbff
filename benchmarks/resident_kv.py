"""What other sessions' resident KV costs one session's decode step on the llama.cpp back end.

In the unified layout of the back end's KV cache (one pool of cells, any session any size)
a forward's attention runs over the cache's occupied span, every other session's cells
included (masked out, but visited), so one session's decode step gets slower as more state
stays resident beside it; in the streams layout (a stream per session) it attends to its own
stream only. This measures it directly on the back end: one session of `--state` tokens
decoding one token at a time, alone, then with `--others` sessions of `--state` tokens each
resident and idle; the two alternate in `--blocks` blocks so that a change in the machine's
load hits both. In the same blocks, a session placed while the others were resident, decoding
after they have all been released: llama.cpp puts new cells in the first free ones and a
forward scans every cell up to the highest in use, so its step pays for the freed cells
below it as if the others had stayed (`placed_above_slowdown`). Then, with all of them
resident, half of them decode one token at once: neighbouring sequence ids against every
other id (a batch the streams layout runs as one ubatch per run of consecutive ids),
alternating the same way. With `--prefill N`, also a new session's prefill of N tokens (a
recompute, a cold first turn) alone and beside the others, in the same blocks: the prefill
pays the occupied span in every row it runs.

    python benchmarks/resident_kv.py [--model smollm2|timing|FILE.gguf] [--samples 64]
                                     [--kv-layout unified|streams] [--prefill N]
The last line printed is the JSON summary (`resident_slowdown`: P50 with the others
resident / P50 alone; `gapped_batch_slowdown`: P50 every other id / P50 neighbours;
`placed_above_slowdown`: P50 of the session placed above the released others / P50 alone;
`prefill_slowdown`: the same for the prefill).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from native_decode import resolve

from common import RESULTS, machine, summarize, write
from prepos.backends import llama_cpp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--state", type=int, default=300)
    ap.add_argument("--others", type=int, default=15)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--cells", type=int, default=16384)
    ap.add_argument("--blocks", type=int, default=4, help="alternations of alone / beside")
    ap.add_argument("--kv-layout", default="unified", choices=llama_cpp.LAYOUTS)
    ap.add_argument("--prefill", type=int, default=0,
                    help="also a new session's prefill of this many tokens (0: none)")
    ap.add_argument("--prefill-samples", type=int, default=3, help="prefills a block, each")
    args = ap.parse_args()
    if not llama_cpp.available():
        sys.exit(f"the llama.cpp back end is not installed: {llama_cpp.IMPORT_ERROR}")
    gguf, _, label = resolve(args.model)
    rng = random.Random(0)
    be = llama_cpp.LlamaCppBackend(gguf, n_ctx=args.cells, threads=args.threads,
                                   max_sequences=args.others + 2, kv_layout=args.kv_layout)
    try:
        def new_session() -> tuple:
            kv, toks = be.new_kv(), [rng.randrange(1000, 20000) for _ in range(args.state)]
            be.extend(kv, [], toks)
            return kv, toks

        def step(*group) -> float:
            """One token for each (kv, tokens) of `group`, in one forward; then cropped."""
            t0 = time.perf_counter()
            be.extend_batch([(kv, toks, [rng.randrange(1000, 20000)]) for kv, toks in group])
            dt = time.perf_counter() - t0
            for kv, toks in group:
                be.crop(kv, len(toks))
            return dt

        def prefill() -> float:
            """A new session's first `--prefill` tokens in one call; then released."""
            kv = be.new_kv()
            toks = [rng.randrange(1000, 20000) for _ in range(args.prefill)]
            t0 = time.perf_counter()
            be.extend(kv, [], toks)
            dt = time.perf_counter() - t0
            be.release(kv)
            return dt

        me = new_session()
        alone, beside, above, pf_alone, pf_beside = [], [], [], [], []
        per_block = max(1, args.samples // args.blocks)
        pf_n = args.prefill_samples if args.prefill else 0
        for _ in range(args.blocks):
            alone += [step(me) for _ in range(per_block)]
            pf_alone += [prefill() for _ in range(pf_n)]
            others = [new_session() for _ in range(args.others)]
            beside += [step(me) for _ in range(per_block)]
            pf_beside += [prefill() for _ in range(pf_n)]
            high = new_session()  # placed above the others' cells
            for kv, _ in others:
                be.release(kv)
            above += [step(high) for _ in range(per_block)]
            be.release(high[0])

        # half the sessions decoding at once: neighbouring sequence ids, or every other id
        # (the streams layout runs a batch as one ubatch per run of consecutive ids)
        held = sorted([me, *(new_session() for _ in range(args.others))], key=lambda s: s[0].seq)
        near, spread = held[:len(held) // 2], held[::2]
        neighbours, gapped = [], []
        for _ in range(args.blocks):
            neighbours += [step(*near) for _ in range(per_block)]
            gapped += [step(*spread) for _ in range(per_block)]
    finally:
        be.close()
    out = {"benchmark": "resident_kv", "model": label, "gguf": str(gguf), "threads": args.threads,
           "state_tokens": args.state, "others": args.others, "kv_layout": args.kv_layout,
           "machine": machine(),
           "alone": summarize(alone), "beside_others": summarize(beside),
           "placed_above_released": summarize(above),
           "batch_neighbours": summarize(neighbours), "batch_every_other": summarize(gapped),
           "batch_size": len(near)}
    out["resident_slowdown"] = round(out["beside_others"]["p50_ms"] / out["alone"]["p50_ms"], 3)
    out["placed_above_slowdown"] = round(out["placed_above_released"]["p50_ms"]
                                         / out["alone"]["p50_ms"], 3)
    out["gapped_batch_slowdown"] = round(out["batch_every_other"]["p50_ms"]
                                         / out["batch_neighbours"]["p50_ms"], 3)
    prefill = {}
    if pf_alone:
        out |= {"prefill_tokens": args.prefill, "prefill_alone": summarize(pf_alone),
                "prefill_beside_others": summarize(pf_beside)}
        prefill = {"prefill_tokens": args.prefill, "prefill_samples": len(pf_alone),
                   "prefill_alone_p50_ms": round(out["prefill_alone"]["p50_ms"], 1),
                   "prefill_beside_p50_ms": round(out["prefill_beside_others"]["p50_ms"], 1),
                   "prefill_slowdown": round(out["prefill_beside_others"]["p50_ms"]
                                             / out["prefill_alone"]["p50_ms"], 3)}
        out["prefill_slowdown"] = prefill["prefill_slowdown"]
    write(RESULTS / f"resident_kv_{args.model.replace('/', '_')}_{args.kv_layout}.json", out)
    print(json.dumps({"model": label, "kv_layout": args.kv_layout, "others": args.others,
                      "state_tokens": args.state,
                      "alone_p50_ms": round(out["alone"]["p50_ms"], 2),
                      "beside_p50_ms": round(out["beside_others"]["p50_ms"], 2),
                      "samples": args.samples, "resident_slowdown": out["resident_slowdown"],
                      "placed_above_p50_ms": round(out["placed_above_released"]["p50_ms"], 2),
                      "placed_above_slowdown": out["placed_above_slowdown"],
                      "batch_neighbours_p50_ms": round(out["batch_neighbours"]["p50_ms"], 2),
                      "batch_every_other_p50_ms": round(out["batch_every_other"]["p50_ms"], 2),
                      "gapped_batch_slowdown": out["gapped_batch_slowdown"], **prefill}))


if __name__ == "__main__":
    main()
