"""Structured output: an OpenAI `response_format`, or a grammar (a forced tool call's), as
constrained decoding.

- A format reaches here checked and canonical (`prepos.response_format`).
- `Grammars` (one per engine) compiles a format into a matcher over the engine's tokenizer,
  once per format (a bounded LRU); each answer gets its own copy, a `Constraint`.
- `Constraint.mask` sets every token the grammar does not allow next to -inf in a full-vocab
  logits tensor (ids past the tokenizer's vocabulary, which a model's logits may have, are
  never allowed); `accept` advances it by the sampled token; `finished` says the grammar can
  take nothing more, so the answer ends there (finish reason "stop"). While the grammar is
  complete but could go on, the end-of-turn tokens are allowed and the model decides.

The grammar library is llguidance (see docs/ARCHITECTURE.md, "Structured output", for the
measurement against xgrammar). JSON is compact: no whitespace between tokens of the
structure, so a model cannot pad an answer with whitespace until it runs out of tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prepos.errors import InvalidResponseFormat
from prepos.response_format import JSON_OPTIONS, STRICT, dumps, schema_of

if TYPE_CHECKING:
    from prepos.chat.format import ChatFormat
    from prepos.core import SamplingParams

CACHE_SIZE = 64  # compiled formats kept per engine


class Constraint:
    """One answer's grammar state: the mask before each sampled token, the token after."""

    def __init__(self, matcher, n_tokens: int):
        self._m = matcher
        self._n = n_tokens  # the tokenizer's vocabulary: the mask's length

    def allowed(self, size: int | None = None) -> np.ndarray:
        """A bool vector of `size` (the tokenizer's vocabulary by default): the tokens the
        grammar allows next (the end-of-turn tokens once it is complete); ids past the
        tokenizer's vocabulary are never allowed."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        self._raise_on_error()
        size = self._n if size is None else size
        keep = np.zeros(size, dtype=bool)
        n = min(self._n, size)
        keep[:n] = np.unpackbits(bits, bitorder="little")[:n].view(bool)
        if not keep.any():  # what the grammar needs next, no token of this model writes
            raise InvalidResponseFormat("the answer cannot go on under its grammar with this "
                                        "model's vocabulary: no token writes what it needs")
        return keep

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A new float32 tensor: `logits` with every token the grammar refuses at -inf."""
        keep = self.allowed(logits.shape[-1])
        if logits.device.type != "cpu":
            return logits.float().masked_fill(~torch.from_numpy(keep).to(logits.device),
                                              float("-inf"))
        # in numpy on the CPU: a third of torch's masked_fill at a 32k vocabulary
        out = np.full(keep.shape, -np.inf, dtype=np.float32)
        out[keep] = logits.detach().float().numpy()[keep]
        return torch.from_numpy(out)

    def accept(self, token: int) -> None:
        if not self._m.consume_token(token):
            self._raise_on_error()

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes no further token."""
        return self._m.is_stopped() and not self._m.is_error()

    def _raise_on_error(self) -> None:
        if self._m.is_error():  # only a token the mask refused gets here: a caller's bug
            raise RuntimeError(f"structured output: {self._m.get_error()}")


class Grammars:
    """The engine's compiled response formats over its tokenizer, most recent kept."""

    def __init__(self, fmt: ChatFormat, capacity: int = CACHE_SIZE):
        self._fmt = fmt
        self._capacity = capacity
        self._tokenizer = None  # built on first use (about 0.5 s at a 49k vocabulary)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, sampling: SamplingParams) -> Constraint | None:
        """A fresh constraint for one answer under `sampling`; None without a format or a
        grammar."""
        if sampling.response_format is not None:
            key = ("json", sampling.response_format)
        elif sampling.grammar is not None:
            key = ("lark", sampling.grammar)
        else:
            return None
        with self._lock:
            template = self._cache.get(key)
            if template is None:
                template = self._compile(*key)
                self._cache[key] = template
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            matcher = template.deep_copy()
        return Constraint(matcher, self._tokenizer.vocab_size)

    def check(self, sampling: SamplingParams) -> None:
        """Compile the request's format or grammar now, before anything changes:
        InvalidResponseFormat where this model cannot write it."""
        self.constraint(sampling)

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, kind: str, text: str):
        import llguidance

        if kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                dumps(schema_of(text)), JSON_OPTIONS, STRICT)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        what = "the grammar" if kind == "lark" else "response_format"
        if matcher.is_error():  # checked before; a tokenizer-specific one
            raise InvalidResponseFormat(f"{what} cannot be compiled for this model: "
                                        f"{matcher.get_error()}")
        _check_writable(matcher, what)
        return matcher

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = llg_tokenizer(self._fmt)
        return self._tokenizer


def _check_writable(matcher, what: str, limit: int = 4096) -> None:
    """Refuse a grammar whose start, through what it forces (a call's opening, a
    constant), no token of the model's vocabulary can write (a character it has no token
    for, without byte fallback)."""
    probe = matcher.deep_copy()
    for _ in range(limit):
        if probe.is_stopped():
            return
        forced = probe.compute_ff_tokens()  # the tokenizer's own tokens of what is forced
        if not any(probe.compute_bitmask()) or forced and not probe.consume_tokens(forced):
            raise InvalidResponseFormat(f"{what} cannot be written with this model's "
                                        "vocabulary: it has no token for what it starts with")
        if not forced:
            return


def llg_tokenizer(fmt: ChatFormat):
    """The model's vocabulary as the grammar library sees it, as prepos tokenizes (about
    0.5 s at a 49k vocabulary): each token's bytes as the library reads them from the
    tokenizer (byte-level, byte fallback), every markup token (the tokenizer's added and
    special tokens: `<|im_end|>`, an added `<tool_call>`) special, so a grammar writes it as
    a token and text is never one; text tokenized without the markup tokens, as content is
    (`ChatFormat.encode`). The library's own loader takes added tokens that are not special
    as text when it tokenizes a grammar's text, yet as special when it checks a token, and
    refuses the token it chose."""
    import llguidance
    import llguidance.hf

    tok = fmt.tokenizer
    n = len(tok)
    eos = sorted(fmt.end_of_turn)
    base = llguidance.hf.from_tokenizer(tok, n_vocab=n, eos_token=eos)
    markup = set(fmt.markup_ids.values())
    special = sorted(i for i in range(n) if i in markup or base.is_special_token(i))
    words = [base.decode_bytes([i]) for i in range(n)]
    for i in special:
        if not words[i].startswith(b"\xff"):
            words[i] = b"\xff" + words[i]
    plain = fmt.controls.plain

    def encode(text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if plain is not None:
            return list(plain.encode(text, add_special_tokens=False).ids)
        return list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    class Vocabulary:  # what llguidance's TokenizerWrapper reads
        eos_token_id = eos[0]
        bos_token_id = None
        tokens = words
        special_token_ids = special

        def __call__(self, text):
            return encode(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=n,
                                  eos_token=eos)
