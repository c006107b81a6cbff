"""First-token latency through prepos on the remote back end (llama.cpp's llama-server on
loopback), per path, beside llama-server's own latency with its prompt cache, in one run.

Model: the tiny bundled-kind model (default) or the timing model (docs/ARCHITECTURE.md;
`--model timing`, ~125M parameters, seeded random weights), converted to GGUF by
`prepos.backends.gguf_export` and served by one llama-server (4 slots). Session state: about
`--state` tokens; each sample appends one fresh data message to the same base state
(rollback + append), waits for pre-positioning, and times one request (max_tokens 1):
  fast         the standing query, answered from the ready distribution (no HTTP at all)
  fall         an ad-hoc question: one request whose prefix (state + query prefix) the engine
               already holds, so it prefills only the question's delta
  cold         the same ad-hoc question on a session that does not pre-position: one request
               that prefills the whole entry after the committed state
  engine_entry llama-server alone: POST /completion of state + entry right after the state
               alone was sent (its prompt cache holds the state): the engine's own cold
  engine_hit   llama-server alone, the same full prompt sent again (its cache holds it all)
The last line printed is the JSON summary.

    python benchmarks/remote_ttft.py [--samples 128] [--model tiny|timing]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import RESULTS, machine, summarize, timing_model_dir, write
from prepos.backends.llama_server import LlamaServer, find_binary
from prepos.config import EngineConfig, GateConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.engine.remote import remote_engine

ONE = SamplingParams(max_tokens=1)
STANDING = "Is it rising?"
QUESTION = "What is the current trend of the series?"


def fill(eng, sid: str, target: int, rng: random.Random) -> None:
    while len(eng.session(sid).snap.tokens) < target - 24:
        eng.append(sid, "AAPL " + " ".join(f"{rng.uniform(90, 110):.2f}" for _ in range(3)),
                   wait=False)
    eng.wait_idle()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--model", choices=["tiny", "timing"], default="tiny")
    ap.add_argument("--state", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    binary = find_binary()
    if binary is None:
        sys.exit("no llama-server binary: run scripts/build_llama_server.sh")
    from prepos.backends.gguf_export import export
    from prepos.lab.tiny import build_model

    work = Path(tempfile.mkdtemp(prefix="remote-ttft-"))
    model_dir = (timing_model_dir() if args.model == "timing"
                 else build_model(work / "model", "chatml", "llama", seed=1))
    gguf = export(model_dir, work / "model.gguf")
    rng = random.Random(0)
    server = LlamaServer(binary, gguf, slots=4, threads=args.threads, log=work / "server.log")
    server.start(wait=300)
    cfg = EngineConfig(gate=GateConfig(tau=0.0, answers=()), workers=2, idle_workers=1,
                       chunk_tokens=256)
    eng = remote_engine("llama.cpp", [server.url], model_dir, cfg, health_interval=1.0)
    samples: dict[str, list[float]] = {k: [] for k in
                                       ("fast", "fall", "cold", "engine_entry", "engine_hit")}
    paths: dict[str, set] = {"fast": set(), "fall": set(), "cold": set()}
    try:
        warm = eng.create_session("streaming", system="You are a market analyst.",
                                  standing=[STANDING])
        cold = eng.create_session("streaming", system="You are a market analyst.",
                                  preposition=False)
        for sid in (warm, cold):
            fill(eng, sid, args.state, rng)
        base = {sid: eng.session(sid).snap.version for sid in (warm, cold)}
        client = httpx.Client(base_url=server.url, timeout=120)
        for i in range(args.samples):
            msg = f"T {i} " + " ".join(str(rng.randint(0, 99)) for _ in range(3))
            for sid in (warm, cold):
                eng.rollback(sid, base[sid])
                eng.append(sid, msg)
            eng.wait_idle()
            for name, sid, q in (("fast", warm, STANDING), ("fall", warm, QUESTION),
                                 ("cold", cold, QUESTION)):
                t0 = time.perf_counter()
                res = eng.query(sid, q, Request(ONE)).result()
                samples[name].append(time.perf_counter() - t0)
                paths[name].add(res.path.value)
                eng.wait_idle()
            # llama-server alone, on a slot prepos does not use for these sessions
            s = eng.session(cold)
            snap = s.snap
            entry = eng.fmt.encode(eng.fmt.frame(s.entries(snap).user, QUESTION))
            body = {"n_predict": 1, "n_probs": 8, "cache_prompt": True, "temperature": 0.0,
                    "id_slot": 3}
            client.post("/completion", json={**body, "prompt": list(snap.tokens)}).json()
            full = [*snap.tokens, *entry]
            for name in ("engine_entry", "engine_hit"):
                t0 = time.perf_counter()
                r = client.post("/completion", json={**body, "prompt": full})
                samples[name].append(time.perf_counter() - t0)
                r.raise_for_status()
        client.close()
        summary = {k: summarize(v) for k, v in samples.items()}
        p50 = {k: v["p50_ms"] for k, v in summary.items()}
        out = {
            "benchmark": "remote_ttft", "model": args.model, "state_tokens": args.state,
            "samples": args.samples, "llama_server": str(binary), "paths_seen": {
                k: sorted(v) for k, v in paths.items()},
            "ttft": summary,
            "ratios_p50": {"cold_over_fast": p50["cold"] / p50["fast"],
                           "cold_over_fall": p50["cold"] / p50["fall"],
                           "fall_over_engine_hit": p50["fall"] / p50["engine_hit"],
                           "cold_over_engine_entry": p50["cold"] / p50["engine_entry"]},
            "backend": eng.backend.metrics(), "machine": machine(),
        }
        assert paths["fast"] == {AnswerPath.FAST.value}, paths
        name = "remote_ttft" if args.model == "tiny" else f"remote_ttft_{args.model}"
        write(name, {**out, "samples_ms": {k: [x * 1e3 for x in v]
                                                    for k, v in samples.items()}})
        print(f"wrote {RESULTS / (name + '.json')}", file=sys.stderr)
        print(json.dumps(out))
    finally:
        eng.close()
        eng.backend.close()
        server.stop()


if __name__ == "__main__":
    main()
