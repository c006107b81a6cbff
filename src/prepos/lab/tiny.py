"""Tiny models and tokenizers made by our own code, for tests, benchmarks and the demo.

Chat-template families, written here in the formats the model families use: ChatML
(Hermes-style tool calls, `<|im_start|>role ... <|im_end|>`, `<tool_call>{json}</tool_call>`),
Qwen-style (the same template, `<tool_call>` and `</tool_call>` added tokens that are not
special), Llama-3.1-style (`<|start_header_id|>role<|end_header_id|> ... <|eot_id|>`, a tool
call one JSON object with "parameters") and Mistral-style (`[INST] ... [/INST]`,
`[TOOL_CALLS][{...}]`, no generation prompt: used at the chat-format level only), and a
plain ChatML template that renders role and content only, no tools (as SmolLM2-Instruct's
does: prepos's tool fallback serves it). Models
are seeded random weights of the Llama or Qwen2 architecture. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- 'Tools:\\n' -}}{%- for t in tools -%}{{- t | tojson + '\\n' -}}{%- endfor -%}"
    "{{- 'Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' -}}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + m.content -}}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{- '<tool_call>\\n' + {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson + '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0].role == 'system' or tools -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{%- if tools -%}{{- 'Environment: ipython\\n' -}}"
    "{%- for t in tools -%}{{- t | tojson + '\\n' -}}{%- endfor -%}{%- endif -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- messages[0].content | trim -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- for c in m.tool_calls -%}"
    "{{- {'name': c.function.name, 'parameters': c.function.arguments} | tojson -}}"
    "{%- endfor -%}{{- '<|eot_id|>' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content | trim"
    " + '<|eot_id|>' -}}"
    "{%- else -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim"
    " + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

PLAIN_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif m.role == 'user' -%}{{- '[INST]' + m.content + '[/INST]' -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{- m.content + '[TOOL_CALLS][' -}}"
    "{%- for c in m.tool_calls -%}{{- ', ' if not loop.first -}}"
    "{{- {'name': c.function.name, 'arguments': c.function.arguments} | tojson -}}"
    "{%- endfor -%}{{- ']' + eos_token -}}"
    "{%- elif m.role == 'assistant' -%}{{- m.content + eos_token -}}"
    "{%- elif m.role == 'tool' -%}{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

FAMILIES = {
    "chatml": {
        "template": CHATML_TEMPLATE,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
    },
    "llama3": {
        "template": LLAMA3_TEMPLATE,
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|end_of_text|>",
    },
    "qwen": {
        "template": CHATML_TEMPLATE,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>"],  # tokens, but not special (as Qwen's)
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
    },
    "plain": {
        "template": PLAIN_TEMPLATE,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<filename>"],
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
    },
    "mistral": {
        "template": MISTRAL_TEMPLATE,
        "specials": ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                     "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                     "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
        "bos": "<s>", "eos": "</s>", "pad": "<pad>",
    },
}

CORPUS = [
    "You are a market analyst. Answer with one word.",
    "AAPL 101.2 101.5 101.9 102.4 102.8 103.1", "MSFT 310.0 309.2 308.7 307.9 307.1",
    "What is the trend? up down flat yes no. Is it rising? Is it falling?",
    "The weather in Paris is sunny, 21 degrees. Call get_weather with a city.",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    "<tool_call> </tool_call> <tool_response> </tool_response> Tools: Environment: ipython",
    "The quick brown fox jumps over the lazy dog 0123456789 ,.;:!?()[]{}<>=+-*/'\"",
]


def filler_corpus(words: int, seed: int = 0) -> list[str]:
    """Seeded random words, so BPE training can reach a large vocabulary."""
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return [" ".join("".join(rng.choices(alphabet, k=rng.randint(3, 9)))
                     for _ in range(100)) for _ in range(words // 100)]


def build_tokenizer(out_dir: str | Path, family: str = "chatml", vocab_size: int = 600,
                    extra_corpus: list[str] | None = None):
    """Train a byte-level BPE on a small built-in corpus (plus `extra_corpus`); save a
    standard tokenizer directory with the family's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=fam["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4 + (extra_corpus or []), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=fam["bos"], eos_token=fam["eos"],
        pad_token=fam["pad"],
    )
    fast.add_tokens(fam.get("added", []))
    fast.chat_template = fam["template"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def model_config(arch: str = "llama", vocab_size: int = 1024, hidden: int = 64,
                 layers: int = 2, heads: int = 4, kv_heads: int = 2, max_positions: int = 2048,
                 intermediate: int | None = None):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=intermediate or hidden * 4,
               max_position_embeddings=max_positions, tie_word_embeddings=False)


