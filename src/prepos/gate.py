"""Algorithm 2's test (Eq. 12): fire iff gap > tau and the argmax is in the fast-answer set."""

from __future__ import annotations

from prepos.config import GateConfig
from prepos.core import ReadyRecord
from prepos.entries import ChatFormat


class Gate:
    def __init__(self, config: GateConfig, fmt: ChatFormat):
        self.config = config
        self.tau = config.tau
        self.answer_ids = answer_token_ids(config.answers, fmt)

    def fires(self, record: ReadyRecord) -> bool:
        return record.gap > self.tau and record.top_ids[0] in self.answer_ids


def answer_token_ids(answers: tuple[str, ...], fmt: ChatFormat) -> frozenset[int]:
    """The single tokens that spell each answer, with or without a leading space."""
    ids: set[int] = set()
    for answer in answers:
        for form in (answer, " " + answer):
            toks = fmt.encode(form)
            if len(toks) == 1:
                ids.add(toks[0])
    return frozenset(ids)
