"""Resuming a session's event stream (`server/http/sse.py`). First without a model: the hub
over a fake engine whose commits the tests make. Every event carries the id of the last
commit its stream sent; a subscription with `Last-Event-ID` is sent every commit after it,
replayed, then the live ones, each once (a live commit the replay sent already is dropped);
one that cannot be resumed is 409 `cannot_resume`; a stream whose session lives on ends with
an `end` event naming why (this node stopping, the session moving, the reader too slow).
Then a real server: a bad `Last-Event-ID` is a 400 or 409 JSON error, and the bundled client
(`prepos.lab.following`) follows a session across a graceful restart, its stream ended with
`end` ("shutdown"), every commit after it replayed from what the journal restored, once."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import pytest

from prepos.errors import SessionNotFound
from prepos.lab.following import Follower
from prepos.server.http.errors import ApiError
from prepos.server.http.sse import Subscriptions
from tests.support.cluster_harness import free_port
from tests.support.server_harness import ServerProc, sse_events


@dataclass(frozen=True)
class Snap:
    version: int
    messages: tuple = ()
    tokens: tuple = ()


@dataclass
class Spec:
    owner: str | None = None
    standing: tuple = ()
    push_tokens: int = 1


@dataclass
class Session:
    id: str
    spec: Spec = field(default_factory=Spec)


class Engine:
    """The engine as the hub reads it: each version kept (from `oldest`), its listeners
    called on commit and close as the real one calls them."""

    def __init__(self, sid: str = "s-1", oldest: int = 0):
        self.s = Session(sid)
        self.version, self.oldest = 0, oldest
        self.listeners = []
        self.closed = False

    def subscribe(self, fn):
        self.listeners.append(fn)

    def snap(self, v: int) -> Snap:
        return Snap(v, tuple(range(v)), tuple(range(2 * v)))

    def ready_now(self, sid):
        if self.closed:
            raise SessionNotFound(sid)
        return self.snap(self.version), {}

    def snapshot(self, sid, version=None):
        if self.closed:
            raise SessionNotFound(sid)
        kept = version is not None and self.oldest <= version <= self.version
        return self.snap(version if kept else self.version)

    def commit(self, emit: bool = True) -> int:
        self.version += 1
        if emit:
            for fn in self.listeners:
                fn("commit", self.s, self.snap(self.version))
        return self.version

    def close(self):
        self.closed = True
        for fn in self.listeners:
            fn("close", self.s, None)


async def read(sub, n: int | None = None, timeout: float = 5.0) -> list[tuple[str, int, dict]]:
    """The stream's next `n` events (all, to its end, where None): (name, id, data)."""
    out, items = [], sub.items()
    try:
        while n is None or len(out) < n:
            chunk = await asyncio.wait_for(items.__anext__(), timeout)
            ids = [line[4:] for line in chunk.split(b"\n") if line.startswith(b"id: ")]
            assert len(ids) == 1, chunk  # every event carries its id
            ((name, data),) = sse_events(chunk.decode())
            out.append((name, int(ids[0]), data))
    except StopAsyncIteration:
        pass
    return out


async def hub(engine: Engine) -> Subscriptions:
    subs = Subscriptions()
    subs.attach(engine, asyncio.get_running_loop())
    return subs


async def settle() -> None:
    for _ in range(3):  # the listeners' hand-off to the loop
        await asyncio.sleep(0)


def test_a_fresh_stream_says_where_it_starts_and_ids_each_commit():
    async def run():
        eng = Engine()
        eng.commit(), eng.commit()
        subs = await hub(eng)
        sub = subs.subscribe(eng.s)
        eng.commit(), eng.commit()
        await settle()
        got = await read(sub, 3)
        assert [(n, i) for n, i, _ in got] == [("hello", 2), ("commit", 3), ("commit", 4)]
        assert got[0][2]["after"] is None and got[0][2]["version"] == 2
        assert got[1][2] == {"session_id": "s-1", "version": 3, "tokens": 6, "messages": 3}

    asyncio.run(run())


def test_a_resumed_stream_replays_every_commit_since_once():
    async def run():
        eng = Engine()
        for _ in range(5):
            eng.commit()
        subs = await hub(eng)
        subs.subscribe(eng.s)  # another subscriber: the commits are handed to the hub
        eng.commit()  # version 6: its event on its way to the loop as the next one subscribes
        subs.check_resume(eng.s.id, 2)
        sub = subs.subscribe(eng.s, after=2)
        eng.commit()
        await settle()
        got = await read(sub, 6)
        assert got[0][:2] == ("hello", 2) and got[0][2]["after"] == 2
        assert got[0][2]["version"] == 6
        assert [(n, i) for n, i, _ in got[1:]] == [("commit", v) for v in range(3, 8)]
        assert [d for _, _, d in got[1:]] == [
            {"session_id": "s-1", "version": v, "tokens": 2 * v, "messages": v}
            for v in range(3, 8)]
        with pytest.raises(TimeoutError):  # version 6's live event came too: not sent again
            await read(sub, 1, timeout=0.3)

    asyncio.run(run())


def test_a_live_gap_is_replayed_in_order():
    async def run():
        eng = Engine()
        subs = await hub(eng)
        sub = subs.subscribe(eng.s)
        eng.commit(), eng.commit(emit=False), eng.commit()
        await settle()
        got = await read(sub, 4)
        assert [(n, i) for n, i, _ in got] == [("hello", 0), ("commit", 1), ("commit", 2),
                                               ("commit", 3)]

    asyncio.run(run())


