"""Prometheus metrics, named `prepos:` the way vLLM names its own `vllm:`.

Request histograms are fed by an engine observer (every finished request, any path);
engine counters and gauges (pre-positions, paths, KV cells, queues, sessions) are read from
`Engine.metrics()` at scrape time (`engine_metrics`), so the hot path pays nothing for them."""

from __future__ import annotations

import asyncio
import threading
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.utils import floatToGoString

from prepos.core import AnswerPath, Result
from prepos.server.http import engine_metrics
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

    def refused(self, err) -> None:
        """An error response (an `ApiError`), counted; backpressure's too, as a rejection."""
        self.errors.labels(str(err.status), err.code).inc()
        if err.code == "overloaded":
            self.rejected.labels("queue_full").inc()

    def render(self) -> bytes:
        """The scrape's text: the registry's families, the engine's (`engine_metrics`), then
        the request and token-stage histograms (`Buckets`, written by themselves)."""
        eng = self.engine
        return self.exposition.render() + "".join((
            engine_metrics.text(eng.metrics() if eng is not None else None, self.model_name),
            *(b.text() for b in (self.ttft, self.e2e, self.token_stage)))).encode()


def cached_prompt_tokens(res: Result) -> int:
    """The fast path computed its whole prompt ahead of the request."""
    return res.prompt_tokens if res.path is AnswerPath.FAST else res.cached_prompt_tokens


class Buckets:
    """A histogram by one label whose values are known ahead (each exported from 0), counted
    here: an observation is a bisect and two additions under one lock (observers run on
    several threads: the model workers, the event loop), where prometheus_client's
    Histogram scans its buckets and reads each under its own lock again at every scrape.
    Written at scrape time from a copy (its count is its buckets'), as the text format's
    lines: each bucket's name and labels formatted once, its count as an integer's float, a
    value's lines written again only once it has been observed since (`text`)."""

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
        # per value: the counts and sum its lines were last written for, and those lines
        self._written: dict[str, tuple[list[int], float, str]] = {}

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
            kept = self._written.get(value)
            if kept is not None and kept[0] == counts and kept[1] == total:
                out.append(kept[2])  # nothing observed since: the lines written then
                continue
            buckets, count, sum_ = self.names[value]
            lines, n = [], 0
            for name, k in zip(buckets, counts):
                n += k
                lines.append(f"{name}{count_text(n)}\n")
            lines.append(f"{count}{count_text(n)}\n{sum_}{floatToGoString(total)}\n")
            block = self._written[value] = (counts, total, "".join(lines))
            out.append(block[2])
        return "".join(out)
