"""Decode at long context: prepos beside llama-server on the same GGUF, the same context
(32,768 positions, YaRN past the model's 8,192) and the same threads.

Each request is one streamed `/v1/chat/completions` (greedy, --max-tokens tokens,
`ignore_eos` sent, which llama-server honours and prepos ignores): a user message of seeded
random words sized to about each of --lengths prompt tokens, then a one-line question. A
request's prompt is new to the server (its own seed), so nothing of it is cached: the time to
the first content chunk (TTFT) is the prefill, and the gaps between content chunks are the
decode steps, timed at the client.

One server runs at a time: `prepos serve --model smollm2 --context-length 32768` (in-process
llama.cpp), then llama-server (`-c 32768 --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx
8192 -np 1`), each started fresh per round and stopped before the other starts. Rounds
alternate the order (ABBA), and both servers are sent the same prompts. prepos takes a free
port, llama-server 18101.

Reported per server and length: prompt tokens (the server's usage), TTFT (median over the
requests), decode gaps (median, P99, mean and n, pooled over the requests), and prepos over
llama-server (`ttft_ratio`, `gap_p50_ratio`, `gap_p99_ratio`).

    python benchmarks/long_context.py [--quick] [--lengths 1000,4000,8000,15000]
                                      [--reps 2] [--rounds 1] [--max-tokens 32]
The last line printed is the JSON summary (also results/long_context.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stock_clients import ratio, resolve, serve_prepos, stop  # noqa: E402

from common import RESULTS, machine, percentile, read_chat_stream, write  # noqa: E402
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402

CONTEXT = 32768
TRAINED = 8192  # SmolLM2's training context: YaRN scales the positions past it
LLAMA_PORT = 18101
WORDS = ("river stone market winter signal copper garden lantern orbit harbor meadow ledger "
         "thunder velvet canyon pocket mirror saddle ember falcon quarry willow cobalt anchor "
         "tunnel biscuit glacier parcel hollow compass trumpet marble cedar beacon fossil "
         "ribbon summit lagoon pepper cradle timber monsoon violet kettle prairie bronze "
         "oyster thistle lantern harvest needle tavern pilgrim jasmine ladder comet vessel").split()
QUESTION = "Which word appears most often in the notes above? Answer in one sentence."


class Tokens:
    """The GGUF's own tokenizer (llama.cpp, vocabulary only), to size the prompts."""

    def __init__(self, gguf: Path):
        from llama_cpp import Llama

        self.llm = Llama(str(gguf), vocab_only=True, verbose=False)

    def count(self, text: str) -> int:
        return len(self.llm.tokenize(text.encode(), add_bos=False, special=False))


def notes(tokens: Tokens, target: int, seed: int) -> str:
    """Seeded random sentences of about `target` tokens."""
    rng = random.Random(seed)
    sentences: list[str] = []
    n = 0
    while n < target:
        batch = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize()
                 + "." for _ in range(20)]
        n += tokens.count(" ".join(batch)) + 1
        sentences += batch
    while sentences and tokens.count(" ".join(sentences)) > target:  # trim to the target
        del sentences[-1]
    return " ".join(sentences)


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"Notes:\n{text}\n\n{QUESTION}"}]


