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
