"""Many streams at once: N concurrent streamed chat clients, prepos beside llama-server on the
same GGUF, the same threads and the same resident KV cells, and where prepos's steps go.

The workload. N clients (--streams, default 1, 4, 16 and 64) start together; each sends
--requests-per-client (default 2) streamed `/v1/chat/completions` in a row, each read to its
end before the next is sent (its own keep-alive connection, as a stock client keeps one):
greedy (temperature 0), --max-tokens tokens out (64 and 256: each a case of its own), a
prompt of about 120 tokens (a system line, then an essay request on one of token_cadence's
topics with --prompt-words seeded words to weave in), a different one for every request of
every case and arm's turn (seeded by max tokens, N, client and request), so no request finds
another's prompt cached beyond the shared system line. `stream_options.include_usage` asks
for the usage, so tokens are the servers' own count of what they generated.

The arms. Per N, a fresh pair of servers, both started and warmed up, one alive at a time
(the other paused with SIGSTOP: it takes no CPU and its idle work waits, as in
token_cadence.py):
  prepos        `prepos serve --model smollm2 --threads T` (its defaults otherwise: the
                unified KV layout; `--kv-cells` passes its resident cells, --server-arg any
                other option); its resident cells read from its /metrics
                (`prepos:kv_cells_budget`)
  llama_server  `llama-server -m <the same GGUF> -np N -c <prepos's resident cells>
                --kv-unified --jinja --metrics -t T` (`--kv-layout streams`: prepos
                `--kv-layout streams --kv-sequences N`, llama-server `--no-kv-unified`, so
                each of the N sequences has cells / N of its own on both)
The cases run max tokens by max tokens within each N; which arm goes first alternates case by
case (ABBA over the whole run), so a slow stretch of this machine falls on both arms alike.

Reported per case (N, max tokens) and arm: tokens/s over the whole run (every stream's
generated tokens, from the usage, over the wall from the clients' common start to the last
stream's end; content chunks where a server sent no usage: `tokens_from`), TTFT P50/P90/P99
(the client's time from sending a request to its first content chunk), gap P50/P99 and max
(the time between two content chunks of one stream), the samples behind each, failed
requests (a status other than 200, a broken stream, or an error event in it, as llama-server
sends "Context size has been exceeded" when its cells run out: counted, left out of the
figures, and the client goes on with its next request; a keep-alive connection the server
closed before answering is opened again once, as the SDKs do: `reconnects`), answers shorter
than max tokens (`short`: the model's end of text), the server's CPU seconds per generated
token and where the machine's CPU went (token_cadence's CpuShare), and the clients' own CPU
(this process: N threads reading SSE on the cores the servers compute on, the same on both
arms).
`cells_needed` is N x (prompt + max tokens) of the run's own prompts: where it exceeds the
cells, a server must move KV down tiers (prepos) or fail requests (llama-server). Ratios
prepos over llama-server with their targets at every N: `tokens_per_s_ratio` >= 1.0,
`ttft_p90_ratio` <= 1.0, `gap_p99_ratio` <= 1.25 (`met`: all False where prepos failed a
request, None where only llama-server did, since its figures then leave work out).

The stage breakdown (prepos): its /metrics scraped before and after each case, the deltas of
its scheduler's counters (`prepos:scheduler_*`; null where the server does not export them):
steps by kind (decode, prefill, mixed) and their mean forward ms (a decode's wait behind a
prefill: mixed-step ms less decode-step ms), sequences carried and foreground tasks left
waiting per step, decode and prefill tokens, prefill chunks (forwards cut to share a step),
and the worker's time per step outside the batched forward ((quantum - forward) / steps, and
per decode token); with the KV moved down tiers and recomputed in the case. llama-server's
counterpart from its own /metrics (`llamacpp:*`): decode calls, tokens predicted and
prompted, tokens per decode call.

    python benchmarks/concurrency.py [--model smollm2] [--streams 1,4,16,64]
                                     [--max-tokens 64,256] [--requests-per-client 2]
                                     [--threads 2] [--kv-layout unified|streams] [--quick]
--quick: N = 1, 4, 64 tokens, one request per client (a smoke run). The last line printed is
the JSON summary (also results/concurrency.json; --quick: results/concurrency-quick.json).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from long_context import WORDS  # noqa: E402
from stock_clients import KEYS, metrics, ratio, resolve, start_prepos  # noqa: E402
from token_cadence import TOPICS, Arm, stop_pair  # noqa: E402

from common import (  # noqa: E402
    RESULTS,
    machine,
    metric_samples,
    percentile,
    read_chat_stream,
    together,
    write,
)
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402
from prepos.config import EngineConfig  # noqa: E402

KEY = KEYS["prepos"]
SYSTEM = "You are a helpful assistant who writes at length."
# prepos over llama-server, at every N: (how, bound)
TARGETS = {"tokens_per_s_ratio": (">=", 1.0), "ttft_p90_ratio": ("<=", 1.0),
           "gap_p99_ratio": ("<=", 1.25)}
SCHED = "prepos:scheduler_"
STEP_KINDS = ("decode", "prefill", "mixed")


# -- the workload --------------------------------------------------------------------------
def prompt(max_tokens: int, n: int, client: int, request: int, words: int = 33
           ) -> list[dict]:
    """One request's messages: a different essay request for every (case, client, request)."""
    rng = random.Random(f"concurrency:{max_tokens}:{n}:{client}:{request}")
    topic = TOPICS[(client + request) % len(TOPICS)]
    picked = ", ".join(rng.choice(WORDS) for _ in range(words))
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Write a long, detailed essay about {topic}. Weave "
                                        f"in each of these words at least once: {picked}. "
                                        f"Use several paragraphs."}]


