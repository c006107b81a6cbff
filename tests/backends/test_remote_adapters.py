"""Each engine's request and response schema, as its project documents it."""

from __future__ import annotations

import math

import pytest

from prepos.backends.remote import (
    LlamaCppAdapter,
    RemoteError,
    SGLangAdapter,
    TopK,
    VLLMAdapter,
    make_adapter,
)


# -- vLLM: OpenAI-compatible /v1/completions ----------------------------------------------
def test_vllm_request():
    a = VLLMAdapter(model="m", background_priority=10)
    c = a.request([1, 2, 3], 5, rid="r1", background=False)
    assert (c.method, c.path) == ("POST", "/v1/completions")
    assert c.json == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0,
                      "logprobs": 5, "return_tokens_as_token_ids": True, "stream": False}
    assert c.headers["X-Request-Id"] == "r1"
    bg = a.request([1], 5, rid="r2", background=True)
    assert bg.json["priority"] == 10
    assert "priority" not in VLLMAdapter().request([1], 5, rid="r", background=True).json


def test_vllm_response():
    body = {
        "id": "cmpl-9", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "token_id:7", "finish_reason": "length",
                     "stop_reason": None,
                     "logprobs": {"text_offset": [0], "token_logprobs": [-0.1],
                                  "tokens": ["token_id:7"],
                                  "top_logprobs": [{"token_id:7": -0.1, "token_id:3": -2.5,
                                                    "token_id:9": -3.0}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 8}},
    }
    top = VLLMAdapter().parse(body)
    assert (top.cached_tokens, top.prompt_tokens) == (8, 12)
    d = top.dist()
    assert d.logits is None and d.top_ids == (7, 3, 9)
    assert d.gap == pytest.approx(2.4)


def test_vllm_response_without_cache_details_and_text_keys():
    body = {"choices": [{"logprobs": {"top_logprobs": [{"token_id:1": -0.5,
                                                        "token_id:2": -1.0}]}}],
            "usage": {"prompt_tokens": 3, "prompt_tokens_details": None}}
    assert VLLMAdapter().parse(body).cached_tokens is None
    text_keyed = {"choices": [{"logprobs": {"top_logprobs": [{"Hello": -0.5}]}}]}
    with pytest.raises(RemoteError, match="return_tokens_as_token_ids"):
        VLLMAdapter().parse(text_keyed)
    with pytest.raises(RemoteError):
        VLLMAdapter().parse({"choices": [{"logprobs": None}]})


