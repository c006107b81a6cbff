"""Control tokens: the tokenizer's added tokens (`<|im_start|>`, `<|im_end|>`, `<filename>`,
...), markup where the chat template writes them, plain characters where a client's text
holds their strings.

A rendered conversation is one string, so "which `<|im_end|>` is the template's" is decided
before rendering: every control-token string in content is *defused*, replaced by an escape
(`ESC` and one private-use character naming the token; a literal `ESC` is doubled). The
template's own control tokens are the only ones left in the text. `encode_pieces` then
tokenizes the text piece by piece: each control token is its id, each piece between them is
restored (escapes back to the original characters) and tokenized with the model's tokenizer
stripped of its added tokens, so `<filename>` in a user's text is the characters `<`,
`filename`, `>`, never token 6. The same function of the same text gives the same tokens,
whoever asks: a session's committed tokens equal a fresh render and tokenization of its
conversation.
"""

from __future__ import annotations

import json
import re
from typing import Any

ESC = "\U000F0000"  # the first code point of Supplementary Private Use Area-A
_FIRST = 0xF0001  # the private-use character of control token k is chr(_FIRST + k)


class ControlTokens:
    """A tokenizer's control-token strings and the escape that makes them plain text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {t.content for t in added.values() if t.special}
        special |= set(tokenizer.all_special_tokens)
        markup = {t.content for t in added.values()} | special
        self.markup = sorted((m for m in markup if m), key=len, reverse=True)
        self.special = frozenset(m for m in special if m)
        self._index = {m: i for i, m in enumerate(self.markup)}
        self._ids = {m: tokenizer.convert_tokens_to_ids(m) for m in self.markup}
        # where a control-token string (or an escape) may start: their first two characters,
        # searched for at once (every string of a conversation is checked at each render)
        self._starts = re.compile("|".join(
            map(re.escape, sorted({m[:2] for m in self.markup} | {ESC}))))
        alternatives = "|".join(map(re.escape, self.markup))
        self._markup_re = re.compile(alternatives) if self.markup else None
        self._defuse_re = re.compile(re.escape(ESC) + (f"|{alternatives}" if alternatives
                                                       else ""))
        self._restore_re = re.compile(re.escape(ESC) + "(.)", re.S)
        self.plain = _backend_copy(tokenizer, added_tokens=False)
        self.prompt_frame = self._prompt_frame()

    # -- escaping ------------------------------------------------------------------------
    def _may_hold(self, text: str) -> bool:
        return self._starts.search(text) is not None

    def defuse(self, text: str) -> str:
        if not self._may_hold(text):  # the common case
            return text
        return self._defuse_re.sub(self._escape, text)

    def _escape(self, m: re.Match) -> str:
        s = m.group(0)
        return ESC + ESC if s == ESC else ESC + chr(_FIRST + self._index[s])

    def defuse_obj(self, obj: Any) -> Any:
        """Every string in a message, a tool call, a list of tools, keys included."""
        if isinstance(obj, str):
            return self.defuse(obj)
        if isinstance(obj, dict):
            return {self.defuse(k) if isinstance(k, str) else k: self.defuse_obj(v)
                    for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.defuse_obj(v) for v in obj]
        return obj

    def restore(self, text: str) -> str:
        """Defused text back to the characters it stands for."""
        return self._restore_re.sub(self._unescape, text) if ESC in text else text

    def _unescape(self, m: re.Match) -> str:
        ch = m.group(1)
        if ch == ESC:
            return ESC
        k = ord(ch) - _FIRST
        return self.markup[k] if 0 <= k < len(self.markup) else m.group(0)

    def find_special(self, text: str) -> str | None:
        """The first special control-token string in raw text, if any."""
        if self._markup_re is None or not self._may_hold(text):
            return None
        for m in self._markup_re.finditer(text):
            if m.group(0) in self.special:
                return m.group(0)
        return None

    def split_special(self, text: str) -> list[str | int]:
        """Template text as its pieces of plain text and the ids of the special control
        tokens between them."""
        out: list[str | int] = []
        at = 0
        for m in self._markup_re.finditer(text) if self._markup_re else ():
            if m.group(0) in self.special:
                out += [text[at:m.start()], self._ids[m.group(0)]]
                at = m.end()
        out.append(text[at:])
        return [p for p in out if p != ""]

    # -- tokenizing ----------------------------------------------------------------------
    def encode_pieces(self, text: str) -> list[int]:
        """Rendered, defused text's tokens: its control tokens their ids, the pieces between
        them restored and tokenized as plain text."""
        ids: list[int] = []
        at = 0
        for m in self._markup_re.finditer(text) if self._markup_re else ():
            ids += self._plain_ids(text[at:m.start()])
            ids.append(self._ids[m.group(0)])
            at = m.end()
        ids += self._plain_ids(text[at:])
        return ids

    def _plain_ids(self, piece: str) -> list[int]:
        if not piece:
            return []
        text = self.restore(piece)
        if self.plain is not None:
            return list(self.plain.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"])

    def _prompt_frame(self) -> tuple[list[int], list[int]]:
        """What the tokenizer adds around a raw prompt on its own (a BOS, ...)."""
        bare = list(self.tokenizer("x", add_special_tokens=False)["input_ids"])
        full = list(self.tokenizer("x")["input_ids"])
        n = len(bare)
        for i in range(len(full) - n + 1):
            if full[i:i + n] == bare:
                return full[:i], full[i + n:]
        return [], []


def direct_tokenizer(tokenizer: Any):
    """The tokenizer's `tokenizers` back end as transformers' call uses it (added tokens
    matched, no truncation or padding), to encode without the call's own layers (its
    checks, and setting the back end's truncation, padding and special-token splitting
    every time: as much again as the encoding of a chat message); None where the tokenizer
    has no such back end, or splits special tokens (then transformers' call is used)."""
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    return _backend_copy(tokenizer, added_tokens=True)


def _backend_copy(tokenizer: Any, added_tokens: bool):
    """The tokenizer's `tokenizers` back end without truncation or padding; without its added
    tokens (so none of their strings is matched) unless `added_tokens`; None for a tokenizer
    without such a back end."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    if not added_tokens:
        spec["added_tokens"] = []
        spec["post_processor"] = None
    spec["truncation"] = None
    spec["padding"] = None
    return Tokenizer.from_str(json.dumps(spec))