def one_request(url: str, model: str, msgs: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times: list[float] = []
    with httpx.Client(timeout=1800) as http, \
            http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        usage, last = read_chat_stream(r, url, times)
    return {"ttft_s": times[0] - sent if times else None,
            "gaps_s": [b - a for a, b in zip(times, times[1:])],
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "server_timing": (last or {}).get("prepos", {}).get("timing")
            if isinstance((last or {}).get("prepos"), dict) else (last or {}).get("timings")}


# -- servers -------------------------------------------------------------------------------
class Arm:
    def __init__(self, name: str, args, gguf: Path, binary: Path | None, work: Path):
        self.name, self.args, self.gguf, self.binary, self.work = name, args, gguf, binary, work
        self.requests: dict[int, list[dict]] = {}

    def run(self, prompts: dict[int, list[list[dict]]]) -> None:
        log = self.work / f"{self.name}.log"
        if self.name == "prepos":
            proc, url = serve_prepos("smollm2", log, [
                "--context-length", str(CONTEXT), "--threads", str(self.args.threads),
                *self.args.server_arg])
            done = lambda: stop(proc)  # noqa: E731
            print(f"prepos pid {proc.pid} at {url}", file=sys.stderr, flush=True)
        else:
            server = LlamaServer(self.binary, self.gguf, port=LLAMA_PORT, slots=1,
                                 ctx_per_slot=CONTEXT, threads=self.args.threads,
                                 extra=("--rope-scaling", "yarn", "--rope-scale",
                                        str(CONTEXT // TRAINED), "--yarn-orig-ctx",
                                        str(TRAINED)), log=log)
            server.start(wait=300)
            url, done = server.url, server.stop
        try:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            for length, msgs_list in prompts.items():
                for msgs in msgs_list:
                    out = one_request(url, model, msgs, self.args.max_tokens)
                    self.requests.setdefault(length, []).append(out)
                    print(f"{self.name} {length}: prompt {out['prompt_tokens']} ttft "
                          f"{out['ttft_s']:.2f} s, gap p50 "
                          f"{percentile(sorted(out['gaps_s']), 50) * 1e3:.1f} ms "
                          f"(n {len(out['gaps_s'])})", file=sys.stderr, flush=True)
        finally:
            done()


def summary(reqs: list[dict]) -> dict:
    gaps = sorted(g for r in reqs for g in r["gaps_s"])
    ttft = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    return {"requests": len(reqs), "prompt_tokens": [r["prompt_tokens"] for r in reqs],
            "ttft_s_p50": statistics.median(ttft) if ttft else None,
            "ttft_s": [round(t, 3) for t in ttft],
            "gap_ms_p50": percentile(gaps, 50) * 1e3, "gap_ms_p99": percentile(gaps, 99) * 1e3,
            "gap_ms_mean": statistics.fmean(gaps) * 1e3 if gaps else None, "gaps": len(gaps),
            "server_timing": [r["server_timing"] for r in reqs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1000,4000,8000,15000",
                    help="prompt sizes in tokens, comma separated")
    ap.add_argument("--reps", type=int, default=2, help="requests per length, per round")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of both servers, in alternating order")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="one request per length, 16 tokens each, lengths 1000,4000,15000")
    ap.add_argument("--arms", default="prepos,llama_server")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `prepos serve` argument (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.rounds, args.max_tokens = 1, 1, 16
        if args.lengths == ap.get_default("lengths"):
            args.lengths = "1000,4000,15000"
    lengths = [int(x) for x in args.lengths.split(",")]
    _, gguf, label = resolve("smollm2")
    binary = find_binary()
    names = args.arms.split(",")
    if "llama_server" in names and binary is None:
        sys.exit("no llama-server binary: run scripts/build_llama_server.sh")
    tokens = Tokens(gguf)
    work = Path(tempfile.mkdtemp(prefix="long-context-"))
    arms = {n: Arm(n, args, gguf, binary, work) for n in names}
    for r in range(args.rounds):
        prompts = {n: [messages(notes(tokens, n, seed=1000 * r + 10 * n + k))
                       for k in range(args.reps)] for n in lengths}
        for name in (names if r % 2 == 0 else names[::-1]):
            arms[name].run(prompts)
    out: dict = {"benchmark": "long_context", "model": label, "context": CONTEXT,
                 "threads": args.threads, "max_tokens": args.max_tokens, "reps": args.reps,
                 "rounds": args.rounds, "server_args": args.server_arg, "machine": machine(),
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip(),
                 "lengths": {}}
    for n in lengths:
        row = {a: summary(arm.requests.get(n, [])) for a, arm in arms.items()}
        if "prepos" in row and "llama_server" in row:
            p, q = row["prepos"], row["llama_server"]
            row["ratios"] = {"ttft_ratio": ratio(p["ttft_s_p50"], q["ttft_s_p50"]),
                             "gap_p50_ratio": ratio(p["gap_ms_p50"], q["gap_ms_p50"]),
                             "gap_p99_ratio": ratio(p["gap_ms_p99"], q["gap_ms_p99"])}
        out["lengths"][str(n)] = row
    write(args.out, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
