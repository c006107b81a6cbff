"""Every token at the engine's pace: the gap between a stream's content chunks, timed at the
client, prepos beside llama-server on the same GGUF with the same threads.

Each stream is one streamed `/v1/chat/completions` (greedy, --max-tokens tokens, a prompt
asking for a long answer, a different one each stream), read line by line as a stock SSE
client reads it; a gap is the time between two chunks that carry content. Four cases:

  single    one stream at a time (--runs streams)
  four      four streams at once (--runs / 2 groups of four, each group's four requests
            sent together); also aggregate tokens/s
  busy      one stream at a time while --busy-sessions other sessions are fed a data line
            every 100 ms in turn (`wait: false`: each append's KV is built at idle, with the
            pre-position of its standing query and the pre-decode of its answer) and
            /metrics is scraped every 250 ms; llama-server's arm: its /metrics scraped the
            same way (it has no idle work). The load is sent from raw keep-alive
            connections (one a server closed while it was paused is opened again:
            `load_reconnects`), and its own CPU reported (`load_cpu_pct`, of one core)
  remote    one stream at a time through `prepos serve --backend llama-server` against the
            same llama-server directly, alternated stream by stream in ABBA order (both
            alive: prepos relays)

Both servers run one KV cache layout (--kv-layout): `unified`, each one's default (one
pool of cells for every sequence: prepos's default, llama-server's `--kv-unified`, its
default when it picks its slots itself), or `streams` (a fixed stream per sequence: prepos's
`--kv-layout streams`, 16 streams of 1,024 cells; llama-server's `--no-kv-unified`, a
slot's 4,096). The layout changes the engine's step (on the unified pool, four sequences
decoding together each attend over the cells of all four), so comparing across layouts
would measure the layout, not the serving path.

Cases single, four and busy run with one server running at a time: prepos and llama-server
(`-np 4 --jinja`) are both started, and while one streams the other is paused (SIGSTOP:
it takes no CPU, and its idle work waits). The two take turns stream by stream (four at
once: group by group) in ABBA order, since this machine's speed changes within seconds (the
mean gap of three streams in a row on one server varied by 7% here): a turn by turn
alternation puts such a change on both arms alike, where blocks of streams did not. Each of
the --rounds rounds is a fresh pair of servers running every case with its share of the
streams; a case's figures pool its rounds' gaps. Reported per case and arm: gap P50, P90,
P99, max and mean in ms, with the number of gaps, streams and tokens, and the ratios prepos
over llama-server (`gap_p50_ratio`, `gap_p99_ratio`, `mean_gap_ratio`; `tokens_per_s_ratio`
at four streams), and turn by turn (`turn_mean_gap_ratio`: the median and quartiles over the
turns of prepos's mean gap over llama-server's in the same turn). Each pooled gap ratio has a
95% bootstrap interval (`ratio_ci95`: the turns drawn again with replacement, a turn's streams
on both arms together): how far the run's figure could have moved with its turns alone.
Per case and arm, where the machine's CPU went while its streams ran, in % of one core:
the server's (`server_cpu_pct`), everything outside the server and this benchmark
(`outside_cpu_pct`: other processes, the kernel's threads) and the hypervisor's steal
(`steal_pct`); in the remote case one window holds both servers. Both servers compute on
every core, so CPU taken outside stretches their steps: a run a neighbour disturbed shows.
With --stages, prepos's own per-token stage times from its /metrics (histogram
`prepos:token_stage_seconds`, P50 / P99 interpolated within buckets, in µs): the decode step,
the hand-off to the event loop, the chunk's encoding and its write to the socket.

    python benchmarks/token_cadence.py [--model smollm2] [--runs 8] [--rounds 2]
                                       [--max-tokens 128] [--kv-layout unified|streams]
The last line printed is the JSON summary (also results/token_cadence.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stock_clients import KEYS, resolve, start_prepos, stop  # noqa: E402

from common import (  # noqa: E402
    RESULTS,
    CpuShare,
    intervals,
    machine,
    percentile,
    read_chat_stream,
    together,
    turn_gaps,
    write,
)
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402

KEY = KEYS["prepos"]
TOPICS = ["the history of the printing press", "how a steam engine works",
          "the water cycle", "the life of honey bees", "how bridges are built",
          "the causes of the seasons", "how a compiler works", "the rise of the railways",
          "how vaccines train the immune system", "the architecture of cathedrals",
          "how tides are formed", "the invention of the telescope"]
STAGES = ("engine", "handoff", "respond", "write")
# both servers on one KV cache layout (--kv-layout): prepos's options, llama-server's
LAYOUTS = {"unified": {"prepos": (), "llama_server": ("--kv-unified",)},
           "streams": {"prepos": ("--kv-layout", "streams", "--kv-sequences", "16",
                                  "--kv-cells", "16384"),
                       "llama_server": ("--no-kv-unified",)}}


def prompt(i: int) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant who writes at length."},
            {"role": "user", "content": f"Write a long, detailed essay about "
                                        f"{TOPICS[i % len(TOPICS)]}. Use several paragraphs."}]


def one_stream(url: str, i: int, max_tokens: int, key: str | None,
               start: threading.Barrier | None = None) -> dict:
    """One streamed chat completion: the client-side times of its content chunks. With
    `start`, its request is sent once every party is ready to send its own."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": prompt(i), "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    times: list[float] = []
    with httpx.Client(timeout=300) as http:
        if start is not None:
            start.wait()
        with http.stream("POST", url + "/v1/chat/completions", json=body,
                         headers=headers) as r:
            read_chat_stream(r, url, times)
    return {"times": times, "gaps": [b - a for a, b in zip(times, times[1:])]}


