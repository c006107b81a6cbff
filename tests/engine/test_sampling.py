"""Sampling from full logits and from a top-k distribution; parameter validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.backends.base import Dist
from prepos.core import SamplingParams
from prepos.decode.sampling import generator_for, sample, token_logprob
from prepos.errors import InvalidSampling

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



@pytest.mark.parametrize("kw", [{"temperature": 1e-38}, {"temperature": 1e-320},
                                {"temperature": 1.0, "top_p": 1e-320},
                                {"temperature": 1e-38, "top_p": 1e-320, "top_k": 2}])
def test_tiny_temperature_and_top_p_pick_the_argmax_never_nan(kw):
    p = SamplingParams(seed=3, **kw)
    gen = generator_for(p)
    assert {sample(LOGITS, p, gen) for _ in range(20)} == {1}


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**64 - 1, -(2**63), -1])
def test_any_int64_or_uint64_seed_reproduces(seed):
    p = SamplingParams(temperature=1.0, seed=seed)
    draws = [[sample(LOGITS, p, g) for _ in range(8)] for g in (generator_for(p),
                                                                 generator_for(p))]
    assert draws[0] == draws[1]


@pytest.mark.parametrize("kw, name", [({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
                                      ({"presence_penalty": 2.5}, "presence_penalty"),
                                      ({"frequency_penalty": -3}, "frequency_penalty"),
                                      ({"logit_bias": {1: 101}}, "logit_bias"),
                                      ({"logit_bias": {-1: 1}}, "logit_bias"),
                                      ({"temperature": float("nan")}, "temperature"),
                                      ({"top_p": float("nan")}, "top_p")])
def test_out_of_range_sampling_is_refused(kw, name):
    with pytest.raises(InvalidSampling, match=name):
        SamplingParams(**kw)


def test_logit_bias_moves_the_choice_greedy_and_sampled():
    p = SamplingParams(logit_bias={3: 100.0})
    assert not p.greedy and sample(LOGITS, p, generator_for(p)) == 3
    ban = SamplingParams(logit_bias={1: -100.0})
    assert sample(LOGITS, ban, generator_for(ban)) == 2  # the argmax banned: the next one
    hot = SamplingParams(temperature=1.0, seed=1, logit_bias={4: 100.0})
    assert {sample(LOGITS, hot, generator_for(hot)) for _ in range(10)} == {4}
    top = Dist.from_logits(LOGITS, k=3)
    assert sample(Dist(None, top.top_ids, top.top_logprobs), ban, generator_for(ban)) == 2


def test_penalties_count_the_generated_tokens():
    """Greedy with a frequency penalty: each repeat of the argmax costs 1.0, so after the
    gap to the runner-up (0.5) is paid the choice alternates as OpenAI's formula says."""
    p = SamplingParams(frequency_penalty=1.0)
    gen = generator_for(p)
    assert [sample(LOGITS, p, gen) for _ in range(4)] == [1, 2, 1, 2]
    q = SamplingParams(presence_penalty=2.0)  # a generated token costs 2.0, however often
    gen = generator_for(q)
    assert [sample(LOGITS, q, gen) for _ in range(4)] == [1, 2, 1, 1]
    neutral = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0)
    assert neutral.greedy and generator_for(neutral) is None
