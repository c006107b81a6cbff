"""benchmarks/concurrency.py without timing and without servers: its prompts, an arm's
summary of its requests, the ratios against their targets, and the stage breakdown derived
from two scrapes of prepos's scheduler counters (and llama-server's)."""

from __future__ import annotations

import httpx
import pytest

from benchmarks import concurrency as cc
from benchmarks.common import metric_samples


def req(ttft_s=0.5, gaps_s=(0.01, 0.02, 0.03), tokens=4, prompt=120, error=None) -> dict:
    return {"error": error, "ttft_s": ttft_s, "gaps_s": list(gaps_s),
            "chunks": len(gaps_s) + 1 if error is None else 0,
            "completion_tokens": tokens, "prompt_tokens": prompt}


def test_prompts_distinct_per_case_client_and_request():
    seen = {str(cc.prompt(mt, n, c, r)) for mt in (64, 256) for n in (4, 16)
            for c in range(n) for r in range(2)}
    assert len(seen) == 2 * (4 + 16) * 2
    assert cc.prompt(64, 4, 1, 0) == cc.prompt(64, 4, 1, 0)  # seeded
    user = cc.prompt(64, 4, 1, 0, words=40)[1]["content"]
    picked = user.split("at least once: ", 1)[1].split(". ", 1)[0].split(", ")
    assert len(picked) == 40 and set(picked) <= set(cc.WORDS)


def test_summary_pools_requests_and_leaves_errors_out():
    reqs = [req(ttft_s=t / 1000, gaps_s=[g / 1000 for g in range(1, 11)], tokens=11)
            for t in range(100, 200)]  # TTFT 100..199 ms; gaps 1..10 ms each
    reqs.append(req(error="ReadTimeout()"))
    s = cc.summary(reqs, wall_s=10.0, server_cpu_s=2.2)
    assert s["requests"] == 101 and s["errors"] == 1
    assert s["error_examples"] == ["ReadTimeout()"]
    assert s["tokens"] == 1100 and s["tokens_from"] == "usage"
    assert s["tokens_per_s"] == 110.0
    assert s["ttft_samples"] == 100 and s["gap_samples"] == 1000
    assert s["ttft_p50_ms"] == pytest.approx(150, abs=1)
    assert s["ttft_p90_ms"] == pytest.approx(189, abs=1)
    assert s["ttft_p99_ms"] == pytest.approx(198, abs=1)
    assert s["gap_p50_ms"] == pytest.approx(5, abs=1) and s["gap_max_ms"] == 10
    assert s["cpu_s_per_token"] == pytest.approx(0.002)
    assert s["prompt_tokens_mean"] == 120


def test_summary_counts_chunks_where_a_server_sent_no_usage():
    s = cc.summary([req(tokens=None), req(tokens=9)], wall_s=2.0)
    assert s["tokens_from"] == "chunks" and s["tokens"] == 8 and s["tokens_per_s"] == 4.0
    assert "cpu_s_per_token" not in s and s["short"] is None
    # a failed request's tokens are left out; answers shorter than max tokens counted
    s = cc.summary([req(tokens=64), req(tokens=30), req(error="error event", tokens=None)],
                   wall_s=1.0, max_tokens=64)
    assert s["tokens"] == 94 and s["short"] == 1 and s["errors"] == 1
    empty = cc.summary([req(error="boom")], wall_s=1.0)
    assert empty["ttft_p90_ms"] is None and empty["gap_p99_ms"] is None


def arm(tps, ttft90, gap99) -> dict:
    return {"tokens_per_s": tps, "ttft_p90_ms": ttft90, "gap_p99_ms": gap99}


