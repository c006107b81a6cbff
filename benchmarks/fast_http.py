"""The exact fast path over HTTP against the floor of the server it runs on.

One server process, `prepos serve`'s own (its uvicorn settings: the guarded h11 protocol of
server/http/guard.py, the event loop uvicorn picks, the same limits and timeouts), serves four
endpoints side by side:

- fast: prepos's exact fast path, a streaming session's standing query asked with
  `max_tokens: 1` (`POST /sessions/{id}/query`, answered from the pre-positioned ready
  distribution; every response is checked to say `x-prepos-path: fast`, `x-prepos-match:
  exact`);
- empty: an empty endpoint (a Starlette route that reads the body and returns a constant JSON
  body) first in the same FastAPI app's router, behind its whole middleware stack;
- raw: a raw ASGI callable (one receive, two sends) in front of the app: the floor of the
  protocol, the loop and the client;
- raw_same: the raw callable answering a copy of one of prepos's fast responses (its
  headers and body, as the client received them): the floor for a response of that size.

The client is Python's http.client, one keep-alive connection per endpoint, loopback, the
same request body to each, the garbage collector paused while timing. Each series times
`--requests` requests of each endpoint (after `--warmup` untimed ones), one request of each
in turn, the order rotating (`--interleave request`, so the machine's noise falls on all
alike), or each endpoint's in a row, the order rotating from series to series (`block`).
The server also times its event loop thread's CPU in each request's ASGI call
(`server_cpu_us_p50`, the same wrapper for every endpoint): a gap between two endpoints' wall
times that their CPU times show too is the server's own work, not waiting. The call's CPU
includes whatever the loop runs while the call waits: http.client sends the head and the
body separately, so a call that reads the body late (after its own checks) also pays the
parsing of the body's segment, which a call that reads at once finds done. Printed last:
one JSON line with P50/P99 per endpoint over all series, per series, and the ratios
(`fast_over_raw_asgi_p50`, target <= 1.5).

    python benchmarks/fast_http.py [--series 3] [--requests 500] [--interleave request]
"""

from __future__ import annotations

import argparse
import gc
import http.client
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import RESULTS, machine, summarize, write  # noqa: E402

QUESTION = "Which way is ACME moving?"
DATA = "ACME 101.2 101.9 102.4 103.1 103.0 103.8 104.5"
EMPTY, RAW, RAW_SAME = "/bench/empty", "/bench/raw", "/bench/raw-same"
CPU = "/bench/cpu"  # the server's CPU time per request, by path (taken: cleared)
ENDPOINTS = ("fast", "empty", "raw", "raw_same")
CONSTANT = b'{"ok": true}'
JSON_HEADERS = [(b"content-type", b"application/json"),
                (b"content-length", str(len(CONSTANT)).encode())]


# -- the server side ----------------------------------------------------------------------
async def raw_asgi(scope, receive, send, copy: dict | None = None) -> None:
    """The floor: read the request, answer a constant JSON body (or `copy`'s response)."""
    message = await receive()
    if copy is not None and "headers" not in copy:  # the first request brings the copy
        given = json.loads(message["body"])
        copy["headers"] = [(k.lower().encode(), v.encode()) for k, v in given["headers"]
                           if k.lower() not in ("date", "server")]  # uvicorn adds both
        copy["body"] = given["body"].encode()
        copy = None
    headers, body = (JSON_HEADERS, CONSTANT) if copy is None else (copy["headers"], copy["body"])
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def around(app):
    """prepos's app with the empty endpoint first in its router, behind the raw callable."""
    from starlette.responses import Response
    from starlette.routing import Route

    async def empty(request):
        await request.body()  # as the other two: the request is read whole
        return Response(CONSTANT, media_type="application/json")

    app.router.routes.insert(0, Route(EMPTY, empty, methods=["POST"]))

    copy: dict = {}
    cpu: dict[str, list[int]] = {}  # path: the event loop thread's CPU ns of each request

    async def served(scope, receive, send):
        path = scope.get("path")
        if path == CPU:  # the samples so far, then none
            body = json.dumps(cpu).encode()
            cpu.clear()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        if scope["type"] != "http":
            return await dispatch(scope, receive, send)
        t0 = time.thread_time_ns()
        await dispatch(scope, receive, send)
        cpu.setdefault(path, []).append(time.thread_time_ns() - t0)

    async def dispatch(scope, receive, send):
        path = scope.get("path")
        if path == RAW:
            return await raw_asgi(scope, receive, send)
        if path == RAW_SAME:
            return await raw_asgi(scope, receive, send, copy)
        return await app(scope, receive, send)

    return served


