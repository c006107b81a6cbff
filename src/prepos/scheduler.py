"""The model worker. Foreground requests go before idle work; each task is a generator that
does one quantum of model work per step (a request's first token or one decode step; one
chunk of a pre-position), so a request waits behind at most one chunk of idle work per
worker, and foreground requests interleave round-robin.

The workers also own the KV caches (`KVPool`): only tasks touch them, and a session's tasks
never run at the same time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Generator, Sequence

from prepos.backends.base import Backend, KVSequence, idle_work
from prepos.errors import EngineClosed, OverBudget


class KVPool:
    """Every session's KV cache, and the engine-wide cell budget. Worker-thread only."""

    def __init__(self, backend: Backend, engine_cells: int):
        self.backend = backend
        self.engine_cells = engine_cells
        self._kv: dict[str, KVSequence] = {}

    def get(self, sid: str) -> KVSequence:
        kv = self._kv.get(sid)
        if kv is None:
            kv = self._kv[sid] = KVSequence(self.backend, key=sid)
        return kv

    def find(self, sid: str) -> KVSequence | None:
        return self._kv.get(sid)

    def drop(self, sid: str) -> None:
        kv = self._kv.pop(sid, None)
        if kv is not None:
            kv.release()

    @property
    def used(self) -> int:
        return sum(len(kv) for kv in list(self._kv.values()))

    def extra_cells(self, sid: str, target: Sequence[int]) -> int:
        """Cells `target` needs beyond what the session's cache already holds."""
        kv = self._kv.get(sid)
        if kv is None:
            return len(target)
        return max(0, len(target) - len(kv))

    def fits(self, sid: str, target: Sequence[int]) -> bool:
        return self.used + self.extra_cells(sid, target) <= self.engine_cells

    def make_room(self, sid: str, target: Sequence[int], committed: Callable[[str], int],
                  reserve: Callable[[str], bool] = lambda key: True,
                  release: Callable[[str], None] = lambda key: None) -> None:
        """For a foreground request: crop other sessions' speculative cells (pre-positioned
        entries, past answers) back to their committed length. Live state is never
        evicted; if that is not enough the request is refused."""
        if self.fits(sid, target):
            return
        for other, kv in list(self._kv.items()):
            if other != sid and reserve(other):  # never touch a cache another task is using
                try:
                    kv.crop(min(len(kv), committed(other)))
                finally:
                    release(other)
            if self.fits(sid, target):
                return
        raise OverBudget(f"the engine's KV budget of {self.engine_cells} cells is full "
                         f"({self.used} in use by committed session state)")


class Task:
    __slots__ = ("gen", "idle", "key", "on_error", "submitted", "started", "done", "idle_mark")

    def __init__(self, gen: Generator, idle: bool, key: str | None,
                 on_error: Callable[[BaseException], None]):
        self.gen = gen
        self.idle = idle
        self.key = key  # tasks with the same key (a session) never run at the same time
        self.on_error = on_error
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.done = threading.Event()
        self.idle_mark = 0  # the workers' idle-step count when this task was submitted


class Scheduler:
    """`workers` threads run task steps; one (the default) suits an in-process model, whose
    forwards use every core; more suit remote back ends, whose steps wait on the network.
    Two tasks of one session never run at once, so each session's KV has one user at a
    time, and at most `idle_workers` idle steps run at once."""

    def __init__(self, workers: int = 1, idle_workers: int | None = None) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._fg: deque[Task] = deque()
        self._idle: deque[Task] = deque()
        self._cv = threading.Condition()
        self._pending = 0  # submitted and not finished
        self._busy: set[str] = set()  # keys of running tasks
        self._idle_running = 0
        self._idle_cap = idle_workers or workers
        self._stopped = False
        self.idle_steps = 0
        # (seconds, idle chunks run meanwhile) each foreground task waited before it started
        self.fg_waits: deque[tuple[float, int]] = deque(maxlen=4096)
        self._threads = [threading.Thread(target=self._loop, name=f"prepos-worker-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, gen: Generator, idle: bool = False, key: str | None = None,
               on_error: Callable[[BaseException], None] | None = None) -> Task:
        task = Task(gen, idle, key, on_error or (lambda exc: None))
        with self._cv:
            if self._stopped:
                gen.close()
                raise EngineClosed("the engine is closed")
            task.idle_mark = self.idle_steps
            (self._idle if idle else self._fg).append(task)
            self._pending += 1
            self._cv.notify_all()
        return task

    def queue_lengths(self) -> tuple[int, int]:
        return len(self._fg), len(self._idle)

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0 or self._stopped, timeout)

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        for task in [*self._fg, *self._idle]:
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

    def _take(self) -> Task | None:
        """The first runnable task: foreground before idle, FIFO within each."""
        for i, task in enumerate(self._fg):
            if task.key is None or task.key not in self._busy:
                del self._fg[i]
                return task
        if self._idle_running < self._idle_cap:
            for i, task in enumerate(self._idle):
                if task.key is None or task.key not in self._busy:
                    del self._idle[i]
                    return task
        return None

    def _loop(self) -> None:
        while True:
            with self._cv:
                task = None
                while not self._stopped and (task := self._take()) is None:
                    self._cv.wait()
                if self._stopped:
                    if task is not None:
                        (self._idle if task.idle else self._fg).appendleft(task)
                    return
                if task.key is not None:
                    self._busy.add(task.key)
                if task.idle:
                    self._idle_running += 1
            if task.started is None:
                task.started = time.perf_counter()
                if not task.idle:
                    self.fg_waits.append((task.started - task.submitted,
                                          self.idle_steps - task.idle_mark))
            more = True
            try:
                with idle_work(task.idle, self._fg_waiting):
                    next(task.gen)
            except StopIteration:
                more = False
            except BaseException as exc:  # a task's failure is its own; the worker lives on
                more = False
                task.on_error(exc)
            with self._cv:
                if task.idle:
                    self.idle_steps += 1
                    self._idle_running -= 1
                self._busy.discard(task.key)
                if more:
                    (self._idle if task.idle else self._fg).append(task)
                else:
                    self._pending -= 1
                    task.done.set()
                self._cv.notify_all()
