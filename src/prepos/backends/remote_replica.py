"""One replica of a serving engine (`Replica`: its connection pool, health, slots, facts
and counters, and its streamed requests) and a session's handle on the remote back end
(`RemoteKV`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import orjson

from prepos.backends.base import Preempted
from prepos.backends.http_transport import Urllib3Transport
from prepos.backends.remote_protocol import Adapter, HttpCall, RemoteError, ReplicaFailure, TopK

# where background streams do not share the engine's steps (`Replica.shares_steps`), one (a
# pre-decode) waits this long for the foreground requests in flight to end, then gives way
# (Preempted: retried later)
GIVE_WAY_S = 0.05
_END = object()  # a stream's `data: [DONE]`


class Replica:
    """One engine endpoint: its connection pool, health, slots, facts and counters."""

    def __init__(self, url: str, adapter: Adapter, timeout: float, background_cap: int,
                 transport: httpx.BaseTransport | None = None, give_way: bool = False):
        self.url = url.rstrip("/")
        self.adapter = adapter
        self.client = httpx.Client(base_url=self.url, timeout=timeout,
                                   transport=transport or Urllib3Transport(maxsize=32))
        self.healthy = True
        self.down_since: float | None = None
        self.n_slots: int | None = None
        self.max_context: int | None = None
        self.priority_refused = False  # the engine runs no priority scheduling
        # background streams give way to foreground requests even where the engine schedules
        # by priority (which batches them together: on a CPU a step costs its batch's width)
        self.give_way = give_way
        self._slots: OrderedDict[str, int] = OrderedDict()  # session key -> slot, LRU order
        self._bg = threading.BoundedSemaphore(background_cap)
        self.lock = threading.Lock()
        # foreground requests in flight, and the background streams they preempt where the
        # engine has no priority scheduling (it would share each of its steps between them)
        self.foreground = 0
        self._quiet = threading.Condition(self.lock)
        self._background: dict[str, RemoteKV] = {}  # request id -> its handle
        self.counters = {"requests": 0, "streams": 0, "streamed_tokens": 0, "failures": 0,
                         "interrupted": 0, "background": 0, "cached_tokens": 0,
                         "prompt_tokens": 0, "moved_in": 0, "rejoins": 0, "seconds": 0.0}

    @property
    def priority(self) -> bool:
        """Whether background work is sent here with the adapter's background priority."""
        return self.adapter.background_priority is not None and not self.priority_refused

    @property
    def shares_steps(self) -> bool:
        """Whether background streams run beside foreground requests here (the engine's
        priority scheduling orders them), rather than giving way to them."""
        return self.priority and not self.give_way

    def bump(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                self.counters[k] += v

    def _check(self, r: httpx.Response, c: HttpCall, text: str) -> None:
        if r.status_code >= 500 or r.status_code in (408, 429):
            raise ReplicaFailure(f"{self.url}{c.path}: HTTP {r.status_code} {text[:200]}")
        if r.status_code >= 400:
            raise RemoteError(f"{self.url}{c.path}: HTTP {r.status_code} {text[:500]}")

    def call(self, c: HttpCall) -> Any:
        try:
            try:
                r = self.client.request(c.method, c.path, json=c.json, headers=c.headers)
            except httpx.RemoteProtocolError:  # a pooled connection the server had closed
                r = self.client.request(c.method, c.path, json=c.json, headers=c.headers)
        except httpx.TransportError as exc:  # refused, reset, timed out
            raise ReplicaFailure(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        self._check(r, c, r.text)
        try:
            return r.json()
        except ValueError as exc:
            raise ReplicaFailure(f"{self.url}{c.path}: not JSON: {r.text[:200]}") from exc

    @contextlib.contextmanager
    def stream(self, c: HttpCall) -> Iterator[Iterator[Any]]:
        """A streamed request: yields an iterator of its server-sent events' JSON objects.
        Leaving the block closes the connection, which aborts the request at the engine
        (vLLM and llama.cpp abort a task whose client disconnected). Transport failures,
        while opening or while reading, raise ReplicaFailure."""
        try:
            with contextlib.ExitStack() as stack:
                try:
                    r = stack.enter_context(self.client.stream(c.method, c.path, json=c.json,
                                                               headers=c.headers))
                except httpx.RemoteProtocolError:
                    # a pooled keep-alive connection the server had closed (llama-server
                    # closes some after a streamed answer): once more, on a new connection
                    r = stack.enter_context(self.client.stream(c.method, c.path, json=c.json,
                                                               headers=c.headers))
                if r.status_code >= 400:
                    r.read()
                    self._check(r, c, r.text)
                yield self._events(r, c)
        except httpx.TransportError as exc:
            raise ReplicaFailure(f"{self.url}: {type(exc).__name__}: {exc}") from exc

    def _events(self, r: httpx.Response, c: HttpCall) -> Iterator[Any]:
        """The stream's events' JSON objects, its lines split here (an engine's events are
        UTF-8 JSON, read as bytes: no text decoding a chunk, nor content decoding where
        none was applied)."""
        rest = b""
        for data in r.iter_bytes() if "content-encoding" in r.headers else r.iter_raw():
            *lines, rest = (rest + data).split(b"\n")
            for line in lines:
                if not line or line == b"\r":  # the blank line that ends each event
                    continue
                event = self._event(line, c)
                if event is _END:
                    return
                if event is not None:
                    yield event
        if (event := self._event(rest, c)) is not None and event is not _END:
            yield event

    def _event(self, line: bytes, c: HttpCall) -> Any:
        """One line's event: its JSON object, None (no data), or _END (`[DONE]`)."""
        line = line.strip()
        if not line or line.startswith(b":"):
            return None
        if line.startswith(b"data:"):
            line = line[5:].strip()
        elif line.startswith(b"error:"):  # llama-server's error events
            raise RemoteError(f"{self.url}{c.path}: "
                              f"{line[6:].strip()[:500].decode(errors='replace')}")
        if line == b"[DONE]":
            return _END
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:  # NaN and Infinity, which Python's own parser reads
            try:
                return json.loads(line)
            except ValueError as exc:
                raise ReplicaFailure(f"{self.url}{c.path}: bad event {line[:200]!r}") from exc

    def send(self, make, background: bool, opener):
        """Make the request `make(priority)` builds with `opener`; where the engine refuses
        background priority (it runs no priority scheduling) it is resent without."""
        prio = background and self.priority
        try:
            return opener(make(prio))
        except RemoteError as exc:
            if not (prio and "priority" in str(exc).lower()):
                raise
            self.priority_refused = True
            return opener(make(False))

    def turn(self, background: bool, rid: str, kv: RemoteKV) -> contextlib.ExitStack:
        """A streamed request's turn beside the others here, closed when it ends: a
        foreground one preempts background streams, a background one raises Preempted where
        it must give way (`foreground_request`, `background_stream`)."""
        turn = contextlib.ExitStack()
        if not background:
            turn.enter_context(self.foreground_request())
        elif not turn.enter_context(self.background_stream(rid, kv, GIVE_WAY_S)):
            turn.close()
            raise Preempted(f"{self.url} is serving foreground requests")
        return turn

    @contextlib.contextmanager
    def foreground_request(self) -> Iterator[None]:
        """A foreground request in flight: where background streams do not share the engine's
        steps (no priority scheduling, or `give_way`), the background streams in flight are
        preempted (each ends at its next token, and is aborted at the engine where it has an
        abort API), and new ones wait until no foreground request is in flight
        (`background_stream`)."""
        with self.lock:
            self.foreground += 1
            preempted = [] if self.shares_steps else list(self._background.items())
        for rid, kv in preempted:
            kv.preempted_rid = rid
            c = self.adapter.abort(rid)
            if c is not None:
                with contextlib.suppress(ReplicaFailure, RemoteError):
                    self.call(c)
        try:
            yield
        finally:
            with self.lock:
                self.foreground -= 1
                self._quiet.notify_all()

    @contextlib.contextmanager
    def background_stream(self, rid: str, kv: RemoteKV, wait: float) -> Iterator[bool]:
        """A background stream's turn: yields False where it does not share the engine's steps
        (`shares_steps`) and a foreground request stayed in flight for `wait` seconds (the caller
        gives way), else True, the stream preemptible by a foreground request meanwhile."""
        with self.lock:
            ok = self.shares_steps or self._quiet.wait_for(lambda: self.foreground == 0, wait)
            if ok:
                self._background[rid] = kv
        if not ok:
            yield False
            return
        try:
            yield True
        finally:
            with self.lock:
                self._background.pop(rid, None)

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
        """Read the engine's facts (context length, slots) once per (re)start."""
        c = self.adapter.info_call()
        if c is not None and (self.max_context is None
                              or self.adapter.uses_slots and self.n_slots is None):
            info = self.adapter.parse_info(self.call(c))
            self.max_context = info.max_context or self.max_context
            if self.adapter.uses_slots:
                self.n_slots = info.n_slots or 1

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
    last: TopK | None = None  # what the last request reported (cached tokens included)
    rid: str | None = None  # the idle-work request in flight (`cancel`'s)
    cancelled_rid: str | None = None  # the in-flight request `cancel` abandoned
    preempted_rid: str | None = None  # the background stream a foreground request preempted


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest(),
                          "big")