def one_request(http: httpx.Client, url: str, model: str, msgs: list[dict], max_tokens: int,
                key: str | None) -> dict:
    """One streamed chat completion read to its end: its TTFT, gaps, chunks and usage, or
    its error."""
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    times: list[float] = []
    sent = time.perf_counter()
    reconnects = 0
    try:
        while True:
            try:
                r = http.send(http.build_request("POST", url + "/v1/chat/completions",
                                                 json=body, headers=headers), stream=True)
                break
            except (httpx.RemoteProtocolError, httpx.ConnectError):
                # a keep-alive connection the server closed before any byte of an answer
                # (it had not taken the request): opened again once, as the SDKs do
                if reconnects:
                    raise
                reconnects += 1
        try:
            usage, last = read_chat_stream(r, url, times)
        finally:
            r.close()
        if isinstance(last, dict) and last.get("error"):  # the server's error event
            raise RuntimeError(f"error event: {json.dumps(last['error'])[:200]}")
    except Exception as exc:  # counted; the client goes on with its next request
        return {"error": repr(exc)[:300], "ttft_s": None, "gaps_s": [], "chunks": len(times),
                "completion_tokens": None, "prompt_tokens": None, "reconnects": reconnects}
    usage = usage or {}
    return {"error": None, "ttft_s": times[0] - sent if times else None,
            "gaps_s": [b - a for a, b in zip(times, times[1:])], "chunks": len(times),
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"), "reconnects": reconnects}


def run_clients(url: str, key: str | None, n: int, per_client: int, max_tokens: int,
                words: int) -> tuple[list[dict], float, float]:
    """N clients started together, each sending its requests in a row: every request's
    record, the wall from their common start to the last one's end, and this process's CPU
    seconds meanwhile (the clients')."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = httpx.get(url + "/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    got: list[list[dict]] = [[] for _ in range(n)]
    ended = [0.0] * n

    def client(c: int, barrier: threading.Barrier) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(1800.0, connect=60.0)) as http:
                barrier.wait()
                for r in range(per_client):
                    got[c].append(one_request(http, url, model,
                                              prompt(max_tokens, n, c, r, words),
                                              max_tokens, key))
        finally:
            ended[c] = time.perf_counter()

    cpu0 = time.process_time()
    start = together(n, client, f"a client of {n}")
    return [q for c in got for q in c], max(ended) - start, time.process_time() - cpu0


# -- the figures (pure: tests/bench/test_concurrency_bench.py) ------------------------------
def summary(reqs: list[dict], wall_s: float, server_cpu_s: float | None = None,
            max_tokens: int | None = None) -> dict:
    """One arm's case: throughput over the wall, TTFT and gap percentiles with their sample
    counts, errors, answers shorter than `max_tokens`, and the server's CPU per generated
    token. A failed request's figures and tokens are left out (its content chunks are in
    `content_chunks`)."""
    ok = [q for q in reqs if q["error"] is None]
    ttft = sorted(q["ttft_s"] * 1e3 for q in ok if q["ttft_s"] is not None)
    gaps = sorted(g * 1e3 for q in ok for g in q["gaps_s"])
    chunks = sum(q["chunks"] for q in reqs)
    usage = [q["completion_tokens"] for q in ok]
    from_usage = bool(ok) and all(u is not None for u in usage)
    tokens = sum(usage) if from_usage else sum(q["chunks"] for q in ok)
    prompts = [q["prompt_tokens"] for q in ok if q["prompt_tokens"] is not None]

    def pct(xs: list[float], p: float) -> float | None:
        return round(percentile(xs, p), 3) if xs else None

    out = {"requests": len(reqs), "errors": len(reqs) - len(ok),
           "error_examples": sorted({q["error"] for q in reqs if q["error"]})[:3],
           "reconnects": sum(q.get("reconnects", 0) for q in reqs),
           "empty": sum(1 for q in ok if q["ttft_s"] is None),
           "short": (sum(1 for q in ok if (q["completion_tokens"] or q["chunks"]) < max_tokens)
                     if max_tokens else None),
           "tokens": tokens, "tokens_from": "usage" if from_usage else "chunks",
           "content_chunks": chunks,
           "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
           "wall_s": round(wall_s, 3),
           "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
           "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
           "ttft_p99_ms": pct(ttft, 99), "ttft_samples": len(ttft),
           "gap_p50_ms": pct(gaps, 50), "gap_p99_ms": pct(gaps, 99),
           "gap_max_ms": pct(gaps, 100), "gap_samples": len(gaps)}
    if server_cpu_s is not None:
        out["server_cpu_s"] = round(server_cpu_s, 3)
        out["cpu_s_per_token"] = round(server_cpu_s / tokens, 6) if tokens else None
    return out


def ratios(ours: dict, theirs: dict) -> dict:
    """prepos over llama-server, each against its target. `met`: False for every target
    where prepos failed a request; else None where llama-server failed one (its figures then
    leave work out: no comparison) or either arm has no figure."""
    r = {"tokens_per_s_ratio": ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
         "ttft_p90_ratio": ratio(ours["ttft_p90_ms"], theirs["ttft_p90_ms"]),
         "gap_p99_ratio": ratio(ours["gap_p99_ms"], theirs["gap_p99_ms"])}
    if ours.get("errors"):
        met = {k: False for k in r}
    elif theirs.get("errors"):
        met = {k: None for k in r}
    else:
        met = {k: None if v is None else (v >= TARGETS[k][1] if TARGETS[k][0] == ">="
                                          else v <= TARGETS[k][1]) for k, v in r.items()}
    return {**r, "met": met}


def _by_label(d: dict[str, float], name: str) -> dict[str, float] | None:
    """The samples of one labelled family in `d` (`name{label="value"}` keys) by label
    value; None where it has none."""
    out = {m.group(1): v for k, v in d.items()
           if (m := re.fullmatch(re.escape(name) + r'\{\w+="([^"]*)"\}', k))}
    return out or None


def deltas(before: dict[str, float], after: dict[str, float], prefix: str) -> dict:
    """Each sample under `prefix` after less before (a sample new since: from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix)}


