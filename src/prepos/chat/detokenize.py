"""The text of an answer as its tokens come, one token at a time.

Decoding the whole answer again for every token costs O(n) a token and O(n^2) an answer.
Where the tokenizer's text of a sequence is the concatenation of its tokens' (a fast
tokenizer that cleans up no spaces: byte-level BPE, SentencePiece), the tokenizers library's
`DecodeStream` gives each token's text in O(1), holding back the bytes of a character not yet
complete. Elsewhere the text is decoded whole, as before.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """The text of `ids`, a token list its owner appends to, calling `add()` after each
    append: `text` is the text of every token so far, equal to decoding them whole (special
    tokens skipped), except that a character whose bytes are not all in yet is left out
    until they are (`pending`; `whole()` shows it as U+FFFD, as a whole decode does).
    `fixed`: how much of `text` no later token can change (a stop string found before it was
    found before)."""

    def __init__(self, fmt, ids: list[int]):
        """`fmt`: what decodes a whole sequence (`decode(ids)`: a ChatFormat), its `tokenizer`
        the one a token at a time follows where it can; the tokens in `ids` already taken."""
        tokenizer = getattr(fmt, "tokenizer", None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        concatenates = (backend is not None
                        and not getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.ids = ids
        self._decode = fmt.decode
        self._backend = backend if concatenates else None
        self._stream = DecodeStream(skip_special_tokens=True) if concatenates else None
        self.text = ""
        self.fixed = 0
        self.pending = False
        if self._stream is None:
            self.text = self._decode(ids) if ids else ""
        else:
            for tok in ids:
                self._step(tok)

    def add(self) -> None:
        """Take the token just appended to `ids`."""
        if self._stream is None:  # whole, every time: any earlier character may change
            self.text = self._decode(self.ids)
        else:
            self._step(self.ids[-1])

    def _step(self, token: int) -> None:
        self.fixed = len(self.text)
        piece = self._stream.step(self._backend, token)
        self.pending = piece is None
        if piece:
            self.text += piece

    def whole(self) -> str:
        """The text with any incomplete character's bytes shown (U+FFFD), as decoding every
        token at once gives it."""
        if not self.pending:
            return self.text
        return self._decode(self.ids)
