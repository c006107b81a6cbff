"""What a delta's prefill costs beside other sessions' KV in llama.cpp's unified pool: the same
delta (DELTA random tokens) prefilled after the same prefix (PREFIX tokens) on one
LlamaCppBackend (threads 1, the GGUF llama-server loads), cropped back and run again, in
three placements of the pool, against llama-server (`-np 1`, its prompt cache) prefilling the
same delta after the same cached prefix. Interleaved round by round.

  alone      the session's KV only, at the pool's lowest cells
  beside     OTHER tokens of other sessions resident below it (cells 0..OTHER): every step
             scans up to the session's highest cell, as when idle sessions stay resident
  freed      the same, then the other sessions' KV removed: the scan still reaches the
             session's cells above the freed ones (llama.cpp scans to the highest occupied
             cell, not the occupied cells)

    python benchmarks/prefill_scan.py [--prefix 1700] [--delta 300] [--other 6000] [--rounds 3]
The last line printed is the JSON summary (`ratio_vs_llama_server` per placement).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, write  # noqa: E402
from prepos.backends.llama_cpp import LlamaCppBackend  # noqa: E402
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402
from prepos.engine.loading import resolve_model  # noqa: E402

PLACEMENTS = ("alone", "beside", "freed")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def in_process(gguf: Path, placement: str, prefix: list[int], delta: list[int], other: int,
               rng: random.Random) -> float:
    """Seconds to prefill `delta` after `prefix` in the given placement (one run)."""
    be = LlamaCppBackend(gguf, threads=1)
    try:
        others = []
        if placement != "alone":
            for _ in range(other // 1000):
                kv = be.new_kv()
                be.extend(kv, [], tokens(rng, 1000))
                others.append(kv)
        kv = be.new_kv()
        be.extend(kv, [], prefix)
        for o in others if placement == "freed" else ():
            be.release(o)
        t0 = time.perf_counter()
        be.extend(kv, prefix, delta)
        return time.perf_counter() - t0
    finally:
        be.close()


def on_server(client: httpx.Client, prefix: list[int], delta: list[int]) -> float:
    client.post("/completion", json={"prompt": prefix, "n_predict": 1, "cache_prompt": True})
    t = client.post("/completion", json={"prompt": prefix + delta, "n_predict": 1,
                                         "cache_prompt": True}).json()["timings"]
    if t["prompt_n"] != len(delta):
        raise RuntimeError(f"llama-server prefilled {t['prompt_n']} tokens, not {len(delta)}")
    return t["prompt_ms"] / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 or a .gguf file")
    ap.add_argument("--prefix", type=int, default=1700)
    ap.add_argument("--delta", type=int, default=300)
    ap.add_argument("--other", type=int, default=6000, help="other sessions' tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    gguf = resolve_model(args.model)
    if gguf.suffix != ".gguf":
        sys.exit("prefill_scan.py needs a GGUF model")
    rng = random.Random(0)
    prefix, delta = tokens(rng, args.prefix), tokens(rng, args.delta)
    runs: dict[str, list[float]] = {p: [] for p in ("llama_server", *PLACEMENTS)}
    log = Path(tempfile.mkdtemp(prefix="prefill-scan-")) / "llama-server.log"
    server = LlamaServer(find_binary(), gguf, port=args.port, slots=1, ctx_per_slot=8192,
                         threads=1, log=log)
    server.start(wait=300)
    try:
        client = httpx.Client(base_url=server.url, timeout=600)
        for r in range(args.rounds):
            for p in PLACEMENTS:
                runs[p].append(in_process(gguf, p, prefix, delta, args.other, rng))
            runs["llama_server"].append(on_server(client, prefix, delta))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()),
                  file=sys.stderr)
    finally:
        server.stop()
    p50 = {k: statistics.median(v) for k, v in runs.items()}
    summary = {"benchmark": "prefill_scan", "model": gguf.name, "prefix": args.prefix,
               "delta": args.delta, "other": args.other, "rounds": args.rounds,
               "p50_ms_per_token": {k: round(v * 1e3 / args.delta, 3) for k, v in p50.items()},
               "ratio_vs_llama_server": {p: round(p50[p] / p50["llama_server"], 3)
                                         for p in PLACEMENTS},
               "machine": machine()}
    write("prefill_scan.json", {**summary, "runs": runs})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