def test_resuming_where_it_cannot_is_409():
    async def run():
        eng = Engine(oldest=3)
        for _ in range(6):
            eng.commit()
        subs = await hub(eng)
        subs.check_resume(eng.s.id, 6)  # nothing since: fine
        subs.check_resume(eng.s.id, 2)  # 3 on are kept: fine
        for after in (7, 1):  # ahead of the session; its next version no longer kept
            with pytest.raises(ApiError) as e:
                subs.check_resume(eng.s.id, after)
            assert (e.value.status, e.value.code) == (409, "cannot_resume")

    asyncio.run(run())


@pytest.mark.parametrize("how", ["shutdown", "moved", "closed"])
def test_a_stream_ends_saying_why(how):
    async def run():
        eng = Engine()
        subs = await hub(eng)
        subs.closing_reason = lambda sid: "moved" if how == "moved" else None
        sub = subs.subscribe(eng.s)
        eng.commit()
        await settle()
        if how == "shutdown":
            subs.shutdown()
            with pytest.raises(ApiError) as e:  # and begins none
                subs.subscribe(eng.s)
            assert e.value.status == 503
        else:
            eng.close()
            await settle()
        got = await read(sub)
        names = [n for n, _, _ in got]
        if how == "closed":  # closed for good: `close`, no `end`
            assert names == ["hello", "commit", "close"]
        else:
            assert names == ["hello", "commit", "end"] and got[-1][1] == 1
            assert got[-1][2]["reason"] == how

    asyncio.run(run())


def test_a_reader_too_far_behind_is_ended_and_resumes_from_its_last_id():
    async def run():
        eng = Engine()
        subs = await hub(eng)
        sub = subs.subscribe(eng.s)
        sub.queue = asyncio.Queue(4)  # room for four events
        for _ in range(10):
            eng.commit()
        await settle()
        got = await read(sub)
        assert [n for n, _, _ in got] == ["end"] and got[0][2]["reason"] == "too_slow"
        assert got[0][1] == 0  # nothing was sent: resumed from 0, all ten come
        subs.unsubscribe(sub)
        again = subs.subscribe(eng.s, after=got[0][1])
        assert [(n, i) for n, i, _ in await read(again, 11)] == [
            ("hello", 0), *(("commit", v) for v in range(1, 11))]

    asyncio.run(run())


def until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_bundled_client_follows_a_session_across_a_restart(model_dirs, tmp_path):
    port, journal = free_port(), tmp_path / "journal.sqlite3"
    args = (model_dirs["chatml"], tmp_path / "srv", "--port", str(port))
    srv = ServerProc(*args, journal=journal).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            sid = c.post("/sessions", json={"kind": "streaming"}).json()["id"]
            for i in range(3):
                assert c.post(f"/sessions/{sid}/append", json={"data": f"tick {i}"}).json()[
                    "version"] == i + 1
            for bad, status, code in (("x1", 400, "invalid_last_event_id"),
                                      ("-1", 400, "invalid_last_event_id"),
                                      ("4", 409, "cannot_resume")):
                r = c.get(f"/sessions/{sid}/events", headers={"Last-Event-ID": bad})
                assert r.status_code == status and r.json()["error"]["code"] == code, r.text
            seen: list[tuple[str, object]] = []
            follower = Follower(srv.url, sid, on_event=lambda n, d: seen.append((n, d)))
            thread = follower.start()
            until(lambda: follower.first is not None, "subscribed")
            assert follower.first == 3 and follower.last == 3
            for i in (3, 4):
                c.post(f"/sessions/{sid}/append", json={"data": f"tick {i}"})
            until(lambda: follower.commits == [4, 5], "the live commits")
        assert srv.stop() == 0  # SIGTERM: a graceful stop
        until(lambda: follower.streams[0]["end"] is not None, "the first stream ends")
        assert follower.streams[0]["end"] == "end: shutdown", follower.streams
        follower.stop()
        thread.join(30)
        srv = ServerProc(*args, journal=journal).start()  # the journal restores the session
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for i in (5, 6):  # committed while no one follows
                c.post(f"/sessions/{sid}/append", json={"data": f"tick {i}"})
            thread = follower.start()  # resumed after 5: 6 and 7 replayed, then 8 live
            until(lambda: follower.commits[-1:] == [7], "the commits since, replayed")
            c.post(f"/sessions/{sid}/append", json={"data": "tick 7"})
            until(lambda: follower.commits[-1:] == [8], "the live commit after them")
            assert c.delete(f"/sessions/{sid}").status_code == 200
        thread.join(30)
        assert not thread.is_alive() and follower.closed and follower.error is None
        assert follower.commits == [4, 5, 6, 7, 8] and follower.repeated == 0
        assert follower.missed(8) == 0 and follower.gaps == 0
        again = follower.streams[-1]
        assert again["after"] == 5 and again["end"] == "closed", follower.streams
        hellos = [d for n, d in seen if n == "hello"]
        assert hellos[0]["after"] is None and hellos[0]["version"] == 3
        assert hellos[-1]["after"] == 5 and hellos[-1]["version"] == 7
    finally:
        srv.stop()
