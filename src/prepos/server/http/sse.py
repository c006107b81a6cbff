"""Server-sent events: formatting, and the hub that pushes session events to subscribers.

Standing queries: after every committed update the engine pre-positions each of a
streaming session's registered queries as an exact-match entry; when one is recorded (the
engine's "record" event, on the model worker) the hub answers it from that record on the
event loop, a fast-path answer that costs no model work, and pushes it to the session's
subscribers before anyone asks. An answer of more than one token (`push_max_tokens`) waits
for the engine's pre-decode of it ("predecoded"), decoded at idle priority, and is pushed
whole the moment that ends. Answers are computed only while someone is subscribed."""

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
from prepos.server.http.auth import public
from prepos.server.http.direct import Stages, direct_body
from prepos.server.http.errors import ApiError
from prepos.server.http.results import json_bytes

log = logging.getLogger("prepos.server.sse")

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE_S = 15.0


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


class Subscriber:
    def __init__(self, sid: str, owner: str | None = None, maxsize: int = 1024):
        self.sid, self.owner = sid, owner
        self.queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.closed = False

    def put(self, item: bytes | None) -> None:
        if self.closed:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:  # too slow a reader: end its stream rather than buffer
            self.closed = True
            self.queue = _closed_queue()
        if item is None:
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
            yield item


def _closed_queue() -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    q.put_nowait(None)
    return q


class Subscriptions:
    """The subscriptions: at most `max_subs` open at once, `per_key` of them a key's (None:
    no keys); a subscription past either is 429."""

    def __init__(self, metrics=None, max_subs: int = 1024, per_key: int | None = None):
        self.engine = None
        self.loop: asyncio.AbstractEventLoop | None = None
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
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_event, name, s, payload)

    # -- event loop side -----------------------------------------------------------------------
    def _on_event(self, name: str, s, payload) -> None:
        if name == "commit":
            self.publish(s.id, "commit", {"session_id": public(s.id), "version": payload.version,
                                          "tokens": len(payload.tokens),
                                          "messages": len(payload.messages)})
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
        elif name == "close":
            self.publish(s.id, "close", {"session_id": public(s.id)})
            for sub in self._subs.pop(s.id, set()):
                sub.put(None)
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

    def publish(self, sid: str, name: str, data: dict) -> None:
        subs = self._subs.get(sid)
        if subs:
            payload = event(data, name)
            for sub in list(subs):
                sub.put(payload)

    # -- subscriptions -------------------------------------------------------------------------
    def subscribe(self, s) -> Subscriber:
        """A new subscriber; it first gets the session's state and the current answers,
        computing any standing answer already recorded but not yet pushed. A 429 past the
        server's or the key's bound."""
        owner = s.spec.owner
        if self._count >= self.max_subs or (
                self.per_key is not None and self._by_key.get(owner, 0) >= self.per_key):
            mine = self._count < self.max_subs
            limit = self.per_key if mine else self.max_subs
            raise ApiError(429, "too_many_subscribers", f"{'this key' if mine else 'this server'}"
                           f" holds its {'share' if mine else 'limit'} of {limit} event "
                           "subscriptions; close one first", headers={"Retry-After": "10"})
        sub = Subscriber(s.id, owner)
        self._count += 1
        self._by_key[owner] = self._by_key.get(owner, 0) + 1
        self._subs.setdefault(s.id, set()).add(sub)
        if self.metrics is not None:
            self.metrics.subscribers.inc()
        snap, records = self.engine.ready_now(s.id)
        sub.put(event({"session_id": public(s.id), "version": snap.version,
                       "tokens": len(snap.tokens), "standing_queries": list(s.spec.standing)},
                      "hello"))
        latest = self._latest.get(s.id, {})
        for q in s.spec.standing:
            ev = latest.get(q)
            if ev is not None and ev["version"] == snap.version:
                sub.put(event(ev, "answer"))
            elif ("query", q) in records and not self._awaits_predecode(s, ("query", q)):
                self._answer(s, ("query", q), records[("query", q)])
        return sub

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
        for subs in self._subs.values():
            for sub in subs:
                sub.put(None)