def test_ratios_against_targets():
    r = cc.ratios(arm(100, 900, 120), arm(100, 1000, 100))
    assert r["tokens_per_s_ratio"] == 1.0 and r["ttft_p90_ratio"] == 0.9
    assert r["gap_p99_ratio"] == 1.2
    assert r["met"] == {"tokens_per_s_ratio": True, "ttft_p90_ratio": True,
                        "gap_p99_ratio": True}
    r = cc.ratios(arm(79, 7078, 1554), arm(98, 5817, 308))  # issue 70's sixteen
    assert r["met"] == {"tokens_per_s_ratio": False, "ttft_p90_ratio": False,
                        "gap_p99_ratio": False}
    r = cc.ratios(arm(100, None, 130), arm(100, 1000, 100))
    assert r["ttft_p90_ratio"] is None and r["met"]["ttft_p90_ratio"] is None
    assert r["met"]["gap_p99_ratio"] is False
    # prepos failed a request: no target met; only llama-server did: no comparison
    failed = cc.ratios({**arm(200, 100, 10), "errors": 1}, arm(100, 1000, 100))
    assert failed["met"] == dict.fromkeys(cc.TARGETS, False)
    peer_failed = cc.ratios(arm(200, 100, 10), {**arm(100, 1000, 100), "errors": 3})
    assert peer_failed["tokens_per_s_ratio"] == 2.0
    assert peer_failed["met"] == dict.fromkeys(cc.TARGETS)
    cases = [cc.ratios(arm(100, 900, 120), arm(100, 1000, 100)),
             cc.ratios(arm(90, 900, 120), arm(100, 1000, 100))]
    assert cc.targets_met(cases) == {"tokens_per_s_ratio": False, "ttft_p90_ratio": True,
                                     "gap_p99_ratio": True}


SCRAPE = """\
# TYPE prepos:scheduler_steps_total counter
prepos:scheduler_steps_total{{kind="decode"}} {decode}
prepos:scheduler_steps_total{{kind="prefill"}} {prefill}
prepos:scheduler_steps_total{{kind="mixed"}} {mixed}
# TYPE prepos:scheduler_step_seconds_total counter
prepos:scheduler_step_seconds_total{{kind="decode"}} {decode_s}
prepos:scheduler_step_seconds_total{{kind="prefill"}} {prefill_s}
prepos:scheduler_step_seconds_total{{kind="mixed"}} {mixed_s}
# TYPE prepos:scheduler_step_sequences_total counter
prepos:scheduler_step_sequences_total {sequences}
# TYPE prepos:scheduler_step_waiting_total counter
prepos:scheduler_step_waiting_total {waiting}
# TYPE prepos:scheduler_step_tokens_total counter
prepos:scheduler_step_tokens_total{{what="decode"}} {decode_tokens}
prepos:scheduler_step_tokens_total{{what="prefill"}} {prefill_tokens}
# TYPE prepos:scheduler_prefill_chunks_total counter
prepos:scheduler_prefill_chunks_total {chunks}
# TYPE prepos:scheduler_quantum_seconds_total counter
prepos:scheduler_quantum_seconds_total {quantum}
# TYPE prepos:kv_cells_budget gauge
prepos:kv_cells_budget 8192
"""


def scrape(**v) -> dict[str, float]:
    return metric_samples(SCRAPE.format(**v))


def test_stages_from_two_scrapes():
    before = scrape(decode=10, prefill=2, mixed=3, decode_s=0.1, prefill_s=0.2, mixed_s=0.09,
                    sequences=40, waiting=5, decode_tokens=30, prefill_tokens=500, chunks=1,
                    quantum=0.5)
    # over the case: 80 decode steps of 20 ms, 5 prefill of 100 ms, 15 mixed of 50 ms;
    # 100 steps carried 1,200 forwards with 300 left waiting; 1.2 s outside the forwards
    after = scrape(decode=90, prefill=7, mixed=18, decode_s=1.7, prefill_s=0.7, mixed_s=0.84,
                   sequences=1240, waiting=305, decode_tokens=1130, prefill_tokens=4500,
                   chunks=9, quantum=0.5 + 2.85 + 1.2)
    s = cc.stages(before, after)
    assert s["steps"] == {"decode": 80, "prefill": 5, "mixed": 15}
    assert s["step_ms_mean"] == pytest.approx({"decode": 20.0, "prefill": 100.0,
                                               "mixed": 50.0})
    assert s["decode_wait_behind_prefill_ms"] == pytest.approx(30.0)
    assert s["sequences_per_step"] == 12.0 and s["waiting_per_step"] == 3.0
    assert s["tokens"] == {"decode": 1100, "prefill": 4000}
    assert s["decode_tokens_per_step"] == 11.0
    assert s["prefill_chunks"] == 8
    assert s["forward_s"] == pytest.approx(2.85)
    assert s["outside_forward_ms_per_step"] == pytest.approx(12.0)
    assert s["outside_forward_ms_per_decode_token"] == pytest.approx(1200 / 1100, abs=1e-3)


