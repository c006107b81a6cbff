"""The three paths an answer takes, and its decode. The engine decides which path serves a
request (Algorithm 2); this module serves it:

- relaxed fast path: the gate fired on the question-independent record: one cached token, no
  scheduler (Eq. 3);
- exact fast path: the first token from the cached distribution with the request's own
  sampling, the rest decoded on from the resident entry KV;
- fall-through / cold: restore to the longest resident prefix, prefill only the delta
  (Eq. 5; the whole entry when nothing was pre-paid, Eq. 2), then decode.

Decode runs one step per scheduler quantum, batched with other sessions' steps; on a back end
that streams answers (a remote engine), every token after the first comes from one streamed
request. Sampling with temperature > 0 is then the engine's own; the one exception is the first
token of a fast answer on a top-k back end, sampled by prepos from the cached top-k,
renormalized.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable

import torch

from prepos.backends.base import Backend, Dist
from prepos.chat.format import ChatFormat
from prepos.core import AnswerPath, Match, ReadyRecord, Result, SamplingParams
from prepos.decode.generation import Generation
from prepos.decode.lookup import Lookup
from prepos.decode.sampling import generator_for, sample, step_token, top_logprobs
from prepos.decode.stream import Stream
from prepos.decode.structured import Grammars
from prepos.engine.admission import Room
from prepos.engine.predecode import replay
from prepos.engine.prepositioner import Prepositioner
from prepos.engine.ready import ReadySet
from prepos.engine.session import Session, Snapshot
from prepos.worker.kv import Forward, KVPool, KVSequence
from prepos.worker.scheduler import Scheduler


def cached(rec: ReadyRecord) -> torch.Tensor | Dist:
    """A record's distribution: the full vector where kept, else its top-k."""
    return rec.logits if rec.logits is not None else Dist(None, rec.top_ids, rec.top_logprobs)


FIRST_TOKEN_GRACE_S = 0.003  # at most this long an exact answer's decode waits for its reader


