"""The durable session store: one small interface over two databases, SQLite (the default:
one node, a file beside it) and PostgreSQL (several nodes sharing one store), and the
versioned migrations that give both the same schema.

`Database(target)` is one connection: a path (SQLite, WAL mode), None (SQLite in memory) or
a `postgresql://` URL (psycopg 3). Statements are written once, in the SQL both accept (`?`
placeholders, `INSERT ... ON CONFLICT`, `IS NOT DISTINCT FROM`, `RETURNING`); the PostgreSQL
side rewrites `?` to `%s`, and `NOW` in a statement is the database's own clock in seconds,
so nodes on several machines compare lease times on one clock. `tx()` is one transaction,
committed when its block ends.

Durable means written. SQLite runs with `synchronous=FULL` (a commit is on disk when it
returns, power loss included; `NORMAL` in WAL mode may lose the last commits) and a short busy
timeout; PostgreSQL with a statement and lock timeout of the same length. Writes that
acknowledge a request (`submit`) run on the store's writer thread, never on the event loop:
the request waits for its write, and a write that fails or cannot start within the timeout is
`StoreUnavailable` (503, naming the store, never its path or the driver's text). A SQLite file
is held by one process (`hold`: an exclusive lock on `<path>.lock`, which names its pid): a
second server on the same journal refuses to start.

Migrations are numbered and applied in order, each once, inside one transaction that holds
a lock (PostgreSQL: an advisory lock), so nodes starting together migrate once. A SQLite
journal written before the migrations existed is migration 1's starting point: its tables
are created only where missing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from prepos.errors import PreposError

log = logging.getLogger("prepos.server.store")
T = TypeVar("T")
TIMEOUT = 2.0  # seconds a write may wait for the store (busy, statement and lock timeouts)

MIGRATIONS: list[tuple[int, str]] = [
    (1, """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, spec TEXT NOT NULL, extras TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    sid TEXT NOT NULL, version BIGINT NOT NULL, "full" INTEGER NOT NULL, ops TEXT NOT NULL,
    PRIMARY KEY (sid, version)) {without_rowid};
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT, parent TEXT, sid TEXT, version BIGINT,
    created DOUBLE PRECISION NOT NULL, messages TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_parent ON responses (parent);
CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, created);
"""),
    # ownership (server/store/lease.py): a node's liveness, renewed while it lives; a session's
    # owner, valid while the node it names is alive in the epoch it names
    (2, """
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY, epoch BIGINT NOT NULL, expires DOUBLE PRECISION NOT NULL,
    url TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    sid TEXT PRIMARY KEY, node TEXT NOT NULL, node_epoch BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_node ON leases (node);
"""),
    # stateless conversations (server/store/directory.py): which node keeps each, by hash
    (3, """
