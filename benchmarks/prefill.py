"""HW-1: prefill cost per token, the slope of prefill time against unique, cache-defeating
prompt lengths (fresh random token ids every sample, an empty cache each time, so nothing is
reused), and HW-2's single decode step at the 512-token state, on the timing model
(seeded RANDOM weights). JSON summary as the last line.

    python benchmarks/prefill.py [--samples 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from common import machine, model_args, model_dir, model_label, summarize, write  # noqa: E402
from prepos.backends.torch_hf import TorchBackend  # noqa: E402

LENGTHS = (8, 16, 32, 64, 128, 256, 512)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    model_args(ap, "prefill")
    args = ap.parse_args(argv)
    backend = TorchBackend.from_pretrained(model_dir(args), args.device, args.dtype)
    rng = random.Random(0)
    vocab = backend.vocab_size

    def unique(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    points, detail = [], {}
    with torch.inference_mode():
        backend.extend(backend.new_kv(), [], unique(16))  # warm-up
        for n in LENGTHS:
            xs = []
            for _ in range(args.samples):
                ids = unique(n)
                cache = backend.new_kv()
                t0 = time.perf_counter()
                backend.extend(cache, [], ids)
                xs.append(time.perf_counter() - t0)
            detail[str(n)] = summarize(xs)
            points.append([n, detail[str(n)]["p50_ms"]])
        state = backend.new_kv()
        backend.extend(state, [], unique(512))
        decode = []
        for _ in range(args.samples * 4):
            backend.crop(state, 512)
            t0 = time.perf_counter()
            backend.extend(state, [], unique(1))
            decode.append(time.perf_counter() - t0)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    xm, ym = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - xm) * (y - ym) for x, y in zip(xs, ys)) / sum((x - xm) ** 2 for x in xs)
    summary = {"benchmark": "prefill", "model": model_label(args), "machine": machine(),
               "samples_per_length": args.samples,
               "prefill": {"points": points, "slope_ms_per_token": slope,
                           "intercept_ms": ym - slope * xm, "by_length": detail},
               "decode_step_at_512": summarize(decode)}
    write(args.out, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