class Answers:
    """Serves the requests the engine routes to it, with the engine's parts: the KV pool and
    the room checks, the scheduler, the pre-positioner (its hit counters), the drafts; owns
    the count of answers by path."""

    def __init__(self, fmt: ChatFormat, backend: Backend, pool: KVPool, scheduler: Scheduler,
                 prepositioner: Prepositioner, lookup: Lookup, room: Room,
                 observe: Callable[[Result], None]):
        self.fmt, self.backend, self.pool, self.scheduler = fmt, backend, pool, scheduler
        self.prepositioner, self.lookup, self.room, self.observe = (prepositioner, lookup,
                                                                     room, observe)
        self.grammars = Grammars(fmt)  # response formats, compiled once each
        self._paths: Counter[str] = Counter()  # fast_exact, fast_relaxed, gate_miss, fall, cold
        self._lock = threading.Lock()

    def count(self, name: str) -> None:
        with self._lock:
            self._paths[name] += 1

    def path_counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self._paths)

    def relaxed(self, ready: ReadySet, rec: ReadyRecord, sampling: SamplingParams,
                logprobs: bool, t0: float, answer_id: str | None = None) -> Stream:
        """The gate fired: one cached token, the question-independent answer."""
        self.prepositioner.consume(ready)
        res = Result(AnswerPath.FAST, Match.RELAXED, tokens=[rec.argmax], text=rec.top_text,
                     finish_reason="stop", gap=rec.gap, version=rec.version, prompt_tokens=rec.p,
                     answer_id=answer_id)
        if logprobs:
            res.logprobs.append(rec.top_logprobs[0])
        if sampling.top_logprobs:
            res.top_logprobs.append(top_logprobs(cached(rec), sampling.top_logprobs))
        res.timing.ttft = res.timing.total = time.perf_counter() - t0
        self.count("fast_relaxed")
        stream = Stream()
        stream.finish(res)
        self.observe(res)
        return stream

    def exact(self, s: Session, snap: Snapshot, ready: ReadySet, key: tuple, rec: ReadyRecord,
              sampling: SamplingParams, logprobs: bool, t0: float,
              on_finish: Callable[[Result], None] | None = None) -> Stream:
        """A greedy request takes the answer pre-decoded at idle, as far as it got; else the
        first token comes from the cached logits with the request's own sampling. Further
        tokens decode on from the resident entry KV."""
        self.prepositioner.consume(ready)
        self.prepositioner.asked(s, key)
        self.prepositioner.kept.used_now(ready, key)
        self.count("fast_exact")
        res = Result(AnswerPath.FAST, Match.EXACT, gap=rec.gap, version=rec.version,
                     prompt_tokens=rec.p)
        if sampling.fit_context:  # max_tokens bounded by the room left (rec.p: the sequence's)
            sampling = self.room.fit(s, rec.p, sampling)
        stream = Stream()
        grammar = self.grammars.constraint(sampling)  # the cached logits are masked too
        rng = generator_for(sampling, grammar)
        answer = ready.answer(key) if sampling.greedy else None
        used, live = [0], [False]  # answer tokens taken (counted before a turn commits)

        def finish(r: Result) -> None:
            if answer is not None and not live[0]:  # finished within the replay
                self.prepositioner.served(ready, key, used[0], live=False)
            self._finisher(s, on_finish)(r)

        out = Generation(self.fmt, sampling, stream, res, t0, logprobs, finish, rng)
        if answer is not None:  # the whole answer at once, or as much as is decoded
            done = replay(out, answer, used)
            res.predecoded = len(out.tokens)
            if done:
                return stream
            live[0] = True  # decode on from it; its pre-decode stops
            self.prepositioner.served(ready, key, used[0], live=True)
        else:
            dist = cached(rec)
            # greedy: the argmax found when the record was made; else sample the cached logits
            first = rec.argmax if sampling.greedy else sample(dist, sampling, rng)
            if out.add(first, dist, rec.top_logprobs[0] if sampling.greedy else None):
                return stream
        self.room.check(s, rec.p, sampling)
        kv = self.pool.get(s.id)

        def rest():
            # the first token is out at once; on a machine with few cores the decode behind it
            # would take the CPU its writer needs, so it waits (briefly) until it was delivered
            stream.wait_delivered(FIRST_TOKEN_GRACE_S)
            yield from self.decode(kv, snap.tokens + rec.entry, out, sampling, rng, s.said())

        self.scheduler.submit(rest(), key=s.id, on_error=stream.fail)
        return stream

    def prefill(self, s: Session, seq: tuple[int, ...], base_len: int, version: int,
                ready: ReadySet, sampling: SamplingParams, logprobs: bool, t0: float,
                gap: float | None = None, on_finish: Callable[[Result], None] | None = None,
                settle_dropped: bool = False, prompt_logprobs: bool = False) -> Stream:
        """Fall-through or cold, decided by what the KV holds: restore to the longest
        resident prefix, prefill only the delta, then decode. With `prompt_logprobs`, the
        whole sequence is run, and the logprobs of its tokens kept in the result."""
        sampling = self.room.fit(s, len(seq), sampling)
        stream = Stream()
        res = Result(AnswerPath.COLD, Match.NONE, gap=gap, version=version, prompt_tokens=len(seq))
        rng = generator_for(sampling, self.grammars.constraint(sampling))
        out = Generation(self.fmt, sampling, stream, res, t0, logprobs,
                         self._finisher(s, on_finish), rng)

        def run():
            tm = res.timing
            tm.queue = time.perf_counter() - t0
            if stream.cancelled:  # the client left while this waited: no model work
                out.finish("cancelled")
                return
            if self.backend.streams_answers:  # the first token is the stream's first event
                kv = self.pool.get(s.id)
                admitted = self.pool.admit([Forward(kv, seq)], None, True)[0]
                if isinstance(admitted, BaseException):  # the engine decodes: no batch runs
                    raise admitted
                kept, step = admitted[0], None
            else:
                kv = self.pool.get(s.id)
                step = yield Forward(kv, seq, logits_from=0 if prompt_logprobs else None,
                                     greedy=out.greedy and not prompt_logprobs)
                if prompt_logprobs:
                    stream.prompt_logprobs = res.prompt_logprobs = _prompt_logprobs(
                        seq, step.logits, sampling.top_logprobs)
                    step.logits = step.logits[-1]
                kept = step.kept
                tm.restore, tm.prefill = step.restore_s, step.forward_s
                tm.prefill_tokens = step.prefilled
            # the request's own prompt: after the committed history, or all of it on a
            # session the server keeps for a client that resends its conversation
            since = 0 if s.spec.implicit else base_len
            tm.cached_tokens = max(0, kept - since)
            res.cached_prompt_tokens = min(kept, len(seq))
            stream.placed = (len(seq), res.cached_prompt_tokens)
            if kept > base_len:  # the pre-paid entry was used
                self.prepositioner.consume(ready)
            elif settle_dropped:
                self.prepositioner.invalidated(ready)
            used = tm.cached_tokens > 0
            res.path = AnswerPath.FALL if used else AnswerPath.COLD
            self.count("fall" if used else "cold")
            if step is None or not out.add(step_token(step, sampling, rng), step.logits):
                yield from self.decode(kv, seq, out, sampling, rng, s.said())

        self.scheduler.submit(run(), key=s.id, on_error=stream.fail)
        return stream

    def decode(self, kv: KVSequence, seq: tuple[int, ...], out: Generation,
               sampling: SamplingParams, rng, said: tuple[int, ...] = ()):
        """The rest of the answer after `seq` and `out`'s tokens: one decode step per
        scheduler quantum, batched with other sessions' steps; or, on a back end that
        streams answers, every token from one streamed request (the engine's own sampling;
        a bare yield after each token gives the worker to another task, where one waits). A
        greedy answer on a back end that verifies drafts runs several tokens per step where
        its context or `said` (the session's latest answers) predicts them
        (`prepos.decode.lookup`)."""
        if self.backend.streams_answers:
            events = kv.stream(seq + tuple(out.tokens), sampling,
                               sampling.max_tokens - len(out.tokens), self.fmt.end_of_turn,
                               dists=out.wants_dists)
            try:
                for token, dist in events:
                    if out.add(token, dist):
                        return
                    yield
            finally:
                events.close()
            out.finish("stop")  # the engine ended the answer without a stop token
            return
        if self.lookup.applies(sampling, self.backend.verifies_drafts):
            yield from self.lookup.decode(kv, seq, out, sampling, rng, said)
            return
        while True:
            step = yield Forward(kv, seq + tuple(out.tokens), greedy=out.greedy)
            if out.add(step_token(step, sampling, rng), step.logits):
                return

    def _finisher(self, s: Session, then: Callable[[Result], None] | None
                  ) -> Callable[[Result], None]:
        def finish(res: Result) -> None:
            s.remember_answer(res.tokens)
            if then is not None:
                then(res)
            self.observe(res)

        return finish


def _prompt_logprobs(seq: tuple[int, ...], logits: torch.Tensor, k: int) -> list:
    """Each token of `seq`, its logprob after the ones before it (None for the first), and
    the k likeliest tokens there, from the logits at every position."""
    lsm = torch.log_softmax(logits[:-1].float(), dim=-1)
    ids = torch.tensor(seq[1:], dtype=torch.long)
    lps = lsm.gather(1, ids[:, None])[:, 0].tolist()
    tops: list = [[] for _ in lps]
    if k:
        vals, top_ids = torch.topk(lsm, k=min(k, lsm.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), vals.tolist())]
    return [(seq[0], None, []), *zip(seq[1:], lps, tops)]
