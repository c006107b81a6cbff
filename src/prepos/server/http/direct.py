"""A streamed answer's body written by the thread that produces its tokens.

On the event loop, each token of a stream costs a thread wake, the loop's turn at the GIL
and the chunk's way down the response stack: about a quarter of a millisecond of CPU a
token here, taken from the model's own step on a machine whose cores the model uses. So
where the connection is plain TCP and its send buffer is empty, the response's headers go
out as usual and then the producer (the model worker, or the worker reading a remote
engine) writes each chunk itself as the token comes: the same chunk generator stepped on
its thread (`Stream.hand_to`), the chunk framed as HTTP/1.1 chunked data and written to a
duplicate of the connection's socket. The event loop is woken once, at the end, and ends
the body through the server (its last chunk and the connection's state). A write the
socket does not take whole (a slow reader) hands that chunk's rest, and every chunk after
it, to the event loop's transport, in order; a write that fails (the client left) cancels
the stream. Where any of this does not hold (TLS, no transport, another server) the body
is written on the event loop as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import types
from collections.abc import AsyncIterator, Callable

from prepos.decode.stream import Stream, TokenEvent

Stages = dict[str, Callable[[float], None]]  # a token stage's name -> its observation


class StageClock:
    """A stream's token stages (`metrics.TOKEN_STAGES`) observed around each event's chunks,
    on whichever path writes them (`streaming.timed` on the event loop, `DirectBody` on the
    producer's thread): engine (since the previous event was produced), handoff (produced to
    taken), respond (its chunks made and written)."""

    __slots__ = ("engine", "handoff", "respond", "last_at")

    def __init__(self, stages: Stages):
        self.engine, self.handoff, self.respond = (stages["engine"], stages["handoff"],
                                                   stages["respond"])
        self.last_at: float | None = None  # the previous event's production time

    def taken(self, event: TokenEvent) -> float:
        """The event is taken now: its engine and handoff stages; returns now."""
        now = time.perf_counter()
        if self.last_at is not None:
            self.engine(event.at - self.last_at)
        self.last_at = event.at
        self.handoff(now - event.at)
        return now

    def answered(self, since: float) -> None:
        """Its chunks are made and written (`since`: when it was taken)."""
        self.respond(time.perf_counter() - since)

log = logging.getLogger("prepos.server.direct")

TRANSPORT = "prepos.transport"  # the scope key the HTTP protocol puts a plain TCP transport at
_EMPTY = object()  # no event handed in yet
_END = object()


def direct_body(scope, stream: Stream, make: Callable[[AsyncIterator], AsyncIterator[bytes]],
                stages: Stages | None) -> DirectBody | None:
    """The body written by `stream`'s producer, where the connection allows it: plain TCP,
    its send buffer empty (the headers gone out whole), its socket still open."""
    transport = scope.get(TRANSPORT)
    if transport is None or transport.is_closing() or transport.get_write_buffer_size():
        return None
    try:
        return DirectBody(stream, make, transport, stages)
    except OSError:  # the connection closed meanwhile: the loop's path ends the body
        return None


class _Feed:
    """The chunk generator's source: the one event handed in, or a suspension that returns
    control to the thread stepping it (`DirectBody.take`)."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.item = _EMPTY

    def __aiter__(self):
        return self

    @types.coroutine
    def __anext__(self):
        while self.item is _EMPTY:
            yield _EMPTY  # nothing to read yet: `take` returns until the next event
        item, self.item = self.item, _EMPTY
        if item is _END:
            self.stream.result()  # raises the stream's error, where it failed
            raise StopAsyncIteration
        return item


class DirectBody:
    """The chunks of `make(source)` written as `stream`'s producer hands in its events."""

    def __init__(self, stream: Stream, make: Callable[[AsyncIterator], AsyncIterator[bytes]],
                 transport: asyncio.Transport, stages: Stages | None):
        self.stream = stream
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.fd = os.dup(transport.get_extra_info("socket").fileno())
        self.feed = _Feed(stream)
        self.chunks = make(self.feed)
        self.step = None  # the chunk generator's step under way
        # each token's stages, and each chunk's write to the socket
        self.clock = StageClock(stages) if stages is not None else None
        self.on_write = stages["write"] if stages is not None else None
        self.via_loop = False  # the socket took a chunk in part: the rest go by the loop
        self.broken = False  # a write failed: the client has gone
        self.ended = False  # the last chunk is written: nothing more is taken
        self.done = self.loop.create_future()

    async def run(self) -> None:
        """Until the last chunk is written (or handed to the loop's transport)."""
        self.stream.hand_to(self.take)
        await self.done

    def take(self, event: TokenEvent | None) -> None:
        """One event (None: the end), on the producer's thread: the chunks it makes, written."""
        if self.ended:
            return
        clock = self.clock if event is not None else None
        since = clock.taken(event) if clock is not None else 0.0
        self.feed.item = _END if event is None else event
        self._chunks()
        if clock is not None:
            clock.answered(since)

    def _chunks(self) -> None:
        try:
            while True:
                if self.step is None:
                    self.step = self.chunks.__anext__()
                try:
                    waits = self.step.send(None)
                except StopIteration as chunk:
                    self.step = None
                    self._write(chunk.value)
                    continue
                if waits is not _EMPTY:  # only its events may be awaited here
                    raise RuntimeError(f"a directly written stream's chunks awaited {waits!r}")
                return  # it waits for the next event
        except StopAsyncIteration:
            self._end(None)
        except BaseException as exc:  # a failed stream ends in the generator's own event
            log.exception("a directly written stream failed")
            self.stream.cancel()
            self._end(exc)

    def _write(self, chunk: bytes) -> None:
        if self.broken:
            return
        data = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        if self.via_loop:
            self.loop.call_soon_threadsafe(self._loop_write, data)
            return
        t0 = time.perf_counter()
        try:
            n = os.write(self.fd, data)
        except BlockingIOError:
            n = 0
        except OSError:  # the connection is gone: the producer stops at its next step
            self.broken = True
            self.stream.cancel()
            return
        if self.on_write is not None:
            self.on_write(time.perf_counter() - t0)
        self.stream.delivered()
        if n < len(data):  # a slow reader: the loop's transport buffers the rest, in order
            self.via_loop = True
            self.loop.call_soon_threadsafe(self._loop_write, data[n:])

    def _loop_write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def _end(self, exc: BaseException | None) -> None:
        self.ended = True
        os.close(self.fd)
        self.loop.call_soon_threadsafe(_settle, self.done, exc)


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
