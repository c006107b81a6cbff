"""Stand-ins for serving engines, behind an httpx.MockTransport: each replica (one host)
answers in the documented request/response format of its engine, computes the next-token
distribution with a given function (a real torch model, in engine tests), keeps a per-slot
prefix cache so it can report cached tokens, and can be taken down and brought back."""

from __future__ import annotations

import json
import threading
from typing import Callable, Sequence

import httpx
import torch

LogitsFn = Callable[[Sequence[int]], torch.Tensor]

# the fields each engine's documented request carries (checked on every request)
REQUIRED = {
    "llama.cpp": {"prompt", "n_predict", "n_probs", "cache_prompt"},
    "vllm": {"prompt", "max_tokens", "logprobs", "temperature"},
    "sglang": {"input_ids", "sampling_params", "return_logprob", "top_logprobs_num"},
}
PATHS = {"llama.cpp": "/completion", "vllm": "/v1/completions", "sglang": "/generate"}


def hash_logits(vocab: int = 50) -> LogitsFn:
    """A deterministic stand-in model: logits seeded by the whole prompt."""

    def fn(prompt: Sequence[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(prompt)) & 0x7FFFFFFF)
        return torch.randn(vocab, generator=g) * 3

    return fn


def torch_logits(model) -> LogitsFn:
    @torch.inference_mode()
    def fn(prompt: Sequence[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([list(prompt)])).logits[0, -1].float()

    return fn


class FakeReplica:
    def __init__(self, kind: str, slots: int = 4):
        self.kind = kind
        self.n_slots = slots
        self.up = True
        self.slot_cache: dict[int, list[int]] = {}
        self.requests: list[dict] = []
        self.aborts: list[str] = []
        self.healthy_checks = 0


class FakeCluster:
    def __init__(self, kind: str, logits: LogitsFn, hosts: Sequence[str], slots: int = 4):
        self.kind = kind
        self.logits = logits
        self.replicas = {h: FakeReplica(kind, slots) for h in hosts}
        self.lock = threading.Lock()
        self.transport = httpx.MockTransport(self.handle)

    @property
    def urls(self) -> list[str]:
        return [f"http://{h}" for h in self.replicas]

    def handle(self, request: httpx.Request) -> httpx.Response:
        rep = self.replicas[request.url.host]
        if not rep.up:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            rep.healthy_checks += 1
            return httpx.Response(200, json={"status": "ok"})
        if path == "/props" and self.kind == "llama.cpp":
            return httpx.Response(200, json={"total_slots": rep.n_slots,
                                             "default_generation_settings": {"n_ctx": 2048}})
        if path == "/abort_request" and self.kind == "sglang":
            rep.aborts.append(json.loads(request.content)["rid"])
            return httpx.Response(200, json={})
        if path != PATHS[self.kind] or request.method != "POST":
            return httpx.Response(404, json={"error": f"no route {path}"})
        body = json.loads(request.content)
        missing = REQUIRED[self.kind] - set(body)
        if missing:
            return httpx.Response(400, json={"error": f"missing {sorted(missing)}"})
        with self.lock:
            rep.requests.append(body)
        return httpx.Response(200, json=getattr(self, "_" + self.kind.replace(".", ""))(rep,
                                                                                       body))

    # -- engine formats ----------------------------------------------------------------
    def _top(self, prompt, k):
        lp = torch.log_softmax(self.logits(prompt).float(), -1)
        vals, ids = torch.topk(lp, k)
        return list(zip(ids.tolist(), vals.tolist()))

    def _cached(self, rep: FakeReplica, slot: int, prompt: list[int]) -> int:
        old = rep.slot_cache.get(slot, [])
        n = 0
        while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
            n += 1
        rep.slot_cache[slot] = list(prompt)
        return min(n, len(prompt) - 1)

    def _llamacpp(self, rep, body):
        assert body["n_predict"] == 1 and body["cache_prompt"] is True
        prompt = body["prompt"]
        slot = body.get("id_slot", -1)
        slot = 0 if slot is None or slot < 0 else slot
        assert slot < rep.n_slots
        cached = self._cached(rep, slot, prompt)
        top = self._top(prompt, body["n_probs"])
        entry = lambda i, lp: {"id": i, "token": f"t{i}", "bytes": [116], "logprob": lp}  # noqa: E731
        return {"content": f"t{top[0][0]}", "tokens": [top[0][0]], "id_slot": slot,
                "stop": True, "tokens_cached": cached + 1, "tokens_evaluated": len(prompt),
                "timings": {"cache_n": cached, "prompt_n": len(prompt) - cached},
                "completion_probabilities": [{**entry(*top[0]),
                                              "top_logprobs": [entry(i, lp) for i, lp in top]}]}

    def _vllm(self, rep, body):
        assert body["max_tokens"] == 1 and body["temperature"] == 0
        assert body.get("return_tokens_as_token_ids") is True
        prompt = body["prompt"]
        cached = self._cached(rep, 0, prompt)
        top = self._top(prompt, body["logprobs"])
        key = lambda i: f"token_id:{i}"  # noqa: E731
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": key(top[0][0]), "finish_reason": "length",
                             "stop_reason": None,
                             "logprobs": {"text_offset": [0], "token_logprobs": [top[0][1]],
                                          "tokens": [key(top[0][0])],
                                          "top_logprobs": [{key(i): lp for i, lp in top}]}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                          "total_tokens": len(prompt) + 1,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    def _sglang(self, rep, body):
        sp = body["sampling_params"]
        assert sp["max_new_tokens"] == 1 and sp["temperature"] == 0
        assert body["return_logprob"] is True
        prompt = body["input_ids"]
        cached = self._cached(rep, 0, prompt)
        top = self._top(prompt, body["top_logprobs_num"])
        return {"text": f"t{top[0][0]}", "output_ids": [top[0][0]],
                "meta_info": {"id": body.get("rid"), "prompt_tokens": len(prompt),
                              "completion_tokens": 1, "cached_tokens": cached,
                              "finish_reason": {"type": "length", "length": 1},
                              "output_token_logprobs": [[top[0][1], top[0][0], None]],
                              "output_top_logprobs": [[[lp, i, None] for i, lp in top]]}}
