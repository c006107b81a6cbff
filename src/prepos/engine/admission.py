"""What a request must satisfy before any of it runs: a request object, sampling the back end
can honour, a prompt of valid token ids, a session's spec and history of valid text, a
foreground queue with room (`Backpressure`), room in the context and in the session's budget.
Each check raises a typed error and changes nothing. `Room` also frees KV cells for a task
about to run (speculative cells only)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Callable, Sequence

from prepos.backends.base import Backend
from prepos.chat.format import ChatFormat
from prepos.core import AnswerPath, Request, Result, SamplingParams
from prepos.decode.stream import Stream
from prepos.engine.session import Session, SessionStore, check_context
from prepos.engine.session_spec import AGENTIC, SessionSpec
from prepos.errors import InvalidInput, InvalidSampling, OverBudget, Overloaded
from prepos.worker.kv import KVPool


def check_request(req: Request, backend: Backend, topk_sampling: bool,
                  grammars=None) -> SamplingParams:
    """The request's sampling, refused where this back end cannot honour it; its format or
    grammar compiled by `grammars` (a `Grammars`) where given."""
    if not isinstance(req, Request):
        raise InvalidInput(f"expected a prepos.core.Request, got {type(req).__name__}")
    sampling = req.sampling
    if req.prompt_logprobs and not backend.verifies_drafts:
        raise InvalidSampling(f"the {backend.name} back end does not return the logits at "
                              "every prompt position: no prompt logprobs there")
    if sampling.shaped and backend.streams_answers:
        raise InvalidSampling(f"the {backend.name} back end samples answers itself: "
                              "penalties, logit_bias, response_format and grammars are not "
                              "applied there")
    if (not sampling.greedy and not backend.full_distribution and not backend.streams_answers
            and not topk_sampling):
        raise InvalidSampling(f"the {backend.name} back end returns top-k logprobs only: it "
                              "serves greedy decoding (temperature 0) unless topk_sampling is "
                              "enabled")
    if grammars is not None:
        grammars.check(sampling)
    return sampling


def check_session(spec: SessionSpec, history: Sequence[tuple[int, Sequence[dict]]],
                  fmt: ChatFormat) -> None:
    """A new or restored session's spec and journalled history, before anything is made."""
    spec.validate()
    if spec.system is not None and (not isinstance(spec.system, str)
                                    or not spec.system.strip()):
        raise InvalidInput("system must be a non-empty string when given")
    fmt.check_text(spec.system, "system")
    for q in spec.standing:
        fmt.check_text(q, "a standing query")
    fmt.check_text(json.dumps(list(spec.tools)), "tools")
    for _, messages in history:
        for i, m in enumerate(messages):
            fmt.check_text(json.dumps(m), f"messages[{i}]")


def prompt_ids(prompt: str | Sequence[int], fmt: ChatFormat, vocab: int) -> tuple[int, ...]:
    """A raw completion's prompt as token ids: text tokenized with no chat template, or ids
    taken as they are (each in the vocabulary)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidInput("prompt must be a non-empty string or token ids")
        return tuple(fmt.encode_prompt(prompt))
    ids = tuple(prompt)
    if not valid_ids(ids, vocab):
        raise InvalidInput(f"prompt token ids must be a non-empty list of integers in "
                           f"[0, {vocab})")
    return ids


def valid_ids(ids: Sequence[object], vocab: int) -> bool:
    """A non-empty sequence of token ids, each an integer in the vocabulary."""
    return bool(ids) and all(not isinstance(t, bool) and isinstance(t, int) and 0 <= t < vocab
                             for t in ids)


class Backpressure:
    """Admission by load: a request that needs model work is refused (`Overloaded`) while
    `max_queue` foreground tasks or more wait for the model worker; the wait it is told is
    the queue times an answer's recent time with model work (a moving average over the
    engine's finished answers, `observe`)."""

    def __init__(self, max_queue: int, queued: Callable[[], int]):
        self.max_queue = max_queue
        self.queued = queued  # the foreground tasks waiting now
        self.answer_seconds = 0.05  # the moving average, seconds

    def observe(self, res: Result) -> None:
        if res.path is not AnswerPath.FAST:
            self.answer_seconds = 0.9 * self.answer_seconds + 0.1 * res.timing.total

    def check(self) -> None:
        fg = self.queued()
        if fg >= self.max_queue:
            wait = max(1, math.ceil(fg * self.answer_seconds))
            raise Overloaded(f"the model worker has {fg} requests queued (limit "
                             f"{self.max_queue}); retry after {wait} s", wait)


