"""Structured output (response_format json_schema): the same schema-constrained answer with
its first token from the fast path (the exact match's cached logits, masked by the grammar)
and on the cold path (the entry prefilled on arrival, then masked), interleaved sample by
sample; plus an unconstrained fast answer, to show what the mask adds there, and the grammar
library's own costs at this model's vocabulary (compile, per-token mask), beside xgrammar's
where it is installed.

The timing model (seeded RANDOM weights, a 32k-row LM head over a smaller tokenizer) answers
garbage, so every answer's JSON is the grammar's doing; each is checked to parse and to equal
the other path's (greedy, exact match). 512 tokens of session state, as in engine_paths.py.
The last line printed is the JSON summary.

    python benchmarks/structured.py [--samples 64] [--model-dir models/trend-reader]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine_paths import fill_state

from common import machine, model_args, model_dir, model_label, summarize, write
from prepos.config import EngineConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.decode.structured import Grammars
from prepos.engine import Engine
from prepos.engine.session import query_key
from prepos.response_format import JSON_OPTIONS, canonical, schema_of

SCHEMA = {"type": "object", "properties": {
    "trend": {"enum": ["up", "down", "flat"]},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "final": {"type": "boolean"}},
    "required": ["trend", "confidence", "final"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "call", "schema": SCHEMA,
                                                 "strict": True}}
QUESTION = "What is the trend? Answer as JSON."


def timed_answer(eng: Engine, sid: str, req: Request) -> tuple[float, float, object]:
    """(ttft, total) in seconds, arrival to first token and to the whole answer."""
    t0 = time.perf_counter()
    res = eng.query(sid, QUESTION, req).result()
    return res.timing.ttft, time.perf_counter() - t0, res


def library_costs(eng: Engine, n: int) -> dict:
    """Compile time of SCHEMA (a fresh compile each sample) and the per-token mask time over
    a schema-valid answer, at this model's tokenizer: llguidance, and xgrammar if present."""
    canon = canonical(FORMAT)
    text = json.dumps({"trend": "flat", "confidence": 42, "final": False},
                      separators=(",", ":"))
    ids = eng.fmt.encode(text)
    out: dict = {"tokenizer_vocab": len(eng.fmt.tokenizer), "answer_tokens": len(ids)}
    grammars = Grammars(eng.fmt)
    grammars.constraint(SamplingParams(response_format=canon))  # the tokenizer, built once
    compile_s, mask_s = [], []
    for i in range(n):
        spec = {**FORMAT, "json_schema": {**FORMAT["json_schema"], "name": f"c{i}"}}
        t0 = time.perf_counter()
        grammars.constraint(SamplingParams(response_format=spec))
        compile_s.append(time.perf_counter() - t0)
    for _ in range(max(1, n // len(ids))):
        c = grammars.constraint(SamplingParams(response_format=canon))
        for t in ids:
            t0 = time.perf_counter()
            allowed = c.allowed()
            mask_s.append(time.perf_counter() - t0)
            assert allowed[t]
            c.accept(t)
    out["llguidance"] = {"compile": summarize(compile_s), "mask": summarize(mask_s)}
    out["xgrammar"] = xgrammar_costs(eng, schema_of(canon), ids, n)
    return out


def xgrammar_costs(eng: Engine, schema: dict, ids: list[int], n: int) -> dict | str:
    try:
        import xgrammar as xgr
    except ImportError:
        return "not installed (pip install xgrammar to compare)"
    tok = eng.fmt.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compile_s, mask_s = [], []
    for i in range(n):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps({**schema, "description": str(i)}),
                                                any_whitespace=False)
        compile_s.append(time.perf_counter() - t0)
    bitmask = xgr.allocate_token_bitmask(1, len(tok))
    for _ in range(max(1, n // len(ids))):
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            mask_s.append(time.perf_counter() - t0)
            assert m.accept_token(t)
    return {"compile": summarize(compile_s), "mask": summarize(mask_s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    model_args(ap, "structured")
    args = ap.parse_args(argv)
    n = args.samples
    eng = Engine.from_pretrained(model_dir(args), EngineConfig(
        device=args.device, dtype=args.dtype, backend=args.backend))
    rng = random.Random(0)
    # the cold session holds the state only; its twin is pre-positioned for QUESTION
    cold_sid = eng.create_session("streaming", system="You read market data.",
                                  preposition=False)
    fill_state(eng, cold_sid, rng)
    fast_sid = eng.create_session("streaming", system="You read market data.",
                                  standing=[QUESTION])
    for m in eng.session(cold_sid).snap.messages[1:]:
        eng.append(fast_sid, m["content"], wait=False)
    eng.wait_idle()
    assert query_key(QUESTION) in eng.session(fast_sid).ready.records

    structured = SamplingParams(max_tokens=args.max_tokens, response_format=FORMAT)
    plain = SamplingParams(max_tokens=1)  # its first token only: the fast path unmasked
    cold_req = Request(structured, fast_path="off")
    fast_req, plain_req = Request(structured), Request(plain)
    for _ in range(3):  # warm up every path (and compile the schema once)
        eng.trim(cold_sid)
        timed_answer(eng, cold_sid, cold_req)
        timed_answer(eng, fast_sid, fast_req)
        timed_answer(eng, fast_sid, plain_req)

    samples = {k: [] for k in ("fast_ttft", "fast_total", "cold_ttft", "cold_total",
                               "plain_fast_ttft")}
    answer_tokens, mismatches = [], 0
    for _ in range(n):
        eng.trim(cold_sid)  # nothing pre-paid: the whole entry prefilled on arrival
        ttft, total, cold = timed_answer(eng, cold_sid, cold_req)
        assert cold.path is AnswerPath.COLD
        samples["cold_ttft"].append(ttft)
        samples["cold_total"].append(total)
        ttft, total, fast = timed_answer(eng, fast_sid, fast_req)
        assert fast.path is AnswerPath.FAST and fast.match.value == "exact"
        samples["fast_ttft"].append(ttft)
        samples["fast_total"].append(total)
        samples["plain_fast_ttft"].append(timed_answer(eng, fast_sid, plain_req)[0])
        for res in (cold, fast):
            assert res.finish_reason == "stop", (res.finish_reason, res.text)
            json.loads(res.text)
        mismatches += cold.tokens != fast.tokens
        answer_tokens.append(len(fast.tokens))
    results = {k: summarize(v) for k, v in samples.items()}
    p50 = {k: v["p50_ms"] for k, v in results.items()}
    summary = {
        "benchmark": "structured",
        "model": model_label(args),
        "backend": args.backend,
        "machine": machine(),
        "state_tokens": len(eng.session(cold_sid).snap.tokens),
        "schema": SCHEMA,
        "answer": fast.text,
        "answer_tokens_p50": sorted(answer_tokens)[len(answer_tokens) // 2],
        "fast_cold_token_mismatches": mismatches,
        "samples_per_path": n,
        "results": results,
        "library": library_costs(eng, n),
        "ratios": {
            "structured_cold_over_fast_p50": p50["cold_ttft"] / p50["fast_ttft"],
            "structured_cold_over_fast_total_p50": p50["cold_total"] / p50["fast_total"],
            "structured_fast_over_plain_fast_ttft_p50": p50["fast_ttft"]
            / p50["plain_fast_ttft"],
        },
        "json_options": JSON_OPTIONS,
    }
    write(args.out, {**summary, "samples_ms": {k: [x * 1e3 for x in v]
                                                     for k, v in samples.items()}})
    eng.close()
    print(json.dumps({**summary, "structured_cold_over_fast_p50":
                      summary["ratios"]["structured_cold_over_fast_p50"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
