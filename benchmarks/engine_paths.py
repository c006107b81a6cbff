"""In-process latency of every path on the timing model, side by side in one run.

A ~125M-parameter Llama with seeded RANDOM weights (a timing model: its answers mean
nothing), 512 tokens of session state, an 18-token query entry, on this machine's CPU.
Paths: cold, fall-through at delta 0 and at delta = entry, the exact-match fast path, the
relaxed fast path (gate forced to fire), a bare transformers forward over the same entry
and cache, the restore (KV crop) cost, and the wait a request suffers when it arrives while
idle work runs. The last line printed is the JSON summary.

    python benchmarks/engine_paths.py [--samples 128]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

import torch

from common import machine, model_args, model_dir, model_label, summarize, write
from prepos.config import EngineConfig, GateConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.engine import Engine
from prepos.engine.session import HEADER, query_key
from prepos.gate.question_class import classify

STATE_TOKENS = 512
ENTRY_TOKENS = 18
ONE = SamplingParams(max_tokens=1)


def fill_state(eng: Engine, sid: str, rng: random.Random) -> None:
    """Append unique price messages until the committed state holds exactly STATE_TOKENS."""
    s = eng.session(sid)

    def size_with(content: str) -> int:
        msgs = [*s.snap.messages, {"role": "user", "content": content}]
        return len(eng.fmt.encode(eng.fmt.render(msgs)))

    while True:
        msg = "AAPL " + " ".join(f"{rng.uniform(90, 110):.2f}" for _ in range(3))
        if size_with(msg) > STATE_TOKENS - 24:
            break
        eng.append(sid, msg, wait=False)
    for _ in range(10_000):  # the last message: as many numbers as land exactly on 512
        msg = "T " + " ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 40)))
        if size_with(msg) == STATE_TOKENS:
            eng.append(sid, msg)
            eng.trim(sid)
            return
    raise SystemExit("could not build a 512-token state")


def question_for(eng: Engine, sid: str) -> str:
    """A question whose full entry is ENTRY_TOKENS tokens."""
    s = eng.session(sid)
    words = "What is the current trend of the series over the last window please".split()
    for n in range(1, len(words) + 1):
        for tail in ("", "?", " now?"):
            q = " ".join(words[:n]) + tail
            if len(eng.fmt.encode(eng.fmt.frame(s.entries().user, q))) == ENTRY_TOKENS:
                return q
    raise SystemExit("no question gives an 18-token entry with this tokenizer")


def run_on_worker(eng: Engine, fn) -> None:
    def task():
        fn()
        yield

    eng._call(task())


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8, help="idle-work chunk, tokens")
    ap.add_argument("--update-ms", type=float, default=500.0,
                    help="update interval of the other session in the wait measurement")
    model_args(ap, "engine_paths")
    args = ap.parse_args(argv)
    n = args.samples
    rng = random.Random(0)
    if args.backend != "torch":  # the bare forward it compares with is transformers' own
        raise SystemExit("engine_paths measures the torch back end; for llama.cpp see "
                         "benchmarks/native_decode.py")
    eng = Engine.from_pretrained(model_dir(args), EngineConfig(
        chunk_tokens=args.chunk, device=args.device, dtype=args.dtype, backend="torch"))

    # -- the session under test: 512 tokens of state, one standing query ----------------
    # an owner of its own: no other session's KV (the pre-positioned twin's) is a prefix it
    # starts from, so its cold entry is prefilled whole
    sid = eng.create_session("streaming", system="You read market data.", fast_path="relaxed",
                             preposition=False, owner="cold")
    fill_state(eng, sid, rng)
    s = eng.session(sid)
    q = question_for(eng, sid)
    entry = tuple(eng.fmt.encode(eng.fmt.frame(s.entries().user, q)))
    committed = s.snap.tokens
    assert len(committed) == STATE_TOKENS, len(committed)
    # pre-position by hand through the engine's own job (Algorithm 1), for this state
    sid_pp = eng.create_session("streaming", system="You read market data.",
                                fast_path="relaxed", standing=[q])
    for m in s.snap.messages[1:]:
        eng.append(sid_pp, m["content"], wait=False)
    eng.wait_idle()
    pp = eng.session(sid_pp)
    assert pp.snap.tokens == committed and query_key(q) in pp.ready.records
    header = pp.ready.records[HEADER]
    eng.set_gate(GateConfig(tau=-1e9, answers=(header.top_text.strip() or "x",)))
    header_fires = eng.gate.fires(header)
    # the class gate forced too: the class promoted with the header's token its verified
    # answer (a random model's full path need not say what its header does), on a full
    # window of agreements, so the disagreements its verifications find meanwhile leave it so
    gate, cls = eng.relaxed.gate, classify("Is it rising?")
    gate.decide(sid_pp, cls, None, header.argmax)  # a class is tracked once asked
    for _ in range(eng.config.relaxed.window):
        gate.evidence(cls, False, header.argmax)

    results: dict[str, dict] = {}
    detail: dict[str, list[float]] = {}

    def record(name: str, xs: list[float]) -> None:
        detail[name] = xs
        results[name] = summarize(xs)

    # warm up every path
    for _ in range(5):
        eng.query(sid, q, Request(ONE, fast_path="off")).result()
        eng.query(sid_pp, q, Request(ONE)).result()

    # cold: the entry prefilled on arrival (speculative cells trimmed before each sample),
    # interleaved sample by sample with the bare transformers forward over the same entry
    # and cache (and one decode step), on the same thread, so both see the same conditions
    backend = eng.backend
    cache = backend.new_kv()
    backend.extend(cache, [], committed)
    ids = torch.tensor([list(entry)], device=backend.device)
    bare, decode = [], []

    @torch.inference_mode()
    def bare_forward():  # on the model worker, the thread the engine's forwards run on
        backend.cache.crop(cache, STATE_TOKENS)
        t0 = time.perf_counter()
        out = backend.model(input_ids=ids, logits_to_keep=1,
                            **backend.cache.forward_kwargs(cache))
        int(torch.argmax(out.logits[0, -1]))
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = backend.model(input_ids=ids[:, -1:], logits_to_keep=1,
                            **backend.cache.forward_kwargs(cache))
        int(torch.argmax(out.logits[0, -1]))
        decode.append(time.perf_counter() - t0)

    cold, cold_internal = [], []
    for _ in range(n):
        eng.trim(sid)
        t0 = time.perf_counter()
        res = eng.query(sid, q, Request(ONE, fast_path="off")).result()
        cold.append(time.perf_counter() - t0)
        cold_internal.append(res.timing.ttft)
        assert res.path is AnswerPath.COLD and res.timing.prefill_tokens == ENTRY_TOKENS
        run_on_worker(eng, bare_forward)
    record("cold", cold)
    record("cold_engine_ttft", cold_internal)
    record("bare_forward", bare)
    record("decode_step", decode)

    # fall-through at delta 0: the whole entry resident; restore, then one decode
    fall0, restore = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        res = eng.query(sid_pp, q, Request(ONE, fast_path="off")).result()
        fall0.append(time.perf_counter() - t0)
        restore.append(res.timing.restore)
        assert res.path is AnswerPath.FALL and res.timing.prefill_tokens == 1
    record("fall_delta0", fall0)
    record("restore_crop", restore)

    # fall-through at delta = entry: speculative cells resident (the header pre-position),
    # restored away, and the whole entry prefilled
    hdr = committed + eng.session(sid).entries().header
    fall_e = []
    for _ in range(n):
        run_on_worker(eng, lambda: eng.pool.get(sid).advance(hdr))
        t0 = time.perf_counter()
        res = eng.query(sid, q, Request(ONE, fast_path="off")).result()
        fall_e.append(time.perf_counter() - t0)
        assert res.timing.prefill_tokens >= ENTRY_TOKENS - 1
    record("fall_delta_entry", fall_e)

    # exact-match fast path: first token from the cached logits
    fast = timed(lambda: eng.query(sid_pp, q, Request(ONE)).result(), n)
    res = eng.query(sid_pp, q, Request(ONE)).result()
    assert res.path is AnswerPath.FAST and res.match.value == "exact"
    record("fast_exact", fast)

    # relaxed fast path, the gate forced to fire
    fast_r = timed(lambda: eng.query(sid_pp, "Is it rising?", Request(ONE)).result(), n)
    res = eng.query(sid_pp, "Is it rising?", Request(ONE)).result()
    assert header_fires and res.path is AnswerPath.FAST and res.match.value == "relaxed", res
    record("fast_relaxed", fast_r)


    # the wait a request suffers when it arrives while idle work runs. The same update
    # workload (another session gets a data message every --update-ms) with that session's
    # pre-positioning on, then off; cold queries on `sid` arrive at random times meanwhile.
    def cold_under_updates(preposition: bool) -> tuple[list[float], list[float], list[int]]:
        busy = eng.create_session("streaming", system="You read market data.",
                                  preposition=preposition)
        stop = threading.Event()

        def updates():
            i = 0
            while not stop.wait(args.update_ms / 1e3):
                eng.append(busy, f"MSFT {i} {rng.uniform(90, 110):.2f}", wait=False)
                i += 1

        th = threading.Thread(target=updates, daemon=True)
        th.start()
        mark = len(eng.scheduler.fg_waits)
        lat, queue = [], []
        for _ in range(n):
            eng.trim(sid)
            time.sleep(rng.uniform(0, args.update_ms / 1e3))
            t0 = time.perf_counter()
            res = eng.query(sid, q, Request(ONE, fast_path="off")).result()
            lat.append(time.perf_counter() - t0)
            queue.append(res.timing.queue)
        stop.set()
        th.join()
        eng.wait_idle()
        chunks = [c for _, c in list(eng.scheduler.fg_waits)[mark:]]
        eng.close_session(busy)
        return lat, queue, chunks

    idle_before = eng.scheduler.idle_steps
    lat_on, queue_on, chunks_on = cold_under_updates(True)
    idle_steps_on = eng.scheduler.idle_steps - idle_before
    lat_off, queue_off, _ = cold_under_updates(False)
    record("cold_updates_preposition_on", lat_on)
    record("cold_updates_preposition_off", lat_off)
    record("queue_wait_preposition_on", queue_on)
    record("queue_wait_preposition_off", queue_off)
    waits = [(0.0, c) for c in chunks_on]
    # a chunk's duration: the bare forward of `chunk` tokens over the same cache
    chunk_ids = ids[:, : args.chunk]
    chunk = []

    @torch.inference_mode()
    def chunk_forwards():
        for _ in range(n):
            backend.cache.crop(cache, STATE_TOKENS)
            t0 = time.perf_counter()
            backend.model(input_ids=chunk_ids, logits_to_keep=1,
                          **backend.cache.forward_kwargs(cache))
            if backend.device.type == "cuda":
                torch.cuda.synchronize()
            chunk.append(time.perf_counter() - t0)

    run_on_worker(eng, chunk_forwards)
    record("idle_chunk", chunk)

    p50 = {k: v["p50_ms"] for k, v in results.items()}
    p99 = {k: v["p99_ms"] for k, v in results.items()}
    rec_bytes = sum(r.logits.numel() * r.logits.element_size()
                    for r in pp.ready.records.values() if r.logits is not None)
    summary = {
        "benchmark": "engine_paths",
        "model": model_label(args),
        "state_tokens": STATE_TOKENS, "entry_tokens": ENTRY_TOKENS, "chunk_tokens": args.chunk,
        "samples_per_path": n, "machine": machine(),
        "paths": results,
        "ratios": {
            "cold_over_fast_exact_p50": p50["cold"] / p50["fast_exact"],
            "cold_over_fast_relaxed_p50": p50["cold"] / p50["fast_relaxed"],
            "engine_cold_over_bare_forward_p50": p50["cold"] / p50["bare_forward"],
            "fall0_over_cold_p50": p50["fall_delta0"] / p50["cold"],
            "cold_p99_preposition_on_over_off": (p99["cold_updates_preposition_on"]
                                                 / p99["cold_updates_preposition_off"]),
            "cold_p50_preposition_on_over_off": (p50["cold_updates_preposition_on"]
                                                 / p50["cold_updates_preposition_off"]),
        },
        "derived": {
            "restore_ms_fall0_minus_decode_p50": p50["fall_delta0"] - p50["decode_step"],
            "restore_ms_measured_crop_p50": p50["restore_crop"],
            "max_idle_chunks_waited": max((c for _, c in waits), default=0),
            "idle_steps_during_wait_run": idle_steps_on,
        },
        "ready_distribution_bytes": {"per_record": rec_bytes // max(1, len(pp.ready.records)),
                                     "records_in_session": len(pp.ready.records)},
        "targets": {"fast_p50_ms<=0.1": p50["fast_exact"] <= 0.1,
                    "cold/fast>=300": p50["cold"] / p50["fast_exact"] >= 300,
                    "restore_ms<=2": p50["fall_delta0"] - p50["decode_step"] <= 2.0,
                    "engine_cold<=1.1x_bare": p50["cold"] / p50["bare_forward"] <= 1.1,
                    "wait<=one_chunk": max((c for _, c in waits), default=0) <= 1,
                    "cold_p99_on<=1.1x_off": (p99["cold_updates_preposition_on"]
                                              / p99["cold_updates_preposition_off"] <= 1.1)},
    }
    write(args.out, {**summary, "samples_ms": {k: [x * 1e3 for x in v]
                                                     for k, v in detail.items()}})
    eng.close()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    sys.exit(main())
