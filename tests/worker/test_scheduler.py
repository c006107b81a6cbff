"""The model worker's ordering rules, on plain generator tasks (no model)."""

import threading
import time

from prepos.worker.scheduler import Scheduler


def steps(log, name, n, pause=0.0):
    for i in range(n):
        log.append((name, i, threading.get_ident(), time.perf_counter()))
        if pause:
            time.sleep(pause)
        yield


def held(gate: threading.Event):
    """A task whose one chunk runs until `gate` opens."""
    gate.wait(5)
    yield


def test_foreground_goes_before_idle_work_after_at_most_one_chunk():
    sched = Scheduler()
    log = []
    gate = threading.Event()

    sched.submit(held(gate), idle=True)
    sched.submit(steps(log, "idle", 5), idle=True)
    sched.submit(steps(log, "fg", 2))
    gate.set()
    assert sched.wait_idle(5)
    names = [n for n, *_ in log]
    assert names[:2] == ["fg", "fg"]  # the held task was the one chunk it waited behind
    assert max(chunks for _, chunks in sched.fg_waits) <= 1
    sched.close()


def test_idle_tasks_run_highest_priority_first_equal_ones_in_turn():
    sched = Scheduler()
    log = []
    gate = threading.Event()

    sched.submit(held(gate), idle=True, priority=10.0)
    sched.submit(steps(log, "low", 2), idle=True, priority=0.1)
    sched.submit(steps(log, "a", 2), idle=True, priority=0.5)
    sched.submit(steps(log, "b", 2), idle=True, priority=0.5)
    sched.submit(steps(log, "high", 2), idle=True, priority=0.9)
    gate.set()
    assert sched.wait_idle(5)
    assert [n for n, *_ in log] == ["high", "high", "a", "b", "a", "b", "low", "low"]
    sched.close()


def test_an_idle_task_whose_session_is_busy_waits_for_it_others_go_on():
    sched = Scheduler(workers=2)  # one holds session s, the other takes idle work
    log = []
    gate = threading.Event()

    sched.submit(held(gate), key="s")  # foreground work holding session s
    sched.submit(steps(log, "s", 1), idle=True, key="s", priority=0.9)
    sched.submit(steps(log, "t", 1), idle=True, key="t", priority=0.1)
    deadline = time.monotonic() + 10  # t runs while s is held, however slow the machine
    while not log and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    assert sched.wait_idle(5)
    assert [n for n, *_ in log] == ["t", "s"]
    sched.close()


def test_foreground_tasks_interleave_round_robin():
    sched = Scheduler()
    log = []
    gate = threading.Event()

    sched.submit(held(gate))
    sched.submit(steps(log, "a", 3))
    sched.submit(steps(log, "b", 3))
    gate.set()
    sched.wait_idle(5)
    assert [n for n, *_ in log] == ["a", "b", "a", "b", "a", "b"]
    sched.close()


def test_a_session_never_runs_two_tasks_at_once_across_workers():
    sched = Scheduler(workers=3)
    log = []
    for i in range(6):
        sched.submit(steps(log, f"s{i % 2}", 4, pause=0.005), key=f"s{i % 2}")
    assert sched.wait_idle(10)
    spans: dict[str, list[float]] = {}
    for name, _, _, t in log:
        spans.setdefault(name, []).append(t)
    # steps of one key are strictly sequential: at least one pause apart
    for ts in spans.values():
        ts.sort()
        assert all(b - a >= 0.004 for a, b in zip(ts, ts[1:]))
    assert len({tid for *_, tid, _ in log}) >= 2  # different keys did use other workers
    sched.close()


def test_idle_concurrency_is_capped():
    sched = Scheduler(workers=3, idle_workers=1)
    running, peak = [0], [0]
    lock = threading.Lock()

    def job():
        for _ in range(3):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.003)
            with lock:
                running[0] -= 1
            yield

    for i in range(4):
        sched.submit(job(), idle=True, key=f"k{i}")
    assert sched.wait_idle(10)
    assert peak[0] == 1
    sched.close()