def summary(streams: list[dict], wall_s: float | None = None) -> dict:
    gaps = sorted(g * 1e3 for s in streams for g in s["gaps"])
    n = len(gaps)

    def pct(p: float) -> float:
        return round(percentile(gaps, p), 3)

    tokens = sum(len(s["times"]) for s in streams)
    out = {"streams": len(streams), "tokens": tokens, "gaps": n, "gap_p50_ms": pct(50),
           "gap_p90_ms": pct(90), "gap_p99_ms": pct(99), "gap_max_ms": pct(100),
           "mean_gap_ms": round(statistics.fmean(gaps), 3) if n else float("nan"),
           "gaps_over_30_ms": sum(1 for g in gaps if g > 30)}
    if wall_s:
        out["tokens_per_s"] = round(tokens / wall_s, 2)
    return out


def four_at_once(url: str, args, key: str | None) -> tuple[list[dict], float]:
    """Four streams sent together (each request once all four are ready to send, so that
    how they overlap is the same each group): their gaps, and the wall time until the last
    ends from then."""
    got: list[dict] = [{}] * 4

    def go(j: int, start: threading.Barrier) -> None:
        got[j] = one_stream(url, j, args.max_tokens, key, start)

    sent = together(4, go, "a stream of four at once", timeout=120)
    return got, time.perf_counter() - sent


