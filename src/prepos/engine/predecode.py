"""Pre-decoding: the whole answer of an exact-match entry, decoded at idle.

After Algorithm 1 records an exact entry's ready distribution (a standing query, the agentic
turn after a committed user message or tool result), everything about the greedy answer is
known: the pre-positioner goes on decoding it, one token per idle chunk (preemptible, as a
pre-position), up to the entry's answer budget or the end of the turn, and stores it in the
version's `ReadySet` beside the record (`Predecoded`), so it is invalidated with the record.
Its cells are speculative, as a pre-positioned entry's: when the next token does not fit the
session's or the engine's budget the pre-decode ends there ("room"), never moving anyone.

Whether an entry's pre-decode pays is decided per entry from its session's observed requests
per update (`prepos.engine.rate`): below `min_hit` the N decode steps would mostly be thrown
away, and the entry keeps its record alone.

On a back end that streams answers (a remote engine: its decode is the engine's own), the
rest of the answer is asked of the engine as ONE streamed greedy request, sent at background
priority where the engine has it, and read token by token within the pre-position job, each
token stored as it comes. A mutation cancels it at the engine (`Prepositioner.invalidated`)
and a request that takes the answer over stops it: either way the next token read ends it,
and closing the stream aborts it at the engine.

A greedy request on that entry is answered from it (`replay`): its tokens go through the
request's own `Generation` (its stop sequences, max_tokens, logprobs) at once; where the
answer needs more than was pre-decoded, the rest is decoded live from there (on a remote
engine, one streamed request with the pre-decoded tokens in its prompt), and the pre-decode
of that entry stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from prepos.backends.base import Dist, Preempted
from prepos.chat.format import ChatFormat
from prepos.core import ReadyRecord, SamplingParams
from prepos.decode.generation import Generation
from prepos.decode.sampling import sample
from prepos.engine.rate import QueryRate
from prepos.engine.ready import Predecoded, ReadySet
from prepos.engine.session import TURN, Session
from prepos.errors import PreposError
from prepos.worker.kv import Forward, KVPool, KVSequence

TOP = 20  # the likeliest tokens kept per pre-decoded token: OpenAI's top_logprobs at most
GREEDY = SamplingParams(max_tokens=1)


@dataclass(frozen=True)
class Budget:
    """An exact entry's answer budget: pre-decode at most `max_tokens` tokens, and stop at
    the first of `stop` (the end of turn always ends it)."""

    max_tokens: int
    stop: tuple[str, ...] = ()


class Predecoder:
    """Pre-decodes the answers of recorded exact entries (a part of the pre-positioner's idle
    job) where `rate` says it pays; `bump(name, n)` counts into the pre-positioner's
    counters."""

    def __init__(self, fmt: ChatFormat, pool: KVPool, tokens: int, session_cells: int,
                 max_context: int, bump: Callable[[str, int], None],
                 on_answer: Callable[[Session, tuple, Predecoded], None] | None = None,
                 min_hit: float = 0.0, chunk: int = 8):
        self.fmt, self.pool, self.tokens, self.chunk = fmt, pool, tokens, chunk
        self.session_cells, self.max_context = session_cells, max_context
        self.bump, self.on_answer = bump, on_answer
        self.enabled = tokens > 0
        self.rate = QueryRate(min_hit)

    def budget(self, s: Session, key: tuple | None) -> Budget | None:
        """What the entry at `key` pre-decodes: standing queries and turns (the session's
        `answer_tokens`, else the engine's), None where nothing is (one token only: the
        record has it) or where its requests are too rare for it to pay."""
        if not self.enabled or key is None or not (key == TURN or key[0] == "query"):
            return None
        n = s.spec.answer_tokens if s.spec.answer_tokens is not None else self.tokens
        if n <= 1 or not self.rate.pays(s, key):
            return None
        return Budget(n, tuple(s.spec.answer_stop))

    def run(self, s: Session, ready: ReadySet, kv: KVSequence,
            recorded: Sequence[tuple[tuple, tuple[int, ...]]], max_yields: int) -> Generator:
        """Pre-decode each recorded (key, sequence) with a budget, the last recorded first
        (the KV holds its entry). Runs on the model worker inside the pre-position job."""
        for key, seq in reversed(recorded):
            budget = self.budget(s, key)
            rec = ready.records.get(key)
            if budget is not None and rec is not None:
                yield from self._decode(s, ready, kv, key, seq, rec, budget, max_yields)

    def _decode(self, s: Session, ready: ReadySet, kv: KVSequence, key: tuple,
                seq: tuple[int, ...], rec: ReadyRecord, budget: Budget,
                max_yields: int) -> Generator:
        first = Dist(rec.logits, rec.top_ids, rec.top_logprobs)
        tokens, lps, tops = [rec.argmax], [rec.top_logprobs[0]], [_top(first)]
        finish = self._finish(tokens, budget)
        cap = min(s.budget(self.session_cells), self.max_context)
        if self.pool.backend.streams_answers:
            yield from self._streamed(s, ready, kv, key, seq, budget, cap, (tokens, lps, tops))
            return
        yielded = stored = 0
        while True:
            answer = Predecoded(tuple(tokens), tuple(lps), tuple(tops), finish)
            stored = self._store(ready, key, answer, stored)
            if stored is None:  # moved on, or a request took over: dropped
                return
            if finish is not None:
                break
            target = seq + tuple(tokens)
            if len(target) > cap or not self.pool.fits(s.id, target):
                finish = "room"  # speculative cells only: skip, never evict
                continue
            try:
                # one decode step; a KV another entry took meanwhile is rebuilt a chunk a time
                step = yield Forward(kv, target, self.chunk, preemptible=yielded < max_yields)
                yielded = 0
            except Preempted:  # the KV holds what it did before the chunk: redo it
                self.bump("preempted", 1)
                yielded += 1
                continue
            if not step.done:
                continue
            dist = step.logits if isinstance(step.logits, Dist) else Dist.from_logits(
                step.logits, TOP)
            _take((tokens, lps, tops), sample(step.logits, GREEDY, None), dist)
            finish = self._finish(tokens, budget)
        if self.on_answer is not None:
            self.on_answer(s, key, answer)

    def _streamed(self, s: Session, ready: ReadySet, kv: KVSequence, key: tuple,
                  seq: tuple[int, ...], budget: Budget, cap: int,
                  answer: tuple[list[int], list[float], list]) -> Generator:
        """A remote engine's pre-decode: the answer after its first token as one streamed
        greedy request, each token stored as it is read, until the answer ends, the budget
        or the session's room runs out, the set moves on or a request takes the answer over
        (the stream closed: aborted at the engine), or the engine fails (what was read is
        kept, the rest decoded live by the request that needs it). On an engine without
        priority scheduling a foreground request preempts it; it asks for the rest again,
        from what it has, once none is in flight."""
        tokens, lps, tops = answer
        finish, stored, events = self._finish(tokens, budget), 0, None
        try:
            while True:
                got = Predecoded(tuple(tokens), tuple(lps), tuple(tops), finish)
                stored = self._store(ready, key, got, stored)
                if stored is None:  # moved on, or a request took over: dropped
                    return
                if finish is not None:
                    break
                if events is None:
                    n = min(budget.max_tokens, cap - len(seq)) - len(tokens)
                    if n < 1:
                        finish = "room"
                        continue
                    events, opened = kv.stream(seq + tuple(tokens), SamplingParams(
                        max_tokens=n, top_logprobs=TOP), n, self.fmt.end_of_turn), len(tokens)
                try:
                    tok, dist = next(events)
                except StopIteration:  # the engine ended the answer itself
                    finish = "end"
                    continue
                except Preempted:  # a foreground request on an engine without priorities
                    events.close()
                    events = None
                    self.bump("preempted", int(len(tokens) > opened))  # stopped part way
                    yield  # the rest asked again from here, in a later idle step
                    continue
                except PreposError:  # cancelled by a mutation, or the engine failed
                    return
                if dist is None:  # no logprobs from the engine: nothing honest to store
                    return
                _take(answer, tok, dist)
                finish = self._finish(tokens, budget)
        finally:
            if events is not None:
                events.close()
        if self.on_answer is not None:
            self.on_answer(s, key, got)

    def _store(self, ready: ReadySet, key: tuple, answer: Predecoded,
               stored: int) -> int | None:
        """Keep `answer` in the ready set: the tokens now stored, or None where the set has
        moved on or a request took the answer over (those not stored before are waste)."""
        n = len(answer.tokens) - stored
        self.bump("predecoded_tokens", n)
        if not ready.predecoded(key, answer):
            self.bump("predecode_wasted", n)
            return None
        return len(answer.tokens)

    def _finish(self, tokens: list[int], budget: Budget) -> str | None:
        if tokens[-1] in self.fmt.end_of_turn:
            return "end"
        if budget.stop and any(x in self.fmt.decode(tokens) for x in budget.stop):
            return "stop"
        return "length" if len(tokens) >= budget.max_tokens else None


def _take(answer: tuple[list[int], list[float], list], tok: int, dist: Dist) -> None:
    """Append a pre-decoded token, its logprob and its likeliest alternatives."""
    tokens, lps, tops = answer
    tokens.append(tok)
    lps.append(dict(zip(dist.top_ids, dist.top_logprobs)).get(tok, float("-inf")))
    tops.append(_top(dist))


def _top(dist: Dist) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if dist.logits is not None and len(dist.top_ids) < TOP:
        dist = Dist.from_logits(dist.logits, TOP)
    return tuple(dist.top_ids[:TOP]), tuple(dist.top_logprobs[:TOP])


def replay(out: Generation, answer: Predecoded, used: list[int]) -> bool:
    """Feed a pre-decoded answer to a greedy request's generation, token by token, until it
    finishes (True) or the answer runs out (False); `used[0]` counts the answer's tokens it
    took, each before the generation sees it (a finished turn commits within `add`)."""
    for i, tok in enumerate(answer.tokens):
        ids, lps = answer.tops[i]
        used[0] = i + 1
        if out.add(tok, Dist(None, ids, lps), answer.logprobs[i]):
            return True
    return False
