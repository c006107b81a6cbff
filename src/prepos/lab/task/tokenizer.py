"""A byte-level BPE tokenizer trained on the market task's text, and our ChatML-style template.

The result is a standard tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``
carrying the Jinja ``chat_template``), loaded by ``transformers.AutoTokenizer`` exactly like
any user's model. What the engine relies on, and :func:`check` verifies:

1. message content is rendered verbatim (no trimming);
2. the template is prefix-stable: rendering a prefix of the messages gives a prefix of the
   text (with or without tools, as long as the same tools are passed);
3. ``<|im_start|>`` and ``<|im_end|>`` are single special tokens; ``<|im_end|>`` is eos;
4. every task answer (up, down, flat, yes, no) is a single token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from prepos.lab.task.market import ANSWERS, PRICE_MAX, PRICE_MIN, SYSTEM_PROMPT, corpus

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
TOOL_MARKUP = ("<tool_call>", "</tool_call>")  # plain added tokens: they stay in decoded text
ROLES = ("system", "user", "assistant", "tool")

# Written for this project. Whitespace control (`{%-`, `-%}`) only trims template source,
# never message content, which is emitted verbatim.
CHAT_TEMPLATE = """\
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages and messages[0]['role'] == 'system' -%}
{{- messages[0]['content'] + '\\n\\n' -}}
{%- endif -%}
{{- 'You can call these tools. To call one, reply with <tool_call> markup.\\n' -}}
{%- for tool in tools -%}
{{- (tool | tojson) + '\\n' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if not (loop.first and tools and message['role'] == 'system') -%}
{{- '<|im_start|>' + message['role'] + '\\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- elif message['content'] is iterable -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if message['role'] == 'assistant' and message['tool_calls'] is defined -%}
{%- for call in message['tool_calls'] or [] -%}
{%- if call['function'] is defined -%}
{%- set fn = call['function'] -%}
{%- else -%}
{%- set fn = call -%}
{%- endif -%}
{%- if (message['content'] is string and message['content']) or not loop.first -%}
{{- '\\n' -}}
{%- endif -%}
{{- '<tool_call>\\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' -}}
{%- if fn['arguments'] is string -%}
{{- fn['arguments'] -}}
{%- else -%}
{{- fn['arguments'] | tojson -}}
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


def _template_corpus(texts: Iterable[str]) -> Iterable[str]:
    """Task text wrapped the way the template renders it, plus tool-call JSON, so the
    merges cover role names, newlines and JSON punctuation too."""
    for i, t in enumerate(texts):
        role = ROLES[i % 3 + 1]
        yield f"{role}\n{t}\n"
    for _ in range(50):
        yield f"system\n{SYSTEM_PROMPT}\n\n"
        yield "You can call these tools. To call one, reply with <tool_call> markup.\n"
        yield '{"name": "get_price", "arguments": {"ticker": "ACME"}}'
        yield '{"type": "function", "function": {"name": "get_price", "parameters": {}}}'


def train_tokenizer(vocab_size: int = 1024, seed: int = 0, n_examples: int = 4000) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_template_corpus(corpus(seed, n_examples)), trainer=trainer)
    tok.add_tokens(list(TOOL_MARKUP))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, max_length: int = 512) -> Path:
    """Write a standard tokenizer directory that AutoTokenizer loads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *TOOL_MARKUP)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": IM_END,
                "pad_token": PAD,
                "additional_special_tokens": [IM_START, IM_END],
            },
            indent=2,
        )
        + "\n"
    )
    return out


def answer_token_ids(tokenizer, answers: Iterable[str] = ANSWERS) -> dict[str, int]:
    """The single token id of each answer as the assistant emits it (after the header)."""
    out = {}
    for a in answers:
        ids = tokenizer.encode(a, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"answer {a!r} is not a single token: {ids}")
        out[a] = ids[0]
    return out


def check(tokenizer) -> None:
    """Raise AssertionError unless the tokenizer meets the engine's four requirements."""
    # (3) special tokens
    for t in (IM_START, IM_END):
        ids = tokenizer.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] in tokenizer.all_special_ids, (t, ids)
    assert tokenizer.eos_token == IM_END, tokenizer.eos_token
    # (4) single-token answers, also right after the assistant header
    answer_token_ids(tokenizer)
    header = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    for a in ANSWERS:
        base = tokenizer.encode(header, add_special_tokens=False)
        full = tokenizer.encode(header + a + IM_END, add_special_tokens=False)
        assert full[: len(base)] == base and len(full) == len(base) + 2, (a, base, full)
    for p in range(PRICE_MIN, PRICE_MAX + 1):
        assert len(tokenizer.encode(f" {p}", add_special_tokens=False)) == 1, p
    # (1) verbatim content and (2) prefix stability, with and without tools
    msgs = [
        {"role": "system", "content": "  sys \n"},
        {"role": "user", "content": "\n ACME 41 42 "},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get", "arguments": {"t": "ACME"}}}]},
        {"role": "tool", "content": " 42 "},
        {"role": "assistant", "content": "up"},
    ]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    for tl in (None, tools):
        prev = ""
        for i in range(1, len(msgs) + 1):
            text = tokenizer.apply_chat_template(msgs[:i], tools=tl, tokenize=False)
            assert text.startswith(prev), (i, prev, text)
            gen = tokenizer.apply_chat_template(
                msgs[:i], tools=tl, tokenize=False, add_generation_prompt=True
            )
            assert gen == text + f"{IM_START}assistant\n", gen
            prev = text
        for m in msgs:
            if m["content"]:
                assert m["content"] in prev, m
    assert '<tool_call>\n{"name": "get", "arguments": {"t": "ACME"}}\n</tool_call>' in prev, prev


def build(out_dir: str | Path, vocab_size: int = 1024, seed: int = 0):
    """Train, save and reload the tokenizer through AutoTokenizer; check it; return it."""
    from transformers import AutoTokenizer

    save_tokenizer(train_tokenizer(vocab_size, seed), out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    check(tokenizer)
    return tokenizer
