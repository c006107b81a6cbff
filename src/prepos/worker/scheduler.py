"""The model worker. Each task is a generator that yields a `Forward` (the one forward it
needs next: a request's prefill, a decode step, a chunk of a pre-position) or a bare `yield`
(a quantum boundary with nothing to run), and is sent the forward's `Advance`.

One quantum of a worker is one *batched step*: the next forward of every runnable foreground
task (up to the back end's `max_batch` tasks and `max_batch_tokens` tokens), run as one
back-end call; idle work runs only when no request waits, one chunk per quantum, and an idle
chunk gives way between layers when a request arrives (`Forward.preemptible`). So a request
waits behind at most one chunk of idle work, foreground tasks interleave round-robin, and a
session's tasks never run at the same time (tasks with the same key are never in one batch
or on two workers at once).

Chunked prefill (one worker: the in-process model): a step first takes every forward that
fits the token cap whole, in queue order (decode steps: one token each), then gives the
cap's remaining tokens to the forwards too long for it, oldest request first, each cut to
what is left (`Forward.max_tokens`); the task is sent one Advance when its whole forward
has run, and goes to the back of the queue between its chunks. So a long prefill shares
every step with the streams decoding beside it: a decoding stream waits behind at most one
step of `max_batch_tokens` tokens, and, with `max_batch` or fewer streams, advances every
step (more streams take their turns: each waits at most ceil(streams / max_batch) - 1
steps). With several workers (remote engines, whose steps run side by side) forwards run
whole. Idle tasks run by `priority`, highest first (what the work is
worth: the engine gives a pre-position its session's chance of being asked before its next
update), in turn among equals. The workers own the KV caches: only tasks touch them.

Requests sent together start together (`batch_wait`): a foreground step that would start
from idle (no foreground task in flight, every one it takes new) waits while other requests
are still on their way into the engine (`arrival`: between an engine entry and its task's
submission, rendering, tokenizing, committing), until none is or `batch_wait` has passed
since the oldest was submitted. Without it, a burst of requests reaches the worker over
several milliseconds, the first few start decoding alone, and the next step's prompts
stall them (a mixed step of every other prompt). Nothing else waits: a single request
finds nothing arriving, and a step with work in flight never waits.

A bare `yield` ends the quantum only where another task is queued that the worker would run
instead: a task alone goes on (a relayed stream reads its next token, housekeeping its next
unit, without a pass through the queues).

Below every idle task, `housekeeping` (the KV pool's: copies of idle KVs saved into the
tiers ahead of need) is queued once the queues run empty after other work, so it runs in
idle time, one preemptible unit at a time, and `wait_idle` waits for it too.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable, Generator

from prepos.backends.base import idle_work
from prepos.errors import EngineClosed
from prepos.worker.sequence import Advance, Forward, run_forwards
from prepos.worker.steps import Steps

log = logging.getLogger("prepos.scheduler")


def _tidy_failed(exc: BaseException) -> None:
    if not isinstance(exc, EngineClosed):
        log.warning("idle housekeeping failed: %r", exc)


class Task:
    __slots__ = ("gen", "idle", "key", "on_error", "submitted", "started", "done", "idle_mark",
                 "want", "reply", "priority", "partial")

    def __init__(self, gen: Generator, idle: bool, key: str | None,
                 on_error: Callable[[BaseException], None], priority: float = 0.0):
        self.gen = gen
        self.idle = idle
        self.priority = priority  # idle tasks: the highest runs first
        self.key = key  # tasks with the same key (a session) never run at the same time
        self.on_error = on_error
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.done = threading.Event()
        self.idle_mark = 0  # the workers' idle-step count when this task was submitted
        self.want: Forward | None = None  # the forward it yielded, not yet run
        self.reply: Advance | BaseException | None = None  # what to send it next
        self.partial: Advance | None = None  # what the chunks of `want` run so far did


def _joined(first: Advance | None, then: Advance) -> Advance:
    """One Advance for a forward run in chunks: the resident prefix found at its start and
    the sums of what each chunk paid."""
    if first is None:
        return then
    return Advance(then.logits, first.kept, first.prefilled + then.prefilled,
                   first.restore_s + then.restore_s, first.forward_s + then.forward_s,
                   then.choice)


def _chunkable(f: Forward) -> bool:
    """A forward the scheduler may cut: one the task wants whole, not every position's
    logits of."""
    return f.max_tokens is None and f.logits_from is None


class Scheduler:
    """`workers` threads run quanta; one (the default) suits an in-process model, whose
    forwards use every core and batch across sessions; more suit remote back ends, whose
    steps wait on the network (`max_batch` 1). At most `idle_workers` idle chunks run at
    once."""

    def __init__(self, workers: int = 1, idle_workers: int | None = None, max_batch: int = 1,
                 max_batch_tokens: int = 512, batch_wait: float = 0.0) -> None:
        if workers < 1 or max_batch < 1 or max_batch_tokens < 1:
            raise ValueError("workers, max_batch and max_batch_tokens must be >= 1")
        self._fg: deque[Task] = deque()
        self._idle: list[tuple[float, int, Task]] = []  # a heap: (-priority, turn, task)
        self._turns = itertools.count()  # equal priorities run in turn
        # the workers wait on `_cv` for work, `wait_idle` on `_drained` for none pending:
        # one lock, so a worker that queues work wakes only the workers it needs
        lock = threading.RLock()
        self._cv = threading.Condition(lock)
        self._drained = threading.Condition(lock)
        self._pending = 0  # submitted and not finished
        self._fg_pending = 0  # of those, foreground tasks
        self._busy: set[str] = set()  # keys of running tasks
        self._idle_running = 0
        self._idle_cap = idle_workers or workers
        self._max_batch = max_batch
        self._max_batch_tokens = max_batch_tokens
        self._batch_wait = batch_wait  # seconds a step from idle waits for arrivals, at most
        self._arriving = 0  # requests between an engine entry and their task's submission
        self._chunks = workers == 1  # a long forward shares steps (see the module's doc)
        self._stopped = False
        # idle work queued when the queues run empty after other work (None: none)
        self.housekeeping: Callable[[], Generator] | None = None
        self._tidy: Task | None = None  # its task, while queued or running
        self.idle_steps = 0
        self.steps = Steps()
        # (seconds, idle chunks run meanwhile) each foreground task waited before it started
        self.fg_waits: deque[tuple[float, int]] = deque(maxlen=4096)
        self._threads = [threading.Thread(target=self._loop, name=f"prepos-worker-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, gen: Generator, idle: bool = False, key: str | None = None,
               on_error: Callable[[BaseException], None] | None = None,
               priority: float = 0.0) -> Task:
        task = Task(gen, idle, key, on_error or (lambda exc: None), priority)
        with self._cv:
            if self._stopped:
                gen.close()
                raise EngineClosed("the engine is closed")
            task.idle_mark = self.idle_steps
            self._queue(task)
            self._pending += 1
            self._fg_pending += not idle
            self._cv.notify()
        return task

    def _queue(self, task: Task) -> None:
        """Queue a task at the back of its kind (among its equals, for idle tasks)."""
        if task.idle:
            heapq.heappush(self._idle, (-task.priority, next(self._turns), task))
        else:
            self._fg.append(task)

    def arrival(self) -> Callable[[], None]:
        """A request on its way to a task (in an engine entry, or a server's until its entry
        returns): a step from idle waits for it (see the module's doc). Returns what says it
        has arrived (or failed), idempotent."""
        with self._cv:
            self._arriving += 1
        done = False

        def arrived() -> None:
            nonlocal done
            with self._cv:
                if done:
                    return
                done = True
                self._arriving -= 1
                if not self._arriving:
                    self._cv.notify_all()
        return arrived

    def _gather(self, batch: list[Task]) -> float:
        """Seconds this foreground step waits for requests still arriving (under the lock):
        0 unless it starts from idle and some are (see the module's doc)."""
        if (not self._arriving or batch[0].idle or self._batch_wait <= 0
                or self._fg_pending != len(batch) + len(self._fg)
                or any(t.started is not None for t in itertools.chain(batch, self._fg))):
            return 0.0
        return min(t.submitted for t in batch) + self._batch_wait - time.perf_counter()

    def queue_lengths(self) -> tuple[int, int]:
        return len(self._fg), len(self._idle)

    def foreground(self) -> int:
        """Foreground tasks submitted and not finished, running ones included (read without
        the lock: an int is read whole)."""
        return self._fg_pending

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._drained.wait_for(lambda: self._pending == 0 or self._stopped, timeout)

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            self._drained.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        for task in [*self._fg, *(t for _, _, t in self._idle)]:
            task.gen.close()
            task.on_error(EngineClosed("the engine closed before this task ran"))
            task.done.set()

    def reserve(self, key: str) -> bool:
        """Claim a session's KV for the calling task, unless another task is using it."""
        with self._cv:
            if key in self._busy:
                return False
            self._busy.add(key)
            return True

    def release(self, key: str) -> None:
        with self._cv:
            self._busy.discard(key)
            self._cv.notify_all()

    def _fg_waiting(self) -> bool:
        """Foreground work is queued (read without the lock: a deque's length is atomic)."""
        return bool(self._fg)

    def _take(self) -> list[Task]:
        """The next quantum's tasks: every runnable foreground task (distinct keys, FIFO, up
        to max_batch), else one idle task."""
        batch: list[Task] = []
        keys: set[str] = set()
        for task in list(self._fg):
            if task.key is not None and (task.key in self._busy or task.key in keys):
                continue
            self._fg.remove(task)
            batch.append(task)
            if task.key is not None:
                keys.add(task.key)
            if len(batch) >= self._max_batch:
                break
        if batch or self._idle_running >= self._idle_cap:
            return batch
        busy = []  # idle tasks whose session is in use: queued again as they were
        try:
            while self._idle:
                item = heapq.heappop(self._idle)
                if item[2].key is None or item[2].key not in self._busy:
                    return [item[2]]
                busy.append(item)
            return []
        finally:
            for item in busy:
                heapq.heappush(self._idle, item)

    def _loop(self) -> None:
        while True:
            with self._cv:
                batch: list[Task] = []
                while not self._stopped:
                    if not (batch := self._take()):
                        self._cv.wait()
                        continue
                    if (wait := self._gather(batch)) <= 0:
                        break
                    self._fg.extendleft(reversed(batch))  # taken again with the arrivals
                    batch = []
                    self._cv.wait_for(lambda: self._stopped or not self._arriving, wait)
                if self._stopped:
                    for task in batch:
                        if task.idle:
                            self._queue(task)
                        else:
                            self._fg.appendleft(task)
                    return
                idle = batch[0].idle
                for task in batch:
                    if task.key is not None:
                        self._busy.add(task.key)
                if idle:
                    self._idle_running += 1
            now = time.perf_counter()
            for task in batch:
                if task.started is None:
                    task.started = now
                    if not idle:
                        self.fg_waits.append((now - task.submitted,
                                              self.idle_steps - task.idle_mark))
            finished = self._quantum(batch, idle)
            with self._cv:
                if idle:
                    self.idle_steps += 1
                    self._idle_running -= 1
                # forwards left out of the batch run first next quantum; a forward run in
                # chunks waits its next turn behind the rest (its task: `partial`)
                waiting = []
                tidy = batch[0] is self._tidy
                for task in batch:
                    self._busy.discard(task.key)
                    if task in finished:
                        self._pending -= 1
                        self._fg_pending -= not task.idle
                        task.done.set()
                        if task is self._tidy:
                            self._tidy = None
                    elif task.want is not None and not task.idle and task.partial is None:
                        waiting.append(task)
                    else:
                        self._queue(task)
                self._fg.extendleft(reversed(waiting))
                if not tidy:
                    self._queue_housekeeping()
                if self._pending == 0:
                    self._drained.notify_all()
                # this thread takes the next quantum itself: other workers are woken for the
                # rest of what is queued only
                self._cv.notify(len(self._fg) + len(self._idle) - 1)

    def _queue_housekeeping(self) -> None:
        """After other work, with nothing else queued: the housekeeping task, below every
        idle task (under the lock)."""
        if self.housekeeping is None or self._tidy is not None or self._fg or self._idle:
            return
        self._tidy = Task(self.housekeeping(), True, None, _tidy_failed, float("-inf"))
        self._tidy.idle_mark = self.idle_steps
        self._queue(self._tidy)
        self._pending += 1

    def _quantum(self, batch: list[Task], idle: bool) -> set[Task]:
        """Step each task to its next forward, then run those forwards as one batch (within
        the token cap, a long forward cut to the cap's rest, and, `run_forwards`, the cells
        room can be made for; a forward left out runs first in the next quantum). Returns
        the tasks that finished."""
        t0 = time.perf_counter()
        finished: set[Task] = set()
        with idle_work(idle, self._fg_waiting):
            for task in batch:
                while task.want is None:
                    if not self._step(task):
                        finished.add(task)
                        if task.key is not None:  # its KV may move for the batch's room now
                            self.release(task.key)
                        break
                    # a bare yield (a relayed token, a unit of housekeeping): a task alone
                    # goes on in this quantum while no task it would give way to is queued
                    # (read without the lock: a deque's or a list's length is read whole)
                    if len(batch) > 1 or self._fg or (idle and self._idle) or self._stopped:
                        break
            chosen, forwards, plans = self._fill(batch, idle)
            if not chosen:
                return finished
            # a task the token cap left out runs no forward now: its KV may move down a tier
            # to make the batch's room, as a waiting forward's does (it comes back when the
            # task runs), so it is not held as in use meanwhile
            left = [t.key for t in batch if t.want is not None and t not in chosen]
            if left:
                with self._cv:
                    self._busy.difference_update(left)
            preemptible = all(f.preemptible for f in forwards)
            t1 = time.perf_counter()
            with idle_work(idle, self._fg_waiting if preemptible else None):
                try:
                    advances = run_forwards(forwards[0].kv.backend, forwards, plans,
                                            moves=not idle)
                except BaseException as exc:  # each task of the batch gets the error
                    advances = [exc] * len(chosen)
        for task, adv in zip(chosen, advances):
            if adv is None:  # not run, for want of room: its forward waits
                continue
            if isinstance(adv, Advance) and not adv.done and task.want.max_tokens is None:
                task.partial = _joined(task.partial, adv)  # a chunk: the forward goes on
                continue
            if isinstance(adv, Advance):
                adv = _joined(task.partial, adv)
            task.want, task.reply, task.partial = None, adv, None
        if not idle:
            # each as it ran: a prefix reused at admission is not run (`Advance.prefilled`)
            ran = [(f, (p[0], p[2] - adv.prefilled, p[2]) if isinstance(adv, Advance) else p)
                   for f, p, adv in zip(forwards, plans, advances) if adv is not None]
            if ran:  # else every forward waited for room: no step ran
                self.steps.record(ran, len(self._fg) + len(left) + len(forwards) - len(ran),
                                  time.perf_counter() - t1, time.perf_counter() - t0)
        return finished

    def _fill(self, batch: list[Task], idle: bool
              ) -> tuple[list[Task], list[Forward], list[tuple[int, int, int]]]:
        """The step's tasks, their forwards and plans: each forward that fits the token cap
        whole, in batch order, then (foreground, one worker) the cap's rest given to those
        too long for it, the oldest request's first, each cut to what is left. A step with
        nothing else runs its first forward whole where it cannot be cut."""
        chosen, forwards, plans, tokens = [], [], [], 0
        cap = self._max_batch_tokens
        long: list[Task] = []
        for task in batch:
            if task.want is None:
                continue
            try:
                plan = task.want.plan()
            except ValueError as exc:  # an empty target: the task's own error
                task.want, task.reply = None, exc
                continue
            cost = plan[2] - plan[1]
            if tokens + cost > cap:
                if self._chunks and not idle and _chunkable(task.want):
                    long.append(task)
                    continue
                if chosen:
                    continue
            chosen.append(task)
            forwards.append(task.want)
            plans.append(plan)
            tokens += cost
        for task in sorted(long, key=lambda t: t.submitted):
            if tokens >= cap:
                break
            cut = replace(task.want, max_tokens=cap - tokens)
            plan = cut.plan()
            chosen.append(task)
            forwards.append(cut)
            plans.append(plan)
            tokens += plan[2] - plan[1]
        return chosen, forwards, plans

    @staticmethod
    def _step(task: Task) -> bool:
        """Run the task to its next yield; False when it has finished (or failed)."""
        reply, task.reply = task.reply, None
        try:
            if isinstance(reply, BaseException):
                out = task.gen.throw(reply)
            else:
                out = task.gen.send(reply)
        except StopIteration:
            return False
        except BaseException as exc:  # a task's failure is its own; the worker lives on
            task.on_error(exc)
            return False
        task.want = out if isinstance(out, Forward) else None
        return True