def serve(argv: list[str]) -> int:
    from prepos.server.http.app import main

    return main(argv, around=around)


# -- the client side ----------------------------------------------------------------------
@contextmanager
def serving(args: argparse.Namespace, log: Path):
    """This file's server mode as a subprocess: its port, once its /health says 200."""
    port_file = log.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    model = ["--model", str(args.model)] if args.model else []
    cmd = [sys.executable, __file__, "--serve", *model, "--backend", args.backend, "--port",
           "0", "--port-file", str(port_file), "--journal", "none", "--log-level", "warning",
           *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not healthy(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server not ready: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    try:
        yield int(port_file.read_text())
    finally:
        proc.terminate()  # a graceful stop
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def healthy(port_file: Path) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", int(port_file.read_text()), timeout=5)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except (OSError, ValueError):  # no port yet, or not listening yet
        return False


def fast_session(port: int) -> str:
    """A streaming session whose standing query is pre-positioned at its current version."""
    from http_ttft import Client  # its JSON calls

    c = Client("127.0.0.1", port)
    sid = c.call("POST", "/sessions", {"kind": "streaming", "standing_queries": [QUESTION]})["id"]
    c.call("POST", f"/sessions/{sid}/append", {"data": DATA})
    if not c.call("GET", f"/sessions/{sid}?wait_ready=60")["ready"]["done"]:
        raise RuntimeError("the standing query was not pre-positioned in 60 s")
    c.conn.close()
    return sid


class Endpoint:
    """One endpoint on its own keep-alive connection; every response checked."""

    def __init__(self, name: str, port: int, path: str, body: bytes,
                 expect: bytes | None = None):
        self.name, self.path, self.body, self.expect = name, path, body, expect
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"Content-Type": "application/json"}
        self.samples: list[float] = []
        self.series: list[dict] = []
        self.engine_ms: list[float] = []  # prepos's answers: the engine's total (Server-Timing)
        self.cpu_ns: list[int] = []  # the server's CPU time in each timed request
        self.wrong = 0
        self.wrong_examples: list[str] = []

    def once(self, into: list[float] | None) -> None:
        """One request, its seconds appended to `into` (None: untimed)."""
        t0 = time.perf_counter()
        self.conn.request("POST", self.path, self.body, self.headers)
        r = self.conn.getresponse()
        raw = r.read()
        if into is not None:
            into.append(time.perf_counter() - t0)
        self.check(r, raw, into is not None)

    def check(self, r: http.client.HTTPResponse, raw: bytes, timed: bool) -> None:
        ok = r.status == 200
        if self.expect is None:  # prepos's answer
            ok = ok and r.getheader("x-prepos-path") == "fast" and \
                r.getheader("x-prepos-match") == "exact"
            timing = dict(part.strip().split(";dur=")
                          for part in (r.getheader("server-timing") or "").split(","))
            if ok and timed:
                self.engine_ms.append(float(timing["total"]))
        else:
            ok = ok and raw == self.expect
        if not ok:
            self.wrong += 1
            if len(self.wrong_examples) < 5:
                self.wrong_examples.append(f"{self.name}: HTTP {r.status} "
                                           f"{dict(r.getheaders())} {raw[:200]!r}")


def taken(port: int) -> dict[str, list[int]]:
    """The server's CPU time samples since the last call, by path."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", CPU)
    took = json.loads(c.getresponse().read())
    c.close()
    return took


def ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def measure(port: int, series: int, requests: int, warmup: int,
            interleave: str = "request") -> dict:
    sid = fast_session(port)
    body = json.dumps({"question": QUESTION, "max_tokens": 1}).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", f"/sessions/{sid}/query", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    answer = r.read()  # the raw callable's copy, sent as its first request's body
    c.request("POST", RAW_SAME, json.dumps({"headers": r.getheaders(), "body": answer.decode()}))
    c.getresponse().read()
    c.close()
    taken(port)  # the set-up's requests: not samples
    eps = [Endpoint("fast", port, f"/sessions/{sid}/query", body),
           Endpoint("empty", port, EMPTY, body, CONSTANT),
           Endpoint("raw", port, RAW, body, CONSTANT),
           Endpoint("raw_same", port, RAW_SAME, body, answer)]
    gc.collect()
    gc.freeze()
    for i in range(series):
        xs: dict[str, list[float]] = {ep.name: [] for ep in eps}
        gc.disable()
        try:
            if interleave == "request":  # one request of each in turn, the order rotating
                for k in range(warmup + requests):
                    for ep in eps[k % len(eps):] + eps[:k % len(eps)]:
                        ep.once(xs[ep.name] if k >= warmup else None)
            else:  # each endpoint's requests in a row, the order rotating per series
                for ep in eps[i % len(eps):] + eps[:i % len(eps)]:
                    for k in range(warmup + requests):
                        ep.once(xs[ep.name] if k >= warmup else None)
        finally:
            gc.enable()
        took = taken(port)  # each path's requests in order: its warm-up ones first
        for ep in eps:
            ep.samples += xs[ep.name]
            ep.series.append(summarize(xs[ep.name]))
            ep.cpu_ns += took[ep.path][warmup:]
    by = {ep.name: ep for ep in eps}
    total = {name: summarize(by[name].samples) for name in ENDPOINTS}
    p50 = {name: total[name]["p50_ms"] for name in ENDPOINTS}
    per_series = [{name: {k: round(by[name].series[i][k], 4) for k in ("n", "p50_ms", "p99_ms")}
                   for name in ENDPOINTS} for i in range(series)]
    return {
        "fast_over_raw_asgi_p50": ratio(p50["fast"], p50["raw"]),
        "fast_over_empty_p50": ratio(p50["fast"], p50["empty"]),
        "empty_over_raw_asgi_p50": ratio(p50["empty"], p50["raw"]),
        "fast_over_raw_same_p50": ratio(p50["fast"], p50["raw_same"]),
        "raw_same_over_raw_asgi_p50": ratio(p50["raw_same"], p50["raw"]),
        "fast_over_raw_asgi_p50_per_series": [
            ratio(s["fast"]["p50_ms"], s["raw"]["p50_ms"]) for s in per_series],
        "endpoints": {name: {k: round(v, 4) if isinstance(v, float) else v
                             for k, v in total[name].items()} for name in ENDPOINTS},
        "series": per_series,
        # the engine's own time for each answer (the request's arrival at the engine to its
        # result), as the answers' Server-Timing says: the rest of `fast` is HTTP's
        "fast_engine_total_ms_p50": round(statistics.median(by["fast"].engine_ms), 4),
        # the server's event loop thread's CPU time in each timed request (its ASGI call,
        # start to end, `time.thread_time`): where the wall time differs, the server waited
        # (for the CPU, or another thread)
        "server_cpu_us_p50": {name: round(statistics.median(by[name].cpu_ns) / 1e3, 1)
                              for name in ENDPOINTS},
        "wrong": sum(ep.wrong for ep in eps),
        "wrong_examples": [w for ep in eps for w in ep.wrong_examples],
        "samples_ms": {ep.name: [round(x * 1e3, 4) for x in ep.samples] for ep in eps},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, default=3)
    ap.add_argument("--requests", type=int, default=500, help="timed requests per endpoint "
                    "per series")
    ap.add_argument("--warmup", type=int, default=100, help="untimed requests of each "
                    "endpoint before each series")
    ap.add_argument("--interleave", default="request", choices=["request", "block"],
                    help="request: one request of each endpoint in turn (the machine's noise "
                    "falls on all alike); block: each endpoint's series in a row (its code "
                    "stays warm in the caches)")
    ap.add_argument("--model", type=Path, help="default: prepos serve's (the bundled model)")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp"])
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `prepos serve` argument (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS / "fast_http.json")
    args = ap.parse_args(argv)
    if args.series < 1 or args.requests < 1:
        ap.error("--series and --requests must be >= 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "benchmark": "fast_http", "machine": machine(),
        "model": str(args.model or "prepos serve's default"), "backend": args.backend,
        "server": "prepos serve's uvicorn settings: h11 with server/http/guard.py, loop "
                  f"{'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio'} (auto)",
        "client": "http.client, one keep-alive connection per endpoint, loopback",
        "series_count": args.series, "requests": args.requests, "warmup": args.warmup,
        "interleave": args.interleave}
    with serving(args, args.out.with_suffix(".server.log")) as port:
        summary.update(measure(port, args.series, args.requests, args.warmup,
                               args.interleave))
    summary["target_fast_over_raw_asgi_p50_le_1_5"] = summary["fast_over_raw_asgi_p50"] <= 1.5
    write(args.out, summary)
    summary.pop("samples_ms")  # the file keeps every sample; the printed line does not
    print(json.dumps(summary))
    return 1 if summary["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
