"""Choosing a token from logits with a request's sampling parameters.

The order is OpenAI's: logit biases and the presence and frequency penalties (over the
tokens this request generated so far) shape the full distribution, then temperature, top-k
and top-p choose from it. Any temperature > 0 and any top_p > 0 is valid, however small: the
scores are shifted by their maximum before they are scaled, so nothing overflows to NaN, and
the likeliest token always survives top-p.
"""

from __future__ import annotations

from collections import Counter

import torch

from prepos.backends.base import Dist
from prepos.core import SamplingParams
from prepos.decode.structured import Constraint

SEED_MOD = 2**64


class SamplerState:
    """A request's sampling state when its logits are shaped: the random generator (None
    at temperature 0), how often each token was generated so far (the penalties'), and the
    response format's grammar state (None without one)."""

    def __init__(self, generator: torch.Generator | None,
                 constraint: Constraint | None = None):
        self.generator = generator
        self.counts: Counter[int] = Counter()
        self.constraint = constraint


def grammar_finished(gen: torch.Generator | SamplerState | None) -> bool:
    """Whether the response format's grammar (held by the request's sampling state, its one
    owner) can take nothing more: the answer ends there."""
    return (isinstance(gen, SamplerState) and gen.constraint is not None
            and gen.constraint.finished)


def _generator(params: SamplingParams) -> torch.Generator:
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed % SEED_MOD)  # any int64 or uint64 seed
    else:
        gen.seed()
    return gen


def generator_for(params: SamplingParams, constraint: Constraint | None = None
                  ) -> torch.Generator | SamplerState | None:
    """A request's random state: None for greedy decoding, a `SamplerState` when penalties,
    biases or a response format shape the logits (it counts the generated tokens and holds
    the format's `constraint`), else a generator."""
    if (params.response_format or params.grammar) is not None and constraint is None:
        raise ValueError("a response_format or grammar is sampled with its Constraint")
    if params.shaped:
        return SamplerState(None if params.temperature == 0 else _generator(params),
                            constraint)
    if params.greedy:
        return None
    return _generator(params)


def shape(logits: torch.Tensor, params: SamplingParams,
          counts: Counter[int] | None = None) -> torch.Tensor:
    """The logits after logit_bias and the presence and frequency penalties (float32)."""
    scores = logits.float().clone()
    n = scores.shape[-1]
    for tok, bias in params.logit_bias:
        if tok < n:
            scores[tok] += bias
    if counts and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor([t for t in counts if 0 <= t < n], dtype=torch.long)
        freq = torch.tensor([float(counts[t]) for t in ids.tolist()])
        scores[ids] -= params.frequency_penalty * freq + params.presence_penalty
    return scores


def sample(logits: torch.Tensor | Dist, params: SamplingParams,
           gen: torch.Generator | SamplerState | None) -> int:
    """A token from full logits, or from a top-k Dist (a remote back end's logprobs: the
    distribution renormalized over its top-k, which `Engine` allows only by option)."""
    if isinstance(gen, SamplerState):
        grammar = gen.constraint
        if grammar is not None:  # only the tokens the grammar allows next
            logits = grammar.mask(_full(logits))
        tok = _sample(logits, params, gen.generator, gen.counts)
        gen.counts[tok] += 1
        if grammar is not None:
            grammar.accept(tok)
        return tok
    return _sample(logits, params, gen, None)


def step_token(step, params: SamplingParams, gen: torch.Generator | SamplerState | None) -> int:
    """A forward's next token (`Advance`): its greedy choice where the back end gave it (a
    `Forward.greedy` forward), else sampled from its logits."""
    if step.choice is not None:
        return step.choice
    return sample(step.logits, params, gen)


def _full(logits: torch.Tensor | Dist) -> torch.Tensor:
    if isinstance(logits, Dist):
        if logits.logits is None:  # the engine refuses a response_format on top-k back ends
            raise ValueError("structured output needs the full distribution, not a top-k")
        return logits.logits
    return logits


def _sample(logits: torch.Tensor | Dist, params: SamplingParams,
            gen: torch.Generator | None, counts: Counter[int] | None) -> int:
    if isinstance(logits, Dist):
        if params.greedy or logits.logits is None and len(logits.top_ids) == 1:
            return logits.top_ids[0]
        if logits.logits is not None:
            return _sample(logits.logits, params, gen, counts)
        ids = list(logits.top_ids)
        top = torch.tensor(logits.top_logprobs, dtype=torch.float32)
        if params.shaped:  # biases and penalties apply to the tokens the Dist holds
            bias = dict(params.logit_bias)
            counts = counts or Counter()
            top += torch.tensor([bias.get(t, 0.0) - params.frequency_penalty * counts[t]
                                 - (params.presence_penalty if counts[t] else 0.0)
                                 for t in ids])
        plain = SamplingParams(max_tokens=1, temperature=params.temperature,
                               top_k=params.top_k, top_p=params.top_p)
        return ids[_sample(top, plain, gen, None)]
    if params.greedy:
        return argmax(logits)
    scores = shape(logits, params, counts) if params.shaped else logits.float()
    if params.temperature == 0:  # greedy over the shaped logits
        return argmax(scores)
    # shifted to <= 0 and scaled in float64: no overflow to inf - inf at any temperature
    scores = (scores - scores.max()).double() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        drop[0] = False
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def argmax(logits: torch.Tensor) -> int:
    """The first index of the largest logit. On one row of a vocabulary in CPU memory numpy's
    argmax takes about a tenth of torch's (whose reduction is made for batches)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1
            and not logits.requires_grad):
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


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
