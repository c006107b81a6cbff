"""Server-sent events: formatting, and the hub that pushes session events to subscribers.

Standing queries: after every committed update the engine pre-positions each of a
streaming session's registered queries as an exact-match entry; when one is recorded (the
engine's "record" event, on the model worker) the hub answers it from that record on the
event loop, a fast-path answer that costs no model work, and pushes it to the session's
subscribers before anyone asks. An answer of more than one token (`push_max_tokens`) waits
for the engine's pre-decode of it ("predecoded"), decoded at idle priority, and is pushed
whole the moment that ends. Answers are computed only while someone is subscribed.

Resuming: every event carries `id:`, the version of the last commit its stream has sent
(`hello`'s: the version it starts from). A subscription with `Last-Event-ID: N` is sent every
commit after N, once: those the session still keeps (the versions kept for rollback, loaded
from the store after a restart or a takeover) replayed after `hello`, then the live ones; a
commit at or before what the stream sent is never sent again. A stream that ends while its
session lives on ends with an `end` event naming why (`ENDS`): subscribe again, with the last id."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response

from prepos.core import Request as EngineRequest
from prepos.core import SamplingParams
from prepos.decode.stream import Stream
from prepos.engine import is_ephemeral
from prepos.errors import SessionNotFound
from prepos.server.http.direct import Stages, direct_body
from prepos.server.http.errors import ApiError
from prepos.server.http.results import json_bytes
from prepos.server.names import public

log = logging.getLogger("prepos.server.sse")

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE_S = 15.0
# why a stream ends while its session lives on (the `end` event's reason)
ENDS = {"shutdown": "this node is stopping",
        "lease_lost": "this node no longer owns the session (its lease lapsed)",
        "moved": "the session moved: this node's copy of it was replaced",
        "too_slow": "the subscriber fell too far behind"}


async def disconnected(receive) -> None:
    """Returns when the client has gone (call it once the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """A finite SSE response written as its generator yields. Lighter than Starlette's
    StreamingResponse: one watcher task, and a client that leaves calls `on_disconnect`
    (cancelling its generation); the writes after that are no-ops. Where `direct` is given
    and the connection allows it, the stream's producer writes the body (`direct.py`).
    Infinite streams (session events) keep StreamingResponse."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_disconnect: Callable[[], None] | None = None,
                 on_write: Callable[[float], None] | None = None,
                 direct: tuple[Stream, Callable[[AsyncIterator], AsyncIterator[bytes]], Stages]
                 | None = None):
        self.status_code = 200
        self.background = None
        self.chunks = chunks
        # (the stream, its chunks over any event source, each token's stage observations):
        # the body may be written by the stream's producer (`direct.py`); `chunks` is then
        # never started
        self.direct = direct
        self.on_disconnect = on_disconnect
        self.on_write = on_write  # each chunk's write time, in seconds
        self.init_headers(headers)  # no body attribute: chunked, no Content-Length

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        gone = None
        if self.on_disconnect is not None:
            gone = asyncio.ensure_future(disconnected(receive))
            gone.add_done_callback(self._gone)
        body = direct_body(scope, *self.direct) if self.direct else None
        try:
            if body is not None:
                await self._by_producer(body)
            else:
                await self._on_loop(send)
        finally:
            if gone is not None:
                gone.remove_done_callback(self._gone)
                gone.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _by_producer(body) -> None:
        try:
            await body.run()
        except asyncio.CancelledError:  # the server stops: so does the writing
            body.stream.cancel()
            raise

    async def _on_loop(self, send) -> None:
        try:
            async for chunk in self.chunks:
                t0 = time.perf_counter()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if self.on_write is not None:
                    self.on_write(time.perf_counter() - t0)
        finally:
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _gone(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.on_disconnect()


def event(data: Any, name: str | None = None) -> bytes:
    """One SSE event; its data as JSON bodies are encoded, unless it is text already."""
    body = data.encode() if isinstance(data, str) else json_bytes(data)
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + body + b"\n\n"


def commit_event(sid: str, snap) -> dict:
    """A `commit` event's data, of version `snap`."""
    return {"session_id": public(sid), "version": snap.version, "tokens": len(snap.tokens),
            "messages": len(snap.messages)}


def end_event(sid: str, reason: str) -> bytes:
    """The `end` event of a stream whose session lives on: why (`ENDS`)."""
    return event({"session_id": public(sid), "reason": reason, "detail": ENDS[reason]}, "end")


class Subscriber:
    """One subscription's events, in order. `last`: the version of the last commit its stream
    sent (each event's `id:`). Queued items: `(version, payload)`, `version` a commit's (None
    for other events); `(version, CATCH_UP)`: every commit up to `version` not sent yet; None:
    the end. `replay(sid, first, last)` gives the commits `first..last` as events (off the
    event loop; `VersionsGone` where the session no longer keeps one)."""

    def __init__(self, sid: str, owner: str | None = None, maxsize: int = 1024,
                 after: int = 0,
                 replay: Callable[[str, int, int], list[tuple[int, bytes]]] | None = None):
        self.sid, self.owner = sid, owner
        self.last = after
        self.replay = replay
        self.queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.closed = False

    def put(self, item: tuple | None) -> None:
        if self.closed:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:  # too slow a reader: end its stream rather than buffer
            self.end("too_slow")
            return
        if item is None:
            self.closed = True

    def end(self, reason: str) -> None:
        """End the stream with an `end` event naming `reason` (of `ENDS`), after the events
        queued before it where there is room (else those are dropped: the client resumes
        from the last id it got)."""
        if self.closed:
            return
        ev = (None, end_event(self.sid, reason))
        if reason == "too_slow" or self.queue.maxsize - self.queue.qsize() < 2:
            self.queue = _closed_queue(ev)
        else:
            self.queue.put_nowait(ev)
            self.queue.put_nowait(None)
        self.closed = True

    async def items(self):
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if item is None:
                return
            version, payload = item
            if version is not None:  # a commit, or a catch-up
                upto = version if payload is CATCH_UP else version - 1
                if self.last < upto:  # commits not sent yet: replayed first
                    try:
                        replayed = await asyncio.get_running_loop().run_in_executor(
                            None, self.replay, self.sid, self.last + 1, upto)
                    except SessionNotFound:  # closed meanwhile: its `close` follows
                        replayed = []
                    except VersionsGone:
                        yield self._with_id(end_event(self.sid, "too_slow"))
                        return
                    for v, ev in replayed:
                        self.last = v
                        yield self._with_id(ev)
                if payload is CATCH_UP or version <= self.last:
                    continue  # sent already
                self.last = version
            yield self._with_id(payload)

    def _with_id(self, payload: bytes) -> bytes:
        """The event with its `id:` (its last field: a reader that takes `event:` first
        finds it first)."""
        return payload[:-1] + b"id: %d\n\n" % self.last


class VersionsGone(LookupError):
    """A commit to replay that the session no longer keeps."""


CATCH_UP = object()  # a queued item's payload: the commits up to its version, replayed


def _closed_queue(*items) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    q.put_nowait(None)
    return q


class Subscriptions:
    """The subscriptions: at most `max_subs` open at once, `per_key` of them a key's (None:
    no keys); a subscription past either is 429."""

    def __init__(self, metrics=None, max_subs: int = 1024, per_key: int | None = None):
        self.engine = None
        # why a session closing now ends its streams (a reason of `ENDS`), None where it was
        # closed for good; asked on the thread that closes it (the cluster's: it moved)
        self.closing_reason: Callable[[str], str | None] = lambda sid: None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False  # `shutdown` ran: no new subscription (503)
        self.metrics = metrics
        self.max_subs, self.per_key = max_subs, per_key
        self._count = 0
        self._by_key: dict[str | None, int] = {}  # open subscriptions by their key's owner id
        self._subs: dict[str, set[Subscriber]] = {}
        self._latest: dict[str, dict[str, dict]] = {}  # sid -> query -> last answer event

    def attach(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        engine.subscribe(self._listener)

    # -- engine side (model worker or request threads): hand off, nothing more ---------------
    def _listener(self, name: str, s, payload) -> None:
        if is_ephemeral(s.id) or (name != "close" and not self._subs.get(s.id)):
            return
        loop = self.loop
        if name == "close":
            payload = self.closing_reason(s.id)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_event, name, s, payload)

    # -- event loop side -----------------------------------------------------------------------
    def _on_event(self, name: str, s, payload) -> None:
        if name == "commit":
            self.publish(s.id, "commit", commit_event(s.id, payload), payload.version)
        elif name == "record":
            key, rec = payload
            self.publish(s.id, "ready", {"session_id": public(s.id), "key": ":".join(map(str, key)),
                                         "version": rec.version, "p": rec.p, "gap": rec.gap})
            if key[0] == "query" and not self._awaits_predecode(s, key):
                self._answer(s, key, rec)
        elif name == "predecoded":  # the whole answer is there: push it
            key, _ = payload
            if key[0] == "query":
                self._answer(s, key)
        elif name == "correction":  # a relaxed answer its verification disagreed with
            self.publish(s.id, "correction", payload)
        elif name == "close":  # payload: why its streams end where it lives on elsewhere
            if payload is None:
                self.publish(s.id, "close", {"session_id": public(s.id)})
            for sub in self._subs.pop(s.id, set()):
                if payload is None:
                    sub.put(None)
                else:
                    sub.end(payload)
            self._latest.pop(s.id, None)

    def _awaits_predecode(self, s, key: tuple) -> bool:
        """Whether the pushed answer at `key` waits for its pre-decode to end."""
        if s.spec.push_tokens <= 1:
            return False
        try:
            budget, answer = self.engine.predecoding(s.id, key)
        except SessionNotFound:
            return False
        return budget is not None and (answer is None or not answer.done)

    def _answer(self, s, key: tuple, rec=None) -> None:
        """Answer a standing query from its exact-match record (`rec`, else the current
        one), if it is still current and its answer at that version was not pushed yet."""
        try:
            records = self.engine.ready_now(s.id)[1]
        except SessionNotFound:  # closed meanwhile
            return
        current = records.get(key)
        question = key[1]
        pushed = self._latest.get(s.id, {}).get(question, {}).get("version")
        if (current is None or rec is not None and current is not rec
                or pushed == current.version or not self._subs.get(s.id)):
            return
        try:
            stream = self.engine.query(s.id, question, EngineRequest(
                SamplingParams(max_tokens=s.spec.push_tokens), fast_path="exact"))
        except Exception as exc:  # closed meanwhile, or over budget: nothing to push
            log.debug("standing query of %s not answered: %s", s.id, exc)
            return
        if stream.done:
            self._push_answer(s.id, question, stream)
        else:
            asyncio.ensure_future(self._finish_answer(s.id, question, stream))

    async def _finish_answer(self, sid: str, question: str, stream) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, stream.result)
        except Exception as exc:
            log.debug("standing query of %s failed: %s", sid, exc)
            return
        self._push_answer(sid, question, stream)

    def _push_answer(self, sid: str, question: str, stream) -> None:
        try:
            res = stream.result()
        except Exception as exc:
            log.debug("standing query of %s failed: %s", sid, exc)
            return
        ev = {"session_id": public(sid), "query": question, "version": res.version,
              "text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason,
              "path": res.path.value, "match": res.match.value, "gap": res.gap,
              "ttft_ms": res.timing.ttft * 1e3, "predecoded": res.predecoded}
        self._latest.setdefault(sid, {})[question] = ev
        if self.metrics is not None:
            self.metrics.pushes.inc()
        self.publish(sid, "answer", ev)

    def publish(self, sid: str, name: str, data: dict, version: int | None = None) -> None:
        """An event to `sid`'s subscribers; `version`: a commit's."""
        subs = self._subs.get(sid)
        if subs:
            payload = event(data, name)
            for sub in list(subs):
                sub.put((version, payload))

    # -- subscriptions -------------------------------------------------------------------------
    def subscribe(self, s, after: int | None = None) -> Subscriber:
        """A new subscriber; it first gets the session's state and the current answers,
        computing any standing answer already recorded but not yet pushed. With `after` (a
        `Last-Event-ID`, `check_resume`d), every commit since that version comes first,
        replayed. A 429 past the server's or the key's bound, a 503 once it stops."""
        owner = s.spec.owner
        if self.stopping:
            raise ApiError(503, "stopping", "this node is stopping; subscribe again (through "
                           "a front door: another node)", headers={"Retry-After": "1"})
        if self._count >= self.max_subs or (
                self.per_key is not None and self._by_key.get(owner, 0) >= self.per_key):
            mine = self._count < self.max_subs
            limit = self.per_key if mine else self.max_subs
            raise ApiError(429, "too_many_subscribers", f"{'this key' if mine else 'this server'}"
                           f" holds its {'share' if mine else 'limit'} of {limit} event "
                           "subscriptions; close one first", headers={"Retry-After": "10"})
        sub = Subscriber(s.id, owner, after=after or 0, replay=self._replay)
        self._count += 1
        self._by_key[owner] = self._by_key.get(owner, 0) + 1
        self._subs.setdefault(s.id, set()).add(sub)
        if self.metrics is not None:
            self.metrics.subscribers.inc()
        # read once subscribed: a later commit is handed to it
        snap, records = self.engine.ready_now(s.id)
        if after is None:
            sub.last = snap.version
        sub.put((None, event({"session_id": public(s.id), "version": snap.version,
                              "tokens": len(snap.tokens), "standing_queries": list(s.spec.standing),
                              "after": after}, "hello")))
        sub.put((snap.version, CATCH_UP))  # the commits since `after` (and any since `snap`)
        latest = self._latest.get(s.id, {})
        for q in s.spec.standing:
            ev = latest.get(q)
            if ev is not None and ev["version"] == snap.version:
                sub.put((None, event(ev, "answer")))
            elif ("query", q) in records and not self._awaits_predecode(s, ("query", q)):
                self._answer(s, ("query", q), records[("query", q)])
        return sub

    def check_resume(self, sid: str, after: int) -> None:
        """409 `cannot_resume` unless every commit of `sid` after version `after` can be sent:
        the session has that version, and keeps the one after it (blocking: that version is
        rendered)."""
        version = self.engine.snapshot(sid).version
        if after > version:
            raise ApiError(409, "cannot_resume", f"Last-Event-ID {after} is ahead of session "
                           f"{public(sid)}'s version {version}: it is not the session those "
                           "events came from; subscribe without it")
        if after < version and self.engine.snapshot(sid, after + 1).version != after + 1:
            raise ApiError(409, "cannot_resume", f"session {public(sid)} no longer keeps "
                           f"version {after + 1}, the commit after Last-Event-ID {after}: "
                           "subscribe without it (its state is in `hello`)")

    def _replay(self, sid: str, first: int, last: int) -> list[tuple[int, bytes]]:
        """The commits `first..last` of `sid` as events (blocking: each version rendered)."""
        out = []
        for v in range(first, last + 1):
            snap = self.engine.snapshot(sid, v)
            if snap.version != v:
                raise VersionsGone(f"session {sid} no longer keeps version {v}")
            out.append((v, event(commit_event(sid, snap), "commit")))
        return out

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self._subs.get(sub.sid)
        if subs is not None and sub in subs:
            subs.discard(sub)
            self._count -= 1
            left = self._by_key[sub.owner] - 1
            if left:
                self._by_key[sub.owner] = left
            else:
                del self._by_key[sub.owner]
            if self.metrics is not None:
                self.metrics.subscribers.dec()
            if not subs:
                self._subs.pop(sub.sid, None)

    def shutdown(self) -> None:
        """This node stops: every stream ends (`end`, "shutdown"), and none is begun."""
        self.stopping = True
        for subs in self._subs.values():
            for sub in subs:
                sub.end("shutdown")
