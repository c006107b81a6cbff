"""The whole answer, waiting: a dashboard's standing query after a data update, answered from
the answer prepos pre-decoded at idle, against llama-server, over HTTP.

Three servers (a fourth for the policy) run side by side, each an HTTP peer of this process
(which runs no model): prepos with pre-decoding on (`--predecode-tokens`), prepos with it off
(the first token from the cached distribution, the rest decoded when asked), and llama-server;
the same GGUF and threads. Their measurements are interleaved round by round, the order
rotated, so a change in the machine's load falls on all of them.

  standing     each round appends an update to a streaming session whose standing query has
               an answer budget of `--tokens`; prepos (on) is asked once the pre-decode is done
               (its SSE push of the whole answer arrived: the idle window was long enough),
               prepos (off) once its pre-position is done, llama-server with the state before
               the update in its prompt cache (its previous request), asked for as many tokens
               as prepos answered (ignore_eos). Time to the whole answer (one JSON response);
               `idle_window_needed_ms`: from the update's request to the push's arrival;
  window       time to the whole answer against the idle window (update to request, each
               of `--windows` ms, `--window-samples` rounds each): prepos on (what was
               pre-decoded by then served at once, the rest decoded live), off, llama-server;
               beside the timing model's closed form (prepos.sim.model.L_whole, its
               constants from the standing part); drawn to docs/figures;
  cold         an unrelated session's cold request (an ad-hoc question, fast path off, 8
               tokens) sent a random 0-300 ms after an update, while the update's
               pre-position (and, on, its pre-decode of `--cold-tokens`) runs: P99 on
               against off;
  waste        at rho queries per update (Poisson), the pre-decoded tokens never served per
               update (the server's counters), beside the pre-positions' hit rate: prepos
               (on) pre-decoding every update, and a fourth server that pre-decodes where
               the policy says it pays (`--predecode-min-hit`).

With `--engine llama-server` (or `--engine vllm`) each prepos server runs in front of an
engine of its own (`prepos serve --backend llama-server|vllm`; its pre-decode one streamed
request to that engine, at background priority on vLLM), and the peer is the engine alone
(llama-server with one slot; vLLM with its prefix cache): `standing_answer_ratio_vs_engine`.
vLLM (its CPU build, `scripts/install_vllm.sh`) serves the GGUF's weights dequantized to an
HF float32 directory (`prepos.engine.loading.dequantized_dir`), prepos the GGUF's tokenizer
and chat template, the same tokens.

    python benchmarks/whole_answer.py [--model smollm2|timing|FILE.gguf] [--samples 64]
        [--tokens 40] [--only standing window cold waste] [--engine llama-server|vllm]
The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from stock_clients import KEYS, metrics, start_prepos, stop

from common import RESULTS, ROOT, cpu_model, machine, summarize, timing_model_dir, write
from prepos.backends.llama_server import LlamaServer, find_binary
from prepos.backends.vllm_server import VLLMServer, find_python
from prepos.engine.loading import dequantized_dir, exported_gguf, resolve_model

SYSTEM = "You are a market analyst. Readings of ACME arrive as lines of six prices."
ASK = "Is ACME going up or down? Explain the trend in two sentences."
AUTH = {"Authorization": f"Bearer {KEYS['prepos']}"}


def update(i: int) -> str:
    return "ACME " + " ".join(f"{101.25 + 0.37 * i + 0.1 * j:.2f}" for j in range(6))


def base(rng: random.Random, lines: int) -> list[str]:
    return ["ACME " + " ".join(f"{rng.uniform(90, 110):.2f}" for _ in range(6))
            for _ in range(lines)]


class Prepos:
    """One `prepos serve`, through its session API."""

    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=600, headers=AUTH)

    def create(self, standing: list[str], data: list[str], **body) -> str:
        r = self.http.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                              "standing_queries": standing, **body})
        r.raise_for_status()
        sid = r.json()["id"]
        for d in data:
            self.append(sid, d)
        self.ready(sid)
        return sid

    def append(self, sid: str, text: str) -> int:
        r = self.http.post(f"/sessions/{sid}/append", json={"data": text})
        r.raise_for_status()
        return r.json()["version"]

    def ready(self, sid: str) -> None:
        """Until the current version's pre-position (and pre-decode) is done."""
        while True:
            info = self.http.get(f"/sessions/{sid}", params={"wait_ready": 30}).json()
            if info["ready"]["done"] and info["ready"]["version"] == info["version"]:
                return

    def query(self, sid: str, question: str, n: int, **kw) -> tuple[float, dict]:
        t0 = time.perf_counter()
        r = self.http.post(f"/sessions/{sid}/query", json={"question": question,
                                                            "max_tokens": n, **kw})
        dt = time.perf_counter() - t0
        r.raise_for_status()
        return dt, r.json()

    def counters(self) -> dict[str, float]:
        m = metrics(self.url)
        head = "prepos:prepositions_"
        return {k[len(head):].removesuffix("_total"): v for k, v in m.items()
                if k.startswith(head)}


