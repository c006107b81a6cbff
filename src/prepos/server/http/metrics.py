"""Prometheus metrics, named `prepos:` the way vLLM names its own `vllm:`.

Request histograms are fed by an engine observer (every finished request, any path);
engine counters and gauges (pre-positions, paths, KV cells, queues, sessions) are read from
`Engine.metrics()` at scrape time by a collector, so the hot path pays nothing for them."""

from __future__ import annotations

import asyncio
import math
import threading
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.utils import floatToGoString

from prepos.core import AnswerPath, Result
from prepos.server.http.exposition import Exposition, count_text, help_lines, label_text

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0, 160.0)
STAGE_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 6e-3, 8e-3, 9e-3,
                 0.01, 0.011, 0.012, 0.014, 0.017, 0.02, 0.025, 0.03, 0.04, 0.05, 0.1, 0.25)
# a streamed token's way through the server: `engine` since the previous token was produced
# (the model's step, sampling, detokenizing), `handoff` from produced to read on the event
# loop, `respond` from read to the next one asked for (its chunk encoded and written),
# `write` the write alone
TOKEN_STAGES = ("engine", "handoff", "respond", "write")
PATHS = [p.value for p in AnswerPath]
# the engine's path counters by the label they are exported with: the path names of
# responses (`AnswerPath` values), the match or gate outcome after the fast path's
ENGINE_PATHS = {"fast_exact": "fast_exact", "fast_relaxed": "fast_relaxed",
                "gate_miss": "gate_miss", AnswerPath.FALL.value: "fall",
                AnswerPath.COLD.value: "cold"}


