"""What a session is asked to be: its kind, system prompt, tools, standing queries and
options, checked (`SessionSpec.validate`) before anything is made of it."""

from __future__ import annotations

from dataclasses import dataclass

from prepos.core import FAST_MODES
from prepos.errors import InvalidInput, WrongSessionKind
from prepos.gate.question_class import check_options

STREAMING = "streaming"
AGENTIC = "agentic"
KINDS = (STREAMING, AGENTIC)


@dataclass
class SessionSpec:
    kind: str
    system: str | None = None
    tools: tuple[dict, ...] = ()
    standing: tuple[str, ...] = ()  # registered queries, pre-positioned as exact matches
    fast_path: str = "exact"
    preposition: bool = True
    budget_cells: int | None = None  # per-session KV budget (default: the engine's)
    owner: str | None = None  # the API key that created it: the server checks it, not us
    # the relaxed fast path (prepos.gate.relaxed): declared question classes (wordings, `*` a
    # wildcard; when given, only these are served relaxed) and this session's risk budget
    relaxed_queries: tuple[str, ...] = ()
    r_max: float | None = None  # None: the engine's
    # kept by the server on a client's behalf (implicit sessions, Responses chains): its KV
    # is a cache, counted for no budget and reclaimable whole, and a request's prompt is the
    # whole conversation (its path and cached tokens count from the start, not the commit)
    implicit: bool = False
    # the answer budget of its exact entries (standing queries, turns), pre-decoded at idle
    # (`prepos.engine.predecode`): at most this many tokens (None: the engine's), up to stop
    answer_tokens: int | None = None
    answer_stop: tuple[str, ...] = ()
    # tokens of a standing query's answer pushed to its subscribers (the server's SSE)
    push_tokens: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.answer_stop, list):  # as a journal reads it back
            self.answer_stop = tuple(self.answer_stop)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInput(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.fast_path not in FAST_MODES:
            raise InvalidInput(f"fast_path must be one of {FAST_MODES}, got {self.fast_path!r}")
        if self.standing and self.kind != STREAMING:
            raise WrongSessionKind("standing queries belong to streaming sessions")
        if any(not isinstance(q, str) or not q.strip() for q in self.standing):
            raise InvalidInput("standing queries must be non-empty strings")
        if self.budget_cells is not None and self.budget_cells < 1:
            raise InvalidInput("budget_cells must be >= 1")
        if self.relaxed_queries and self.kind != STREAMING:
            raise WrongSessionKind("relaxed_queries belong to streaming sessions")
        check_options(self.relaxed_queries, self.r_max)
        n = self.answer_tokens
        if n is not None and (not isinstance(n, int) or n < 0):
            raise InvalidInput(f"answer_tokens must be an integer >= 0, got {n!r}")
        if not isinstance(self.push_tokens, int) or self.push_tokens < 1:
            raise InvalidInput(f"push_tokens must be an integer >= 1, got {self.push_tokens!r}")
        if any(not isinstance(x, str) or not x for x in self.answer_stop):
            raise InvalidInput("answer_stop must be non-empty strings")
