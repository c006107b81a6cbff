"""The journal under store faults: no acknowledged commit lost, no failed one kept, and the
event loop never waiting on the store.

A real `prepos serve` (the tiny chatml model our own code builds, on the CPU) with a SQLite
journal and `--store-timeout 0.5`. Each of `--sessions` agentic sessions has one client
thread that commits in a loop (a user message, then a turn: its answer pre-positioned at
idle, an exact fast-path turn where the pre-position was done in time), and a poller times
`GET /health` every 10 ms. Phases, `--phase-s` seconds each:

- healthy: the store as it is;
- locked: a second SQLite connection holds `BEGIN EXCLUSIVE` on the journal the whole phase
  (every commit must fail: a 503 `store_unavailable`, the session unchanged);
- slow: the lock held 0.3 s of every 0.4 s (commits wait, most are written late).

Each client keeps a ledger: for every 200, the messages its commit left (the count and the
last one); for every failure, its status and code, and whether the session (read back at
once) is as it was before. Then every session is read, the server killed
(SIGKILL) and started again on the journal, and every session's restored messages checked
against the ledger and against what the server served before the kill.

Printed last, one JSON line: `lost_acked` (200s whose commit the restored store lacks),
`acked_not_written` (answers that disagree with the store: a 200 whose commit is missing, a
failure that changed the session, a failure that was not a 503 `store_unavailable`),
`sessions_restored_unlike_served`, `health_p99_ms_during_stall` (the locked and slow
phases), turn and health latencies per phase, n.

    python benchmarks/store_faults.py [--sessions 4] [--phase-s 4]
"""

from __future__ import annotations

import argparse
import json
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # the server is started as the tests start it

from common import machine, summarize  # noqa: E402
from prepos.lab.tiny import build_model  # noqa: E402
from tests.support.server_harness import ServerProc  # noqa: E402

SYSTEM = "You are a market analyst. Answer with one word."
PHASES = ("healthy", "locked", "slow")


class Phase:
    def __init__(self):
        self.name = "warmup"
        self.stop = threading.Event()


def state(c: httpx.Client, sid: str) -> tuple[int, list]:
    info = c.get(f"/sessions/{sid}", params={"include": "messages"}).json()
    return info["version"], info["message_list"]


def client(url: str, sids: list, phase: Phase, ledger: dict, turns: dict) -> None:
    """Commits on one session until told to stop: a user message, then its turn; a session
    whose context is full (413 over_budget, the server's answer, nothing committed) is left
    for a new one, made once the store takes it (every session made is in `sids`)."""
    acked, failed = ledger["acked"], ledger["failed"]
    with httpx.Client(base_url=url, timeout=60) as c:
        i, sid = 0, sids[-1]
        while not phase.stop.is_set():
            before = state(c, sid)
            user = {"role": "user", "content": f"{sid} message {i}"}
            t0 = time.perf_counter()
            if before[1][-1]["role"] == "user":  # the answer, pre-positioned: an exact turn
                r = c.post(f"/sessions/{sid}/turn", json={"max_tokens": 1})
            else:
                r = c.post(f"/sessions/{sid}/messages", json=user)
            name = phase.name  # the phase it ended in: where its outcome was decided
            turns.setdefault(name, []).append(time.perf_counter() - t0)
            if r.status_code == 413 and state(c, sid) == before:
                made = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM})
                if made.status_code == 201:
                    sid = made.json()["id"]
                    sids.append(sid)
                ledger["full"] += 1
                time.sleep(0.01)
                continue
            if r.status_code == 200:
                msgs = state(c, sid)[1]
                acked.append({"sid": sid, "n": len(msgs), "last": msgs[-1], "phase": name})
            else:
                after = state(c, sid)
                code = r.json()["error"]["code"] if r.headers.get("content-type", "").startswith(
                    "application/json") else None
                failed.append({"sid": sid, "status": r.status_code, "code": code,
                               "consistent": after == before, "phase": name})
            i += 1


def poll_health(url: str, phase: Phase, out: dict) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        while not phase.stop.is_set():
            t0 = time.perf_counter()
            r = c.get("/health")
            out.setdefault(phase.name, []).append((time.perf_counter() - t0, r.status_code))
            time.sleep(0.01)