def test_reserve_excludes_running_tasks():
    sched = Scheduler()
    assert sched.reserve("s")
    assert not sched.reserve("s")
    sched.release("s")
    assert sched.reserve("s")
    sched.release("s")
    sched.close()


def test_a_failing_task_reports_and_the_worker_lives_on():
    sched = Scheduler()
    errors = []

    def bad():
        yield
        raise RuntimeError("boom")

    sched.submit(bad(), on_error=errors.append)
    log = []
    sched.submit(steps(log, "ok", 1))
    assert sched.wait_idle(5)
    assert [str(e) for e in errors] == ["boom"] and log
    sched.close()


def test_housekeeping_runs_once_the_queues_are_empty_below_idle_work_and_gives_way():
    """The housekeeping task is queued once the queues run empty after other work (never
    after its own), runs below every idle task, and is waited for like them; a request that
    arrives while it runs waits one unit of it at most."""
    sched = Scheduler()
    log, runs = [], []
    started, gate = threading.Event(), threading.Event()

    def housekeeping():
        runs.append(len(log))
        for i in range(4):
            log.append(("tidy", i))
            if i == 0 and len(runs) == 1:
                started.set()
                gate.wait(5)  # a unit running when the request comes
            yield

    sched.housekeeping = housekeeping
    hold = threading.Event()
    sched.submit(held(hold), idle=True)
    sched.submit(steps(log, "idle", 2), idle=True, priority=-1.0)
    hold.set()
    assert started.wait(5)
    sched.submit(steps(log, "fg", 2))
    gate.set()
    assert sched.wait_idle(5)
    names = [n for n, *_ in log]
    assert names[:3] == ["idle", "idle", "tidy"]  # below the lowest idle task
    assert names[3:5] == ["fg", "fg"]  # after one unit of housekeeping
    assert max(chunks for _, chunks in sched.fg_waits) <= 1
    # it went on after the request where it stopped, and was not queued again after itself
    assert len(runs) == 1 and names.count("tidy") == 4
    sched.close()


def test_a_task_requeued_each_quantum_wakes_no_other_worker():
    """A stream relayed from a remote engine is one task yielding a token a quantum: the
    worker that ran the quantum takes the next one itself, and the other workers sleep on
    (every worker woken a token made a relayed token cost several thread wake-ups)."""
    s = Scheduler(workers=4)
    woken: dict[str, int] = {}
    wait = s._cv.wait

    def counting_wait(*a, **kw):
        out = wait(*a, **kw)
        name = threading.current_thread().name
        woken[name] = woken.get(name, 0) + 1
        return out

    s._cv.wait = counting_wait
    runner: set[str] = set()

    def relay(n: int):
        for _ in range(n):
            runner.add(threading.current_thread().name)
            time.sleep(0.001)  # the engine's next token: the GIL released, as a read does
            yield

    try:
        s.submit(relay(200)).done.wait(30)
        assert s.wait_idle(30)
    finally:
        s.close()
    others = {name: n for name, n in woken.items() if name not in runner}
    assert sum(others.values()) <= 8, others  # each woken at most for the submit and close


def test_a_task_alone_goes_on_through_its_bare_yields_and_gives_way_where_one_waits():
    """A bare yield ends the quantum only where a task the worker would run instead is
    queued: alone, a task's five units are one quantum; a foreground task submitted during
    an idle task's units runs before its next one."""
    sched = Scheduler()
    log = []
    sched.submit(steps(log, "alone", 5), idle=True)
    assert sched.wait_idle(5)
    assert sched.idle_steps == 1 and [i for _, i, *_ in log] == [0, 1, 2, 3, 4]

    order = []

    def idle_units():
        for i in range(4):
            order.append(("idle", i))
            if i == 1:  # a request arrives while the idle task runs
                sched.submit(fg())
            yield

    def fg():
        order.append(("fg", 0))
        return
        yield

    sched.submit(idle_units(), idle=True)
    assert sched.wait_idle(5)
    assert order == [("idle", 0), ("idle", 1), ("fg", 0), ("idle", 2), ("idle", 3)]
    sched.close()
