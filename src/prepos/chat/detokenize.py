"""The text of an answer as its tokens come, one token at a time.

Decoding the whole answer again for every token costs O(n) a token and O(n^2) an answer.
Where the tokenizer's text of a sequence is the concatenation of its tokens' (a fast
tokenizer that cleans up no spaces: byte-level BPE, SentencePiece), the tokenizers library's
`DecodeStream` gives each token's text in O(1), holding back the bytes of a character not yet
complete. Elsewhere the text is decoded whole, as before.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """`add(token)` takes the next token; `text` is the text of every token so far, equal to
    decoding them whole (special tokens skipped), except that a character whose bytes are not
    all in yet is left out until they are (`pending`; `whole()` shows it as U+FFFD, as a whole
    decode does). `fixed`: how much of `text` no later token can change (a stop string found
    before it was found before)."""

    def __init__(self, fmt, ids: Sequence[int] = ()):
        """`fmt`: what decodes a whole sequence (`decode(ids)`: a ChatFormat), its `tokenizer`
        the one a token at a time follows where it can."""
        tokenizer = getattr(fmt, "tokenizer", None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        concatenates = (backend is not None
                        and not getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._decode = fmt.decode
        self._backend = backend if concatenates else None
        self._stream = DecodeStream(skip_special_tokens=True) if concatenates else None
        self.ids: list[int] = []
        self.text = ""
        self.fixed = 0
        self.pending = False
        for tok in ids:
            self.add(tok)

    def add(self, token: int) -> None:
        self.ids.append(token)
        if self._stream is None:  # whole, every time: any earlier character may change
            self.text = self._decode(self.ids)
            return
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