CREATE TABLE IF NOT EXISTS conversations (
    key TEXT PRIMARY KEY, sid TEXT NOT NULL, node TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_sid ON conversations (sid, node);
"""),
    # idempotency keys (server/store/idempotency.py): a request's result per API key and key; a
    # NULL status: claimed by its commit, its result not written yet
    (4, """
CREATE TABLE IF NOT EXISTS idempotency (
    owner TEXT NOT NULL, key TEXT NOT NULL, digest TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL, status INTEGER, headers TEXT, body TEXT NOT NULL,
    PRIMARY KEY (owner, key));
CREATE INDEX IF NOT EXISTS idempotency_owner ON idempotency (owner, created);
CREATE INDEX IF NOT EXISTS idempotency_created ON idempotency (created);
"""),
    # the Conversations API's conversations and their items (server/store/conversations.py)
    (5, """
CREATE TABLE IF NOT EXISTS openai_conversations (
    id TEXT PRIMARY KEY, owner TEXT, created DOUBLE PRECISION NOT NULL, metadata TEXT NOT NULL,
    version BIGINT NOT NULL, next BIGINT NOT NULL, bytes BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS openai_conversations_owner ON openai_conversations (owner);
CREATE TABLE IF NOT EXISTS openai_conversation_items (
    id TEXT PRIMARY KEY, conversation TEXT NOT NULL, seq BIGINT NOT NULL, call_id TEXT,
    body TEXT NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS openai_conversation_items_seq
    ON openai_conversation_items (conversation, seq);
"""),
    # the bytes of each idempotency record, bounded per API key (server/store/idempotency.py)
    (6, """
ALTER TABLE idempotency ADD COLUMN bytes BIGINT NOT NULL DEFAULT 0;
"""),
]
NOW = {"sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
       "postgresql": "extract(epoch from clock_timestamp())::double precision"}


class StoreUnavailable(PreposError):
    """The store did not take a write (locked, slow or unreachable): nothing was committed."""

    code = "store_unavailable"


class StoreHeld(RuntimeError):
    """Another process holds the SQLite journal."""


_held: dict[str, tuple[int, int]] = {}  # lock file -> (its descriptor, holders here)
_held_lock = threading.Lock()


def hold(path: str | Path) -> str:
    """Hold the SQLite file at `path` for this process (an exclusive `flock` on `<path>.lock`,
    released by the kernel when the process ends, `kill -9` included); StoreHeld, naming the
    holder's pid, where another process holds it. Several holders in one process share the
    lock; each `release`s it once."""
    lock = os.path.abspath(f"{path}.lock")
    with _held_lock:
        if lock in _held:
            fd, n = _held[lock]
            _held[lock] = (fd, n + 1)
            return lock
        Path(lock).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreHeld(f"the journal {path} is in use by another prepos process (pid "
                            f"{holder}): one server per journal; give this one another "
                            "--journal (or none)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[lock] = (fd, 1)
        return lock


def release(lock: str) -> None:
    with _held_lock:
        fd, n = _held.pop(lock, (None, 0))
        if fd is None:
            return
        if n > 1:
            _held[lock] = (fd, n - 1)
        else:
            os.close(fd)  # the flock goes with the descriptor


def is_url(target: object) -> bool:
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def redacted(target: str | Path) -> str:
    """The target as it may be shown: a URL without its password."""
    if not is_url(target):
        return str(target)
    parts = urlsplit(str(target))
    if not parts.password:
        return str(target)
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


class Database:
    """One connection to the store, safe to share between threads (one statement or
    transaction at a time), and its writer thread (`submit`). `timeout`: seconds a write may
    wait for the store."""

    def __init__(self, target: str | Path | None, migrate: bool = True,
                 timeout: float = TIMEOUT):
        self.target = target
        self.dialect = "postgresql" if is_url(target) else "sqlite"
        self.shared = self.dialect == "postgresql"  # several nodes: sessions held by lease
        self.lock_row = " FOR SHARE" if self.shared else ""  # row lock held to commit
        self.timeout = timeout
        self.name = "PostgreSQL" if self.shared else "SQLite"
        self._lock = threading.RLock()
        self._setup = threading.Lock()  # the writer's, never held while a statement runs
        self._jobs: queue.SimpleQueue | None = None
        self._writer: threading.Thread | None = None
        self._file = hold(target) if target is not None and not self.shared else None
        try:
            self._conn = self._connect()
            if migrate:
                self.migrate()
        except BaseException:
            if self._file is not None:
                release(self._file)
            raise

    def _connect(self):
        if self.shared:
            try:
                import psycopg
            except ImportError:
                raise RuntimeError("a PostgreSQL store needs psycopg 3: pip install "
                                   "'psycopg[binary]'") from None
            ms = max(1, int(self.timeout * 1000))
            return psycopg.connect(str(self.target), autocommit=True, connect_timeout=10,
                                   options=f"-c statement_timeout={ms} -c lock_timeout={ms}")
        path = ":memory:"
        if self.target is not None:
            Path(self.target).parent.mkdir(parents=True, exist_ok=True)
            path = str(self.target)
        conn = sqlite3.connect(path, check_same_thread=False, timeout=self.timeout,
                               isolation_level=None)
        if self.target is not None:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # a commit is on disk when it returns
        return conn

    def unavailable(self) -> StoreUnavailable:
        return StoreUnavailable(f"the session store ({self.name}) did not take the write in "
                                f"time: nothing was committed; retry shortly")

    # -- the writer thread ---------------------------------------------------------------
    def submit(self, fn: Callable[[Database], T]) -> Future:
        """`fn(self)` on the store's writer thread, in order (`fn` opens its own `tx`): its
        future. A job that has not started within `timeout` of its submission (the store is
        stalled behind the jobs before it) fails unstarted with StoreUnavailable, as does one
        the driver fails; other errors (a refused fence) are the future's as raised."""
        fut: Future = Future()
        with self._setup:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                self._writer = threading.Thread(target=self._write_loop, args=(self._jobs,),
                                                name="prepos-store", daemon=True)
                self._writer.start()
            self._jobs.put((fut, fn, time.monotonic() + self.timeout))
        return fut

    def _write_loop(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fut, fn, deadline = job
            if not fut.set_running_or_notify_cancel():
                continue
            if time.monotonic() > deadline:
                log.error("store: a write waited over %.1f s for the %s store: not written",
                          self.timeout, self.name)
                fut.set_exception(self.unavailable())
                continue
            try:
                fut.set_result(fn(self))
            except PreposError as exc:
                fut.set_exception(exc)
            except Exception as exc:  # the driver's: logged here, a 503 for the request
                log.error("store: a write to the %s store failed: %s", self.name, exc)
                fut.set_exception(self.unavailable())

    def sql(self, statement: str) -> str:
        s = statement.replace("NOW", NOW[self.dialect])
        return s.replace("?", "%s") if self.shared else s

    def q(self, statement: str, params: tuple | list = ()):
        """Run one statement (its own transaction outside `tx`); the cursor, for
        `fetchone`, `fetchall` and `rowcount`."""
        with self._lock:
            self._reconnect()
            return self._conn.execute(self.sql(statement), params)

    @contextmanager
    def tx(self):
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self._lock:
            self._reconnect()
            if self.shared:
                with self._conn.transaction():
                    yield self
                return
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _reconnect(self) -> None:
        """A PostgreSQL connection that broke (the server restarted) is opened again."""
        if self.shared and (self._conn.closed or self._conn.broken):
            self._conn = self._connect()

    def migrate(self) -> int:
        """Apply the migrations not applied yet; the schema's version."""
        with self.tx():
            if self.shared:
                self.q("SET LOCAL statement_timeout = 0")  # waits on nodes migrating too
                self.q("SET LOCAL lock_timeout = 0")
                self.q("SELECT pg_advisory_xact_lock(726373)")  # nodes starting together
            self.q("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                   "applied DOUBLE PRECISION NOT NULL)")
            done = {r[0] for r in self.q("SELECT version FROM schema_migrations").fetchall()}
            for version, script in MIGRATIONS:
                if version in done:
                    continue
                script = script.format(without_rowid="" if self.shared else "WITHOUT ROWID")
                for statement in filter(str.strip, script.split(";")):
                    self.q(statement)
                self.q("INSERT INTO schema_migrations VALUES (?, ?)", (version, time.time()))
        return max(v for v, _ in MIGRATIONS)

    def schema_version(self) -> int:
        row = self.q("SELECT MAX(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    def close(self) -> None:
        """Finish the writes submitted, then close the connection and let the file go."""
        with self._setup:
            writer, jobs = self._writer, self._jobs
            self._jobs = self._writer = None
        if jobs is not None:
            jobs.put(None)
            writer.join()
        with self._lock:
            try:
                if not self.shared and self.target is not None:
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._conn.close()
                if self._file is not None:
                    release(self._file)
                    self._file = None
