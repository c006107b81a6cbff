"""The back-end protocol and the transformers cache adapter."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prepos.backends.base import Dist
from prepos.backends.hf_cache import CacheAdapter
from prepos.backends.torch_hf import TorchBackend
from prepos.worker.sequence import KVSequence


@pytest.fixture(params=["chatml", "llama3"])
def backend(request, model_dirs):
    return TorchBackend.from_pretrained(model_dirs[request.param])


def fresh_logits(backend, tokens):
    with torch.inference_mode():
        out = backend.model(input_ids=torch.tensor([tokens]))
    return out.logits[0, -1]


def test_adapter_crop_keeps_a_prefix(backend):
    adapter = CacheAdapter(backend.model)
    cache = adapter.new()
    backend.extend(cache, [], list(range(3, 15)))
    assert adapter.length(cache) == 12
    adapter.crop(cache, 5)
    assert adapter.length(cache) == 5
    adapter.crop(cache, 9)  # growing is not cropping: a no-op
    assert adapter.length(cache) == 5
    adapter.crop(cache, 0)
    assert adapter.length(cache) == 0


@pytest.mark.parametrize("cut", [0, 1, 7, 11])
def test_restore_and_delta_equal_a_fresh_forward(backend, cut):
    seq_a = list(range(3, 15))
    seq_b = seq_a[:cut] + [40, 41, 42]
    kv = KVSequence(backend)
    kv.advance(seq_a)
    step = kv.advance(seq_b)
    assert step.kept == cut and step.prefilled == 3
    assert kv.tokens == seq_b
    torch.testing.assert_close(step.logits, fresh_logits(backend, seq_b), atol=1e-4, rtol=1e-4)


def test_chunked_advance_reaches_the_same_logits(backend):
    seq = list(range(3, 30))
    kv = KVSequence(backend)
    steps = 0
    while True:
        step = kv.advance(seq, max_tokens=4)
        steps += 1
        if step.done:
            break
        assert step.logits is None
    assert steps == 7  # ceil(27 / 4)
    torch.testing.assert_close(step.logits, fresh_logits(backend, seq), atol=1e-4, rtol=1e-4)


def test_resident_target_reruns_its_last_token(backend):
    seq = list(range(3, 12))
    kv = KVSequence(backend)
    first = kv.advance(seq)
    again = kv.advance(seq)
    assert again.kept == len(seq) and again.prefilled == 1
    torch.testing.assert_close(first.logits, again.logits, atol=1e-5, rtol=1e-5)


def test_advance_rejects_an_empty_target(backend):
    with pytest.raises(ValueError):
        KVSequence(backend).advance([])


def test_dist_gap_is_the_logit_gap():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.25])
    d = Dist.from_logits(logits, k=3)
    assert d.top_ids[:2] == (1, 3)
    assert d.gap == pytest.approx(0.75, abs=1e-6)


def test_adapter_finds_the_forward_keyword(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(str(model_dirs["chatml"]))
    adapter = CacheAdapter(model)
    assert adapter.kwarg in ("cache", "past_key_values")
    kwargs = adapter.forward_kwargs(adapter.new())
    assert kwargs["use_cache"] is True and adapter.kwarg in kwargs


def test_adapter_handles_both_cache_api_generations(model_dirs, monkeypatch):
    """Older releases: `past_key_values=` and `crop(max_length)`; newer: `cache=` and
    `crop(tokens_to_remove)` with a negative count."""
    import prepos.backends.hf_cache as hf_cache

    calls = []

    class OldLayer:
        def __init__(self, n):
            self.n = n

        def get_seq_length(self):
            return self.n

        def crop(self, max_length):
            calls.append(max_length)
            self.n = min(self.n, max_length)

    class OldCache:
        crop = OldLayer.crop  # the signature the adapter inspects

        def __init__(self, config=None):
            self.layers = [OldLayer(10), OldLayer(10)]

        def get_seq_length(self):
            return self.layers[0].n

    class OldModel(torch.nn.Module):
        config = None

        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    monkeypatch.setattr(hf_cache, "DynamicCache", OldCache)
    old = CacheAdapter(OldModel())
    assert old.kwarg == "past_key_values" and not old.crop_removes
    cache = old.new()
    old.crop(cache, 4)
    assert calls == [4, 4] and old.length(cache) == 4
    monkeypatch.undo()
    new = CacheAdapter(TorchBackend.from_pretrained(model_dirs["chatml"]).model)
    assert new.crop_removes and new.kwarg == "cache"


def test_crop_takes_each_layer_to_the_length(model_dirs):
    """After an interrupted forward the first layers hold more positions than the rest; a
    crop brings every layer to the same absolute length."""
    backend = TorchBackend.from_pretrained(model_dirs["chatml"])
    kv = backend.new_kv()
    backend.extend(kv, [], list(range(5, 15)))
    first = kv.layers[0]
    first.keys, first.values = (torch.cat([first.keys, first.keys[..., :3, :]], dim=-2),
                                torch.cat([first.values, first.values[..., :3, :]], dim=-2))
    assert [int(layer.get_seq_length()) for layer in kv.layers][:2] == [13, 10]
    backend.crop(kv, 10)
    assert all(int(layer.get_seq_length()) == 10 for layer in kv.layers)
    backend.crop(kv, 4)
    assert all(int(layer.get_seq_length()) == 4 for layer in kv.layers)


def test_preemption_hooks_find_the_decoder_layers_of_other_architectures():
    from transformers import GPT2Config, GPT2LMHeadModel

    from prepos.backends.base import Preempted, idle_work

    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64))
    backend = TorchBackend(model)
    kv = backend.new_kv()
    backend.extend(kv, [], [1, 2, 3])
    with idle_work(True, should_yield=lambda: True), pytest.raises(Preempted):
        backend.extend(kv, [1, 2, 3], [4, 5])
    assert backend.cache.length(kv) == 3  # the interrupted chunk left nothing behind
