"""Algorithm 1: after a committed update, at idle priority, append each entry, run one
forward, and record the ready distribution, unless the cell budget says skip.

What to pre-position follows from the session's state:
- streaming: the generic assistant header (question-independent, relaxed match), each
  standing query's full entry (exact match), and the query prefix left resident so an
  ad-hoc query pays only its delta;
- agentic awaiting a tool result: the tool-result envelope;
- agentic with a committed user or tool message and no answer yet: the generation prompt
  (exact match for the next turn); after an answer: the next user message's prefix.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Generator

from prepos.backends.base import Dist, Preempted
from prepos.chat.format import ChatFormat
from prepos.core import ReadyRecord
from prepos.engine.logits import KeptLogits
from prepos.engine.predecode import Predecoder
from prepos.engine.rate import QueryRate
from prepos.engine.ready import ReadySet
from prepos.engine.session import ENVELOPE, HEADER, TURN, Session, Snapshot, query_key
from prepos.engine.session_spec import STREAMING
from prepos.worker.kv import Forward, KVPool

MAX_YIELDS = 1  # a chunk gives way to waiting requests at most this many times in a row


@dataclass(frozen=True)
class Target:
    key: tuple | None  # where the record goes; None: leave the KV pre-paid, record nothing
    entry: tuple[int, ...]


@dataclass
class Counters:
    """Pre-positions, counted per committed version (one Algorithm 1 run each)."""

    started: int = 0
    recorded: int = 0
    consumed: int = 0  # used by a request before invalidation: a hit
    invalidated: int = 0  # cleared by a mutation before any request used it: wasted
    discarded: int = 0  # of those, still in flight when the mutation came
    superseded: int = 0  # scheduled, but the next mutation came before they started
    skipped: int = 0  # entries skipped for the cell budget (never evicting)
    preempted: int = 0  # idle chunks stopped part way for a waiting request, redone later
    # pre-decoded answers (`prepos.engine.predecode`), in tokens: decoded at idle, used by
    # requests (each request's share), never used by any before their version went
    predecoded_tokens: int = 0
    predecode_served: int = 0
    predecode_wasted: int = 0
    # requests bringing the next message (a user message or tool result) after an answer,
    # and of those, the ones whose session's entry was pre-positioned when they arrived
    next_turns: int = 0
    next_turns_ready: int = 0

    @property
    def hit_rate(self) -> float | None:
        n = self.consumed + self.invalidated
        return self.consumed / n if n else None

    @property
    def wasted(self) -> float | None:
        h = self.hit_rate
        return None if h is None else 1.0 - h

    def as_dict(self) -> dict:
        return {**self.__dict__, "hit_rate": self.hit_rate, "wasted": self.wasted}


class Prepositioner:
    """`emit(event, session, payload)`: "record" ((key, ReadyRecord)) as each ready record is
    stored, "predecoded" ((key, Predecoded)) as each pre-decoded answer ends."""

    def __init__(self, fmt: ChatFormat, pool: KVPool, chunk_tokens: int, session_cells: int,
                 emit: Callable[[str, Session, object], None] | None = None,
                 predecode_tokens: int = 0, max_context: int = 1 << 30,
                 predecode_min_hit: float = 0.0, logits_bytes: int = 1 << 62):
        self.fmt = fmt
        self.emit = emit or (lambda event, s, payload: None)
        self.pool = pool
        self.chunk = chunk_tokens
        self.session_cells = session_cells
        self.counters = Counters()
        self.kept = KeptLogits(logits_bytes)  # which records keep their full vectors
        self.in_flight = 0  # jobs queued or running (idle work ranked below them waits)
        self._lock = threading.Lock()  # counters and in_flight: bumped from the worker and callers
        self.predecoder = Predecoder(fmt, pool, predecode_tokens, session_cells, max_context,
                                     self._bump, lambda s, key, answer: self.emit(
                                         "predecoded", s, (key, answer)), predecode_min_hit,
                                     chunk_tokens)

    # -- what to pre-position ------------------------------------------------------------
    def targets(self, session: Session, snap: Snapshot) -> list[Target]:
        ent = session.entries(snap)
        enc = self.fmt.encode
        if session.kind == STREAMING:
            out = [Target(HEADER, ent.header)]
            for q in session.spec.standing:
                out.append(Target(query_key(q), tuple(enc(self.fmt.frame(ent.user, q)))))
            if not session.spec.standing:  # a standing entry already starts with the prefix
                out.append(Target(None, tuple(enc(ent.user.prefix))))
            return out
        if ent.tool is not None:
            return [Target(ENVELOPE, tuple(enc(ent.tool.prefix)))]
        last = snap.messages[-1]["role"] if snap.messages else "system"
        if last in ("user", "tool"):
            return [Target(TURN, ent.header)]
        return [Target(None, tuple(enc(ent.user.prefix)))]

    # -- Algorithm 1 ---------------------------------------------------------------------
    def job(self, session: Session, snap: Snapshot, ready: ReadySet) -> Generator:
        """Runs on the model worker at idle priority, one chunk (one Forward) per quantum."""
        rate = self.predecoder.rate
        rate.update(session)  # one committed version: an update
        if self.pool.tier(session.id) in ("ram", "disk") and not rate.pays(session):
            self._bump("skipped")  # a spilled KV brought back only for a session often asked
            return
        kv = self.pool.get(session.id)
        budget = session.budget(self.session_cells)
        started = False
        yielded = 0  # consecutive chunks stopped for a waiting request
        recorded: list[tuple[tuple, tuple[int, ...]]] = []  # exact entries, to pre-decode
        try:
            for target in self.targets(session, snap):
                seq = snap.tokens + target.entry
                if len(seq) > budget or not self.pool.fits(session.id, seq):
                    self._bump("skipped")  # skip without eviction: the baseline path applies
                    continue
                while True:
                    if not ready.valid:  # the session moved on: discard, never record
                        if started:
                            self._bump("discarded")
                        return
                    if not started:
                        started = True
                        ready.mark(started=True)
                        self._bump("started")
                    try:  # a request that arrives mid-chunk stops it between layers; after
                        # MAX_YIELDS such stops in a row the chunk runs through, so idle
                        # work progresses under load and a request waits one chunk at most
                        step = yield Forward(kv, seq, self.chunk,
                                             preemptible=yielded < MAX_YIELDS)
                        yielded = 0
                    except Preempted:  # the KV holds what it did before the chunk
                        self._bump("preempted")
                        yielded += 1
                        continue
                    if step.done:
                        break
                if target.key is not None:
                    self._record(ready, session, target, seq, step.logits)
                    recorded.append((target.key, seq))
            if started and ready.valid:
                ready.mark(prepared=True)
                self._bump("recorded")
                yield from self.predecoder.run(session, ready, kv, recorded, MAX_YIELDS)
        finally:
            ready.mark(done=True)
            if ready.scheduled:  # counted in flight when queued
                with self._lock:
                    self.in_flight -= 1

    def _record(self, ready: ReadySet, session: Session, target: Target, seq: tuple,
                logits) -> None:
        dist = logits if isinstance(logits, Dist) else Dist.from_logits(logits)
        rec = ReadyRecord(
            p=len(seq), entry=target.entry, logits=dist.logits, top_ids=dist.top_ids,
            top_logprobs=dist.top_logprobs, gap=dist.gap, version=ready.version,
            top_text=self.fmt.decode([dist.top_ids[0]]),
        )
        if ready.record(target.key, rec):  # else its version is no longer current
            self.kept.add(ready, target.key, rec)
            self.emit("record", session, (target.key, rec))

    # -- accounting ----------------------------------------------------------------------
    def scheduled(self, ready: ReadySet) -> None:
        """A pre-position job for this ready set is being queued."""
        ready.mark(scheduled=True)
        with self._lock:
            self.in_flight += 1

    def consume(self, ready: ReadySet | None) -> None:
        """A request used this ready set (a record, or its pre-paid KV): a hit."""
        if ready is not None and ready.consume():
            self._bump("consumed")

    def arrived(self, was_ready: bool) -> None:
        """A request brought the next message after an answer; `was_ready`: the entry was
        pre-positioned (the current version's job had prepared it) when it arrived."""
        self._bump("next_turns")
        if was_ready:
            self._bump("next_turns_ready")

    def asked(self, s: Session, key: tuple = QueryRate.ANY) -> None:
        """A request came: an exact one for the entry at `key`, or (ANY) another."""
        self.predecoder.rate.asked(s, key)

    def worth(self, s: Session) -> float:
        """What a pre-position of the session is worth: h(rho), the chance a request comes
        before its next update (idle work runs the most worth first)."""
        return self.predecoder.rate.hit(s)

    def served(self, ready: ReadySet, key: tuple, n: int, live: bool) -> None:
        """A request used `n` tokens of the answer pre-decoded at `key`; with `live` it
        decodes on from there (its pre-decode stops)."""
        ready.serve(key, n, live)
        self._bump("predecode_served", n)

    def invalidated(self, dropped: ReadySet | None, sid: str | None = None) -> None:
        """A mutation cleared this ready set; it is waste if work started and nothing used it.
        With `sid`: a remote pre-position of it still in flight is aborted where the engine
        allows (its answer was never going to be recorded: the set is invalid)."""
        if dropped is None:
            return
        waste = dropped.waste()
        if waste is not None:
            self._bump(waste)
        self._bump("predecode_wasted", dropped.unserved())
        cancel = getattr(self.pool.backend, "cancel", None)
        kv = self.pool.find(sid) if sid is not None and cancel is not None else None
        if kv is not None and dropped.started and not dropped.done:
            cancel(kv.handle)

    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)
