"""Remote back end: the session layer in front of real serving engines.

The engine behind it (vLLM, SGLang, llama.cpp's `llama-server`) keeps the KV in its prefix
cache; prepos keeps the sessions, decision points and ready distributions. A KV handle here
is only the session's replica (and, for llama.cpp, slot) affinity and the tokens it last
sent: `extend` sends the whole prompt `past + tokens` for one token with top-k logprobs, and
the engine's prefix cache makes that cost only the delta. `crop` costs nothing: the next
request simply sends the shorter prompt.

Each engine's request and response format lives in one adapter class (`VLLMAdapter`,
`SGLangAdapter`, `LlamaCppAdapter`); `RemoteBackend` holds the replicas: sessions are pinned
by rendezvous hashing over the healthy replicas (adding a replica moves only the sessions it
wins), a failing replica is marked down and its sessions move to the next replica in their
ranking and rebuild there (the next request carries the full prompt, so no answer is stale
and no request is lost while any replica is up), and a replica that passes its health check
again rejoins and wins its sessions back.

What the remote distribution lacks, compared with the in-process back end: it is the top-k
(`top_k`, default 8) of the full vocabulary, so `Dist.logits` is None, greedy answers are
exact and sampling is renormalized within the top-k (only by the engine's `topk_sampling`
option).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from prepos.backends.base import Backend, Dist, in_idle_work
from prepos.errors import PreposError


class RemoteError(PreposError):
    """The engine refused a request (a 4xx: the request, not the replica, is at fault)."""

    code = "remote_error"
    status = 502


class BackendUnavailable(PreposError):
    """No replica could serve the request."""

    code = "backend_unavailable"
    status = 503


class Abandoned(PreposError):
    """A background request was cancelled (its session moved on); its answer is discarded."""

    code = "abandoned"
    status = 409


class ReplicaFailure(Exception):
    """The replica, not the request, failed: connection refused or reset, timeout, 5xx."""


# == background priority: the scheduler marks idle steps (base.idle_work) ==============


# == adapters: one per engine, each engine's differences in one place =====================
@dataclass
class TopK:
    """What one request brought back."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached_tokens: int | None = None  # prompt tokens the engine found in its prefix cache
    prompt_tokens: int | None = None
    slot: int | None = None

    def dist(self) -> Dist:
        if not self.ids:
            raise RemoteError("the engine returned no top-k logprobs")
        order = sorted(range(len(self.ids)), key=lambda i: (-self.logprobs[i], self.ids[i]))
        ids = tuple(self.ids[i] for i in order)
        lps = tuple(self.logprobs[i] for i in order)
        if len(ids) == 1:  # the Dist protocol wants two; a lone token holds all the mass
            ids, lps = ids + (-1,), lps + (-math.inf,)
        return Dist(None, ids, lps)


@dataclass
class Call:
    """One HTTP request an adapter wants made."""

    method: str
    path: str
    json: dict | None = None
    headers: dict = field(default_factory=dict)


class Adapter:
    """The request and response format of one engine."""

    kind = "base"
    health_path = "/health"
    uses_slots = False

    def __init__(self, model: str | None = None, background_priority: int | None = None):
        self.model = model
        # None: send no priority (the engine runs without priority scheduling)
        self.background_priority = background_priority

    def request(self, prompt: Sequence[int], k: int, *, rid: str, background: bool,
                slot: int | None = None) -> Call:
        raise NotImplementedError

    def parse(self, body: Any) -> TopK:
        raise NotImplementedError

    def abort(self, rid: str) -> Call | None:
        """The request that aborts an in-flight one, where the engine has such an API."""
        return None

    def slots_call(self) -> Call | None:
        return None

    def parse_slots(self, body: Any) -> int:
        return 1


def _lp(x: Any) -> float:
    return -math.inf if x is None else float(x)