def hold_lock(journal: Path, until: float, duty: tuple[float, float] | None,
              held: Callable[[], None]) -> int:
    """Hold the journal's write lock until `until` (monotonic): throughout, or `duty`
    (held, free) seconds at a time; `held()` once it was first taken. The times it was."""
    con = sqlite3.connect(journal, isolation_level=None, timeout=10)
    taken = 0
    try:
        while time.monotonic() < until:
            con.execute("BEGIN EXCLUSIVE")
            if not taken:
                held()
            taken += 1
            held = until - time.monotonic() if duty is None else duty[0]
            time.sleep(max(0.0, min(held, until - time.monotonic())))
            con.execute("ROLLBACK")
            if duty is not None:
                time.sleep(duty[1])
    finally:
        con.close()
    return taken


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=4.0)
    ap.add_argument("--store-timeout", type=float, default=0.5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="store-faults-"))
    model = build_model(work / "model", "chatml", "llama", seed=1)
    journal = work / "journal.sqlite3"
    srv = ServerProc(model, work / "first", "--store-timeout", str(args.store_timeout),
                     journal=journal).start()
    ledger: dict = {"acked": [], "failed": [], "full": 0}
    turns: dict = {}
    health: dict = {}
    phase = Phase()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            made = [[c.post("/sessions", json={"kind": "agentic", "system": SYSTEM}
                            ).json()["id"]] for _ in range(args.sessions)]
        threads = [threading.Thread(target=client, args=(srv.url, mine, phase, ledger, turns))
                   for mine in made]
        threads.append(threading.Thread(target=poll_health, args=(srv.url, phase, health)))
        for t in threads:
            t.start()
        locks = {}
        for name in PHASES:
            end = time.monotonic() + args.phase_s
            if name == "healthy":
                phase.name = name
                time.sleep(args.phase_s)
            else:  # the phase begins once the lock is held
                locks[name] = hold_lock(journal, end, None if name == "locked" else (0.3, 0.1),
                                        lambda name=name: setattr(phase, "name", name))
        phase.name = "after"
        time.sleep(1.0)  # a few turns on the store as it is again
        phase.stop.set()
        for t in threads:
            t.join()
        sids = [sid for mine in made for sid in mine]
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            served = {sid: state(c, sid)[1] for sid in sids}
        srv.stop(signal.SIGKILL)
        srv = ServerProc(model, work / "second", journal=journal).start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            restored = {sid: state(c, sid)[1] for sid in sids}
    finally:
        srv.stop()
    lost = [a for a in ledger["acked"] if len(restored[a["sid"]]) < a["n"]
            or restored[a["sid"]][a["n"] - 1] != a["last"]]
    failed = ledger["failed"]
    kept_failed = [f for f in failed if not f["consistent"]]
    differs = [sid for sid in sids if restored[sid] != served[sid]]
    not_5xx = [f for f in failed if not 500 <= f["status"] < 600
               or f["code"] != "store_unavailable"]
    stall = [s * 1e3 for name in ("locked", "slow") for s, _ in health.get(name, [])]
    stall_bad = sum(1 for name in ("locked", "slow") for _, st in health.get(name, [])
                    if st != 200)
    per_phase = {name: {"acked": sum(a["phase"] == name for a in ledger["acked"]),
                        "failed": sum(f["phase"] == name for f in failed),
                        "turn": summarize(turns[name]) if turns.get(name) else None,
                        "health": summarize([s for s, _ in health[name]])
                        if health.get(name) else None}
                 for name in (*PHASES, "after")}
    stall_summary = summarize([s / 1e3 for s in stall]) if stall else None
    print(json.dumps({
        "benchmark": "store_faults", "machine": machine(), "sessions": args.sessions,
        "phase_s": args.phase_s, "store_timeout_s": args.store_timeout, "locks_taken": locks,
        "phases": per_phase, "sessions_made": len(sids), "context_full": ledger["full"],
        "acked": len(ledger["acked"]), "failed": len(failed),
        "failed_codes": sorted({f"{f['status']} {f['code']}" for f in failed}),
        "lost_acked": len(lost),
        "acked_not_written": len(lost) + len(kept_failed) + len(not_5xx),
        "failed_not_rolled_back": len(kept_failed), "failed_not_store_5xx": len(not_5xx),
        "sessions_restored_unlike_served": len(differs),
        "health_n_during_stall": len(stall), "health_non_200_during_stall": stall_bad,
        "health_p50_ms_during_stall": stall_summary["p50_ms"] if stall_summary else None,
        "health_p99_ms_during_stall": stall_summary["p99_ms"] if stall_summary else None,
    }))


if __name__ == "__main__":
    main()