class RawHttp:
    """One keep-alive HTTP/1.1 connection whose requests are written as bytes and whose
    answers are read by their length: the busy case's load sent with as little of the
    client's own CPU as a client can spend (a pooled httpx client spent 1.8 ms of CPU an
    append here and 2.9 ms a scrape, taken from the cores both servers decode on)."""

    def __init__(self, url: str, headers: dict[str, str]):
        host, port = url.removeprefix("http://").split(":")
        self.address = (host, int(port))
        self.head = "".join(f"{k}: {v}\r\n" for k, v in
                            {"Host": f"{host}:{port}", **headers}.items()).encode()
        self.reconnects = 0  # idle connections the server had closed, opened again
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection(self.address, timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def request(self, method: str, path: str, body: bytes = b"") -> int:
        """The answer's status (its body read and dropped). A connection the server closed
        while it was idle (its keep-alive timeout, run out while the benchmark paused it)
        is opened again and the request sent once more: no byte of an answer had come, so
        the server had not taken the request."""
        extra = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body) \
            if body else b""
        raw = b"%s %s HTTP/1.1\r\n%s%s\r\n%s" % (method.encode(), path.encode(), self.head,
                                                 extra, body)
        try:
            self.sock.sendall(raw)
            self._recv()
        except ConnectionError:  # closed or reset; a timeout is not retried
            self.sock.close()
            self._connect()
            self.reconnects += 1
            self.sock.sendall(raw)
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.lower().split(b"\r\n")
        fields = dict(line.split(b":", 1) for line in lines[1:])
        if b"content-length" in fields:
            self._skip(int(fields[b"content-length"]))
        elif fields.get(b"transfer-encoding", b"").strip() == b"chunked":
            while True:
                while b"\r\n" not in self.buf:
                    self._recv()
                size, self.buf = self.buf.split(b"\r\n", 1)
                n = int(size.split(b";")[0], 16)
                self._skip(n + 2)
                if n == 0:
                    break
        return int(lines[0].split()[1])

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    def _skip(self, n: int) -> None:
        while len(self.buf) < n:
            self._recv()
        self.buf = self.buf[n:]

    def close(self) -> None:
        self.sock.close()