class VLLMAdapter(Adapter):
    """vLLM's OpenAI-compatible `POST /v1/completions` with a token-id prompt.

    Request: `prompt` a list of token ids, `max_tokens: 1`, `temperature: 0`, `logprobs: k`
    and vLLM's `return_tokens_as_token_ids` extension, so `top_logprobs` is keyed
    `"token_id:<id>"` rather than by (ambiguous) token text; `priority` (lower runs earlier
    under `--scheduling-policy priority`) for background work when configured. Response:
    `choices[0].logprobs.top_logprobs[0]` (up to k+1 entries: the sampled token is always
    included); cached prompt tokens in `usage.prompt_tokens_details.cached_tokens` when the
    server runs with `--enable-prompt-tokens-details`. vLLM aborts a request whose client
    disconnects; there is no separate abort endpoint.
    """

    kind = "vllm"
    health_path = "/health"

    def request(self, prompt, k, *, rid, background, slot=None) -> Call:
        body: dict = {"prompt": list(prompt), "max_tokens": 1, "temperature": 0.0,
                      "logprobs": k, "return_tokens_as_token_ids": True, "stream": False}
        if self.model:
            body["model"] = self.model
        if background and self.background_priority is not None:
            body["priority"] = self.background_priority
        return Call("POST", "/v1/completions", body, {"X-Request-Id": rid})

    def parse(self, body) -> TopK:
        try:
            choice = body["choices"][0]
            top = choice["logprobs"]["top_logprobs"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise RemoteError(f"vLLM response has no top_logprobs: {exc!r}") from exc
        ids, lps = [], []
        for key, lp in top.items():
            if not key.startswith("token_id:"):
                raise RemoteError("vLLM returned top_logprobs keyed by text; it must honour "
                                  "return_tokens_as_token_ids")
            ids.append(int(key[len("token_id:"):]))
            lps.append(_lp(lp))
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return TopK(tuple(ids), tuple(lps), details.get("cached_tokens"),
                    usage.get("prompt_tokens"))


class SGLangAdapter(Adapter):
    """SGLang's native `POST /generate`.

    Request: `input_ids`, `sampling_params: {max_new_tokens: 1, temperature: 0}`,
    `return_logprob: true`, `top_logprobs_num: k`, `logprob_start_len: -1` (no prompt
    logprobs), `rid` (so the request can be aborted with `POST /abort_request {"rid"}`), and
    `priority` for background work when configured (`--enable-priority-scheduling`).
    Response: `meta_info.output_top_logprobs[0]` is a list of `[logprob, token_id, text]`;
    `meta_info.cached_tokens` and `meta_info.prompt_tokens` report the prefix-cache hit.
    """

    kind = "sglang"
    health_path = "/health"

    def request(self, prompt, k, *, rid, background, slot=None) -> Call:
        body: dict = {"input_ids": list(prompt),
                      "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                      "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": -1,
                      "stream": False, "rid": rid}
        if background and self.background_priority is not None:
            body["priority"] = self.background_priority
        return Call("POST", "/generate", body)

    def parse(self, body) -> TopK:
        if isinstance(body, list):  # a batch answer: one prompt was sent
            body = body[0]
        try:
            meta = body["meta_info"]
            top = meta["output_top_logprobs"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise RemoteError(f"SGLang response has no output_top_logprobs: {exc!r}") from exc
        ids = tuple(int(t[1]) for t in top)
        lps = tuple(_lp(t[0]) for t in top)
        return TopK(ids, lps, meta.get("cached_tokens"), meta.get("prompt_tokens"))

    def abort(self, rid: str) -> Call:
        return Call("POST", "/abort_request", {"rid": rid})


class LlamaCppAdapter(Adapter):
    """llama.cpp's `llama-server` `POST /completion`.

    Request: `prompt` a token array, `n_predict: 1`, `n_probs: k`, `cache_prompt: true`,
    `temperature: 0` (greedy; the probabilities are then a plain softmax of the logits,
    before any sampler), `id_slot` for slot affinity (each slot keeps its own prompt cache),
    `post_sampling_probs: false`. Response: `completion_probabilities[0]`, whose shape depends
    on the server version: `top_logprobs: [{id, token, logprob}]` (current), `top_probs:
    [{id, token, prob}]` (with `post_sampling_probs`), or `probs: [{tok_str, prob}]` (before
    late 2024: no ids, so a `token_to_id` map is needed). Cached prompt tokens: `timings.cache_n`
    where reported, else `tokens_cached`; `id_slot` says which slot served it. Slots:
    `GET /props` `total_slots`. There is no abort endpoint: the server cancels a task when its
    client disconnects.
    """

    kind = "llama.cpp"
    health_path = "/health"
    uses_slots = True

    def __init__(self, model: str | None = None, background_priority: int | None = None,
                 token_to_id: Callable[[str], int | None] | None = None):
        super().__init__(model, background_priority)
        self.token_to_id = token_to_id

    def request(self, prompt, k, *, rid, background, slot=None) -> Call:
        body: dict = {"prompt": list(prompt), "n_predict": 1, "n_probs": k,
                      "cache_prompt": True, "temperature": 0.0, "post_sampling_probs": False,
                      "stream": False}
        if slot is not None:
            body["id_slot"] = slot
        return Call("POST", "/completion", body)

    def parse(self, body) -> TopK:
        try:
            first = body["completion_probabilities"][0]
        except (KeyError, IndexError, TypeError) as exc:
            if isinstance(body, dict) and body.get("tokens_predicted") == 1:
                # llama-server withholds a token whose text is an incomplete UTF-8 sequence,
                # and its probabilities with it
                raise RemoteError(
                    "llama-server returned no probabilities: the greedy token's text is an "
                    "incomplete UTF-8 sequence; serve a GGUF exported with "
                    "prepos.backends.gguf_export.export(for_token_ids=True)") from exc
            raise RemoteError("llama.cpp response has no completion_probabilities "
                              f"(is n_probs > 0?): {exc!r}") from exc
        if "top_logprobs" in first:
            ids = tuple(int(t["id"]) for t in first["top_logprobs"])
            lps = tuple(_lp(t["logprob"]) for t in first["top_logprobs"])
        elif "top_probs" in first:
            ids = tuple(int(t["id"]) for t in first["top_probs"])
            lps = tuple(_log(t["prob"]) for t in first["top_probs"])
        elif "probs" in first:  # older servers: probabilities keyed by token text
            ids_l, lps_l = [], []
            for t in first["probs"]:
                tid = t.get("id")
                if tid is None:
                    tid = self.token_to_id(t["tok_str"]) if self.token_to_id else None
                if tid is None:
                    raise RemoteError("llama.cpp returned probabilities by token text only; "
                                      "pass token_to_id to map them")
                ids_l.append(int(tid))
                lps_l.append(_log(t["prob"]))
            ids, lps = tuple(ids_l), tuple(lps_l)
        else:
            raise RemoteError(f"unknown llama.cpp probability format: {sorted(first)}")
        timings = body.get("timings") or {}
        cached = timings.get("cache_n", body.get("tokens_cached"))
        prompt_n = body.get("tokens_evaluated")
        return TopK(ids, lps, cached, prompt_n, body.get("id_slot"))

    def slots_call(self) -> Call:
        return Call("GET", "/props")

    def parse_slots(self, body) -> int:
        return max(1, int((body or {}).get("total_slots", 1)))


def _log(p: Any) -> float:
    p = float(p)
    return math.log(p) if p > 0 else -math.inf


ADAPTERS: dict[str, type[Adapter]] = {
    "vllm": VLLMAdapter, "sglang": SGLangAdapter, "llama.cpp": LlamaCppAdapter,
    "llamacpp": LlamaCppAdapter, "llama-server": LlamaCppAdapter,
}


def make_adapter(kind: str, **kwargs) -> Adapter:
    try:
        cls = ADAPTERS[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r}; one of {sorted(ADAPTERS)}") from None
    return cls(**kwargs)


# == replicas ==============================================================================
class Replica:
    """One engine endpoint: its connection pool, health, slots and counters."""

    def __init__(self, url: str, adapter: Adapter, timeout: float, background_cap: int,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self.adapter = adapter
        self.client = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                   limits=httpx.Limits(max_keepalive_connections=32))
        self.healthy = True
        self.down_since: float | None = None
        self.n_slots: int | None = None
        self._slots: OrderedDict[str, int] = OrderedDict()  # session key -> slot, LRU order
        self._bg = threading.BoundedSemaphore(background_cap)
        self.lock = threading.Lock()
        self.counters = {"requests": 0, "failures": 0, "background": 0, "cached_tokens": 0,
                         "prompt_tokens": 0, "moved_in": 0, "rejoins": 0, "seconds": 0.0}

    def bump(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                self.counters[k] += v

    def call(self, c: Call) -> Any:
        try:
            r = self.client.request(c.method, c.path, json=c.json, headers=c.headers)
        except httpx.TransportError as exc:  # refused, reset, timed out
            raise ReplicaFailure(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500 or r.status_code in (408, 429):
            raise ReplicaFailure(f"{self.url}{c.path}: HTTP {r.status_code} {r.text[:200]}")
        if r.status_code >= 400:
            raise RemoteError(f"{self.url}{c.path}: HTTP {r.status_code} {r.text[:500]}")
        try:
            return r.json()
        except ValueError as exc:
            raise ReplicaFailure(f"{self.url}{c.path}: not JSON: {r.text[:200]}") from exc

    def slot_for(self, key: str) -> int | None:
        """llama.cpp slot affinity: a session keeps its slot while it is among the
        `n_slots` most recently used sessions of this replica."""
        if not self.adapter.uses_slots:
            return None
        with self.lock:
            if self.n_slots is None:
                return None
            slot = self._slots.get(key)
            if slot is not None:
                self._slots.move_to_end(key)
                return slot
            if len(self._slots) < self.n_slots:
                used = set(self._slots.values())
                slot = next(i for i in range(self.n_slots) if i not in used)
            else:
                _, slot = self._slots.popitem(last=False)
            self._slots[key] = slot
            return slot

    def forget(self, key: str) -> None:
        with self.lock:
            self._slots.pop(key, None)

    def discover(self) -> None:
        c = self.adapter.slots_call()
        if c is not None and self.n_slots is None:
            self.n_slots = self.adapter.parse_slots(self.call(c))

    def check(self, timeout: float) -> bool:
        try:
            r = self.client.get(self.adapter.health_path, timeout=timeout)
            ok = r.status_code == 200
            if ok:
                self.discover()
            return ok
        except (httpx.HTTPError, ReplicaFailure, RemoteError, ValueError):
            return False

    def close(self) -> None:
        self.client.close()


@dataclass
class RemoteKV:
    """A session's handle: its pinning key, the replica serving it, and what it last sent."""

    key: str
    replica: Replica | None = None
    sent: int = 0  # tokens of the last prompt sent (the replica's cache may hold them)
    last: TopK | None = None  # what the last request reported
    rid: str | None = None  # the request in flight
    cancelled_rid: str | None = None  # the in-flight request `cancel` abandoned


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest(),
                          "big")


class RemoteBackend(Backend):
    """A `Backend` over one or more replicas of a serving engine."""

    name = "remote"
    full_distribution = False

    def __init__(self, adapter: Adapter, urls: Sequence[str], vocab_size: int,
                 max_context: int, top_k: int = 8, timeout: float = 60.0,
                 health_interval: float | None = 1.0, health_timeout: float = 1.0,
                 background_cap: int = 1, retry_down_after: float = 5.0,
                 transport: httpx.BaseTransport | None = None):
        if not urls:
            raise ValueError("at least one replica URL is needed")
        if top_k < 2:
            raise ValueError("top_k must be >= 2 (the gate reads the top-2 gap)")
        self.adapter = adapter
        self.name = f"remote:{adapter.kind}"
        self.vocab_size = int(vocab_size)
        self.max_context = int(max_context)
        self.top_k = top_k
        self.health_timeout = health_timeout
        self.retry_down_after = retry_down_after
        self.background_cap = background_cap
        self.timeout = timeout
        self.transport = transport  # tests: an httpx.MockTransport standing in for the network
        self.replicas: list[Replica] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.moves = 0  # sessions served by a replica other than the one they were on
        for url in urls:
            self.add_replica(url)
        self._stop = threading.Event()
        self._health: threading.Thread | None = None
        self.health_interval = health_interval
        if health_interval:
            self._health = threading.Thread(target=self._health_loop, name="prepos-health",
                                            daemon=True)
            self._health.start()

    @classmethod
    def from_urls(cls, kind: str, urls: Sequence[str] | str, vocab_size: int,
                  max_context: int, model: str | None = None,
                  background_priority: int | None = None, **kwargs) -> RemoteBackend:
        """`kind` is "vllm", "sglang" or "llama.cpp"; `urls` the replicas' base URLs (a
        comma-separated string works too)."""
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        adapter = make_adapter(kind, model=model, background_priority=background_priority)
        return cls(adapter, urls, vocab_size, max_context, **kwargs)

    # -- replicas ------------------------------------------------------------------------
    def add_replica(self, url: str) -> Replica:
        rep = Replica(url, self.adapter, self.timeout, self.background_cap, self.transport)
        with contextlib.suppress(ReplicaFailure, RemoteError, ValueError):
            rep.discover()
        with self._lock:
            if any(r.url == rep.url for r in self.replicas):
                rep.close()
                raise ValueError(f"replica {url} is already configured")
            self.replicas = [*self.replicas, rep]
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
        with rep.lock:
            if rep.healthy:
                rep.healthy = False
                rep.down_since = time.monotonic()
            rep._slots.clear()  # a restarted server has empty slots
            rep.n_slots = None
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
        """Abandon the handle's in-flight background request, if any (thread-safe): aborted
        at the engine where it has an abort API; its answer is discarded either way (the
        `extend` that made it raises `Abandoned`). Later requests are not affected."""
        rep, rid = kv.replica, kv.rid
        if rid is None:
            return
        kv.cancelled_rid = rid
        if rep is not None:
            c = self.adapter.abort(rid)
            if c is not None:
                with contextlib.suppress(ReplicaFailure, RemoteError):
                    rep.call(c)

    # -- one request, with failover ------------------------------------------------------
    def forward(self, kv: RemoteKV, prompt: Sequence[int]) -> TopK:
        """Send `prompt` for one token's top-k to the session's replica. A replica failure
        marks it down and resends the full prompt to the next replica in the session's
        ranking (which rebuilds the cache there); only a request every replica failed
        raises."""
        if len(prompt) > self.max_context:
            raise RemoteError(f"prompt of {len(prompt)} tokens exceeds the context of "
                              f"{self.max_context}")
        background = in_idle_work()
        tried: list[Replica] = []
        errors: list[str] = []
        while True:
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
        if rep.adapter.uses_slots and rep.n_slots is None:
            with contextlib.suppress(RemoteError, ValueError):
                rep.discover()
        rid = f"prepos-{kv.key}-{next(self._ids)}"
        call = self.adapter.request(prompt, self.top_k, rid=rid, background=background,
                                    slot=rep.slot_for(kv.key))
        sem = rep._bg if background else None
        if sem is not None:
            sem.acquire()
        t0 = time.perf_counter()
        kv.rid = rid
        try:
            body = rep.call(call)
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

    # -- metrics -------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Per-replica counters: requests, failures, cached prompt tokens, health, ..."""
        out: dict = {"kind": self.adapter.kind, "moves": self.moves, "replicas": {}}
        for r in self.replicas:
            with r.lock:
                out["replicas"][r.url] = {**r.counters, "healthy": r.healthy,
                                          "slots": r.n_slots, "slot_sessions": len(r._slots)}
        return out

    def close(self) -> None:
        self._stop.set()
        if self._health is not None:
            self._health.join(timeout=5)
        for r in self.replicas:
            r.close()


# == building an Engine on it ==============================================================
def remote_engine(kind: str, urls: Sequence[str] | str, tokenizer_dir: str | Path,
                  config=None, max_context: int | None = None, **kwargs):
    """An `Engine` on a remote back end, with the chat template and tokenizer of a local
    model directory (the same model the engine serves; only its tokenizer files are read,
    plus `config.json` for the context length and `gate.json` for a calibrated gate)."""
    import json
    from dataclasses import replace

    from transformers import AutoTokenizer

    from prepos.config import EngineConfig, GateConfig
    from prepos.engine import Engine
    from prepos.entries import ChatFormat

    path = Path(tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() \
        else {}
    vocab = max(len(tok), int(cfg.get("vocab_size", 0)))
    ctx = max_context or int(cfg.get("max_position_embeddings", 2048))
    # several workers: their steps wait on the network, not on local cores; bigger chunks:
    # each chunk of a pre-position is one request
    config = config or EngineConfig(workers=4, idle_workers=2, chunk_tokens=64)
    if not config.gate.answers and (path / "gate.json").is_file():
        config = replace(config, gate=GateConfig.load(path / "gate.json"))
    backend = RemoteBackend.from_urls(kind, urls, vocab, ctx, **kwargs)
    return Engine(backend, ChatFormat(tok), config, model_name=path.name)