class Room:
    """Room for sessions' tokens: in the context and the session's budget (a request's
    prompt and answer), in the engine's cell budget (committed state across sessions: only
    speculative cells are reclaimable, live state never is). The cells a forward needs are
    the pool's to find where the batch it runs in is admitted (`KVPool.admit`), as an answer
    a remote engine streams is admitted before it starts."""

    def __init__(self, max_context: int, session_cells: int, pool: KVPool,
                 sessions: SessionStore):
        self.max_context, self.session_cells = max_context, session_cells
        self.pool, self.sessions = pool, sessions
        pool.keeps = (self._committed_len, self._kept_len)  # what room-making keeps

    def check(self, s: Session, prompt_len: int, sampling: SamplingParams) -> None:
        self.fit(s, prompt_len, sampling)

    def fit(self, s: Session, prompt_len: int, sampling: SamplingParams) -> SamplingParams:
        """The sampling an answer after `prompt_len` tokens of `s` runs with: refused where
        it does not fit; with `fit_context`, its max_tokens cut to the room left (refused
        only where none is): an agentic session's answer is committed, so its room keeps
        the session's reserve and the end of the message."""
        budget = s.budget(self.session_cells)
        room = min(self.max_context, budget) - prompt_len
        if s.kind == AGENTIC:
            room -= s.reserve + s.fmt.closing_tokens
        if sampling.fit_context and room < 1:
            raise OverBudget(f"prompt of {prompt_len} tokens leaves no room for an answer "
                             f"in the context of {self.max_context} (session budget "
                             f"{budget} cells)")
        if sampling.fit_context and room < sampling.max_tokens:
            sampling = replace(sampling, max_tokens=room)
        check_context(prompt_len, sampling.max_tokens, self.max_context, budget)
        return sampling

    def check_commit(self, s: Session, n: int) -> None:
        """`s` may commit `n` tokens: committed state across all sessions fits the pool (an
        implicit session's counts for nothing: its KV is reclaimable whole)."""
        if s.spec.implicit:
            return
        if self.pool.tiers is not None:  # the others' KV can move down: this one must fit
            if n > self.pool.engine_cells:
                raise OverBudget(f"the engine's KV budget of {self.pool.engine_cells} cells "
                                 f"cannot hold a session of {n} tokens")
            return
        others = sum(len(o.snap.tokens) for o in self.sessions.all()
                     if o is not s and not o.spec.implicit)
        if others + n > self.pool.engine_cells:
            raise OverBudget(f"the engine's KV budget of {self.pool.engine_cells} cells cannot "
                             f"hold {n} more committed tokens ({others} committed elsewhere)")

    def _committed_len(self, sid: str) -> int:
        s = self.sessions.find(sid)
        return len(s.snap.tokens) if s is not None else 0

    def _kept_len(self, sid: str) -> int:
        """What is never cropped: committed tokens. An implicit session's counts for no
        budget, so without tiers nothing of it is kept (a later request re-prefills it); with
        tiers it moves down a tier as any other's."""
        s = self.sessions.find(sid)
        if s is None or (s.spec.implicit and self.pool.tiers is None):
            return 0
        return len(s.snap.tokens)


def one_turn(turn: Callable[..., Stream]) -> Callable[..., Stream]:
    """An engine's `turn(engine, session, ...)`, called as `(engine, sid, ...)`: admitted
    under the session's turn claim (SessionBusy while another turn is in flight), held until the
    stream it returns has ended; any other mutation meanwhile is refused too, before it
    changes anything (`Session._admit`)."""
    def claimed(engine, sid: str, *args) -> Stream:
        s = engine.session(sid)
        with s.lock:
            s._admit()
            s._turn = True
        stream = None  # where the turn does not start, the claim is free again
        try:
            stream = turn(engine, s, *args)
            return stream
        finally:
            s._turn = stream
    return claimed
