"""Client-observed time to first token over HTTP, on loopback with keep-alive, for the fast
path, fall-through and the cold path, side by side in one run; then a load run.

Setup (the timing model: a ~125M-parameter Llama with seeded random weights, on the
CPU): three streaming sessions hold the same ~512 tokens of price data. One registers the
query as a standing query (fast path: exact match), one does not (fall-through: the query
prefix is pre-paid), one never pre-positions (cold). Each round rolls every session back to
that state, appends one new data message (so every round answers a fresh version), waits
until the pre-positions are recorded, then asks the same question of the three in a
shuffled order. Even rounds ask with `max_tokens: 1` and no streaming (the response is the
first token); odd rounds stream (SSE, `max_tokens: 4`) and time the first token event.

The client is Python's http.client on one keep-alive connection, with the garbage collector
paused while a request is timed. Printed last: one JSON line with P50/P99 per path and the
ratios. Then the load run: 64 concurrent sessions, >= 2,000 mixed updates and queries,
counting errors and stale answers, with throughput and P99.

    python benchmarks/http_ttft.py [--samples 128] [--no-load]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine, model_args, model_dir, model_label  # noqa: E402
from prepos.lab.loadgen import load_run, percentile, price_messages  # noqa: E402
from prepos.lab.task.market import SYSTEM_PROMPT  # noqa: E402

QUESTION = "Which way is ACME moving?"
PATHS = ("fast", "fall-through", "cold", "peer")
PATH_OF = {"peer": "fall-through"}  # the path the server reports for each arm


class Client:
    """One keep-alive HTTP/1.1 connection; JSON in, JSON (or SSE) out."""

    def __init__(self, host: str, port: int):
        self.conn = http.client.HTTPConnection(host, port, timeout=600)

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, data, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        raw = r.read()
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {r.status}: {raw[:300]!r}")
        return json.loads(raw)

    def timed_query(self, sid: str, stream: bool, fast_path: str | None = None
                    ) -> tuple[float, dict]:
        """Seconds from sending the request to the first token, and the result."""
        req = {"question": QUESTION, "max_tokens": 4 if stream else 1, "stream": stream}
        if fast_path is not None:
            req["fast_path"] = fast_path
        body = json.dumps(req).encode()
        headers = {"Content-Type": "application/json"}
        t0 = time.perf_counter()
        self.conn.request("POST", f"/sessions/{sid}/query", body, headers)
        r = self.conn.getresponse()
        if not stream:
            raw = r.read()
            first = time.perf_counter() - t0
            if r.status != 200:
                raise RuntimeError(f"query: HTTP {r.status}: {raw[:300]!r}")
            return first, json.loads(raw)
        first = None
        result, name = None, None
        while True:
            line = r.readline()
            if not line:
                break
            if first is None and line.startswith(b"event: token"):
                first = time.perf_counter() - t0
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:") and name == b"result":
                result = json.loads(line[5:])
        r.read()  # the end of the response, so the connection can be reused
        if r.status != 200 or result is None or first is None:
            raise RuntimeError(f"streamed query: HTTP {r.status}, no result")
        return first, result


def start_server(model: Path, threads: int | None, log: Path, extra: list[str]):
    port_file = log.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "prepos.cli", "serve", "--model", str(model), "--port", "0",
           "--port-file", str(port_file), "--journal", "none", "--log-level", "warning",
           *(["--threads", str(threads)] if threads else []), *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        if port_file.exists():
            port = int(port_file.read_text())
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return proc, port
            except OSError:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("server not ready in 600 s")
        time.sleep(0.1)


def summarize(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": _ms(percentile(xs, 50)), "p99_ms": _ms(percentile(xs, 99)),
            "min_ms": _ms(min(xs)) if xs else None, "max_ms": _ms(max(xs)) if xs else None}


def _ms(x):
    return None if x is None else round(x * 1e3, 4)


def measure_ttft(port: int, samples: int, state_tokens: int, warmup: int, progress) -> dict:
    c = Client("127.0.0.1", port)
    # "peer": a prefix cache's behaviour: the whole entry's KV is resident (pre-positioned)
    # but the cached distribution is not used, so the first token costs one decode step
    specs = {"fast": {"standing_queries": [QUESTION]}, "fall-through": {},
             "cold": {"preposition": False}, "peer": {"standing_queries": [QUESTION]}}
    # the cold session's system line its own: its twins' KVs (the same state, the entry
    # pre-positioned) are otherwise a prefix it starts from, and its entry is not cold
    sids = {p: c.call("POST", "/sessions", {
        "kind": "streaming", "system": SYSTEM_PROMPT + (" Cold." if p == "cold" else ""),
        **spec})["id"] for p, spec in specs.items()}
    rounds = 2 * samples + warmup
    data = price_messages(7, 400 + rounds, "ACME")
    feed = iter(data)
    tokens = 0
    while tokens < state_tokens:  # the same session state in all three
        msg = next(feed)
        for sid in sids.values():
            out = c.call("POST", f"/sessions/{sid}/append", {"data": msg})
        tokens = out["tokens"]
    base = out["version"]
    info = c.call("GET", f"/sessions/{sids['fast']}?wait_ready=60")
    entry = info["ready"]["records"][f"query:{QUESTION}"]["entry_tokens"]
    client_s: dict = {m: {p: [] for p in PATHS} for m in ("json", "sse")}
    server_s: dict = {m: {p: [] for p in PATHS} for m in ("json", "sse")}
    wrong_path: list[str] = []
    rng = random.Random(0)
    gc.collect()
    gc.freeze()
    for r in range(rounds):
        msg = next(feed)
        for sid in sids.values():
            c.call("POST", f"/sessions/{sid}/rollback", {"version": base})
            c.call("POST", f"/sessions/{sid}/append", {"data": msg})
        for p in ("fast", "fall-through", "peer"):
            ready = c.call("GET", f"/sessions/{sids[p]}?wait_ready=60")["ready"]
            if not ready["done"]:
                raise RuntimeError(f"{p} session not pre-positioned in 60 s")
        mode = "sse" if r % 2 else "json"
        order = list(PATHS)
        rng.shuffle(order)
        for p in order:
            gc.disable()
            try:
                t, res = c.timed_query(sids[p], stream=mode == "sse",
                                       fast_path="off" if p == "peer" else None)
            finally:
                gc.enable()
            if res["path"] != PATH_OF.get(p, p):
                wrong_path.append(f"round {r}: {p} session served by {res['path']}")
                continue
            if r >= warmup:
                client_s[mode][p].append(t)
                server_s[mode][p].append(res["timing"]["ttft_ms"] / 1e3)
        progress(1)
    for sid in sids.values():
        c.call("DELETE", f"/sessions/{sid}")
    out = {"state_tokens": tokens, "entry_tokens": entry, "rounds": rounds, "warmup": warmup,
           "wrong_path": len(wrong_path), "wrong_path_examples": wrong_path[:5]}
    for mode in ("json", "sse"):
        per = {p: summarize(client_s[mode][p]) for p in PATHS}
        srv = {p: summarize(server_s[mode][p]) for p in PATHS}
        fast = per["fast"]
        out[mode] = {
            "client": per, "server_ttft": srv,
            "cold_over_fast_p50": _ratio(per["cold"]["p50_ms"], fast["p50_ms"]),
            "fall_over_fast_p50": _ratio(per["fall-through"]["p50_ms"], fast["p50_ms"]),
            "cold_over_fast_p99": _ratio(per["cold"]["p99_ms"], fast["p99_ms"]),
            "peer_over_fast_p50": _ratio(per["peer"]["p50_ms"], fast["p50_ms"]),
            "samples_ms": {p: [_ms(x) for x in client_s[mode][p]] for p in PATHS},
        }
    return out


def _ratio(a, b):
    return None if not a or not b else round(a / b, 2)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=128, help="samples per path per mode")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--state-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, help="the server's torch threads (default: its own)")
    ap.add_argument("--load-sessions", type=int, default=64)
    ap.add_argument("--load-ops", type=int, default=2048)
    ap.add_argument("--load-state-messages", type=int, default=4)
    ap.add_argument("--load-think-ms", type=float, default=0.0,
                    help="mean think time between a session's operations (0: closed loop)")
    ap.add_argument("--no-load", action="store_true", help="skip the load run")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `prepos serve` argument (repeatable)")
    model_args(ap, "http_ttft")
    args = ap.parse_args(argv)

    model = model_dir(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    proc, port = start_server(model, args.threads, args.out.with_suffix(".server.log"),
                              ["--device", args.device, "--dtype", args.dtype,
                               "--backend", args.backend, *args.server_arg])
    summary: dict = {"benchmark": "http_ttft", "model": model_label(args), "machine": machine(),
                     "client": "http.client, one keep-alive connection, loopback",
                     "cpus": os.cpu_count(), "server_threads": args.threads}
    try:
        rounds = 2 * args.samples + args.warmup
        with tqdm(total=rounds, desc="ttft rounds", file=sys.stderr) as bar:
            summary["ttft"] = measure_ttft(port, args.samples, args.state_tokens, args.warmup,
                                           bar.update)
        if not args.no_load:
            with tqdm(total=args.load_ops, desc="load ops", file=sys.stderr) as bar:
                summary["load"] = asyncio.run(load_run(
                    f"http://127.0.0.1:{port}", sessions=args.load_sessions, ops=args.load_ops,
                    state_messages=args.load_state_messages, think_ms=args.load_think_ms,
                    progress=bar.update))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    t = summary["ttft"]["json"]
    fast = t["client"]["fast"]
    summary["targets"] = {
        "fast_p50_le_1ms": fast["p50_ms"] is not None and fast["p50_ms"] <= 1.0,
        "fast_p99_le_2ms": fast["p99_ms"] is not None and fast["p99_ms"] <= 2.0,
        "cold_over_fast_ge_50x": (t["cold_over_fast_p50"] or 0) >= 50,
        "peer_over_fast_ge_40x": (t["peer_over_fast_p50"] or 0) >= 40,
    }
    if "load" in summary:
        ld = summary["load"]
        summary["targets"]["load_zero_errors"] = ld["errors"] == 0
        summary["targets"]["load_zero_stale"] = ld["stale"] == 0
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    for mode in ("json", "sse"):  # the file keeps every sample; the printed summary does not
        summary["ttft"][mode].pop("samples_ms")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
