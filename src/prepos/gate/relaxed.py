"""The relaxed fast path's online risk gate: which questions may take the question-independent
token, decided from verified evidence, within a risk budget.

- A question's *class* is its normalized form (`masked_wording`: data-dependent spans masked), or
  the first of the session's declared `relaxed_queries` it matches (`patterns`); a session
  that declares patterns serves only those classes relaxed.
- Per class, the engine keeps the latest verified outcomes (agree / disagree) and their
  Wilson 95% bound (`wilson`, the one implementation the offline calibration uses too). A
  class is served relaxed while that upper bound is within `r_max` (`ClassStats.status`).
- Per class too, its *answer set*: the tokens its verified full-path answers used in those
  outcomes (a polar class learns yes / no, a trend class up / down / flat). A cached token
  outside it falls through to the full path, on probation too: a new class's set is empty.
- Evidence comes from the full path's greedy first token at the question's real entry: free
  from a cold answer the gate fired on but the class withheld, else from a *shadow
  verification* run after a relaxed answer, at idle priority behind pre-positions
  (`Relaxed.shadow`). A disagreement about a served answer is a false accept: the engine
  emits a `correction` event carrying the answer id.

Evidence is its owner's (an API key's, pooled over its sessions like the calibration's
decision points): another key's questions and verdicts never change what it is served nor show
in its views; the metrics count classes, never name one. A session owns only its options
(declared patterns, its `r_max`). All of it is bounded: classes per owner (least recently
asked forgotten), outcomes per class, verifications queued per session and per owner.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Generator, Sequence

from prepos.backends.base import Dist, Preempted
from prepos.chat.format import Split
from prepos.config import RelaxedConfig
from prepos.gate.question_class import classify
from prepos.stats import wilson
from prepos.worker.kv import Forward, KVPool

PROBATION, PROMOTED, DEMOTED = "probation", "promoted", "demoted"
DEFER_QUANTA = 4  # a verification gives way to pre-positions for at most this many quanta


@dataclass
class ClassStats:
    """One class's verified outcomes: the latest `window` (disagreed, the full path's token)
    with the tokens they used (`answers`, the class's answer set), and lifetime counts."""

    window: int
    recent: deque[tuple[bool, int | None]] = field(default_factory=deque)
    answers: Counter[int] = field(default_factory=Counter)  # full tokens within the window
    disagree_recent: int = 0
    agreements: int = 0
    disagreements: int = 0
    served: int = 0  # relaxed answers served
    withheld: int = 0  # the gate fired but the class was not served: a full answer
    probing: int = 0  # served on probation, verification still to come
    probation_served: int = 0  # served on probation in all (at most min_verified)

    def add(self, disagree: bool, full: int | None = None) -> None:
        """One outcome; `full`: the full path's token (None: its answer ended at once)."""
        self.recent.append((disagree, full))
        self.disagree_recent += disagree
        if full is not None:
            self.answers[full] += 1
        if len(self.recent) > self.window:
            old, token = self.recent.popleft()
            self.disagree_recent -= old
            if token is not None:
                self.answers[token] -= 1
                if not self.answers[token]:
                    del self.answers[token]
        if disagree:
            self.disagreements += 1
        else:
            self.agreements += 1

    def bound(self) -> tuple[float, float]:
        return wilson(self.disagree_recent, len(self.recent))

    def status(self, r_max: float, min_verified: int) -> str:
        """promoted: enough evidence, its upper bound within r_max; probation: too little
        evidence yet, but the bound would still be within r_max were the rest to agree;
        demoted: otherwise, until new evidence brings the bound back under."""
        n, d = len(self.recent), self.disagree_recent
        if n >= min_verified:
            return PROMOTED if wilson(d, n)[1] <= r_max else DEMOTED
        return PROBATION if wilson(d, min_verified)[1] <= r_max else DEMOTED

    def view(self, r_max: float, min_verified: int, decode: Callable[[int], str]) -> dict:
        n = len(self.recent)
        lo, hi = self.bound()
        return {"status": self.status(r_max, min_verified), "verified": n,
                "answers": sorted(decode(t) for t in self.answers),
                "disagreements": self.disagree_recent,
                "false_accept": self.disagree_recent / n if n else None,
                "false_accept_ci": [lo, hi], "r_max": r_max,
                "agreements_total": self.agreements, "disagreements_total": self.disagreements,
                "served": self.served, "withheld": self.withheld}


@dataclass(frozen=True)
class Decision:
    """What the gate says about one question whose header record fired: serve it relaxed
    (with this answer id), and whether a shadow verification is booked for it."""

    cls: str | None
    serve: bool
    verify: bool = False
    answer_id: str | None = None
    probe: bool = False  # served on probation


class ClassGate:
    """Per owner, its per-class evidence and the decisions made from it; thread-safe. An
    owner is an API key's id (None: the server's one owner when it has no keys)."""

    ASKED_PER_SESSION = 32  # classes a session's info lists (the ones it asked last)

    def __init__(self, config: RelaxedConfig, decode: Callable[[int], str] = str):
        self.config = config
        # a token's text, for the views: cached, as they are built under the lock below
        self.decode = functools.lru_cache(maxsize=4096)(decode)
        self._lock = threading.Lock()
        self._classes: dict[str | None, OrderedDict[str, ClassStats]] = {}  # owner -> its
        self._asked: dict[str, OrderedDict[str, None]] = {}
        self._pending: Counter[str] = Counter()  # sid -> verifications booked, not settled
        self._owner_pending: Counter[str | None] = Counter()  # the same, per owner
        self.counters: Counter[str] = Counter()

    # -- decisions -----------------------------------------------------------------------
    def decide(self, sid: str, cls: str | None, r_max: float | None, token: int,
               owner: str | None = None) -> Decision:
        """The gate fired on the header record (its argmax `token`) for a question of
        `owner`'s class `cls`: serve it relaxed iff the token is in the class's answer set
        and the class is promoted, or on probation under start "serve" with a verification
        booked; a served answer books a verification when there is room."""
        c = self.config
        r_max = r_max or c.r_max
        with self._lock:
            if cls is None:
                self.counters["no_class"] += 1
                return Decision(None, False)
            st = self._touch(sid, owner, cls)
            if token not in st.answers:  # no verified answer of the class used it: full path
                self.counters["outside_answers"] += 1
            elif (status := st.status(r_max, c.min_verified)) == PROMOTED:
                verify = c.verify and self._book(sid, owner)
                return self._serve(st, cls, verify)
            elif status == PROBATION and c.start == "serve" and \
                    st.probing < c.session_pending and \
                    st.probation_served < c.min_verified and self._book(sid, owner):
                st.probing += 1  # unverified exposure on probation: at most min_verified
                st.probation_served += 1
                return self._serve(st, cls, True, probe=True)
            st.withheld += 1
            self.counters["withheld"] += 1
            return Decision(cls, False)

    def _serve(self, st: ClassStats, cls: str, verify: bool, probe: bool = False) -> Decision:
        st.served += 1
        self.counters["served"] += 1
        if not verify:
            self.counters["unverified_capped" if self.config.verify else "unverified_off"] += 1
        # a random id: a sequence would tell any key how many answers others were served
        return Decision(cls, True, verify, f"ra-{uuid.uuid4().hex[:16]}", probe)

    def _touch(self, sid: str, owner: str | None, cls: str) -> ClassStats:
        classes = self._classes.setdefault(owner, OrderedDict())
        st = classes.get(cls)
        if st is None:
            st = classes[cls] = ClassStats(self.config.window)
            while len(classes) > self.config.max_classes:
                classes.popitem(last=False)  # forgotten: it starts over, unpromoted
                self.counters["classes_forgotten"] += 1
        classes.move_to_end(cls)
        asked = self._asked.setdefault(sid, OrderedDict())
        asked[cls] = None
        asked.move_to_end(cls)
        while len(asked) > self.ASKED_PER_SESSION:
            asked.popitem(last=False)
        return st

    def book_evidence(self, sid: str, owner: str | None = None) -> bool:
        """Room for a verification of an answer not served relaxed (evidence only)?"""
        with self._lock:
            return self._book(sid, owner)

    def _book(self, sid: str, owner: str | None) -> bool:
        c = self.config
        if self._pending[sid] >= c.session_pending or \
                self._owner_pending[owner] >= c.owner_pending:
            return False
        self._pending[sid] += 1
        self._owner_pending[owner] += 1
        return True

    def _stats(self, owner: str | None, cls: str | None) -> ClassStats | None:
        return self._classes.get(owner, {}).get(cls) if cls is not None else None

    # -- evidence ------------------------------------------------------------------------
    def evidence(self, cls: str, disagree: bool, full: int | None, probe: bool = False,
                 owner: str | None = None) -> None:
        """A verified outcome for `owner`'s class `cls`, `full` the full path's token (None:
        its answer ended at once); a forgotten class is not revived."""
        with self._lock:
            st = self._stats(owner, cls)
            if st is not None:
                st.add(disagree, full)
                if probe:
                    st.probing = max(0, st.probing - 1)
            self.counters["disagree" if disagree else "agree"] += 1

    def settle(self, sid: str, cls: str | None = None, outcome: str | None = None,
               probe: bool = False, owner: str | None = None) -> None:
        """A booked verification is over: verified (its evidence given), or dropped for
        `outcome` (stale, budget)."""
        with self._lock:
            for pending, key in ((self._pending, sid), (self._owner_pending, owner)):
                pending[key] -= 1  # a Counter: a key at 0 goes
                if pending[key] <= 0:
                    del pending[key]
            if outcome is not None:
                self.counters[f"dropped_{outcome}"] += 1
                st = self._stats(owner, cls)
                if probe and st is not None:
                    st.probing = max(0, st.probing - 1)

    def corrected(self) -> None:
        with self._lock:
            self.counters["corrections"] += 1

    def forget(self, sid: str) -> None:
        """A session closed: its view goes (its evidence stays its owner's)."""
        with self._lock:
            self._asked.pop(sid, None)

    # -- views ---------------------------------------------------------------------------
    def status(self, cls: str, r_max: float | None = None, owner: str | None = None) -> str:
        with self._lock:
            st = self._stats(owner, cls)
            r = r_max or self.config.r_max
            return PROBATION if st is None else st.status(r, self.config.min_verified)

    def info(self, sid: str, declared: Sequence[str], r_max: float | None,
             owner: str | None = None) -> dict:
        """A session's view: its options and the classes it asked last, under its r_max,
        with its owner's evidence."""
        c = self.config
        r = r_max or c.r_max
        with self._lock:
            own = self._classes.get(owner, {})
            classes = {k: own[k].view(r, c.min_verified, self.decode)
                       for k in self._asked.get(sid, ()) if k in own}
            pending = self._pending.get(sid, 0)
        return {"r_max": r, "start": c.start, "min_verified": c.min_verified,
                "verify": c.verify, "declared": list(declared), "pending_verifications": pending,
                "classes": classes}

    def metrics(self) -> dict:
        """Counts over every owner, no class named: classes by status, how many are served
        relaxed, the highest false-accept upper bound among those (None: none served)."""
        c = self.config
        with self._lock:
            views = [(st.status(c.r_max, c.min_verified), st.bound()[1])
                     for classes in self._classes.values() for st in classes.values()]
            counters, pending = dict(self.counters), sum(self._pending.values())
        served = [hi for status, hi in views
                  if status == PROMOTED or (status == PROBATION and c.start == "serve")]
        return {"counters": counters, "pending": pending, "r_max": c.r_max, "start": c.start,
                "classes": {s: sum(status == s for status, _ in views)
                            for s in (PROMOTED, PROBATION, DEMOTED)},
                "classes_served": len(served), "served_upper_max": max(served, default=None)}


# ---------------------------------------------------------------------------------------
# Shadow verification


@dataclass(frozen=True)
class Verification:
    """One booked check: the question's real entry at the version its answer came from."""

    sid: str
    owner: str | None  # the session's: whose evidence the verdict is
    version: int
    cls: str
    tokens: tuple[int, ...]  # the version's committed tokens
    frame: Split  # the session's user-message frame at that version (`Entries.user`)
    served_token: int  # the header record's argmax
    answer_id: str | None  # None: nothing was served (evidence only)
    question: str
    probe: bool = False  # served on probation


class Relaxed:
    """The glue between the engine and its `ClassGate`: decisions for a request, free
    evidence from cold answers, shadow verifications as idle work, corrections."""

    def __init__(self, config: RelaxedConfig, fmt, pool: KVPool, submit: Callable,
                 chunk_tokens: int, max_yields: int, session_cells: int,
                 prepositions_pending: Callable[[], int],
                 on_correction: Callable[[object, dict], None]):
        self.config, self.fmt, self.pool = config, fmt, pool
        self.gate = ClassGate(config, lambda t: fmt.decode([t]))
        self.submit = submit  # the scheduler's
        self.chunk, self.max_yields, self.session_cells = chunk_tokens, max_yields, session_cells
        self.prepositions_pending, self.on_correction = prepositions_pending, on_correction
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Verification]] = {}  # sid -> verifications to run

    def decide(self, s, question: str, header) -> Decision:
        """The header record fired the gate for this question: may it be served relaxed?"""
        owner = s.spec.owner
        return self.gate.decide(s.id, classify(question, s.spec.relaxed_queries, owner),
                                s.spec.r_max, header.argmax, owner)

    def served(self, s, snap, question: str, header, d: Decision) -> None:
        """After a relaxed answer: its shadow verification, when one was booked."""
        if d.verify:
            self.book(s, self._check(s, snap, question, header, d))

    def withheld(self, s, snap, question: str, header, d: Decision,
                 greedy: bool) -> Callable | None:
        """A question the class gate withheld gets a full answer: under greedy decoding its
        first token is the evidence (the returned on_finish); otherwise a shadow verification
        gives it, when there is room."""
        if d.cls is None:
            return None
        if greedy:
            return self.from_answer(s.spec.owner, d.cls, header.argmax)
        if self.gate.book_evidence(s.id, s.spec.owner):
            self.book(s, self._check(s, snap, question, header, d))
        return None

    def _check(self, s, snap, question: str, header, d: Decision) -> Verification:
        """A check to book: no tokenizing here (this runs on a relaxed answer's path); the
        question's entry is tokenized when the check runs, at idle priority."""
        return Verification(s.id, s.spec.owner, snap.version, d.cls, snap.tokens,
                            s.entries(snap).user, header.argmax, d.answer_id, question, d.probe)

    def info(self, s) -> dict:
        return self.gate.info(s.id, s.spec.relaxed_queries, s.spec.r_max, s.spec.owner)

    # -- free evidence -------------------------------------------------------------------
    def from_answer(self, owner: str | None, cls: str, served_token: int) -> Callable:
        """An on_finish for the full answer to `owner`'s withheld question: its greedy first
        token is the full path's; an answer that ended at once disagrees."""
        def observe(res) -> None:
            if res.tokens:
                self.gate.evidence(cls, res.tokens[0] != served_token, res.tokens[0], False, owner)
            elif res.finish_reason == "stop":
                self.gate.evidence(cls, True, None, owner=owner)

        return observe

    # -- shadow verification -------------------------------------------------------------
    def book(self, s, v: Verification) -> None:
        """Queue the verification (its slot was booked already). A session's verifications
        run one after another, in one idle task: two at once would crop each other's entry
        out of the session's KV, chunk after chunk."""
        with self._lock:
            queue = self._queues.get(s.id)
            start = queue is None
            if start:
                queue = self._queues[s.id] = deque()
            queue.append(v)
        if start:
            try:
                # before any pre-position (whose priority, a chance, is below 1): a served
                # answer's verification is owed, and its correction is due as soon as can be
                self.submit(self._drain(s), idle=True, key=s.id, priority=1.0)
            except Exception:  # the engine is closing: nothing will run
                self._fail(s.id, "closed")

    def _drain(self, s) -> Generator:
        budget = s.budget(self.session_cells)
        while True:
            with self._lock:
                queue = self._queues[s.id]
                if not queue:
                    del self._queues[s.id]
                    return
                v = queue.popleft()
            try:
                yield from self.shadow(s, v, budget)
            except GeneratorExit:  # the engine closed
                self._drop(v, "closed")
                self._fail(s.id, "closed")
                raise
            except Exception:  # a back-end failure is this verification's alone
                self._drop(v, "error")

    def _fail(self, sid: str, why: str) -> None:
        with self._lock:
            queue = self._queues.pop(sid, deque())
        for v in queue:
            self._drop(v, why)

    def shadow(self, s, v: Verification, budget: int) -> Generator:
        """The question's real entry, in preemptible chunks behind pre-positions; its
        greedy argmax compared with the served token. Dropped, never run, once the session
        has moved past the version (or closed), or when the cell budget has no room."""
        kv = self.pool.get(s.id)
        seq: tuple[int, ...] | None = None  # tokenized once the check is about to run
        yielded = 0  # consecutive chunks stopped for a waiting request
        deferred = 0
        while True:
            if self.prepositions_pending() > 0 and deferred < DEFER_QUANTA:
                deferred += 1  # pre-positions first: give way (a bounded number of quanta,
                yield  # or a steady stream of updates elsewhere would starve it)
                continue
            if s.closed or s.version != v.version:
                return self._drop(v, "stale")
            if seq is None:
                seq = v.tokens + tuple(self.fmt.encode(self.fmt.frame(v.frame, v.question)))
            if len(seq) > budget or not self.pool.fits(s.id, seq):
                return self._drop(v, "budget")  # skipped, never evicting
            try:  # gives way between layers to a waiting request, at most max_yields times
                step = yield Forward(kv, seq, self.chunk,
                                     preemptible=yielded < self.max_yields)
                yielded = 0
            except Preempted:
                yielded += 1
                continue
            if step.done:
                break
        if s.closed or s.version != v.version:  # moved on during the last chunk
            return self._drop(v, "stale")
        self._verdict(s, v, step.logits)

    def _drop(self, v: Verification, why: str) -> None:
        self.gate.settle(v.sid, v.cls, why, v.probe, v.owner)

    def _verdict(self, s, v: Verification, logits) -> None:
        dist = logits if isinstance(logits, Dist) else Dist.from_logits(logits)
        full = dist.top_ids[0]
        disagree = full != v.served_token
        self.gate.evidence(v.cls, disagree, full, v.probe, v.owner)
        self.gate.settle(v.sid, owner=v.owner)
        if disagree and v.answer_id is not None:
            self.gate.corrected()
            self.on_correction(s, {
                "session_id": v.sid, "answer_id": v.answer_id, "version": v.version,
                "question": v.question, "class": v.cls,
                "served_token": v.served_token, "served_text": self.fmt.decode([v.served_token]),
                "full_token": full, "full_text": self.fmt.decode([full])})
