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
  cold         an unrelated session's cold request (an ad-hoc question, fast path off, 8
               tokens) sent a random 0-300 ms after an update, while the update's
               pre-position (and, on, its pre-decode of `--cold-tokens`) runs: P99 on
               against off;
  waste        at rho queries per update (Poisson), the pre-decoded tokens never served per
               update (the server's counters), beside the pre-positions' hit rate: prepos
               (on) pre-decoding every update, and a fourth server that pre-decodes where
               the policy says it pays (`--predecode-min-hit`).

    python benchmarks/whole_answer.py [--model smollm2|FILE.gguf] [--samples 64] [--tokens 40]
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

from common import RESULTS, cpu_model, machine, summarize, write
from prepos.backends.llama_server import LlamaServer, find_binary
from prepos.engine.loading import resolve_model

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
    t: dict[str, list[float]] = {"on": [], "off": [], "peer": [], "idle_needed": []}
    served, answered = [], []

    def run_on(i):
        t0 = time.perf_counter()
        version = on.append(sid_on, update(i))
        arrived, pushed = pushes.wait(version)
        t["idle_needed"].append(arrived - t0)
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


def measure_cold(on: Prepos, off: Prepos, args, data: list[str]) -> dict:
    """An unrelated cold request while the update's pre-position (and pre-decode) runs."""
    rng = random.Random(7)
    sids = {s: (s.create([ASK], data, answer_max_tokens=args.cold_tokens),
                s.create([], data[:4])) for s in (on, off)}
    t: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.samples):
        delay = rng.uniform(0.0, 0.3)
        for name, s in ((("on", on), ("off", off)) if i % 2 == 0 else
                        (("off", off), ("on", on))):
            standing, other = sids[s]
            s.append(standing, update(1000 + i))
            time.sleep(delay)
            dt, res = s.query(other, f"Is series {i % 10} above {40 + i}?", 8, fast_path="off")
            t[name].append(dt)
            s.ready(standing)
    return {name: summarize(xs) for name, xs in t.items()}


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
    ap.add_argument("--model", default="smollm2", help="smollm2 or a GGUF file")
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
    ap.add_argument("--only", choices=["standing", "cold", "waste"])
    ap.add_argument("--out", type=Path, default=RESULTS / "whole_answer.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # the servers stop too
    binary = find_binary()
    if binary is None:
        sys.exit("no llama-server: scripts/build_llama_server.sh")
    gguf = resolve_model(args.model)
    data = base(random.Random(1), args.state)
    logs = RESULTS / "whole_answer_logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--backend", "llama.cpp", "--max-session-tokens", "8192"]
    procs = []
    try:
        p_on, url_on = start_prepos(str(gguf), logs / "prepos_on.log", args.threads,
                                    [*common, "--predecode-tokens", str(args.tokens),
                                     "--predecode-min-hit", "0"])
        procs.append(p_on)
        p_off, url_off = start_prepos(str(gguf), logs / "prepos_off.log", args.threads,
                                      [*common, "--predecode-tokens", "0"])
        procs.append(p_off)
        p_pol, url_pol = start_prepos(str(gguf), logs / "prepos_policy.log", args.threads,
                                      [*common, "--predecode-tokens", str(args.tokens),
                                       "--predecode-min-hit", str(args.min_hit)])
        procs.append(p_pol)
        on, off, policy = Prepos(url_on), Prepos(url_off), Prepos(url_pol)
        out: dict = {"benchmark": "whole_answer", "model": gguf.name, "threads": args.threads,
                     "samples": args.samples, "answer_budget": args.tokens,
                     "machine": {**machine(), "cpu_model": cpu_model()},
                     "llama_server": str(binary)}
        keys = []
        if args.only in (None, "standing"):
            with LlamaServer(binary, gguf, slots=1, ctx_per_slot=8192,
                             threads=args.threads) as srv:
                st = out["standing"] = measure_standing(on, off, Peer(srv.url), args, data)
            out["standing_answer_ratio_vs_llama_server"] = ratio(st["on"], st["peer"])
            out["standing_answer_ratio_vs_first_token_only"] = ratio(st["on"], st["off"])
            out["first_token_only_ratio_vs_llama_server"] = ratio(st["off"], st["peer"])
            out["idle_window_needed_ms"] = round(st["idle_needed"]["p50_ms"], 1)
            keys += ["standing_answer_ratio_vs_llama_server",
                     "standing_answer_ratio_vs_first_token_only",
                     "first_token_only_ratio_vs_llama_server", "idle_window_needed_ms"]
        if args.only in (None, "cold"):
            cold = out["cold"] = measure_cold(on, off, args, data)
            out["p99_cold_ratio_predecode_on_off"] = ratio(cold["on"], cold["off"], "p99_ms")
            out["p50_cold_ratio_predecode_on_off"] = ratio(cold["on"], cold["off"])
            keys += ["p99_cold_ratio_predecode_on_off", "p50_cold_ratio_predecode_on_off"]
        if args.only in (None, "waste"):
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
    write(args.out, out)
    print(json.dumps({"benchmark": "whole_answer", "model": gguf.name,
                      "samples": args.samples, "cpu": out["machine"]["cpu_model"],
                      "loadavg_1m": [out["machine"]["loadavg_1m_at_start"],
                                     out["loadavg_1m_at_end"]],
                      **{k: out[k] for k in keys}}))


if __name__ == "__main__":
    main()