def build_model(out_dir: str | Path, family: str = "chatml", arch: str = "llama",
                seed: int = 0, tokenizer_vocab: int | None = None, device: str = "cpu",
                dtype: str = "float32", **config) -> Path:
    """A seeded random-weight model and a tokenizer of the given template family.

    `tokenizer_vocab` trains a smaller tokenizer than the model's vocabulary (ids past it
    decode to nothing), so a timing model can have a real-size LM head without training a
    128k-token BPE. `device`/`dtype` initialize the weights there (a GPU builds 8B in
    seconds) and save them in that dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    vocab = config.pop("vocab_size", None)
    tok_vocab = tokenizer_vocab or vocab
    if tok_vocab is None:
        tok = build_tokenizer(out, family)
    else:  # a vocabulary this large needs more text than the built-in corpus
        tok = build_tokenizer(out, family, tok_vocab, filler_corpus(words=tok_vocab * 8,
                                                                     seed=seed))
    config["vocab_size"] = max(len(tok), vocab or 0)
    cfg = model_config(arch, **config)
    cfg.bos_token_id = tok.bos_token_id
    cfg.eos_token_id = tok.eos_token_id
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    # Random init gives near-uniform logits; widen them so greedy choices are well separated.
    # Rows past the tokenizer's vocabulary are zeroed: their logit is 0, below the largest of
    # the real rows' (a maximum over thousands of centred draws), so greedy never picks an id
    # that decodes to nothing, and the LM head keeps its real size.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        model.lm_head.weight[len(tok):].zero_()
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "prepos-model.json").write_text(json.dumps({"family": family, "arch": arch,
                                                       "seed": seed, "random_weights": True}))
    return out


# The timing model (docs/ARCHITECTURE.md) and the larger classes of the GPU run (Llama-3.2-1B and
# Llama-3.1-8B shapes); all seeded random weights. "test" is a CPU-sized stand-in that lets
# the GPU script's pipeline run in the test suite.
TIMING_SIZES = {
    "125m": dict(vocab_size=32000, hidden=768, layers=12, heads=12, kv_heads=4,
                 intermediate=2048),
    "1b": dict(vocab_size=128256, tokenizer_vocab=32000, hidden=2048, layers=16, heads=32,
               kv_heads=8, intermediate=8192),
    "8b": dict(vocab_size=128256, tokenizer_vocab=32000, hidden=4096, layers=32, heads=32,
               kv_heads=8, intermediate=14336),
    "test": dict(vocab_size=2048, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
}


def timing_model(out_dir: str | Path, seed: int = 0, size: str = "125m", device: str = "cpu",
                 dtype: str = "float32") -> Path:
    """A timing model of one of TIMING_SIZES (default the 125m one: a ~125M-parameter Llama,
    hidden 768, 12 layers, 12 heads, 4 KV heads, vocabulary 32,000), seeded random weights."""
    if size not in TIMING_SIZES:
        raise ValueError(f"size must be one of {sorted(TIMING_SIZES)}, got {size!r}")
    return build_model(out_dir, "chatml", "llama", seed, device=device, dtype=dtype,
                       max_positions=4096, **TIMING_SIZES[size])


def vllm_tiny_model(out_dir: str | Path, family: str = "chatml", seed: int = 1) -> Path:
    """A tiny model vLLM's CPU build serves: the tiny Llama of `build_model` with head size
    32 (hidden 64, 2 heads, 1 KV head); vLLM's CPU attention rejects the default's 16 and
    the bundled trend-reader's 28."""
    return build_model(out_dir, family, "llama", seed=seed, hidden=64, heads=2, kv_heads=1)