def test_stages_null_where_the_counters_are_absent():
    plain = metric_samples("# TYPE prepos:kv_cells_budget gauge\nprepos:kv_cells_budget 8192\n")
    assert cc.stages(plain, plain) is None
    # some families only: the rest None, nothing divided by zero
    only = metric_samples('prepos:scheduler_steps_total{kind="decode"} 0\n'
                          "prepos:scheduler_quantum_seconds_total 0\n")
    s = cc.stages({}, only)
    assert s["steps"] == {"decode": 0, "prefill": 0, "mixed": 0}
    assert s["step_ms_mean"] is None and s["sequences_per_step"] is None
    assert s["outside_forward_ms_per_step"] is None and s["prefill_chunks"] is None


def test_llama_server_counters_and_kv_moves():
    text = ("llamacpp:n_decode_total {n}\nllamacpp:tokens_predicted_total {p}\n"
            "llamacpp:prompt_tokens_total {q}\n")
    before = metric_samples(text.format(n=10, p=20, q=100))
    after = metric_samples(text.format(n=110, p=1620, q=2100))
    assert cc.llama_stages(before, after) == {"decode_calls": 100, "tokens_predicted": 1600,
                                              "prompt_tokens": 2000,
                                              "predicted_per_decode_call": 16.0}
    assert cc.llama_stages({}, {}) is None
    moves = metric_samples('prepos:kv_tier_moves_total{into="ram"} 7\n'
                           "prepos:kv_recomputed_tokens_total 40\n")
    assert cc.kv_moves({}, moves) == {"moved_down": {"ram": 7}, "restores": 0,
                                      "recomputed_tokens": 40}
    assert cc.cells_needed(64, 125.0, 256) == 64 * 381
    assert cc.value_of(["--kv-layout", "streams", "--kv-layout", "unified"], "--kv-layout",
                       "x") == "unified"
    assert cc.value_of([], "--kv-sequences", 256) == 256


def sse(*events: str) -> httpx.MockTransport:
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    return httpx.MockTransport(lambda request: httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))


def test_one_request_reads_usage_and_counts_an_error_event_as_failed():
    chunk = '{"choices": [{"delta": {"content": "x"}}]}'
    usage = '{"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 120}}'
    with httpx.Client(transport=sse(chunk, chunk, chunk, usage, "[DONE]")) as http:
        got = cc.one_request(http, "http://t", "m", cc.prompt(64, 1, 0, 0), 64, None)
    assert got["error"] is None and got["chunks"] == 3 and len(got["gaps_s"]) == 2
    assert got["completion_tokens"] == 3 and got["prompt_tokens"] == 120
    assert got["ttft_s"] is not None and got["ttft_s"] >= 0
    # llama-server's answer when its cells run out: an error event, then the end
    error = '{"error": {"code": 500, "message": "Context size has been exceeded."}}'
    with httpx.Client(transport=sse(chunk, error)) as http:
        got = cc.one_request(http, "http://t", "m", cc.prompt(64, 1, 0, 0), 64, None)
    assert "Context size has been exceeded" in got["error"] and got["chunks"] == 1