class Pushes:
    """A session's SSE events: when each version's standing answer arrived."""

    def __init__(self, url: str, sid: str):
        self.arrived: queue.Queue = queue.Queue()
        self.hello = threading.Event()
        self.thread = threading.Thread(target=self._listen, args=(url, sid), daemon=True)
        self.thread.start()

    def _listen(self, url: str, sid: str) -> None:
        with httpx.Client(base_url=url, timeout=None, headers=AUTH) as c, \
                c.stream("GET", f"/sessions/{sid}/events") as r:
            name = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    if name == "hello":
                        self.hello.set()
                    elif name == "answer":
                        self.arrived.put((time.perf_counter(), data))
                    elif name == "close":
                        return

    def wait(self, version: int, timeout: float = 120.0) -> tuple[float, dict]:
        while True:
            t, data = self.arrived.get(timeout=timeout)
            if data["version"] == version:
                return t, data


class Peer:
    """llama-server's chat route; its prompt cache holds its previous request."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=600)

    def ask(self, messages: list[dict], n: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = self.http.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": True})
        dt = time.perf_counter() - t0
        r.raise_for_status()
        return dt, r.json()["usage"]["completion_tokens"]


def measure_standing(on: Prepos, off: Prepos, peer: Peer, args, data: list[str]) -> dict:
    sid_on = on.create([ASK], data, push_max_tokens=args.tokens)
    sid_off = off.create([ASK], data)
    pushes = Pushes(on.url, sid_on)
    pushes.hello.wait(60)
    msgs = [{"role": "system", "content": SYSTEM}, *({"role": "user", "content": d}
                                                     for d in data)]
    peer.ask([*msgs, {"role": "user", "content": ASK}], args.tokens)  # its cache: the state
    t: dict[str, list[float]] = {"on": [], "off": [], "peer": [], "idle_needed": [],
                                 "idle_after_commit": []}
    served, answered = [], []

    def run_on(i):
        t0 = time.perf_counter()
        version = on.append(sid_on, update(i))
        t1 = time.perf_counter()  # the update committed (and its tokens ingested)
        arrived, pushed = pushes.wait(version)
        t["idle_needed"].append(arrived - t0)
        t["idle_after_commit"].append(arrived - t1)
        dt, res = on.query(sid_on, ASK, args.tokens)
        assert res["tokens"] == pushed["tokens"] and res["path"] == "fast", res
        t["on"].append(dt)
        served.append(res["predecoded"])
        answered.append(len(res["tokens"]))

    def run_off(i):
        off.append(sid_off, update(i))
        off.ready(sid_off)
        dt, res = off.query(sid_off, ASK, args.tokens)
        assert res["predecoded"] == 0
        t["off"].append(dt)

    def run_peer(i):
        msgs.append({"role": "user", "content": update(i)})
        n = answered[-1] if answered else args.tokens
        dt, got = peer.ask([*msgs, {"role": "user", "content": ASK}], n)
        t["peer"].append(dt)

    arms = [run_on, run_off, run_peer]
    for i in range(args.samples):
        order = arms[i % 3:] + arms[:i % 3]
        if order[0] is run_peer:  # the peer's n is the prepos answer of this round
            order = order[1:] + order[:1]
        for arm in order:
            arm(i)
    out = {name: summarize(xs) for name, xs in t.items()}
    out["answer_tokens_p50"] = sorted(answered)[len(answered) // 2]
    out["predecoded_served_of_answer"] = sum(served) / max(1, sum(answered))
    return out


def measure_window(on: Prepos, off: Prepos, peer: Peer, args, data: list[str]) -> dict:
    """Time to the whole answer against the idle window: each round appends an update, waits
    `w` ms (the idle window), then asks the standing question for the whole answer; prepos
    with pre-decoding on (the part decoded by then is served at once, the rest decoded live)
    and off (the first token cached once its pre-position is done), and llama-server (its
    prompt cache holding the state before the update; a stateless server learns of the
    update only with the request, so it is asked without the wait: the window changes
    nothing for it). Windows in the order given, each on new sessions (the same state:
    a session's updates would fill its cell budget), rounds within a window rotated."""
    points, k = [], 0
    for w in args.windows:
        sid = {s: s.create([ASK], data, answer_max_tokens=args.tokens) for s in (on, off)}
        msgs = [{"role": "system", "content": SYSTEM}, *({"role": "user", "content": d}
                                                         for d in data)]
        peer.ask([*msgs, {"role": "user", "content": ASK}], args.tokens)  # its cache
        t: dict[str, list[float]] = {"on": [], "off": [], "peer": []}
        served, answered = [], []

        def run_prepos(s: Prepos, name: str, i: int) -> None:
            s.append(sid[s], update(3000 + i))
            time.sleep(w / 1e3)
            dt, res = s.query(sid[s], ASK, args.tokens)
            t[name].append(dt)
            if name == "on":
                served.append(res["predecoded"])
                answered.append(len(res["tokens"]))
            s.ready(sid[s])  # its idle work done before the next arm's round

        def run_peer(i: int) -> None:
            msgs.append({"role": "user", "content": update(3000 + i)})
            dt, _ = peer.ask([*msgs, {"role": "user", "content": ASK}], answered[-1])
            t["peer"].append(dt)

        arms = [lambda i: run_prepos(on, "on", i), lambda i: run_prepos(off, "off", i)]
        for j in range(args.window_samples):
            for arm in (arms if j % 2 == 0 else arms[::-1]):
                arm(k)
            run_peer(k)  # its n: this round's prepos answer
            k += 1
        point = {"window_ms": w, **{name: summarize(xs) for name, xs in t.items()},
                 "predecoded_served_p50": sorted(served)[len(served) // 2],
                 "answer_tokens_p50": sorted(answered)[len(answered) // 2]}
        point["ratio_vs_llama_server"] = ratio(point["on"], point["peer"])
        points.append(point)
    return {"samples_per_point": args.window_samples, "points": points}


def closed_form(st: dict, win: dict, n: int) -> dict:
    """The timing model's whole answer (prepos.sim.model.L_whole: the scan, plus what is left
    of the pre-position and its N - 1 decode steps when the window closes), its constants
    from this run's standing part: T_scan the pre-decoded answer's P50, T_decode from the
    first-token-only answer's P50 ((off - T_scan) / (N - 1)), T_pp (tau_p * L_entry, Eq. 6)
    the idle window needed after the update's commit (where the windows start) less the
    N - 1 decode steps. `constants` is a file of them for
    `prepos simulate --constants` (T_restore and g, which the whole answer does not use, are
    the reference's)."""
    from prepos.sim.model import REFERENCE, L_whole, L_whole_first_token

    t_scan = st["on"]["p50_ms"]
    t_dec = (st["off"]["p50_ms"] - t_scan) / (n - 1)
    idle = st.get("idle_after_commit", st["idle_needed"])  # (an older run: from the request)
    since = "after the commit" if "idle_after_commit" in st else "from the update's request"
    t_pp = max(idle["p50_ms"] - (n - 1) * t_dec, 0.0)
    c = REFERENCE.with_(
        T_scan=round(t_scan, 4), T_decode=round(t_dec, 4),
        tau_p=round(t_pp / REFERENCE.L_entry, 4),
        label="whole_answer.py standing part (HTTP, this machine)",
        sources={"T_scan": "measured: pre-decoded answer P50 over HTTP",
                 "T_decode": f"derived: (first-token-only answer P50 - T_scan) / {n - 1}",
                 "tau_p": f"derived: (idle window needed {since} P50 - "
                          f"{n - 1} T_decode) / L_entry",
                 "L_entry": "the reference's (only tau_p * L_entry = T_pp is used)",
                 "T_restore": "the reference's (unused)", "g": "the reference's (unused)"})
    ws = [p["window_ms"] for p in win["points"]]
    return {"T_scan_ms": c.T_scan, "T_decode_ms": c.T_decode, "T_pp_ms": round(t_pp, 1),
            "window_ms": ws, "whole_ms": [round(float(L_whole(c, n, w)), 1) for w in ws],
            "whole_first_token_only_ms": round(float(L_whole_first_token(c, n)), 1),
            "constants": c.as_dict()}


def figure(out: dict, path: Path) -> None:
    """Time to the whole answer against the idle window: measured P50 (P25-P75 would need
    more samples per point; P99 as the bar's top), and the closed form."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts, cf = out["window"]["points"], out.get("closed_form")
    ws = [p["window_ms"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, style in (("on", "prepos, pre-decoding on", "o-"),
                              ("off", "prepos, first token only", "s-"),
                              ("peer", "llama-server, prompt cache", "^-")):
        p50 = [p[key]["p50_ms"] for p in pts]
        p99 = [p[key]["p99_ms"] for p in pts]
        ax.errorbar(ws, p50, yerr=[[0] * len(ws), [b - a for a, b in zip(p50, p99)]],
                    fmt=style, capsize=3, label=f"{label} (P50, bar to P99)")
    if cf:
        ax.plot(cf["window_ms"], cf["whole_ms"], "k--", lw=1,
                label="timing model (closed form, constants from this run)")
    ax.set_yscale("log")
    ax.set_xlabel("idle window: the update committed to the request (ms)")
    ax.set_ylabel("time to the whole answer (ms)")
    ax.set_title(f"{out['answer_budget']}-token standing answer, {out['model']}, "
                 f"n={out['window']['samples_per_point']} per point", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_cold(on: Prepos, off: Prepos, args, data: list[str]) -> dict:
    """An unrelated cold request while the update's pre-position (and pre-decode) runs; with
    the server's own account of each (its wait for the model worker, its time from arrival
    to the last token) and whether it stopped an idle chunk (the `preempted` counter moved
    while it ran: it came while idle work ran)."""
    rng = random.Random(7)
    sids = {s: (s.create([ASK], data, answer_max_tokens=args.cold_tokens),
                s.create([], data[:4])) for s in (on, off)}
    t: dict[str, list[float]] = {"on": [], "off": []}
    queue_s: dict[str, list[float]] = {"on": [], "off": []}
    server_s: dict[str, list[float]] = {"on": [], "off": []}
    overlap: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.samples):
        delay = rng.uniform(0.0, 0.3)
        for name, s in ((("on", on), ("off", off)) if i % 2 == 0 else
                        (("off", off), ("on", on))):
            standing, other = sids[s]
            s.append(standing, update(1000 + i))
            time.sleep(delay)
            before = s.counters().get("preempted", 0)
            dt, res = s.query(other, f"Is series {i % 10} above {40 + i}?", 8, fast_path="off")
            t[name].append(dt)
            queue_s[name].append(res["timing"]["queue_ms"] / 1e3)
            server_s[name].append(res["timing"]["total_ms"] / 1e3)
            s.ready(standing)  # (a stopped chunk is counted when its task runs again)
            if s.counters().get("preempted", 0) > before:
                overlap[name].append(dt)
    out = {name: summarize(xs) for name, xs in t.items()}
    out["server_queue"] = {name: summarize(xs) for name, xs in queue_s.items()}
    out["server_total"] = {name: summarize(xs) for name, xs in server_s.items()}
    out["stopped_an_idle_chunk"] = {name: summarize(xs) if xs else {"n": 0}
                                    for name, xs in overlap.items()}
    return out


def poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def measure_waste(on: Prepos, args, data: list[str]) -> dict:
    """rho queries per update (Poisson, each after the pre-decode is done): pre-decoded
    tokens never served per update, and the pre-positions' hit rate."""
    rng = random.Random(11)  # the same draws on every server
    out = {}
    for rho in args.rho:
        sid = on.create([ASK], data, answer_max_tokens=args.tokens)
        before = on.counters()
        queries = 0
        for i in range(args.updates + 1):  # the last update settles the one before it
            on.append(sid, update(2000 + i))
            on.ready(sid)
            if i == args.updates:
                break
            k = poisson(rng, rho)
            queries += k
            for _ in range(k):
                on.query(sid, ASK, args.tokens)
        after = on.counters()
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        used = d.get("consumed", 0)
        out[str(rho)] = {
            "updates": args.updates, "queries": queries,
            "predecoded_tokens": d.get("predecoded_tokens"),
            "served_tokens": d.get("predecode_served"),
            "wasted_tokens": d.get("predecode_wasted"),
            "waste_tokens_per_update": round(d.get("predecode_wasted", 0) / args.updates, 2),
            "hit_rate": round(used / max(1, used + d.get("invalidated", 0)), 3)}
    return out


def ratio(a: dict, b: dict, key: str = "p50_ms") -> float:
    return round(a[key] / b[key], 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, timing or a GGUF file")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=40, help="the standing answer's budget")
    ap.add_argument("--threads", type=int, default=1,
                    help="per server (on a shared, loaded machine two threads' OpenMP "
                    "barriers made every server 10-30x slower)")
    ap.add_argument("--min-hit", type=float, default=0.2,
                    help="the policy server's --predecode-min-hit (waste)")
    ap.add_argument("--state", type=int, default=8, help="data lines before the first update")
    ap.add_argument("--cold-tokens", type=int, default=16,
                    help="the answer budget pre-decoded while the cold requests come")
    ap.add_argument("--updates", type=int, default=16, help="updates per rho (waste)")
    ap.add_argument("--rho", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    ap.add_argument("--windows", type=float, nargs="+", default=[0, 500, 1000, 2000, 3000, 5000],
                    help="idle windows (ms): the update's commit to the request, for the figure")
    ap.add_argument("--window-samples", type=int, default=12, help="rounds per window")
    ap.add_argument("--only", choices=["standing", "window", "cold", "waste"], nargs="+",
                    help="these parts alone (window needs standing for the closed form)")
    ap.add_argument("--standing-from", type=Path, default=None,
                    help="an earlier run's JSON: its standing part gives the closed form's "
                    "constants when this run has none")
    ap.add_argument("--figure", type=Path, default=None,
                    help="the window figure's PNG (default docs/figures/"
                    "whole_answer_window_MODEL.png)")
    ap.add_argument("--engine", choices=["in-process", "llama-server", "vllm"],
                    default="in-process",
                    help="prepos's back end: llama.cpp in process, or each prepos server in "
                    "front of an engine of its own (`--backend llama-server` or `vllm`)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more `prepos serve` argument for every prepos server (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS / "whole_answer.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # the servers stop too
    binary = find_binary()
    if binary is None:
        sys.exit("no llama-server: scripts/build_llama_server.sh")
    vllm = find_python() if args.engine == "vllm" else None
    if args.engine == "vllm" and vllm is None:
        sys.exit("no vLLM: scripts/install_vllm.sh")
    if args.model == "timing":  # the timing model (seeded random weights) as F32 GGUF
        gguf = exported_gguf(timing_model_dir("125m"))
    else:
        gguf = resolve_model(args.model)
    data = base(random.Random(1), args.state)
    logs = RESULTS / "whole_answer_logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs, engines = [], []
    hf = dequantized_dir(gguf) if vllm else None

    def engine(name: str, slots: int):
        """An engine of its own, started: llama-server (`slots` slots, the same GGUF and
        threads) or vLLM (the dequantized weights, priority scheduling, prefix caching)."""
        if vllm:
            eng = VLLMServer(vllm, hf, max_model_len=8192, kv_cache_gb=1,
                             log=logs / f"engine_{name}.log")
        else:
            eng = LlamaServer(binary, gguf, slots=slots, ctx_per_slot=8192,
                              threads=args.threads, log=logs / f"engine_{name}.log")
        engines.append(eng)
        eng.start(wait=900)
        return eng

    def backend(name: str) -> list[str]:
        """A prepos server's back end: llama.cpp in process, or (--engine) in front of an
        engine of its own."""
        if args.engine == "in-process":
            return ["--backend", "llama.cpp", "--max-session-tokens", "8192", *args.server_arg]
        return ["--backend", args.engine, "--engine-url", engine(name, 4).url, *args.server_arg]

    try:
        p_on, url_on = start_prepos(str(gguf), logs / "prepos_on.log", args.threads,
                                    [*backend("on"), "--predecode-tokens", str(args.tokens),
                                     "--predecode-min-hit", "0"])
        procs.append(p_on)
        p_off, url_off = start_prepos(str(gguf), logs / "prepos_off.log", args.threads,
                                      [*backend("off"), "--predecode-tokens", "0"])
        procs.append(p_off)
        p_pol, url_pol = start_prepos(str(gguf), logs / "prepos_policy.log", args.threads,
                                      [*backend("policy"), "--predecode-tokens",
                                       str(args.tokens), "--predecode-min-hit",
                                       str(args.min_hit)])
        procs.append(p_pol)
        on, off, policy = Prepos(url_on), Prepos(url_off), Prepos(url_pol)
        out: dict = {"benchmark": "whole_answer", "model": gguf.name, "threads": args.threads,
                     "engine": args.engine, "server_args": args.server_arg,
                     "samples": args.samples, "answer_budget": args.tokens,
                     "machine": {**machine(), "cpu_model": cpu_model()},
                     "llama_server": str(binary), **({"vllm": str(vllm)} if vllm else {})}
        keys = []
        parts = set(args.only or ["standing", "window", "cold", "waste"])
        if parts & {"standing", "window"}:  # the peer: the engine alone
            srv = engine("peer", 1)
            try:
                if "standing" in parts:
                    out["standing"] = measure_standing(on, off, Peer(srv.url), args, data)
                if "window" in parts:
                    out["window"] = measure_window(on, off, Peer(srv.url), args, data)
            finally:
                srv.stop()
        if "standing" in parts:
            st = out["standing"]
            out["standing_answer_ratio_vs_llama_server"] = ratio(st["on"], st["peer"])
            if args.engine != "in-process":  # the engine alone, its prefix cache warm
                out["standing_answer_ratio_vs_engine"] = out[
                    "standing_answer_ratio_vs_llama_server"]
                keys.append("standing_answer_ratio_vs_engine")
            out["standing_answer_ratio_vs_first_token_only"] = ratio(st["on"], st["off"])
            out["first_token_only_ratio_vs_llama_server"] = ratio(st["off"], st["peer"])
            out["idle_window_needed_ms"] = round(st["idle_needed"]["p50_ms"], 1)
            keys += ["standing_answer_ratio_vs_llama_server",
                     "standing_answer_ratio_vs_first_token_only",
                     "first_token_only_ratio_vs_llama_server", "idle_window_needed_ms"]
        if "window" in parts:
            if "standing" in parts or args.standing_from:
                st = out["standing"] if "standing" in parts else json.loads(
                    args.standing_from.read_text())["standing"]
                out["closed_form"] = closed_form(st, out["window"], args.tokens)
            out["time_to_whole_answer_vs_window_ms"] = {
                str(p["window_ms"]): {k: round(p[k]["p50_ms"], 1) for k in ("on", "off", "peer")}
                for p in out["window"]["points"]}
            keys.append("time_to_whole_answer_vs_window_ms")
            fig = args.figure or (ROOT / "docs" / "figures" /
                                  f"whole_answer_window_{Path(args.model).stem.lower()}.png")
            figure(out, fig)
            out["figure"] = str(fig.relative_to(ROOT)) if fig.is_relative_to(ROOT) else str(fig)
        if "cold" in parts:
            cold = out["cold"] = measure_cold(on, off, args, data)
            out["p99_cold_ratio_predecode_on_off"] = ratio(cold["on"], cold["off"], "p99_ms")
            out["p50_cold_ratio_predecode_on_off"] = ratio(cold["on"], cold["off"])
            keys += ["p99_cold_ratio_predecode_on_off", "p50_cold_ratio_predecode_on_off"]
        if "waste" in parts:
            w = out["waste"] = measure_waste(on, args, data)
            wp = out["waste_policy"] = measure_waste(policy, args, data)
            out["waste_tokens_per_update"] = {r: v["waste_tokens_per_update"]
                                              for r, v in w.items()}
            out["hit_rate"] = {r: v["hit_rate"] for r, v in w.items()}
            out["waste_tokens_per_update_policy"] = {r: v["waste_tokens_per_update"]
                                                     for r, v in wp.items()}
            out["served_tokens_per_update_policy"] = {
                r: round(v["served_tokens"] / v["updates"], 2) for r, v in wp.items()}
            keys += ["waste_tokens_per_update", "hit_rate", "waste_tokens_per_update_policy",
                     "served_tokens_per_update_policy"]
        out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    finally:
        for p in procs:
            stop(p)
        for e in engines:
            e.stop()
    write(args.out, out)
    if "closed_form" in out:  # for `prepos simulate --constants`
        write(args.out.with_name(args.out.stem + "_constants.json"),
              out["closed_form"]["constants"])
    print(json.dumps({"benchmark": "whole_answer", "model": gguf.name, "engine": args.engine,
                      "samples": args.samples, "cpu": out["machine"]["cpu_model"],
                      "loadavg_1m": [out["machine"]["loadavg_1m_at_start"],
                                     out["loadavg_1m_at_end"]],
                      **{k: out[k] for k in keys}}))


if __name__ == "__main__":
    main()
