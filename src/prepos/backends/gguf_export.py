"""Convert a bundled model directory (transformers Llama or Qwen2 causal LM as safetensors, a
byte-level BPE `tokenizer.json` with a chat template) to GGUF, so llama.cpp's `llama-server`
can serve the same model prepos serves in process.

Written from the GGUF format and the key and tensor names the `gguf` package publishes
(`gguf.constants`); tensors are written in float32, so the remote answer matches the in-process
one up to float noise.

The one trap is rotary embeddings. Hugging Face's Llama applies RoPE to the two halves of each
head (`rotate_half`), while llama.cpp's `llama` architecture rotates adjacent pairs; HF
checkpoints therefore hold q/k projections whose rows, per head, are ordered
[even pair members..., odd pair members...]. We undo that per head, interleaving the two halves
back: row 2i <- row i, row 2i+1 <- row i + head_dim/2 (`permute_qk`). Qwen2 in llama.cpp uses
the half-split ("NEOX") rotation already, so its q/k are written unchanged.

    python -m prepos.backends.gguf_export MODEL_DIR OUT.gguf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ARCHES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF (half-split rotary) q/k rows -> llama.cpp (interleaved pairs), per head."""
    out_dim, in_dim = w.shape[0], w.shape[1:]
    head = out_dim // n_heads
    return (w.reshape(n_heads, 2, head // 2, *in_dim).swapaxes(1, 2)
            .reshape(out_dim, *in_dim))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `permute_qk`."""
    out_dim, in_dim = w.shape[0], w.shape[1:]
    head = out_dim // n_heads
    return (w.reshape(n_heads, head // 2, 2, *in_dim).swapaxes(1, 2)
            .reshape(out_dim, *in_dim))


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        rtype = params.get("rope_type", "default")
        if rtype not in ("default", None):
            raise ValueError(f"rope_type {rtype!r} is not supported by this exporter")
        return float(params["rope_theta"])
    return 10000.0


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _complete_utf8(text: str, dec: dict[str, int]) -> bool:
    try:
        bytes(dec[c] for c in text).decode("utf-8")
        return True
    except (KeyError, UnicodeDecodeError):
        return False


def _tokenizer_metadata(model_dir: Path, n_vocab: int, for_token_ids: bool = True) -> dict:
    """Tokens in id order, their types, merges and special ids from tokenizer.json."""
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    model = tj["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers are supported, not {model.get('type')!r}")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = t["id"]
    size = max(n_vocab, max(vocab.values()) + 1)
    dec = _byte_decoder()
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED until filled
    for text, i in vocab.items():
        tokens[i] = text
        if text in added:
            types[i] = 3 if added[text].get("special", False) else 4  # CONTROL / USER_DEFINED
        elif for_token_ids and not _complete_utf8(text, dec):
            types[i] = 4  # see `export`: its piece is its byte-level text, valid UTF-8
        else:
            types[i] = 1  # NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg = {}
    tc_path = model_dir / "tokenizer_config.json"
    if tc_path.is_file():
        cfg = json.loads(tc_path.read_text())
    template = cfg.get("chat_template")
    jt = model_dir / "chat_template.jinja"
    if template is None and jt.is_file():
        template = jt.read_text()

    def special(name: str) -> int | None:
        tok = cfg.get(name)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return vocab.get(tok) if isinstance(tok, str) else None

    return {"tokens": tokens, "types": types, "merges": merges, "template": template,
            "bos": special("bos_token"), "eos": special("eos_token"),
            "pad": special("pad_token")}


def export(model_dir: str | Path, out_path: str | Path, name: str | None = None,
           for_token_ids: bool = True) -> Path:
    """Write `out_path` (GGUF, all tensors float32) from a model directory.

    `for_token_ids` (default): llama-server withholds the top-k logprobs of a generated token
    whose text ends in an incomplete UTF-8 sequence (a lone byte of a multi-byte character),
    which would leave prepos without a distribution whenever such a token is the greedy
    choice. prepos sends and reads token ids only, so those tokens are written as
    user-defined tokens, whose piece is their byte-level text (valid UTF-8): ids, logits and
    prompt caching are unchanged; only llama-server's own detokenized text of those tokens
    differs (prepos decodes with its own tokenizer). False writes them as normal tokens."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out_path = Path(model_dir), Path(out_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = next((ARCHES[a] for a in archs if a in ARCHES), None)
    if arch is None:
        raise ValueError(f"unsupported architectures {archs}; supported: {sorted(ARCHES)}")
    n_layer = int(cfg["num_hidden_layers"])
    n_embd = int(cfg["hidden_size"])
    n_head = int(cfg["num_attention_heads"])
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    if head_dim * n_head != n_embd:
        raise ValueError("head_dim * num_attention_heads != hidden_size is not supported")
    n_vocab = int(cfg["vocab_size"])

    tensors: dict[str, np.ndarray] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise ValueError(f"no safetensors in {model_dir}")
    tok = _tokenizer_metadata(model_dir, n_vocab, for_token_ids)

    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_name(name or model_dir.name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(len(tok["tokens"]))

    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    if tok["bos"] is not None:
        w.add_bos_token_id(tok["bos"])
    w.add_add_bos_token(False)  # prepos sends token ids; the template writes any BOS itself
    if tok["eos"] is not None:
        w.add_eos_token_id(tok["eos"])
    if tok["pad"] is not None:
        w.add_pad_token_id(tok["pad"])
    if tok["template"]:
        w.add_chat_template(tok["template"])

    def put(gg_name: str, arr: np.ndarray) -> None:
        w.add_tensor(gg_name, np.ascontiguousarray(arr.astype(np.float32)))

    def pad_rows(arr: np.ndarray) -> np.ndarray:
        n = len(tok["tokens"])
        if arr.shape[0] == n:
            return arr
        return np.concatenate([arr, np.zeros((n - arr.shape[0], *arr.shape[1:]), arr.dtype)])

    put("token_embd.weight", pad_rows(tensors["model.embed_tokens.weight"]))
    put("output_norm.weight", tensors["model.norm.weight"])
    if "lm_head.weight" in tensors and not cfg.get("tie_word_embeddings", False):
        put("output.weight", pad_rows(tensors["lm_head.weight"]))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(n_layer):
        pre = f"model.layers.{i}."
        for hf, gg in names.items():
            for kind in ("weight", "bias"):
                t = tensors.get(f"{pre}{hf}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and gg in ("attn_q", "attn_k"):
                    t = permute_qk(t, n_head if gg == "attn_q" else n_head_kv)
                put(f"blk.{i}.{gg}.{kind}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Convert a prepos model directory to GGUF (F32).")
    ap.add_argument("model_dir")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    print(export(args.model_dir, args.out))


if __name__ == "__main__":
    main()
