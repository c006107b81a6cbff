"""Sampling from full logits and from a top-k distribution; parameter validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.backends.base import Dist
from prepos.core import SamplingParams
from prepos.errors import InvalidSampling
from prepos.sampling import generator_for, sample, token_logprob

LOGITS = torch.tensor([1.0, 4.0, 3.5, -2.0, 0.0])


def test_greedy_is_the_argmax():
    assert sample(LOGITS, SamplingParams(), None) == 1
    d = Dist.from_logits(LOGITS, k=3)
    assert sample(Dist(None, d.top_ids, d.top_logprobs), SamplingParams(), None) == 1


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), temp=st.floats(0.1, 3.0), top_k=st.integers(0, 5),
       top_p=st.floats(0.05, 1.0))
def test_sampling_respects_top_k_and_top_p(seed, temp, top_k, top_p):
    p = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)
    tok = sample(LOGITS, p, generator_for(p))
    order = torch.argsort(LOGITS, descending=True).tolist()
    if top_k:
        assert tok in order[:top_k]
    probs = torch.softmax(LOGITS / temp, dim=-1)[order]
    mass_before = float(probs[: order.index(tok)].sum())
    assert mass_before < top_p + 1e-6  # inside the nucleus
    assert tok == sample(LOGITS, p, generator_for(p))  # the seed makes it reproducible


def test_topk_dist_samples_within_its_top_k():
    d = Dist.from_logits(LOGITS, k=2)
    top = Dist(None, d.top_ids, d.top_logprobs)
    p = SamplingParams(temperature=5.0, seed=1)
    rng = generator_for(p)
    seen = {sample(top, p, rng) for _ in range(200)}
    assert seen == {1, 2}
    assert token_logprob(top, 1) == pytest.approx(float(torch.log_softmax(LOGITS, -1)[1]))
    assert token_logprob(top, 4) is None


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1.0),
                                dict(temperature=float("nan")), dict(top_k=-2),
                                dict(top_p=0.0), dict(top_p=1.5), dict(stop=("",))])
def test_invalid_sampling_is_refused(kw):
    with pytest.raises(InvalidSampling):
        SamplingParams(**kw)

