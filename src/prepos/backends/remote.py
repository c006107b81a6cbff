"""Remote back end: the session layer in front of real serving engines.

The engine behind it (vLLM, SGLang, llama.cpp's `llama-server`) keeps the KV in its prefix
cache; prepos keeps the sessions, decision points and ready distributions. A KV handle here
is only the session's replica (and, for llama.cpp, slot) affinity and the tokens it last
sent. `extend` (pre-positions, single steps) sends the whole prompt `past + tokens` for one
token with top-k logprobs, and the engine's prefix cache makes that cost only the delta.
`stream_answer` sends an answer as ONE streamed request: the whole prompt, `max_tokens`,
the stop token ids, the request's sampling and seed, top-k logprobs per token; the engine
decodes at its own speed and prepos reads the tokens as they come. `crop` costs nothing:
the next request simply sends the shorter prompt.

Each engine's formats live in `remote_adapters`; `RemoteBackend` holds the replicas:
sessions are pinned by rendezvous hashing over the healthy replicas (adding a replica moves
only the sessions it wins), a failing replica is marked down and its sessions move to the
next replica in their ranking and rebuild there (the next request carries the full prompt,
so no answer is stale and no request is lost while any replica is up), and a replica that
passes its health check again rejoins and wins its sessions back. A streamed answer whose
replica fails before its first token moves the same way; one that fails after tokens were
delivered raises `AnswerInterrupted` (a `BackendUnavailable`): never a splice of two
replicas' continuations.

Sampling. Every token of an answer is the engine's own sampling over the full vocabulary
(seeded with the request's seed where given) except one: the FIRST token of a fast-path
answer with temperature > 0, which prepos samples from the ready distribution it cached,
and that holds only the engine's top-k (`top_k`, default 8) — so that one token is sampled
from the top-k renormalized (the mass outside the top-k is dropped). Greedy answers are
exact on every path (the argmax is always in the top-k). The distributions reported with
each token (`Dist`, `logits` None) are the top max(2, top_logprobs) of the raw model
distribution; an answer that keeps no logprobs asks for none (llama-server's `n_probs` 0;
vLLM and SGLang return each token's id in its logprobs, so they are asked for one), since
the engine pays a top-k over the vocabulary for each token it reports one of.

The engine's facts come from the engine: the context length from vLLM/SGLang's
`GET /v1/models` `max_model_len` or llama.cpp's `GET /props` `n_ctx` (per slot; the
smallest over the replicas, capped by any `max_context` given), llama.cpp's slot count from
`/props`. Background priority (pre-positions: `idle_work`) is sent only where the engine
runs priority scheduling: vLLM documents that a non-zero priority is an error without
`--scheduling-policy priority` (0.32.0's CPU build in fact accepts and ignores it), so the
first refusal naming the priority (HTTP 400) turns priority off for that replica and the
request is resent without it; no engine reports its scheduling policy. Where a replica runs
no priority scheduling (llama-server), or that is told to (`give_way`: an engine on CPUs, where
a batched step costs its width), a foreground request preempts the background streams in
flight there (`Replica.foreground_request`): each ends at its next token.

Cached-token accounting (`metrics()`: `cached_tokens`, `prompt_tokens` per replica) is the
engine's own report, and it has the engine's granularity: vLLM caches whole KV blocks
(`--block-size`, 32 here), so `cached_tokens` is a multiple of the block size, at most the
prompt length minus one rounded down to a block (the last prompt token is always run, to get
its logits); a prompt that shares 100 tokens with the cached one reports 96 at block size 32,
and a prompt shorter than one block reports 0. llama.cpp caches per token within a slot
(`cache_n`: the common prefix with the slot's last prompt, at most length minus one).
Prepos's own `cached_prompt_tokens` (the token mirror's common prefix) is therefore an upper
bound of what the engine reports.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Iterator, Sequence

import httpx

from prepos.backends.base import Backend, Dist, Preempted, in_idle_work
from prepos.backends.remote_adapters import (  # noqa: F401  (re-exported)
    ADAPTERS,
    LlamaCppAdapter,
    SGLangAdapter,
    VLLMAdapter,
    make_adapter,
)
from prepos.backends.remote_protocol import (  # noqa: F401  (re-exported)
    Abandoned,
    Adapter,
    AnswerInterrupted,
    BackendUnavailable,
    EngineInfo,
    HttpCall,
    RemoteError,
    ReplicaFailure,
    TopK,
)
from prepos.backends.remote_replica import RemoteKV, Replica, _score

log = logging.getLogger("prepos.remote")

class RemoteBackend(Backend):
    """A `Backend` over one or more replicas of a serving engine."""

    name = "remote"
    full_distribution = False
    streams_answers = True

    def __init__(self, adapter: Adapter, urls: Sequence[str], vocab_size: int,
                 max_context: int | None = None, top_k: int = 8, timeout: float = 60.0,
                 health_interval: float | None = 1.0, health_timeout: float = 1.0,
                 background_cap: int = 1, retry_down_after: float = 5.0,
                 transport: httpx.BaseTransport | None = None, give_way: bool = False):
        if not urls:
            raise ValueError("at least one replica URL is needed")
        if top_k < 2:
            raise ValueError("top_k must be >= 2 (the gate reads the top-2 gap)")
        self.adapter = adapter
        self.name = f"remote:{adapter.kind}"
        self.vocab_size = int(vocab_size)
        self.top_k = top_k
        self.health_timeout = health_timeout
        self.retry_down_after = retry_down_after
        self.background_cap = background_cap
        self.timeout = timeout
        self.transport = transport  # tests: an httpx.MockTransport standing in for the network
        self.give_way = give_way  # background streams give way on every engine (`Replica`)
        self.replicas: list[Replica] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.moves = 0  # sessions served by a replica other than the one they were on
        for url in urls:
            self.add_replica(url)
        known = [r.max_context for r in self.replicas if r.max_context]
        if max_context is None and not known:
            raise BackendUnavailable("no replica reported its context length (are they up?); "
                                     "pass max_context")
        self.max_context = min([*known, *([int(max_context)] if max_context else [])])
        self._stop = threading.Event()
        self._health: threading.Thread | None = None
        self.health_interval = health_interval
        if health_interval:
            self._health = threading.Thread(target=self._health_loop, name="prepos-health",
                                            daemon=True)
            self._health.start()

    @classmethod
    def from_urls(cls, kind: str, urls: Sequence[str] | str, vocab_size: int,
                  max_context: int | None = None, model: str | None = None,
                  background_priority: int | None = None, **kwargs) -> RemoteBackend:
        """`kind` is "vllm", "sglang" or "llama.cpp"; `urls` the replicas' base URLs (a
        comma-separated string works too). `max_context` None: the engines' own."""
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        adapter = make_adapter(kind, model=model, background_priority=background_priority)
        return cls(adapter, urls, vocab_size, max_context, **kwargs)

    # -- replicas ------------------------------------------------------------------------
    def add_replica(self, url: str) -> Replica:
        rep = Replica(url, self.adapter, self.timeout, self.background_cap, self.transport,
                      self.give_way)
        with contextlib.suppress(ReplicaFailure, RemoteError, ValueError):
            rep.discover()
        with self._lock:
            if any(r.url == rep.url for r in self.replicas):
                rep.close()
                raise ValueError(f"replica {url} is already configured")
            self.replicas = [*self.replicas, rep]
            if rep.max_context and getattr(self, "max_context", None):
                self.max_context = min(self.max_context, rep.max_context)  # the smallest
        return rep

    def remove_replica(self, url: str) -> None:
        url = url.rstrip("/")
        with self._lock:
            gone = [r for r in self.replicas if r.url == url]
            self.replicas = [r for r in self.replicas if r.url != url]
        for r in gone:
            r.close()

    def replica_for(self, key: str, exclude: Sequence[Replica] = ()) -> Replica | None:
        """Rendezvous hashing over the replicas that are up: each key goes to the replica
        with its highest score, so adding or losing a replica moves only the keys it wins
        or held. A replica down for `retry_down_after` seconds without a health checker is
        tried again."""
        now = time.monotonic()
        best, best_score = None, -1
        for r in self.replicas:
            if r in exclude:
                continue
            if not r.healthy and not (self._health is None and r.down_since is not None
                                      and now - r.down_since >= self.retry_down_after):
                continue
            s = _score(key, r.url)
            if s > best_score:
                best, best_score = r, s
        return best

    def mark_down(self, rep: Replica, reason: str = "") -> None:
        if rep.healthy:
            log.warning("replica %s marked down: %s", rep.url, reason or "no reason given")
        with rep.lock:
            if rep.healthy:
                rep.healthy = False
                rep.down_since = time.monotonic()
            rep._slots.clear()  # a restarted server has empty slots
            rep.n_slots = None
            rep.priority_refused = False  # it may come back with other flags
        rep.bump(failures=1)

    def mark_up(self, rep: Replica) -> None:
        if not rep.healthy:
            with rep.lock:
                rep.healthy = True
                rep.down_since = None
            rep.bump(rejoins=1)

    def check_health(self) -> dict[str, bool]:
        """One round of health checks; down replicas that answer rejoin."""
        out = {}
        for rep in list(self.replicas):
            ok = rep.check(self.health_timeout)
            if ok:
                self.mark_up(rep)
            elif rep.healthy:
                self.mark_down(rep, "health check failed")
            out[rep.url] = ok
        return out

    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval):
            self.check_health()

    # -- the protocol --------------------------------------------------------------------
    def new_kv(self, key: str | None = None) -> RemoteKV:
        return RemoteKV(key if key is not None else f"kv{next(self._ids)}")

    def extend(self, kv: RemoteKV, past: Sequence[int], tokens: Sequence[int]) -> Dist:
        prompt = [*past, *tokens]
        if not prompt:
            raise ValueError("cannot extend an empty sequence")
        top = self.forward(kv, prompt)
        return top.dist()

    def crop(self, kv: RemoteKV, length: int) -> None:
        """Nothing to do: the next request sends the shorter prompt, and the engine's
        prefix cache keeps the common part."""
        kv.sent = min(kv.sent, length)

    def release(self, kv: RemoteKV) -> None:
        if kv.replica is not None:
            kv.replica.forget(kv.key)
        kv.replica = None
        kv.sent = 0

    def cancel(self, kv: RemoteKV) -> None:
        """Abandon the handle's in-flight idle-work request, if any (thread-safe; never a
        foreground one: a pre-position that gave way to its session's foreground request
        is not done, and a mutation then cancels it, not that request): aborted at the
        engine where it has an abort API (a stream is also closed by the reader, which
        aborts it at any engine); its answer is discarded either way (the `extend` that
        made it, or the stream at its next token, raises `Abandoned`). Later requests are
        not affected."""
        rep, rid = kv.replica, kv.rid
        if rid is None:
            return
        kv.cancelled_rid = rid
        if rep is not None:
            c = self.adapter.abort(rid)
            if c is not None:
                with contextlib.suppress(ReplicaFailure, RemoteError):
                    rep.call(c)

    # -- requests, with failover ---------------------------------------------------------
    def _place(self, kv: RemoteKV, tried: list[Replica], errors: list[str]) -> Replica:
        """The session's replica: the best-ranked one up and not yet tried."""
        rep = self.replica_for(kv.key, exclude=tried)
        if rep is None:
            raise BackendUnavailable("no replica could serve the request"
                                     + (f": {'; '.join(errors)}" if errors else ""))
        if kv.replica is not rep:
            if kv.replica is not None:
                kv.replica.forget(kv.key)
                with self._lock:
                    self.moves += 1
                rep.bump(moved_in=1)
            kv.replica, kv.sent = rep, 0
        if rep.adapter.uses_slots and rep.n_slots is None:
            with contextlib.suppress(RemoteError, ValueError, ReplicaFailure):
                rep.discover()
        return rep

    def _check_length(self, n: int) -> None:
        if n > self.max_context:
            raise RemoteError(f"prompt of {n} tokens exceeds the context of "
                              f"{self.max_context}")

    def forward(self, kv: RemoteKV, prompt: Sequence[int]) -> TopK:
        """Send `prompt` for one token's top-k to the session's replica. A replica failure
        marks it down and resends the full prompt to the next replica in the session's
        ranking (which rebuilds the cache there); only a request every replica failed
        raises."""
        self._check_length(len(prompt))
        background = in_idle_work()
        tried: list[Replica] = []
        errors: list[str] = []
        while True:
            rep = self._place(kv, tried, errors)
            try:
                top = self._post(rep, kv, prompt, background)
            except ReplicaFailure as exc:
                errors.append(str(exc))
                tried.append(rep)
                self.mark_down(rep, str(exc))
                continue
            self.mark_up(rep)
            kv.sent, kv.last = len(prompt), top
            return top

    def _post(self, rep: Replica, kv: RemoteKV, prompt: Sequence[int],
              background: bool) -> TopK:
        rid = f"prepos-{kv.key}-{next(self._ids)}"
        slot = rep.slot_for(kv.key)
        sem = rep._bg if background else None
        if sem is not None:
            sem.acquire()
        t0 = time.perf_counter()
        kv.rid = rid if background else None  # what `cancel` may abandon
        try:
            with contextlib.nullcontext() if background else rep.foreground_request():
                body = rep.send(lambda prio: self.adapter.request(
                    prompt, self.top_k, rid=rid, background=prio, slot=slot), background,
                    rep.call)
        except (ReplicaFailure, RemoteError) as exc:
            if kv.cancelled_rid == rid:  # the abort, not the replica, ended it
                raise Abandoned(f"request {rid} was cancelled") from exc
            raise
        finally:
            kv.rid = None
            if sem is not None:
                sem.release()
        if kv.cancelled_rid == rid:
            raise Abandoned(f"request {rid} was cancelled; its answer is discarded")
        top = self.adapter.parse(body)
        rep.bump(requests=1, background=int(background), seconds=time.perf_counter() - t0,
                 cached_tokens=top.cached_tokens or 0, prompt_tokens=len(prompt))
        return top

    def stream_answer(self, kv: RemoteKV, prompt: Sequence[int], sampling: Any,
                      max_tokens: int, stop_ids: frozenset[int], dists: bool = True
                      ) -> Iterator[tuple[int, Dist | None]]:
        """One streamed request continuing `prompt` by up to `max_tokens` tokens, sampled by
        the engine (see the module docstring), ending after a token in `stop_ids`; yields
        (token id, top-k Dist or None). Before its first token a replica failure moves the
        session to the next replica (the full prompt is resent); after it, the stream
        raises `AnswerInterrupted`. Closing the generator closes the HTTP stream, which
        aborts the request at the engine."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("cannot continue an empty sequence")
        if max_tokens < 1:
            return
        self._check_length(len(prompt))
        k = max(2, int(getattr(sampling, "top_logprobs", 0) or 0)) if dists else 0
        background = in_idle_work()
        tried: list[Replica] = []
        errors: list[str] = []
        while True:
            rep = self._place(kv, tried, errors)
            rid = f"prepos-{kv.key}-{next(self._ids)}"
            slot = rep.slot_for(kv.key)
            parser = self.adapter.stream_parser()
            delivered = 0
            turn = rep.turn(background, rid, kv)  # beside foreground requests on the replica
            sem = rep._bg if background else None
            if sem is not None:
                sem.acquire()
            t0 = time.perf_counter()
            kv.rid = rid if background else None  # what `cancel` may abandon
            done = False
            try:
                with contextlib.ExitStack() as stack:
                    events = rep.send(lambda prio: self.adapter.stream_request(
                        prompt, k, sampling, max_tokens, stop_ids, rid=rid, background=prio,
                        slot=slot), background, lambda c: stack.enter_context(rep.stream(c)))
                    for event in events:
                        pending = parser.feed(event)
                        for token, top in pending:
                            last = token in stop_ids or delivered + 1 >= max_tokens
                            if last and (self.adapter.stops_on_ids or token not in stop_ids):
                                # the engine ends the stream itself: read the rest (its cache
                                # report) before handing the last token on
                                with contextlib.suppress(ReplicaFailure, RemoteError):
                                    for rest in events:
                                        parser.feed(rest)
                            if kv.cancelled_rid == rid:
                                raise Abandoned(f"request {rid} was cancelled")
                            if kv.preempted_rid == rid:
                                raise Preempted(f"request {rid} gave way to a foreground one")
                            delivered += 1
                            kv.sent = len(prompt) + delivered - 1
                            kv.last = top if top is not None else TopK((), ())
                            done = last  # llama.cpp past a stop id: leaving closes the stream
                            yield token, (top.dist() if top is not None and top.ids else None)
                            if done:
                                break
                        if done:
                            break
                    if not done and not parser.finished:
                        raise ReplicaFailure(f"{rep.url}: the stream ended before the answer")
                    done = True
            except ReplicaFailure as exc:
                self.mark_down(rep, str(exc))
                if delivered:
                    rep.bump(interrupted=1)
                    raise AnswerInterrupted(
                        f"the replica streaming this answer failed after {delivered} tokens "
                        f"({exc}); the answer is not resumed elsewhere") from exc
                errors.append(str(exc))
                tried.append(rep)
                continue
            finally:
                kv.rid = None
                if sem is not None:
                    sem.release()
                turn.close()
                if not done:  # closed early (client gone, error): abort where there is an API
                    c = self.adapter.abort(rid)
                    if c is not None:
                        with contextlib.suppress(ReplicaFailure, RemoteError):
                            rep.call(c)
                rep.bump(streams=1, streamed_tokens=delivered, background=int(background),
                         seconds=time.perf_counter() - t0,
                         cached_tokens=parser.cached_tokens or 0, prompt_tokens=len(prompt))
                if done:  # also when the reader closes the generator at the last token
                    self.mark_up(rep)
                    if kv.last is not None:
                        kv.last.cached_tokens = parser.cached_tokens
                        kv.last.prompt_tokens = parser.prompt_tokens
            return

    # -- metrics -------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Per-replica counters: requests, streams, failures, cached prompt tokens, ..."""
        out: dict = {"kind": self.adapter.kind, "moves": self.moves,
                     "max_context": self.max_context, "replicas": {}}
        for r in self.replicas:
            with r.lock:
                out["replicas"][r.url] = {**r.counters, "healthy": r.healthy, "slots": r.n_slots,
                                          "slot_sessions": len(r._slots),
                                          "max_context": r.max_context, "priority": r.priority}
        return out

    def close(self) -> None:
        self._stop.set()
        if self._health is not None:
            self._health.join(timeout=5)
        for r in self.replicas:
            r.close()

