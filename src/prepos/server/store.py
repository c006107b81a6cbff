"""The durable session store: one small interface over two databases, SQLite (the default:
one node, a file beside it) and PostgreSQL (several nodes sharing one store), and the
versioned migrations that give both the same schema.

`Database(target)` is one connection: a path (SQLite, WAL mode), None (SQLite in memory) or
a `postgresql://` URL (psycopg 3). Statements are written once, in the SQL both accept (`?`
placeholders, `INSERT ... ON CONFLICT`, `IS NOT DISTINCT FROM`, `RETURNING`); the PostgreSQL
side rewrites `?` to `%s`, and `NOW` in a statement is the database's own clock in seconds,
so nodes on several machines compare lease times on one clock. `tx()` is one transaction,
committed when its block ends: the journal's rows are in the store before the request that
wrote them returns.

Migrations are numbered and applied in order, each once, inside one transaction that holds
a lock (PostgreSQL: an advisory lock), so nodes starting together migrate once. A SQLite
journal written before the migrations existed is migration 1's starting point: its tables
are created only where missing.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

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
    # ownership (server/lease.py): a node's liveness, renewed while it lives; a session's
    # owner, valid while the node it names is alive in the epoch it names
    (2, """
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY, epoch BIGINT NOT NULL, expires DOUBLE PRECISION NOT NULL,
    url TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    sid TEXT PRIMARY KEY, node TEXT NOT NULL, node_epoch BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_node ON leases (node);
"""),
    # stateless conversations (server/conversations.py): which node keeps each, by hash
    (3, """
CREATE TABLE IF NOT EXISTS conversations (
    key TEXT PRIMARY KEY, sid TEXT NOT NULL, node TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_sid ON conversations (sid, node);
"""),
]
NOW = {"sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
       "postgresql": "extract(epoch from clock_timestamp())::double precision"}


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
    transaction at a time)."""

    def __init__(self, target: str | Path | None, migrate: bool = True):
        self.target = target
        self.dialect = "postgresql" if is_url(target) else "sqlite"
        self.shared = self.dialect == "postgresql"  # several nodes: sessions held by lease
        self.lock_row = " FOR SHARE" if self.shared else ""  # row lock held to commit
        self._lock = threading.RLock()
        self._conn = self._connect()
        if migrate:
            self.migrate()

    def _connect(self):
        if self.shared:
            try:
                import psycopg
            except ImportError:
                raise RuntimeError("a PostgreSQL store needs psycopg 3: pip install "
                                   "'psycopg[binary]'") from None
            return psycopg.connect(str(self.target), autocommit=True, connect_timeout=10)
        path = ":memory:"
        if self.target is not None:
            Path(self.target).parent.mkdir(parents=True, exist_ok=True)
            path = str(self.target)
        conn = sqlite3.connect(path, check_same_thread=False, timeout=30,
                               isolation_level=None)
        if self.target is not None:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        return conn

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
        with self._lock:
            try:
                if not self.shared and self.target is not None:
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._conn.close()
