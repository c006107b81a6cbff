"""A request's output as it is produced: tokens pushed by the model worker, read by the
caller as an iterator, an async iterator, or all at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prepos.core import Result


@dataclass(slots=True)  # not frozen: a frozen dataclass's init sets each field the slow way
class TokenEvent:
    token: int
    text: str  # the text this token adds (may be empty while a character is incomplete)
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # the most likely tokens, when asked for
    at: float = field(default_factory=time.perf_counter)  # when it was produced


_DONE = object()
_MAKING = threading.Lock()  # makes a stream's delivered event once
_ENDING = threading.Lock()  # runs a stream's end callbacks once
log = logging.getLogger("prepos.stream")


class Stream:
    def __init__(self) -> None:
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        # an async reader waiting on the event loop for the next event (`aiter`): the
        # producer wakes it there, with no thread in between
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._on_end: list[Callable[[], None]] | None = []  # None once it ends
        self.cancelled = False
        # the reader takes the tokens one by one as they come (iteration, `aiter`), not the
        # whole answer at once: its producer runs one token a step (no drafts), so the tokens
        # come at the engine's pace, without the stall of a refused draft's wider forward
        self.paced = False
        # whether the reader came back after the first event (it has been delivered: written
        # to the client, printed), or wants the whole result at once; the event to wait on
        # it is made only for a producer that waits (the fast path's never does)
        self._delivered = False
        self._delivered_event: threading.Event | None = None
        # a raw completion's prompt logprobs (`Result.prompt_logprobs`), set before the first
        # event when asked for
        self.prompt_logprobs: list | None = None
        # the prompt's tokens and those of them found in the KV cache, set before the first
        # event once the prompt is placed (`Result.prompt_tokens`, `.cached_prompt_tokens`)
        self.placed: tuple[int, int] | None = None
        # a reader that takes the events on the producer's thread (`hand_to`), and the lock
        # that hands the queued ones over in order
        self._sink: Callable[[TokenEvent | None], None] | None = None
        self._handing = threading.Lock()

    # -- producer side (worker or fast path) ---------------------------------------------
    def push(self, event: TokenEvent) -> None:
        self._put(event)

    def _put(self, item) -> None:
        if self._sink is None:
            with self._handing:
                if self._sink is None:
                    self._events.put(item)
                    self._wake()
                    return
        self._sink(None if item is _DONE else item)

    def finish(self, result: Result) -> None:
        self._result = result
        self._end_now()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._end_now()

    def _end_now(self) -> None:
        """Finished: the end callbacks run first, so a reader that sees the end sees what
        they did (a kept conversation released for its next turn)."""
        with _ENDING:
            then, self._on_end = self._on_end, None
        for fn in then or ():
            try:
                fn()
            except Exception:  # the answer stands; what ran after it is logged
                log.exception("a stream's end callback failed")
        self._finished = True
        self._put(_DONE)

    def on_end(self, fn: Callable[[], None]) -> None:
        """`fn()` once the stream has finished or failed (a cancelled one finishes too), on
        the producer's thread before its reader sees the end; at once if it has."""
        with _ENDING:
            if self._on_end is not None:
                self._on_end.append(fn)
                return
        fn()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, fut)

    def wait_delivered(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until the first event was delivered."""
        if self._delivered:
            return True
        with _MAKING:
            if self._delivered_event is None:
                self._delivered_event = threading.Event()
        # delivered before the event existed: the reader saw no event to set
        return self._delivered or self._delivered_event.wait(timeout)

    # -- consumer side -------------------------------------------------------------------
    def hand_to(self, sink: Callable[[TokenEvent | None], None]) -> None:
        """From now on every event is handed to `sink` on the producer's thread as it is
        produced, then None at the end (`result()` then returns or raises); the events
        queued before are handed over first, here, in order. The one reader then: no
        iteration, no thread wakes for it."""
        self.paced = True
        with self._handing:
            while not self._events.empty():
                item = self._events.get_nowait()
                sink(None if item is _DONE else item)
            self._sink = sink

    def delivered(self) -> None:
        """The first event has been delivered (or the reader wants no more events)."""
        self._delivered = True
        event = self._delivered_event
        if event is not None:
            event.set()

    def cancel(self) -> None:
        """The reader has gone: the producer stops before its next forward and finishes with
        reason "cancelled". A stream already finished is unaffected."""
        self.cancelled = True
        self.delivered()

    @property
    def done(self) -> bool:
        return self._finished

    def _end(self, item) -> bool:
        """True at the end of the events (raising the stream's error if it failed)."""
        if item is not _DONE:
            return False
        self._events.put(_DONE)  # later readers see the end too
        if self._error is not None:
            raise self._error
        return True

    def __iter__(self):
        self.paced = True
        try:
            while not self._end(item := self._events.get()):
                yield item
                self.delivered()  # the reader is back: the event was delivered
        finally:
            self.delivered()

    def result(self, timeout: float | None = None) -> Result:
        self.delivered()
        if not self._finished:
            item = self._events.get(timeout=timeout)
            while item is not _DONE:
                item = self._events.get(timeout=timeout)
            self._events.put(_DONE)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    async def aiter(self):
        """Async iteration on the event loop: with no event queued it waits on a future the
        producer resolves from its thread (`_wake`), so no thread waits on its behalf."""
        loop = asyncio.get_running_loop()
        self.paced = True
        try:
            while True:
                item = await self._next(loop)
                if self._end(item):
                    return
                yield item
                self.delivered()
        finally:
            self.delivered()

    async def _next(self, loop: asyncio.AbstractEventLoop):
        while True:
            try:
                return self._events.get_nowait()
            except queue.Empty:
                pass
            fut = loop.create_future()
            self._waiter = (loop, fut)
            try:  # an event pushed before the waiter was seen: taken now, not waited for
                item = self._events.get_nowait()
            except queue.Empty:
                await fut
                continue
            self._waiter = None
            return item


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
