"""Algorithm 2's test (Eq. 12): fire iff gap > tau and the argmax is in the fast-answer set."""

from __future__ import annotations

from prepos.chat.format import ChatFormat
from prepos.config import GateConfig
from prepos.core import ReadyRecord


class Gate:
    def __init__(self, config: GateConfig, fmt: ChatFormat):
        self.config = config
        self.tau = config.tau
        self.answer_ids = answer_token_ids(config.answers, fmt)

    def fires(self, record: ReadyRecord) -> bool:
        return record.gap > self.tau and record.top_ids[0] in self.answer_ids


def answer_token_ids(answers: tuple[str, ...], fmt: ChatFormat) -> frozenset[int]:
    """Every vocabulary token that spells one of the answers, give or take surrounding
    whitespace (so "up" and " up" both count). One scan of the vocabulary, at load."""
    wanted = {a.strip() for a in answers if a.strip()}
    if not wanted:
        return frozenset()
    tok = fmt.tokenizer
    ids = range(len(tok))
    texts = tok.batch_decode([[i] for i in ids], skip_special_tokens=True)
    return frozenset(i for i, t in zip(ids, texts) if t.strip() in wanted)