class Busy:
    """Background load while streams run: other sessions fed data (prepos) and /metrics
    scraped every 250 ms (both servers), from raw connections (`RawHttp`); the load's own
    CPU (its threads') is counted, to be reported beside the gaps."""

    def __init__(self, url: str, sessions: int, key: str | None, prepos: bool):
        self.url, self.key, self.stop_ = url, key, threading.Event()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.sids: list[str] = []
        self.appends = self.scrapes = self.failed = self.reconnects = 0
        self.cpu_s = 0.0  # the load's threads' CPU
        self.lock = threading.Lock()
        if prepos:
            for i in range(sessions):
                r = httpx.post(url + "/sessions", headers=self.headers, timeout=60, json={
                    "kind": "streaming", "system": "You watch a price feed.",
                    "standing_queries": [f"Is ticker T{i} rising? Answer briefly."]})
                r.raise_for_status()
                self.sids.append(r.json()["id"])
        self.running = threading.Event()  # set while its server runs (`Arm.running`)
        self.threads = [threading.Thread(target=self._counted, args=(f,), daemon=True)
                        for f in (self._feed, self._scrape)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """The load stopped and its sessions deleted (its server running)."""
        self.stop_.set()
        self.running.set()
        for t in self.threads:
            t.join()
        for sid in self.sids:
            httpx.delete(f"{self.url}/sessions/{sid}", headers=self.headers, timeout=60)

    def _counted(self, load) -> None:
        c0 = time.thread_time()
        http = RawHttp(self.url, self.headers)
        try:
            load(http)
        except Exception:  # the connection failed: counted, and this load stops
            self._failed()
            raise
        finally:
            http.close()
            with self.lock:
                self.cpu_s += time.thread_time() - c0
                self.reconnects += http.reconnects

    def _go(self, every: float) -> bool:
        """Whether to send the next request: `every` seconds on, once its server runs."""
        if self.stop_.wait(every):
            return False
        self.running.wait()
        return not self.stop_.is_set()

    def _failed(self) -> None:  # either thread's
        with self.lock:
            self.failed += 1

    def _feed(self, http: RawHttp) -> None:
        i = 0
        while self.sids and self._go(0.1):
            sid = self.sids[i % len(self.sids)]
            data = f"T{i % 8} {100 + i % 17}.{i % 10} {101 + i % 13}.5"
            # `wait: false`: its KV built at idle, with the pre-position
            status = http.request("POST", f"/sessions/{sid}/append",
                                  b'{"data": "%s", "wait": false}' % data.encode())
            self.appends += 1
            if status >= 300:
                self._failed()
            i += 1

    def _scrape(self, http: RawHttp) -> None:
        while self._go(0.25):
            if http.request("GET", "/metrics") >= 300:
                self._failed()
            self.scrapes += 1


def stage_buckets(url: str, key: str | None) -> dict[tuple[str, float], float]:
    """prepos's `prepos:token_stage_seconds` buckets: (stage, le) -> count."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {key}"} if key else {}).text
    return {(s.labels["stage"], float(s.labels["le"])): s.value
            for f in text_string_to_metric_families(text) if f.name == "prepos:token_stage_seconds"
            for s in f.samples if s.name.endswith("_bucket")}


def stage_times(counts: dict) -> dict:
    """P50 / P99 per stage (µs) from the histogram's bucket counts (`(stage, le) -> count`,
    cumulative as Prometheus keeps them), interpolated linearly within a bucket."""
    out = {}
    for stage in STAGES:
        buckets = sorted((le, v) for (st, le), v in counts.items() if st == stage)
        total = buckets[-1][1] if buckets else 0
        if not total:
            continue
        row = {"n": int(total)}
        for p in (50, 99):
            want, lo, below = total * p / 100, 0.0, 0.0
            for le, c in buckets:
                if c >= want:
                    hi = le if le != float("inf") else lo
                    frac = (want - below) / (c - below) if c > below else 1.0
                    row[f"p{p}_us"] = round((lo + frac * (hi - lo)) * 1e6, 1)
                    break
                lo, below = le, c
        out[stage] = row
    return out


class Arm:
    """One server of a round (`serve`), and its streams pooled over the rounds, per case.
    It runs only inside `running`: paused otherwise (SIGSTOP), so that while the other arm
    streams it takes no CPU and its idle work waits."""

    def __init__(self, name: str, key: str | None) -> None:
        self.name, self.key, self.prepos = name, key, name == "prepos"
        self.url, self.pid = "", 0
        self.busy: Busy | None = None  # the busy case's load, while that case runs
        self.streams: dict[str, list[dict]] = {}
        self.cpu: dict[str, CpuShare] = {}
        self.wall = 0.0  # the four case's
        self.appends = self.scrapes = self.failed = self.reconnects = 0  # the busy load
        self.load_cpu_s = 0.0  # the load's own CPU
        self.stages: dict[tuple[str, float], float] = {}  # the single case's bucket counts

    def serve(self, url: str, pid: int) -> None:
        """This round's server (running): warmed up, then paused."""
        self.url, self.pid = url, pid
        one_stream(url, 99, 8, self.key)  # warm-up: the template, the first allocation
        os.kill(pid, signal.SIGSTOP)

    @contextlib.contextmanager
    def running(self, case: str | None = None):
        """The server running (and its load sending) inside; `case`: the time and CPU are
        that case's."""
        os.kill(self.pid, signal.SIGCONT)
        if self.busy is not None:
            self.busy.running.set()
        try:
            if case is None:
                yield
            else:
                with self.cpu.setdefault(case, CpuShare()).window(self.pid):
                    yield
        finally:
            if self.busy is not None:
                self.busy.running.clear()
            os.kill(self.pid, signal.SIGSTOP)

    def stream(self, case: str, i: int, args) -> None:
        with self.running(case):
            got = one_stream(self.url, i, args.max_tokens, self.key)
        self.streams.setdefault(case, []).append(got)

    def four(self, args) -> None:
        with self.running("four"):
            streams, wall = four_at_once(self.url, args, self.key)
        self.streams.setdefault("four", []).extend(streams)
        self.wall += wall

    def stage_counts(self, sign: int) -> None:
        """prepos's stage histogram added (1) or taken away (-1): read around its streams."""
        with self.running():
            for k, v in stage_buckets(self.url, self.key).items():
                self.stages[k] = self.stages.get(k, 0.0) + sign * v

    def load(self, args) -> None:
        """The busy case's load made (paused with its server)."""
        with self.running():
            self.busy = Busy(self.url, args.busy_sessions, self.key, self.prepos)
            self.busy.start()

    def unload(self) -> None:
        busy, self.busy = self.busy, None
        with self.running():
            busy.stop()
        self.appends += busy.appends
        self.scrapes += busy.scrapes
        self.failed += busy.failed
        self.reconnects += busy.reconnects
        self.load_cpu_s += busy.cpu_s

    def summaries(self) -> dict:
        out = {case: {**summary(s, self.wall if case == "four" else None),
                      **self.cpu[case].summary()} for case, s in self.streams.items()}
        if "busy" in out:
            out["busy"].update(appends=self.appends, scrapes=self.scrapes,
                               load_failed=self.failed, load_reconnects=self.reconnects,
                               load_cpu_pct=round(100 * self.load_cpu_s / self.cpu["busy"].wall, 2))
        if self.stages:
            out["stages"] = stage_times(self.stages)
        return out