# -- SGLang: /generate ----------------------------------------------------------------------
def test_sglang_request_and_abort():
    a = SGLangAdapter(background_priority=1)
    c = a.request([4, 5], 3, rid="r7", background=True)
    assert (c.method, c.path) == ("POST", "/generate")
    assert c.json["input_ids"] == [4, 5]
    assert c.json["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert c.json["return_logprob"] is True and c.json["top_logprobs_num"] == 3
    assert c.json["logprob_start_len"] == -1 and c.json["rid"] == "r7"
    assert c.json["priority"] == 1
    ab = a.abort("r7")
    assert (ab.method, ab.path, ab.json) == ("POST", "/abort_request", {"rid": "r7"})


def test_sglang_response():
    body = {"text": " up", "output_ids": [11],
            "meta_info": {"id": "r7", "prompt_tokens": 40, "completion_tokens": 1,
                          "cached_tokens": 32, "finish_reason": {"type": "length", "length": 1},
                          "output_token_logprobs": [[-0.2, 11, None]],
                          "output_top_logprobs": [[[-0.2, 11, None], [-1.9, 4, None],
                                                   [-2.2, 5, None]]]}}
    top = SGLangAdapter().parse(body)
    assert (top.cached_tokens, top.prompt_tokens) == (32, 40)
    assert top.dist().top_ids == (11, 4, 5)
    assert SGLangAdapter().parse([body]).ids == top.ids  # a batch of one
    with pytest.raises(RemoteError):
        SGLangAdapter().parse({"text": "x", "meta_info": {}})


# -- llama.cpp: llama-server /completion -----------------------------------------------------
def test_llamacpp_request():
    c = LlamaCppAdapter().request([1, 2], 4, rid="r", background=False, slot=2)
    assert (c.method, c.path) == ("POST", "/completion")
    assert c.json == {"prompt": [1, 2], "n_predict": 1, "n_probs": 4, "cache_prompt": True,
                      "temperature": 0.0, "post_sampling_probs": False, "stream": False,
                      "id_slot": 2}
    assert "id_slot" not in LlamaCppAdapter().request([1], 4, rid="r", background=False).json
    assert LlamaCppAdapter().abort("r") is None  # cancelled by disconnecting
    assert LlamaCppAdapter().parse_slots({"total_slots": 4}) == 4


def test_llamacpp_current_format_logprobs():
    body = {"content": "a", "tokens": [], "id_slot": 1, "stop": True, "tokens_cached": 21,
            "tokens_evaluated": 20, "timings": {"cache_n": 17, "prompt_n": 3},
            "completion_probabilities": [{
                "id": 9, "token": "a", "bytes": [97], "logprob": -0.05,
                "top_logprobs": [{"id": 9, "token": "a", "bytes": [97], "logprob": -0.05},
                                 {"id": 2, "token": "b", "bytes": [98], "logprob": -3.1}]}]}
    top = LlamaCppAdapter().parse(body)
    assert (top.cached_tokens, top.prompt_tokens, top.slot) == (17, 20, 1)
    assert top.dist().top_ids == (9, 2) and top.dist().gap == pytest.approx(3.05)


def test_llamacpp_probability_formats():
    post = {"tokens_cached": 5, "completion_probabilities": [{
        "id": 3, "token": "x", "prob": 0.5,
        "top_probs": [{"id": 3, "token": "x", "prob": 0.5}, {"id": 8, "token": "y",
                                                             "prob": 0.25}]}]}
    top = LlamaCppAdapter().parse(post)
    assert top.cached_tokens == 5  # no timings.cache_n: tokens_cached
    assert top.dist().top_ids == (3, 8)
    assert top.dist().gap == pytest.approx(math.log(2))
    old = {"completion_probabilities": [{"content": "x", "probs": [
        {"tok_str": "x", "prob": 0.75}, {"tok_str": "y", "prob": 0.0}]}]}
    with pytest.raises(RemoteError, match="token_to_id"):
        LlamaCppAdapter().parse(old)
    top = LlamaCppAdapter(token_to_id={"x": 3, "y": 8}.get).parse(old)
    assert top.dist().top_ids == (3, 8) and top.dist().top_logprobs[1] == -math.inf
    with pytest.raises(RemoteError, match="n_probs"):
        LlamaCppAdapter().parse({"content": "x"})


def test_topk_to_dist_sorts_and_pads():
    d = TopK((5, 1, 2), (-3.0, -0.5, -1.0)).dist()
    assert d.top_ids == (1, 2, 5) and d.top_logprobs == (-0.5, -1.0, -3.0)
    lone = TopK((4,), (0.0,)).dist()
    assert lone.top_ids[0] == 4 and lone.gap == math.inf
    with pytest.raises(RemoteError):
        TopK((), ()).dist()


def test_make_adapter():
    assert isinstance(make_adapter("llama.cpp"), LlamaCppAdapter)
    assert isinstance(make_adapter("vllm", model="m"), VLLMAdapter)
    with pytest.raises(ValueError, match="unknown engine"):
        make_adapter("tgi")


# -- streamed answers and the engine's facts ------------------------------------------------
def test_stream_requests_carry_every_sampling_knob():
    from prepos.core import SamplingParams

    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4)
    v = VLLMAdapter(background_priority=3).stream_request([1, 2], 4, sp, 16, frozenset({9, 2}),
                                                          rid="r", background=True)
    assert v.path == "/v1/completions" and v.headers["X-Request-Id"] == "r"
    assert v.json == {"prompt": [1, 2], "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
                      "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0,
                      "stop_token_ids": [2, 9], "ignore_eos": True, "logprobs": 4,
                      "return_tokens_as_token_ids": True, "stream": True,
                      "stream_options": {"include_usage": True}, "seed": 4, "priority": 3}
    g = SGLangAdapter().stream_request([1], 2, SamplingParams(), 8, frozenset({2}), rid="r",
                                       background=False)
    assert g.json["stream"] is True and g.json["rid"] == "r"
    assert g.json["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.0,
                                         "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                         "stop_token_ids": [2], "ignore_eos": True}
    c = LlamaCppAdapter().stream_request([1], 2, sp, 8, frozenset({2}), rid="r",
                                         background=False, slot=1)
    assert c.path == "/completion" and c.json["stream"] is True and c.json["id_slot"] == 1
    assert (c.json["n_predict"], c.json["n_probs"], c.json["seed"]) == (8, 2, 4)
    assert c.json["samplers"] == ["top_k", "temperature", "top_p"]
    assert c.json["min_p"] == 0.0 and c.json["repeat_penalty"] == 1.0 and c.json["top_k"] == 5
    # greedy: the top token kept first (the same choice, without a softmax of the vocabulary)
    assert LlamaCppAdapter().stream_request([1], 0, SamplingParams(top_k=5), 8, frozenset(),
                                            rid="r", background=False).json["top_k"] == 1
    assert LlamaCppAdapter().stream_request([1], 2, SamplingParams(seed=4), 8, frozenset(),
                                            rid="r", background=False).json["seed"] == -1


def test_vllm_stream_events_as_vllm_0_32_sends_them():
    p = VLLMAdapter().stream_parser()
    ev = {"id": "cmpl-9", "object": "text_completion", "choices": [{
        "index": 0, "text": "", "logprobs": {"text_offset": [12], "token_logprobs": [-3.69],
                                             "tokens": ["token_id:331"],
                                             "top_logprobs": [{"token_id:331": -3.69,
                                                               "token_id:307": -3.75}]},
        "finish_reason": "stop", "stop_reason": 331, "prompt_token_ids": None,
        "token_ids": None}]}
    [(tok, top)] = p.feed(ev)
    assert tok == 331 and top.dist().top_ids == (331, 307) and p.finished
    p.feed({"id": "cmpl-9", "choices": [], "usage": {
        "prompt_tokens": 6, "total_tokens": 8, "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 0}}})
    assert (p.cached_tokens, p.prompt_tokens) == (0, 6)


def test_sglang_stream_cumulative_or_incremental():
    def ev(toks, total):
        return {"meta_info": {"completion_tokens": total, "cached_tokens": 4,
                              "output_token_logprobs": [[-0.1, t, None] for t in toks],
                              "output_top_logprobs": [[[-0.1, t, None], [-2.0, 0, None]]
                                                      for t in toks], "finish_reason": None}}
    cum = SGLangAdapter().stream_parser()
    assert [t for t, _ in cum.feed(ev([5], 1))] == [5]
    assert [t for t, _ in cum.feed(ev([5, 6], 2))] == [6]
    inc = SGLangAdapter().stream_parser()
    assert [t for t, _ in inc.feed(ev([5], 1))] == [5]
    assert [t for t, _ in inc.feed(ev([6], 2))] == [6]


def test_engine_info():
    models = {"object": "list", "data": [{"id": "m", "max_model_len": 2048}]}
    assert VLLMAdapter().parse_info(models).max_context == 2048
    assert SGLangAdapter().parse_info(models).max_context == 2048
    props = {"total_slots": 4, "default_generation_settings": {"n_ctx": 1024}}
    info = LlamaCppAdapter().parse_info(props)
    assert (info.max_context, info.n_slots) == (1024, 4)