class Metrics:
    def __init__(self, model_name: str = "model"):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.engine = None
        self.model_name = model_name
        self.ttft = Buckets("prepos:time_to_first_token_seconds", "Time to first token, "
                            "from arrival at the engine, by path", "path", PATHS, TTFT_BUCKETS)
        self.e2e = Buckets("prepos:e2e_request_latency_seconds", "Request latency, arrival to "
                           "last token, by path", "path", PATHS, LATENCY_BUCKETS)
        self.prompt_tokens = Counter("prepos:prompt_tokens", "Prompt tokens of finished "
                                     "requests (session state plus entry)", registry=r)
        self.cached_tokens = Counter("prepos:cached_prompt_tokens", "Prompt tokens found in "
                                     "the KV cache (fast path: all of them)", registry=r)
        self.generation_tokens = Counter("prepos:generation_tokens", "Generated tokens",
                                         registry=r)
        self.requests = Counter("prepos:requests", "Finished requests by path",
                                ["path", "match"], registry=r)
        self.cancelled = Counter("prepos:requests_cancelled", "Requests whose client left "
                                 "before the end: their generation stopped there", registry=r)
        self.errors = Counter("prepos:http_errors", "Error responses by status and code",
                              ["status", "code"], registry=r)
        self.rejected = Counter("prepos:rejected_requests", "Requests refused for a limit",
                                ["reason"], registry=r)
        self.pushes = Counter("prepos:standing_query_pushes", "Standing-query answers pushed "
                              "over SSE before anyone asked", registry=r)
        self.subscribers = Gauge("prepos:sse_subscribers", "Open SSE event subscriptions",
                                 registry=r)
        self.journal_writes = Counter("prepos:journal_writes", "Rows written to the journal",
                                      registry=r)
        self.journal_errors = Counter("prepos:journal_errors", "Journal writes that failed",
                                      registry=r)
        self.token_stage = Buckets("prepos:token_stage_seconds", "A streamed token's time in "
                                   "each stage of the server, by stage", "stage", TOKEN_STAGES,
                                   STAGE_BUCKETS)
        self.token_stages = {s: self.token_stage.observer(s) for s in TOKEN_STAGES}
        self._ttft = {p: self.ttft.observer(p) for p in PATHS}
        self._e2e = {p: self.e2e.observer(p) for p in PATHS}
        self._requests: dict[tuple[str, str], object] = {}
        self._step_ewma = 0.05  # seconds per foreground request, for Retry-After
        r.register(_EngineCollector(self))
        self.exposition = Exposition(r)

    def observe(self, res: Result) -> None:
        """Engine observer: runs on the model worker, or on the event loop for an answer made
        there (the fast path), where it counts on the loop's next turn, once the answer is
        written: its client does not wait for the counting."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the worker's (or another thread's) answer
            self._count(res)
            return
        loop.call_soon(self._count, res)

    def _count(self, res: Result) -> None:
        self.prompt_tokens.inc(res.prompt_tokens)
        self.generation_tokens.inc(len(res.tokens))
        if res.finish_reason == "cancelled":  # no answer was delivered: not a latency sample
            self.cancelled.inc()
            return
        path = res.path.value
        self._ttft[path](res.timing.ttft)
        self._e2e[path](res.timing.total)
        key = (path, res.match.value)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests.setdefault(key, self.requests.labels(*key))
        counter.inc()
        self.cached_tokens.inc(cached_prompt_tokens(res))
        if res.path is not AnswerPath.FAST:
            self._step_ewma = 0.9 * self._step_ewma + 0.1 * res.timing.total

    @property
    def step_seconds(self) -> float:
        return self._step_ewma

    def render(self) -> bytes:
        """The scrape's text: the registry's families, then the request and token-stage
        histograms (`Buckets`, written by themselves)."""
        return self.exposition.render() + "".join(
            b.text() for b in (self.ttft, self.e2e, self.token_stage)).encode()


def cached_prompt_tokens(res: Result) -> int:
    """The fast path computed its whole prompt ahead of the request."""
    return res.prompt_tokens if res.path is AnswerPath.FAST else res.cached_prompt_tokens


class Buckets:
    """A histogram by one label whose values are known ahead (each exported from 0), counted
    here: an observation is a bisect and two additions under one lock (observers run on
    several threads: the model workers, the event loop), where prometheus_client's
    Histogram scans its buckets and reads each under its own lock again at every scrape.
    Written at scrape time from a copy (its count is its buckets'), as the text format's
    lines: each bucket's name and labels formatted once, its count as an integer's float
    (`text`)."""

    def __init__(self, name: str, doc: str, label: str, values, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = {v: [0] * (len(bounds) + 1) for v in values}
        self.sums = dict.fromkeys(values, 0.0)
        self.lock = threading.Lock()
        les = [floatToGoString(b) for b in bounds] + ["+Inf"]

        def labels(value: str, le: str | None = None) -> str:
            pairs = [(label, value)] + ([("le", le)] if le is not None else [])
            return label_text(sorted(pairs)) + " "

        self.head = help_lines(name, doc, "histogram")
        # per value: its buckets' names, its count's and its sum's
        self.names = {v: ([f"{name}_bucket{labels(v, le)}" for le in les],
                          f"{name}_count{labels(v)}", f"{name}_sum{labels(v)}")
                      for v in values}

    def observer(self, value: str) -> Callable[[float], None]:
        counts, bounds, sums, lock = self.counts[value], self.bounds, self.sums, self.lock

        def observe(seconds: float) -> None:
            with lock:
                counts[bisect_left(bounds, seconds)] += 1  # le: the first bound >= it
                sums[value] += seconds

        return observe

    def text(self) -> str:
        """Its lines in the text format, as prometheus_client writes a Histogram's (less the
        `_created` series)."""
        with self.lock:
            copies = [(v, list(c), self.sums[v]) for v, c in self.counts.items()]
        out = [self.head]
        for value, counts, total in copies:
            buckets, count, sum_ = self.names[value]
            n = 0
            for name, k in zip(buckets, counts):
                n += k
                out.append(f"{name}{count_text(n)}\n")
            out.append(f"{count}{count_text(n)}\n{sum_}{floatToGoString(total)}\n")
        return "".join(out)


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        eng = self.m.engine
        info = GaugeMetricFamily("prepos:model_info", "The served model", labels=["model"])
        info.add_metric([self.m.model_name], 1.0 if eng is not None else 0.0)
        yield info
        if eng is None:
            return
        m = eng.metrics()  # readable from any thread (KVPool keeps a running count)
        pre = m["prepositions"]
        helps = {
            "started": "Pre-positions started (one per committed version)",
            "recorded": "Pre-positions that recorded their ready distributions",
            "consumed": "Pre-positions a request used before invalidation (hits)",
            "invalidated": "Pre-positions cleared by a mutation before any use (waste)",
            "discarded": "Pre-positions still running when their session moved on",
            "superseded": "Pre-positions whose session moved on before they started",
            "skipped": "Pre-position entries skipped for the KV cell budget",
            "preempted": "Idle chunks stopped between layers for a waiting request (redone)",
            "predecoded_tokens": "Answer tokens pre-decoded at idle after exact entries",
            "predecode_served": "Pre-decoded answer tokens served to requests",
            "predecode_wasted": "Pre-decoded answer tokens no request used before a mutation",
        }
        for name, value in pre.items():  # every integer counter the engine keeps
            if isinstance(value, int) and not isinstance(value, bool):
                yield CounterMetricFamily(f"prepos:prepositions_{name}",
                                          helps.get(name, f"Pre-positions {name}"), value)
        hit = pre.get("hit_rate")
        yield GaugeMetricFamily("prepos:preposition_hit_rate",
                                "consumed / (consumed + invalidated); NaN before any",
                                math.nan if hit is None else hit)
        paths = m["paths"]
        fam = CounterMetricFamily("prepos:requests_by_path", "Requests by engine path: "
                                  "fast_exact, fast_relaxed (gate fired), gate_miss, "
                                  "fall-through, cold", labels=["path"])
        for label, counter in ENGINE_PATHS.items():
            fam.add_metric([label], paths.get(counter, 0))
        yield fam
        yield CounterMetricFamily("prepos:gate_fires", "Relaxed-match gate fires (Eq. 12)",
                                  paths.get("fast_relaxed", 0))
        yield CounterMetricFamily("prepos:gate_misses", "Relaxed-match gate misses",
                                  paths.get("gate_miss", 0))
        yield CounterMetricFamily("prepos:fall_throughs", "Requests that resumed from a "
                                  "pre-paid entry (fall-through)", paths.get("fall", 0))
        yield CounterMetricFamily("prepos:cold_requests", "Requests that paid their whole "
                                  "entry (cold)", paths.get("cold", 0))
        yield GaugeMetricFamily("prepos:kv_cells_used", "KV cells (tokens) held",
                                m["kv_cells_used"])
        yield GaugeMetricFamily("prepos:kv_cells_budget", "The engine's KV cell budget",
                                m["kv_cells_budget"])
        yield from _tiers(m["kv_tiers"])
        kept = m["ready_logits"]
        yield GaugeMetricFamily("prepos:ready_logits_bytes", "Bytes of full next-token "
                                "vectors ready records keep (--ready-logits-memory)",
                                kept["bytes"])
        yield CounterMetricFamily("prepos:ready_logits_stripped", "Ready records that kept "
                                  "their top tokens only, for the budget", kept["stripped"])
        fam = CounterMetricFamily("prepos:kv_prefix_reuse", "KVs that started from the "
                                  "longest prefix another KV of their key held (hits), and "
                                  "the tokens they did not prefill for it", labels=["what"])
        fam.add_metric(["hits"], m["prefix_reuse"]["hits"])
        fam.add_metric(["tokens"], m["prefix_reuse"]["tokens"])
        yield fam
        q = GaugeMetricFamily("prepos:queue_length", "Tasks queued on the model worker",
                              labels=["queue"])
        q.add_metric(["foreground"], m["queue_foreground"])
        q.add_metric(["idle"], m["queue_idle"])
        yield q
        yield GaugeMetricFamily("prepos:num_requests_waiting", "Foreground requests queued "
                                "on the model worker", m["queue_foreground"])
        yield GaugeMetricFamily("prepos:sessions", "Live sessions", m["sessions"])
        lk = m["lookup"]
        fam = CounterMetricFamily("prepos:lookup_drafts", "Prompt-lookup drafted tokens of "
                                  "greedy answers: proposed (run in a verifying forward) and "
                                  "accepted (equal to the greedy choice)", labels=["outcome"])
        fam.add_metric(["proposed"], lk["proposed"])
        fam.add_metric(["accepted"], lk["accepted"])
        yield fam
        yield CounterMetricFamily("prepos:lookup_verify_steps", "Forwards that verified "
                                  "drafted tokens", lk["verify_steps"])
        fam = CounterMetricFamily("prepos:implicit_sessions", "Stateless chat requests by "
                                  "what their implicit session did (continued a kept "
                                  "conversation, started one), and kept ones evicted",
                                  labels=["outcome"])
        for outcome, n in m["implicit"].items():
            fam.add_metric([outcome], n)
        yield fam
        yield from _relaxed(m["relaxed"])


def _tiers(t: dict):
    """Where sessions' KV is: per tier its bytes (cells, resident) and sessions, the moves
    into each, restores and their time, tokens recomputed where no tier held a KV."""
    held = GaugeMetricFamily("prepos:kv_tier_sessions", "Sessions whose KV is in each tier",
                             labels=["tier"])
    size = GaugeMetricFamily("prepos:kv_tier_bytes", "Bytes held in each tier below "
                             "resident", labels=["tier"])
    held.add_metric(["resident"], t["resident"]["sessions"])
    for tier in ("ram", "disk"):
        if tier in t:
            held.add_metric([tier], t[tier]["sessions"])
            size.add_metric([tier], t[tier]["bytes"])
    yield held
    yield size
    moves = CounterMetricFamily("prepos:kv_tier_moves", "KV states moved down into a tier, "
                                "or dropped from the last", labels=["into"])
    for into, n in t.get("moves", {}).items():
        moves.add_metric([into], n)
    yield moves
    yield CounterMetricFamily("prepos:kv_restores", "KVs loaded back from a tier",
                              t["restores"])
    yield CounterMetricFamily("prepos:kv_restore_seconds", "Time spent loading KVs back",
                              t["restore_s"])
    yield CounterMetricFamily("prepos:kv_prefix_loads", "States read from a tier (and left "
                              "there) for the prefix another KV starts from",
                              t["prefix_loads"])
    yield CounterMetricFamily("prepos:kv_recomputed_tokens", "Tokens of KVs no tier held, "
                              "prefilled again from the session's committed tokens",
                              t["recomputed_tokens"])
    yield CounterMetricFamily("prepos:kv_deferred_forwards", "Forwards of a batch that waited "
                              "a step for resident cells", t.get("deferred", 0))


def _relaxed(rx: dict):
    """The relaxed path's online risk gate: verifications by outcome, the unverified by
    reason, corrections, and its question classes counted by status, with the highest
    false-accept upper bound among those served. No label carries a class's wording (a
    question's text): classes are counted over every API key, never named."""
    c = rx["counters"]
    fam = CounterMetricFamily("prepos:relaxed_verified", "Relaxed-path verifications (the "
                              "full path's first token at the real entry) by outcome",
                              labels=["outcome"])
    for outcome in ("agree", "disagree"):
        fam.add_metric([outcome], c.get(outcome, 0))
    yield fam
    fam = CounterMetricFamily("prepos:relaxed_unverified", "Verifications not run, by "
                              "reason (stale: the session moved on; budget; capped; off; "
                              "closed; error)", labels=["reason"])
    for reason in ("stale", "budget", "error", "closed"):
        fam.add_metric([reason], c.get(f"dropped_{reason}", 0))
    fam.add_metric(["capped"], c.get("unverified_capped", 0))
    fam.add_metric(["off"], c.get("unverified_off", 0))
    yield fam
    yield CounterMetricFamily("prepos:relaxed_corrections", "Correction events sent for "
                              "served relaxed answers the full path disagreed with",
                              c.get("corrections", 0))
    yield CounterMetricFamily("prepos:relaxed_withheld", "Gate fires whose class was not "
                              "served relaxed (a full answer instead)", c.get("withheld", 0))
    yield GaugeMetricFamily("prepos:relaxed_verifications_pending", "Verifications queued",
                            rx["pending"])
    fam = GaugeMetricFamily("prepos:relaxed_classes", "Question classes tracked (per API "
                            "key, counted together) by status", labels=["status"])
    for status, n in rx["classes"].items():
        fam.add_metric([status], n)
    yield fam
    yield GaugeMetricFamily("prepos:relaxed_classes_served", "Question classes served relaxed "
                            "(promoted, or on probation with start serve)", rx["classes_served"])
    upper = rx["served_upper_max"]
    yield GaugeMetricFamily("prepos:relaxed_served_false_accept_upper", "The highest Wilson "
                            "95% upper bound of the false-accept rate among the classes served "
                            "relaxed; NaN when none is", math.nan if upper is None else upper)