def one_round(arms: tuple[Arm, Arm], args, cases: set[str], runs: int) -> None:
    """Every case on this round's two servers (prepos's first), `runs` streams a case each,
    the arms taking turns stream by stream (four at once: group by group) in ABBA order: a
    change of the machine's speed within seconds falls on both alike."""
    def turns(i: int) -> tuple[Arm, Arm]:
        return arms if i % 2 == 0 else arms[::-1]
    if "single" in cases:
        if args.stages:
            arms[0].stage_counts(-1)
        for i in range(runs):
            for arm in turns(i):
                arm.stream("single", i, args)
        if args.stages:
            arms[0].stage_counts(1)
    if "four" in cases:
        for r in range(max(1, runs // 2)):
            for arm in turns(r):
                arm.four(args)
    if "busy" in cases:
        for arm in arms:
            arm.load(args)
        try:
            for i in range(runs):
                for arm in turns(i):
                    arm.stream("busy", 5 + i, args)
        finally:
            for arm in arms:
                arm.unload()


def remote_case(binary: Path, gguf: Path, served: str, args, log: Path) -> dict:
    llama = LlamaServer(binary, gguf, slots=4, ctx_per_slot=4096, threads=args.threads,
                        extra=("--jinja", *LAYOUTS[args.kv_layout]["llama_server"]),
                        log=log / "llama-remote.log").start(wait=300)
    proc = None
    try:
        proc, url = start_prepos(served, log / "prepos-remote.log", args.threads,
                                 ["--backend", "llama-server", "--engine-url", llama.url])
        one_stream(url, 99, 8, KEY)
        one_stream(llama.url, 99, 8, None)
        through, direct = [], []
        cpu = CpuShare()  # both servers alive: their CPU together, one window for both arms
        with cpu.window(proc.pid, llama.proc.pid):
            sides = [(url, KEY, through), (llama.url, None, direct)]
            for i in range(args.runs):  # ABBA, as the other cases
                for u, key, got in sides if i % 2 == 0 else sides[::-1]:
                    got.append(one_stream(u, i, args.max_tokens, key))
        return {"prepos": summary(through), "llama_server": summary(direct),
                **turn_ratios(through, direct, 1), **intervals(through, direct, 1),
                **cpu.summary()}
    finally:
        if proc is not None:
            stop(proc)
        llama.stop()


def turn_ratios(ours: list[dict], theirs: list[dict], per: int) -> dict:
    """Turn by turn (`per` streams a turn, the two arms' turns side by side in time): prepos's
    mean gap over llama-server's in the same turn; their median and quartiles. The pooled
    ratios weigh a slow stretch of the machine by its gaps; these show whether prepos's
    excess is in most turns or in a few."""
    r = sorted(statistics.fmean(a) / statistics.fmean(b)
               for a, b in zip(turn_gaps(ours, per), turn_gaps(theirs, per)))
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else r * 3
    return {"turn_mean_gap_ratio": {"p25": round(q[0], 3), "p50": round(statistics.median(r), 3),
                                    "p75": round(q[2], 3), "turns": len(r)}}


def ratios(p: dict, ls: dict) -> dict:
    out = {k: round(p[f"{k[:-6]}_ms"] / ls[f"{k[:-6]}_ms"], 3)
           for k in ("gap_p50_ratio", "gap_p99_ratio") if ls[f"{k[:-6]}_ms"]}
    out["mean_gap_ratio"] = round(p["mean_gap_ms"] / ls["mean_gap_ms"], 3)
    if "tokens_per_s" in p:
        out["tokens_per_s_ratio"] = round(p["tokens_per_s"] / ls["tokens_per_s"], 3)
    return out


def stop_pair(proc, llama: LlamaServer | None) -> None:
    """Stop prepos (`proc`) and llama-server, either possibly paused (SIGSTOP) or not
    started (None): a paused one is continued first, so it takes its SIGTERM."""
    for server in (proc, llama and llama.proc):
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGCONT)
    if proc is not None:
        stop(proc)
    if llama is not None:
        llama.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=8, help="streams a case (four: runs/2 rounds)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="fresh pairs of servers; each runs runs/rounds streams a case and arm")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--busy-sessions", type=int, default=8)
    ap.add_argument("--cases", default="single,four,busy,remote",
                    help="which cases, comma-separated")
    ap.add_argument("--stages", action="store_true", help="prepos's per-token stage times")
    ap.add_argument("--kv-layout", choices=sorted(LAYOUTS), default="unified",
                    help="both servers' KV cache layout (see the docstring)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more for prepos")
    ap.add_argument("--out", type=Path, default=RESULTS / "token_cadence.json")
    args = ap.parse_args(argv)
    binary = find_binary()
    if binary is None:
        print("no llama-server binary: run scripts/build_llama_server.sh", file=sys.stderr)
        return 2
    served, gguf, label = resolve(args.model)
    log = Path(tempfile.mkdtemp(prefix="token-cadence-"))
    out: dict = {"benchmark": "token_cadence", "model": label, "machine": machine(),
                 "threads": args.threads, "runs": args.runs, "max_tokens": args.max_tokens,
                 "kv_layout": args.kv_layout, "server_args": args.server_arg}
    cases = set(args.cases.split(","))
    local = cases & {"single", "four", "busy"}
    layout = LAYOUTS[args.kv_layout]
    if local:
        ours, theirs = Arm("prepos", KEY), Arm("llama_server", None)
        runs = max(1, args.runs // max(1, args.rounds))
        for _ in range(max(1, args.rounds)):  # a fresh pair of servers a round
            proc = llama = None
            try:
                proc, url = start_prepos(served, log / "prepos.log", args.threads,
                                         [*layout["prepos"], *args.server_arg])
                ours.serve(url, proc.pid)
                llama = LlamaServer(binary, gguf, slots=4, ctx_per_slot=4096,
                                    threads=args.threads,
                                    extra=("--jinja", "--metrics", *layout["llama_server"]),
                                    log=log / "llama.log").start(wait=300)
                theirs.serve(llama.url, llama.proc.pid)
                one_round((ours, theirs), args, local, runs)
            finally:
                stop_pair(proc, llama)
        mine, peer = ours.summaries(), theirs.summaries()
        out["rounds"] = args.rounds
        for case in sorted(local):
            per = 4 if case == "four" else 1
            out[case] = {"prepos": mine[case], "llama_server": peer[case],
                         **ratios(mine[case], peer[case]),
                         **turn_ratios(ours.streams[case], theirs.streams[case], per),
                         **intervals(ours.streams[case], theirs.streams[case], per)}
        if "stages" in mine:
            out["stages_us"] = mine["stages"]
    if "remote" in cases:
        r = remote_case(binary, gguf, served, args, log)
        out["remote"] = {**r, **ratios(r["prepos"], r["llama_server"])}
    write(args.out, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
