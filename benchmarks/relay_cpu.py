"""What relaying a token costs prepos: its CPU per token streamed from a remote engine.

`prepos serve --backend llama-server` in front of a stand-in engine: a small asyncio server
speaking llama-server's `/completion` protocol (`/health`, `/props`, streamed and one-token
answers) that streams a fixed run of the model's own token ids at a fixed pace
(--gap-ms) and computes nothing. So the machine's cores are prepos's and the client's, and
what prepos spends a token is read apart from any engine's compute: on a machine where the
engine shares the cores (token_cadence.py's relay case), every microsecond of it is taken
from the engine's step.

The client streams --streams chat completions of --max-tokens tokens one after another (the
OpenAI wire format, read line by line) after one untimed stream. Reported: prepos's CPU
time (each thread's time on a CPU, from /proc's schedstat, in nanoseconds) over the
streamed content chunks, in µs per token, the event loop's thread apart from the others
(the model workers and the replicas' health check); wall time per token beside the
stand-in's pace; --repeats runs, the median and each. This is a probe of prepos's own
cost with a stand-in for the engine, not a comparison with one.

    python benchmarks/relay_cpu.py [--streams 6] [--max-tokens 128] [--gap-ms 8]
The last line printed is the JSON summary (also results/relay_cpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stock_clients import KEYS, resolve, start_prepos, stop  # noqa: E402

from common import RESULTS, machine, write  # noqa: E402

TEXT = ("The market opened higher this morning as traders weighed the latest figures on "
        "growth, prices and the labour market, and most sectors followed the lead of the ")


# -- the stand-in engine --------------------------------------------------------------------
def engine(port: int, gap: float, tokens: list[int]) -> None:
    """llama-server's `/completion` protocol, streaming `tokens` round robin, one every
    `gap` seconds; nothing is computed."""

    def event(i: int, req: dict, last: bool) -> bytes:
        ev = {"index": 0, "content": "", "tokens": [tokens[i % len(tokens)]], "stop": last,
              "id_slot": 0, "tokens_predicted": i + 1, "tokens_evaluated": len(req["prompt"])}
        if last:
            ev["timings"] = {"cache_n": len(req["prompt"]) - 1}
        data = b"data: " + json.dumps(ev).encode() + b"\n\n"
        return b"%x\r\n%s\r\n" % (len(data), data)

    def one_token(req: dict) -> dict:
        k = max(1, int(req.get("n_probs") or 1))
        top = [{"id": tokens[j % len(tokens)], "token": "", "logprob": -0.5 - j}
               for j in range(k)]
        return {"completion_probabilities": [{"id": top[0]["id"], "logprob": -0.5,
                                              "top_logprobs": top}],
                "tokens": [top[0]["id"]], "tokens_predicted": 1, "id_slot": 0,
                "tokens_evaluated": len(req["prompt"]), "timings": {"cache_n": 0}}

    async def handle(reader, writer):
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                path = head[0].split(" ")[1]
                fields = dict(h.split(":", 1) for h in head[1:] if ":" in h)
                length = int({k.lower(): v for k, v in fields.items()}.get("content-length",
                                                                            0))
                req = json.loads(await reader.readexactly(length)) if length else {}
                if path == "/completion" and req.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                    n = int(req["n_predict"])
                    for i in range(n):
                        await asyncio.sleep(gap)
                        writer.write(event(i, req, i == n - 1))
                    writer.write(b"0\r\n\r\n")
                else:
                    body = json.dumps(
                        one_token(req) if path == "/completion" else
                        {"total_slots": 1, "default_generation_settings": {"n_ctx": 8192}}
                        if path == "/props" else {"status": "ok"}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


# -- the client side ------------------------------------------------------------------------
def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the process's threads (the scheduler's count, in nanoseconds): its
    main thread (the event loop) and the rest together (the model workers, the replicas'
    health check; the interpreter names no OS thread, so they are not told apart)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:  # the thread ended
            continue
        kind = "event_loop" if tid == str(pid) else "other_threads"
        out[kind] = out.get(kind, 0.0) + ns / 1e9
    return out


AUTH = {"Authorization": f"Bearer {KEYS['prepos']}"}


def stream(http: httpx.Client, url: str, model: str, i: int, max_tokens: int) -> int:
    """One streamed chat completion; its chunks that carry content."""
    n = 0
    with http.stream("POST", url + "/v1/chat/completions", headers=AUTH, json={
            "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Story number {i}, please."}]}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                n += bool(choices[0].get("delta", {}).get("content"))
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="for the tokenizer and template")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gap-ms", type=float, default=8.0, help="the stand-in's pace")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--engine", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "relay_cpu.json")
    args = ap.parse_args(argv)

    from prepos.chat.format import ChatFormat
    from prepos.engine.loading import load_tokenizer, resolve_model

    served, _, label = resolve(args.model)
    ids = ChatFormat(load_tokenizer(resolve_model(args.model))).encode(TEXT)
    if args.engine is not None:  # this file's engine mode
        engine(args.engine, args.gap_ms / 1e3, ids)
        return 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = Path(tempfile.mkdtemp(prefix="relay-cpu-"))
    stand_in = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--engine",
                                 str(port), "--gap-ms", str(args.gap_ms)])
    out: dict = {"benchmark": "relay_cpu", "model": label, "machine": machine(),
                 "streams": args.streams, "max_tokens": args.max_tokens,
                 "gap_ms": args.gap_ms, "server_args": args.server_arg, "runs": []}
    try:
        deadline = time.monotonic() + 120
        while True:  # the stand-in up first: prepos asks it for its context when it loads
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                if stand_in.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the stand-in engine did not start") from None
                time.sleep(0.2)
        proc, url = start_prepos(served, work / "prepos.log", 2, [
            "--backend", "llama-server", "--engine-url", f"http://127.0.0.1:{port}",
            *args.server_arg])
        try:
            with httpx.Client(timeout=120) as http:
                model = http.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
                stream(http, url, model, -1, args.max_tokens)  # untimed
                for _ in range(args.repeats):
                    a, t0 = thread_cpu(proc.pid), time.perf_counter()
                    tokens = sum(stream(http, url, model, i, args.max_tokens)
                                 for i in range(args.streams))
                    wall, b = time.perf_counter() - t0, thread_cpu(proc.pid)
                    per = {k: round((b[k] - a.get(k, 0.0)) / tokens * 1e6, 1) for k in b}
                    out["runs"].append({"tokens": tokens, "cpu_us_per_token": per,
                                        "cpu_us_per_token_total": round(sum(per.values()), 1),
                                        "wall_ms_per_token": round(wall / tokens * 1e3, 3)})
        finally:
            stop(proc)
    finally:
        stand_in.terminate()
        stand_in.wait(30)
    runs = out["runs"]
    out["cpu_us_per_token_p50"] = statistics.median(r["cpu_us_per_token_total"] for r in runs)
    out["cpu_us_per_token_p50_by_thread"] = {
        k: statistics.median(r["cpu_us_per_token"].get(k, 0.0) for r in runs)
        for k in ("event_loop", "other_threads")}
    out["wall_ms_per_token_p50"] = statistics.median(r["wall_ms_per_token"] for r in runs)
    write(args.out, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
