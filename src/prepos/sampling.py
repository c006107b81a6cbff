"""Choosing a token from logits with a request's sampling parameters."""

from __future__ import annotations

import torch

from prepos.backends.base import Dist
from prepos.core import SamplingParams


def generator_for(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(logits: torch.Tensor | Dist, params: SamplingParams,
           gen: torch.Generator | None) -> int:
    """A token from full logits, or from a top-k Dist (a remote back end's logprobs: the
    distribution renormalized over its top-k, which `Engine` allows only by option)."""
    if isinstance(logits, Dist):
        if params.greedy or logits.logits is None and len(logits.top_ids) == 1:
            return logits.top_ids[0]
        if logits.logits is not None:
            return sample(logits.logits, params, gen)
        top = torch.tensor(logits.top_logprobs)
        return logits.top_ids[sample(top, params, gen)]
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def top_logprobs(logits: torch.Tensor | Dist, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens and their logprobs (fewer where a top-k back end returned
    fewer)."""
    if isinstance(logits, Dist):
        if logits.logits is None:
            return list(zip(logits.top_ids, logits.top_logprobs))[:k]
        logits = logits.logits
    vals, ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), k=min(k, logits.shape[-1]))
    return list(zip(ids.tolist(), vals.tolist()))


def token_logprob(logits: torch.Tensor | Dist, token: int) -> float | None:
    if isinstance(logits, Dist):
        if logits.logits is not None:
            return token_logprob(logits.logits, token)
        lp = dict(zip(logits.top_ids, logits.top_logprobs))
        return lp.get(token)
    return float(torch.log_softmax(logits.float(), dim=-1)[token])
