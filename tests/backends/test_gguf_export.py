"""GGUF export: metadata and tensor names llama.cpp expects, and the q/k rotary permutation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from prepos.backends.gguf_export import export, permute_qk, unpermute_qk  # noqa: E402


def rope_half(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """HF Llama: rotate (x[i], x[i + d/2]) by pos * theta^(-2i/d), per head."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * c - b * s, a * s + b * c], -1)


def rope_pairs(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """llama.cpp's `llama` arch (GGML_ROPE_TYPE_NORM): rotate (x[2i], x[2i+1])."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def test_permutation_turns_half_split_rope_into_pairwise_rope():
    torch.manual_seed(0)
    n_heads, hd, dim = 3, 8, 12
    wq = torch.randn(n_heads * hd, dim, dtype=torch.float64)
    wk = torch.randn(n_heads * hd, dim, dtype=torch.float64)
    x, y = torch.randn(dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
    pq, pk = (torch.from_numpy(permute_qk(w.numpy(), n_heads)) for w in (wq, wk))
    for p1, p2 in ((0, 0), (3, 7), (11, 2)):
        hf = (rope_half((wq @ x).view(n_heads, hd), p1)
              * rope_half((wk @ y).view(n_heads, hd), p2)).sum(-1)
        gg = (rope_pairs((pq @ x).view(n_heads, hd), p1)
              * rope_pairs((pk @ y).view(n_heads, hd), p2)).sum(-1)
        torch.testing.assert_close(hf, gg)  # same attention scores, head by head
    np.testing.assert_array_equal(unpermute_qk(permute_qk(wq.numpy(), n_heads), n_heads),
                                  wq.numpy())


def test_export_metadata_and_tensors(model_dirs, tmp_path):
    d = model_dirs["chatml"]
    cfg = json.loads((d / "config.json").read_text())
    path = export(d, tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(path))

    def field(name):
        f = r.fields[name]
        return f.contents()

    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == cfg["num_hidden_layers"]
    assert field("llama.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert field("tokenizer.ggml.model") == "gpt2"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"]
    tj = json.loads((d / "tokenizer.json").read_text())
    for text, i in list(tj["model"]["vocab"].items())[:50]:
        assert tokens[i] == text
    assert "<|im_start|>" in field("tokenizer.chat_template")
    names = {t.name for t in r.tensors}
    want = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(cfg["num_hidden_layers"]):
        want |= {f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v",
                                                   "attn_output", "ffn_norm", "ffn_gate",
                                                   "ffn_up", "ffn_down")}
    assert names == want
    from safetensors.numpy import load_file

    hf = load_file(str(d / "model.safetensors"))
    t = {t.name: t for t in r.tensors}
    np.testing.assert_array_equal(
        unpermute_qk(np.asarray(t["blk.0.attn_k.weight"].data), cfg["num_key_value_heads"]),
        hf["model.layers.0.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(np.asarray(t["blk.1.ffn_down.weight"].data),
                                  hf["model.layers.1.mlp.down_proj.weight"])
