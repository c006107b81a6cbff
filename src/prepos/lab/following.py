"""A session's event stream followed across the ends of its streams: the project's clients'
one rule for subscriptions (`prepos.lab.retrying` is theirs for requests).

`Follower(url, sid)` subscribes to `GET /sessions/{sid}/events` at one URL: a front door's
(or a single server's); it needs to know nothing of the nodes behind it. Each event carries
`id:`, the version of the last commit its stream sent. Where a stream ends, with an `end`
event (its node stopping, the session moving) or broken off (its node killed), the follower
subscribes again at once through the same URL with `Last-Event-ID`, and is sent every commit
after that one: none is missed, and none is handed on twice (a commit at or before the last
one handed on is dropped, and counted in `repeated`, whatever a server sends).

A subscription refused as a dying node or a takeover refuses one (502, 503, 504, 429, 409
`session_moved`, a refused or broken connection) is tried again with backoff, until
`retry_s` have passed with no stream. 409 `cannot_resume` (the session no longer keeps the
commits since) subscribes afresh and counts a gap (`gaps`). The session's `close` event, or a
404, ends the following.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import quote, urlsplit

RETRIED = (429, 502, 503, 504)


class FollowError(RuntimeError):
    pass


class Follower:
    """`run()` follows the session's events (blocking) until `stop()`, its `close` event, or
    a refusal it cannot retry (`FollowError`). `on_event(name, data)` sees each event once;
    `commits`: the versions of the commits handed on, in order."""

    def __init__(self, url: str, sid: str, key: str | None = None,
                 on_event: Callable[[str, object], None] | None = None, retry_s: float = 30.0,
                 read_timeout: float = 60.0):
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.sid = sid
        self.path = f"/sessions/{quote(sid, safe='')}/events"
        self.headers = {"Accept": "text/event-stream", "x-session-id": sid}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.on_event = on_event or (lambda name, data: None)
        self.retry_s, self.read_timeout = retry_s, read_timeout
        self.last: int | None = None  # the last event id: what a subscription resumes after
        self.first: int | None = None  # the version of the first stream's `hello`
        self.commits: list[int] = []
        self.repeated = 0  # commits a server sent again (dropped here)
        self.gaps = 0  # subscriptions that could not resume: commits were missed
        # each subscription: its node, the id it resumed after, its events, how it ended
        self.streams: list[dict] = []
        self.closed = False  # the session's `close` event came
        self.error: BaseException | None = None  # what ended `start()`'s thread, if not stop
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None

    def start(self) -> threading.Thread:
        """`run()` in a daemon thread (again after `stop()`: resumed from the last id); its
        error, if any, kept in `error`."""
        self._stop.clear()
        self.error = None

        def run():
            try:
                self.run()
            except BaseException as exc:
                self.error = exc

        t = threading.Thread(target=run, daemon=True, name=f"follow-{self.sid}")
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:  # wakes the read blocked on it
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self) -> None:
        wait, since = 0.1, time.monotonic()
        while not self._stop.is_set() and not self.closed:
            try:
                status, body = self._subscribe()
            except (OSError, http.client.HTTPException) as exc:
                status, body = None, repr(exc).encode()
            if self._stop.is_set() or self.closed:
                return
            if status == 200:  # a stream, ended: again at once
                wait, since = 0.1, time.monotonic()
                continue
            if status == 404:
                raise FollowError(f"session {self.sid}: no such session (404)")
            if status == 409 and b'"cannot_resume"' in body:
                self.gaps += 1
                self.last = None  # afresh: its `hello` says where it starts
                continue
            if not (status is None or status in RETRIED
                    or status == 409 and b'"session_moved"' in body):
                raise FollowError(f"session {self.sid}: HTTP {status}: {body[:300]!r}")
            if time.monotonic() - since > self.retry_s:
                raise FollowError(f"session {self.sid}: no stream for {self.retry_s:g} s "
                                  f"(last: {status or body[:200]!r})")
            time.sleep(wait * random.uniform(0.5, 1.0))
            wait = min(wait * 2, 2.0)

    def _subscribe(self) -> tuple[int, bytes]:
        """One subscription, read to its end: (status, the body of a refusal)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.read_timeout)
        self._conn = conn
        try:
            headers = dict(self.headers)
            if self.last is not None:
                headers["Last-Event-ID"] = str(self.last)
            conn.request("GET", self.path, headers=headers)
            r = conn.getresponse()
            if r.status != 200:
                return r.status, r.read()
            stream = {"node": r.getheader("x-prepos-node"), "after": self.last, "events": 0,
                      "end": None}
            self.streams.append(stream)
            try:
                self._read(r, stream)
            except (OSError, http.client.HTTPException) as exc:
                if not self._stop.is_set():
                    stream["end"] = stream["end"] or f"broken: {exc!r}"[:120]
            # how it ended: "end: <reason>", "broken: ...", "closed" (no `end` event) or
            # "stopped" (by `stop()`)
            stream["end"] = stream["end"] or ("stopped" if self._stop.is_set() else "closed")
            return 200, b""
        finally:
            self._conn = None
            conn.close()

    def _read(self, r, stream: dict) -> None:
        name, data, eid = "message", [], None
        while not self._stop.is_set():
            line = r.readline()
            if not line:
                return
            line = line.decode("utf-8").rstrip("\r\n")
            if not line:  # the event is whole
                if data:
                    self._event(name, "\n".join(data), eid, stream)
                name, data, eid = "message", [], None
                continue
            if line.startswith(":"):  # a keep-alive
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                eid = value

    def _event(self, name: str, raw: str, eid: str | None, stream: dict) -> None:
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw
        if eid is not None and eid.isdigit():
            self.last = int(eid)
        stream["events"] += 1
        if name == "commit":
            version = data["version"]
            if self.commits and version <= self.commits[-1]:
                self.repeated += 1
                return
            self.commits.append(version)
        elif name == "hello" and self.first is None:
            self.first = data["version"]
        elif name == "end":
            stream["end"] = f"end: {data.get('reason')}"
        elif name == "close":
            self.closed = True
        self.on_event(name, data)

    def missed(self, through: int) -> int:
        """Commits after the first `hello`, up to version `through`, never handed on (versions
        are consecutive: each commit is the one before plus one)."""
        if self.first is None:
            return max(0, through)
        seen = {v for v in self.commits if self.first < v <= through}
        return (through - self.first) - len(seen)
