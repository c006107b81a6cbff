"""Which ready records keep their full next-token vector.

A record's full logits (vocabulary-sized: 192 KiB a record at SmolLM2's 49,152 tokens in
float32) are what lets a request with its own sampling (a temperature, penalties, a response
format, more top logprobs than the record's top tokens) be answered from the record. Its top
tokens alone serve every greedy request. With thousands of sessions the vectors would be most
of the server's memory, so they are a cache of their own: kept for the records recorded or
used most recently, within a byte budget (`EngineConfig.ready_logits_bytes`); beyond it the
least recently used record keeps its top tokens only (`ReadySet.strip`), and a request that
needs more of it takes the full path from its pre-paid entry (`Engine.query`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from prepos.core import ReadyRecord, SamplingParams
from prepos.engine.ready import ReadySet


def answers_from(rec: ReadyRecord, sampling: SamplingParams, full_distribution: bool) -> bool:
    """Whether the distribution `rec` kept answers a request with `sampling`: always where
    it kept its full vector, or where the back end never gives one (a top-k engine: its
    sampling is what the record holds); else only a greedy request wanting no more top
    logprobs than it kept."""
    if not sampling.greedy:
        return rec.logits is not None or not full_distribution
    return keeps_top(rec, sampling.top_logprobs, full_distribution)


def keeps_top(rec: ReadyRecord, k: int, full_distribution: bool) -> bool:
    """Whether `rec` still gives the `k` likeliest tokens a request asks for (a top-k back
    end's record gives what it has, as it always did)."""
    return rec.logits is not None or not full_distribution or k <= len(rec.top_ids)


class KeptLogits:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0  # bytes of the vectors kept now
        self.stripped = 0  # records that lost their vector to the budget
        self._kept: OrderedDict[tuple[int, tuple], int] = OrderedDict()  # LRU: bytes
        # each ready set holding kept vectors, by id: its weak reference and their keys
        self._sets: dict[int, tuple[weakref.ref[ReadySet], set[tuple]]] = {}
        self._lock = threading.RLock()  # a set dying in a collection here forgets itself here

    def add(self, ready: ReadySet, key: tuple, rec: ReadyRecord) -> None:
        """A record was stored: its vector kept, the least recently used ones stripped
        while the budget is exceeded."""
        if rec.logits is None:
            return
        size = rec.logits.element_size() * rec.logits.nelement()
        victims = []
        with self._lock:
            rid = id(ready)
            if rid not in self._sets:
                self._sets[rid] = (weakref.ref(ready, lambda _, rid=rid: self._forget(rid)),
                                   set())
            self._sets[rid][1].add(key)
            self.used += size - self._kept.pop((rid, key), 0)
            self._kept[(rid, key)] = size
            while self.used > self.budget and self._kept:
                (vid, vkey), vsize = self._kept.popitem(last=False)
                self.used -= vsize
                ref, keys = self._sets.get(vid, (None, set()))
                keys.discard(vkey)
                victims.append((ref() if ref is not None else None, vkey))
        for victim, vkey in victims:  # outside this lock: the set takes its own
            if victim is not None and victim.strip(vkey):
                self.stripped += 1

    def used_now(self, ready: ReadySet, key: tuple) -> None:
        """A request was answered from the record: it is the most recently used."""
        with self._lock:
            if (id(ready), key) in self._kept:
                self._kept.move_to_end((id(ready), key))

    def _forget(self, rid: int) -> None:
        """A ready set is gone (its session moved on): its vectors went with it."""
        with self._lock:
            _, keys = self._sets.pop(rid, (None, ()))
            for key in keys:
                self.used -= self._kept.pop((rid, key), 0)