def stages(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """prepos's scheduler counters over a case (two scrapes, `metric_samples`'s form) and
    what they say per step; None where the server exports none of them, a figure None where
    its family is missing or it has no steps to divide by."""
    d = deltas(before, after, SCHED)
    if not d:
        return None
    steps = _by_label(d, SCHED + "steps_total")
    secs = _by_label(d, SCHED + "step_seconds_total")
    tokens = _by_label(d, SCHED + "step_tokens_total")
    total = sum(steps.values()) if steps else 0

    def per_step(name: str) -> float | None:
        v = d.get(SCHED + name)
        return round(v / total, 3) if v is not None and total else None

    step_ms = None
    if steps and secs:
        step_ms = {k: round(secs.get(k, 0.0) / steps[k] * 1e3, 3) if steps.get(k) else None
                   for k in STEP_KINDS}
    wait = None
    if step_ms and step_ms["mixed"] is not None and step_ms["decode"] is not None:
        wait = round(step_ms["mixed"] - step_ms["decode"], 3)
    quantum = d.get(SCHED + "quantum_seconds_total")
    forward = sum(secs.values()) if secs else None
    outside = quantum - forward if quantum is not None and forward is not None else None
    decoded = (tokens or {}).get("decode")
    return {"steps": {k: int(steps.get(k, 0)) for k in STEP_KINDS} if steps else None,
            "step_ms_mean": step_ms,
            "decode_wait_behind_prefill_ms": wait,
            "sequences_per_step": per_step("step_sequences_total"),
            "waiting_per_step": per_step("step_waiting_total"),
            "tokens": {k: int(v) for k, v in tokens.items()} if tokens else None,
            "decode_tokens_per_step": round(decoded / total, 3) if decoded and total else None,
            "prefill_chunks": (int(d[SCHED + "prefill_chunks_total"])
                               if SCHED + "prefill_chunks_total" in d else None),
            "quantum_s": round(quantum, 4) if quantum is not None else None,
            "forward_s": round(forward, 4) if forward is not None else None,
            "outside_forward_ms_per_step": (round(outside / total * 1e3, 3)
                                            if outside is not None and total else None),
            "outside_forward_ms_per_decode_token": (round(outside / decoded * 1e3, 3)
                                                    if outside is not None and decoded
                                                    else None)}


def kv_moves(before: dict[str, float], after: dict[str, float]) -> dict:
    """prepos's KV pressure over a case: states moved down tiers (or dropped), restored, and
    tokens recomputed where no tier held them."""
    d = deltas(before, after, "prepos:kv_")
    moved = _by_label(d, "prepos:kv_tier_moves_total")
    return {"moved_down": {k: int(v) for k, v in moved.items()} if moved else {},
            "restores": int(d.get("prepos:kv_restores_total", 0)),
            "recomputed_tokens": int(d.get("prepos:kv_recomputed_tokens_total", 0))}


def llama_stages(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """llama-server's own counters over a case (`--metrics`): its decode calls and the
    tokens they carried."""
    d = deltas(before, after, "llamacpp:")
    calls = d.get("llamacpp:n_decode_total")
    if calls is None:
        return None
    predicted = d.get("llamacpp:tokens_predicted_total")
    return {"decode_calls": int(calls),
            "tokens_predicted": int(predicted) if predicted is not None else None,
            "prompt_tokens": int(d.get("llamacpp:prompt_tokens_total", 0)),
            "predicted_per_decode_call": round(predicted / calls, 3)
            if predicted is not None and calls else None}


def cells_needed(n: int, prompt_tokens: float | None, max_tokens: int) -> int | None:
    """The KV cells N streams hold at once at their longest."""
    return None if prompt_tokens is None else round(n * (prompt_tokens + max_tokens))


# -- the run ---------------------------------------------------------------------------------
def scrape(url: str, key: str | None, keep: tuple[str, ...]) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return metric_samples(httpx.get(url + "/metrics", headers=headers, timeout=60).text, keep)


def layout_args(layout: str, n: int) -> tuple[list[str], list[str]]:
    """prepos's and llama-server's options for one KV layout at N streams."""
    if layout == "streams":
        return ["--kv-layout", "streams", "--kv-sequences", str(n)], ["--no-kv-unified"]
    return [], ["--kv-unified"]


def run_case(arm: Arm, n: int, max_tokens: int, args) -> dict:
    """One arm's case; its counters read around it (the server running, outside the case's
    CPU window)."""
    case = str(max_tokens)
    keep = ("prepos:",) if arm.prepos else ("llamacpp:",)
    with arm.running():
        before = scrape(arm.url, arm.key, keep)
    with arm.running(case):
        reqs, wall, client_cpu = run_clients(arm.url, arm.key, n, args.requests_per_client,
                                             max_tokens, args.prompt_words)
    with arm.running():
        after = scrape(arm.url, arm.key, keep)
    cpu = arm.cpu[case]
    out = {**summary(reqs, wall, cpu.server, max_tokens), **cpu.summary(),
           "client_cpu_s": round(client_cpu, 3)}
    if arm.prepos:
        out["stages"] = stages(before, after)
        out["kv_moves"] = kv_moves(before, after)
    else:
        out["stages"] = llama_stages(before, after)
    print(f"N={n} max_tokens={max_tokens} {arm.name}: {out['tokens_per_s']} tokens/s, TTFT "
          f"P90 {out['ttft_p90_ms']} ms, gap P99 {out['gap_p99_ms']} ms, "
          f"errors {out['errors']}, short {out['short']}", file=sys.stderr, flush=True)
    return out


def run_n(n: int, max_tokens: list[int], args, served: str, gguf: Path, binary: Path,
          work: Path, turn: int) -> tuple[list[dict], dict]:
    """A fresh pair of servers for N streams, every max tokens case on both, the arms'
    order alternating case by case from `turn`."""
    ours, theirs = Arm("prepos", KEY), Arm("llama_server", None)
    prepos_layout, llama_layout = layout_args(args.kv_layout, n)
    extra = [*prepos_layout, *(["--kv-cells", str(args.kv_cells)] if args.kv_cells else []),
             *args.server_arg]
    proc = llama = None
    try:
        proc, url = start_prepos(served, work / f"prepos-{n}.log", args.threads, extra)
        cells = int(metrics(url)["prepos:kv_cells_budget"])
        ours.serve(url, proc.pid)
        llama = LlamaServer(binary, gguf, slots=n, ctx_per_slot=cells // n,
                            threads=args.threads,
                            extra=("--jinja", "--metrics", *llama_layout),
                            log=work / f"llama-{n}.log").start(wait=300)
        theirs.serve(llama.url, llama.proc.pid)
        kv = {"prepos": {"layout": value_of(extra, "--kv-layout", EngineConfig.kv_layout),
                         "cells": cells,
                         "sequences": int(value_of(extra, "--kv-sequences",
                                                   EngineConfig.max_sequences))},
              "llama_server": {"layout": llama_layout[0], "ctx": cells // n * n, "slots": n}}
        cases = []
        for mt in max_tokens:
            order = (ours, theirs) if turn % 2 == 0 else (theirs, ours)
            turn += 1
            got = {arm.name: run_case(arm, n, mt, args) for arm in order}
            p, q = got["prepos"], got["llama_server"]
            cases.append({"streams": n, "max_tokens": mt, "order": [a.name for a in order],
                          "cells_needed": cells_needed(n, p["prompt_tokens_mean"]
                                                       or q["prompt_tokens_mean"], mt),
                          "prepos": p, "llama_server": q, **ratios(p, q)})
        return cases, kv
    finally:
        stop_pair(proc, llama)


def value_of(argv: list[str], flag: str, default):
    """The last value given to `flag` in an argument list, else `default`."""
    found = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return found[-1] if found else default


def targets_met(cases: list[dict]) -> dict:
    """Per target, whether every case met it (None where some case had no figure)."""
    out = {}
    for k in TARGETS:
        got = [c["met"][k] for c in cases]
        out[k] = None if not got or None in got else all(got)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, an HF model directory or a .gguf file")
    ap.add_argument("--streams", default="1,4,16,64", help="concurrent clients, comma separated")
    ap.add_argument("--max-tokens", default="64,256", help="tokens out, comma separated")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-words", type=int, default=33,
                    help="seeded words in each prompt (33: about 120 prompt tokens on SmolLM2)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    ap.add_argument("--kv-layout", choices=("unified", "streams"), default="unified",
                    help="both servers' KV cache layout (see the docstring)")
    ap.add_argument("--kv-cells", type=int, default=None,
                    help="prepos's resident KV cells (default: its own), llama-server's -c")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: N = 1,4, 64 tokens, one request per client")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `prepos serve` argument (repeatable)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.max_tokens, args.requests_per_client = "1,4", "64", 1
    streams = [int(x) for x in args.streams.split(",")]
    max_tokens = [int(x) for x in args.max_tokens.split(",")]
    binary = find_binary()
    if binary is None:
        print("no llama-server binary: run scripts/build_llama_server.sh", file=sys.stderr)
        return 2
    served, gguf, label = resolve(args.model)
    work = Path(tempfile.mkdtemp(prefix="concurrency-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers stopped on the way
    out: dict = {"benchmark": "concurrency", "model": label, "machine": machine(),
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip(),
                 "threads": args.threads, "streams": streams, "max_tokens": max_tokens,
                 "requests_per_client": args.requests_per_client,
                 "prompt_words": args.prompt_words, "quick": args.quick,
                 "server_args": args.server_arg, "logs": str(work),
                 "targets": {k: f"{how} {bound}" for k, (how, bound) in TARGETS.items()},
                 "kv": {}, "cases": []}
    for i, n in enumerate(streams):
        cases, kv = run_n(n, max_tokens, args, served, gguf, binary, work,
                          turn=i * len(max_tokens))
        out["cases"] += cases
        out["kv"][str(n)] = kv
    out["met"] = targets_met(out["cases"])
    out["all_met"] = all(out["met"].values())
    write(args.out or RESULTS / ("concurrency-quick.json" if args.quick
                                 else "concurrency.json"), out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
