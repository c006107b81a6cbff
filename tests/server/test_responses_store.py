"""Stored responses bounded per key, without a model, on SQLite and PostgreSQL: by bytes
(oldest first), by count and by age (an injected clock); a response that goes while others
continue it leaves its messages to them by reference (the stored bytes do not grow), and a
response whose conversation alone passes the bound is not stored (never one cut short)."""

from __future__ import annotations

import json

import pytest

from prepos.server.store.database import Database
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
    db = Database(url)
    db.q("DELETE FROM responses")
    db.close()
    return url


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def row(rid: str, parent: str | None = None, text: str = "x", owner: str | None = "k",
        n: int = 1) -> Stored:
    return Stored(rid, owner, parent, None, None,
                  [{"role": "user", "content": text}] * n, {"id": rid, "output": []})


def size(r: Stored) -> int:
    return len(json.dumps(r.messages)) + len(json.dumps(r.body))


def store(target, **kw) -> tuple[ResponseStore, Clock]:
    clock = Clock()
    return ResponseStore(target, clock=clock, **kw), clock


def test_past_the_byte_bound_the_oldest_go(target):
    first = row("r10", text="a" * 1000)  # the size of each of the last ten
    rs, clock = store(target, max_bytes=10 * size(first))
    for i in range(25):
        clock.t += 1
        assert rs.put(row(f"r{i}", text="a" * 1000))
    used, live = rs.used("k")
    assert used <= rs.max_bytes and live == 10
    assert rs.get("k", "r14") is None and rs.get("k", "r15") is not None
    assert rs.get("k", "r24") is not None
    assert rs.put(row("other", owner="j"))  # another key's bound is its own
    assert rs.get("k", "r24") is not None and rs.used("k") == (used, live)


def test_an_evicted_response_s_children_read_its_messages_by_reference(target):
    """A root of 27 KB with 150 children, evicted: each child's conversation still starts
    with the root's messages, and the rows shrink by the root's object, none of its
    messages copied (before: 27 KB into each child, 4 MB)."""
    root = row("root", text="r" * 27_000)
    rs, clock = store(target, keep=151)
    rs.put(root)
    for i in range(150):
        clock.t += 1
        rs.put(row(f"c{i}", "root", text=f"child {i}"))
    before, live = rs.used("k")
    assert live == 151
    clock.t += 1
    rs.put(row("new"))  # one over `keep`: the oldest (the root) goes
    after, live = rs.used("k")
    assert live == 151 and rs.get("k", "root") is None
    assert after == before + size(row("new")) - len(json.dumps(root.body)) + len("null")
    for i in (0, 149):
        conv = rs.conversation(rs.get("k", f"c{i}"))
        assert [m["content"] for m in conv] == ["r" * 27_000, f"child {i}"]
        assert rs.get("k", f"c{i}").messages == [{"role": "user", "content": f"child {i}"}]


def test_a_deleted_response_s_messages_go_with_its_last_child(target):
    rs, clock = store(target)
    rs.put(row("a", text="one"))
    rs.put(row("b", "a", text="two"))
    rs.put(row("c", "b", text="three"))
    assert rs.delete("k", "a") and rs.delete("k", "b")
    assert rs.get("k", "a") is None and not rs.delete("k", "a")
    assert [m["content"] for m in rs.conversation(rs.get("k", "c"))] == ["one", "two", "three"]
    assert rs.delete("k", "c")  # the last that continued them: all three rows go
    assert rs.used("k") == (0, 0)


def test_a_response_whose_conversation_alone_passes_the_bound_is_not_stored(target):
    """Retired ancestors' messages are kept while a response continues them: a response
    whose conversation alone passes the bound is not stored (and nothing else changes), so
    none is answered from a conversation cut short."""
    link = row("l0", text="m" * 1000)
    rs, clock = store(target, max_bytes=6 * size(link))
    stored = []
    for i in range(7):
        clock.t += 1
        stored.append(rs.put(row(f"l{i}", f"l{i - 1}" if i else None, text="m" * 1000)))
    assert stored == [True] * 6 + [False]
    used, live = rs.used("k")
    assert used <= rs.max_bytes and live == 6
    for i in range(6):  # each kept is whole: its conversation from l0
        assert len(rs.conversation(rs.get("k", f"l{i}"))) == i + 1
    clock.t += 1
    assert rs.put(row("solo", text="s"))  # a chain of its own fits: the oldest retired
    assert rs.get("k", "l0") is None and rs.get("k", "l5") is not None
    assert len(rs.conversation(rs.get("k", "l5"))) == 6
    assert not rs.put(row("huge", text="h" * (rs.max_bytes + 1)))  # over the bound alone
    assert rs.get("k", "huge") is None and rs.get("k", "solo") is not None


def test_responses_expire_after_the_ttl(target):
    rs, clock = store(target, ttl=3600.0)
    rs.put(row("a", text="one"))
    rs.put(row("b", "a", text="two"))
    clock.t += 1800
    rs.put(row("fresh", owner="j"))
    clock.t += 1801  # a and b are past the ttl, fresh is not
    assert rs.get("k", "a") is None and rs.get("k", "b") is None
    assert not rs.delete("k", "b")
    assert rs.get("j", "fresh") is not None
    rs.put(row("later", owner="j"))  # a write sweeps every key's expired rows
    assert rs.used("k") == (0, 0) and rs.used("j")[1] == 2
