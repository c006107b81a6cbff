"""The replicas' HTTP transport (`backends/http_transport.py`) against a real socket server,
and the reading of an engine's event stream (`Replica._events`) however its bytes are cut."""

from __future__ import annotations

import gzip
import json
import socket
import threading

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.backends.http_transport import Urllib3Transport
from prepos.backends.remote_adapters import make_adapter
from prepos.backends.remote_protocol import HttpCall, RemoteError, ReplicaFailure
from prepos.backends.remote_replica import Replica


class Server:
    """A listening socket; each connection is handed to `serve(conn)` on its own thread,
    and counted."""

    def __init__(self, serve):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.serve = serve
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn):
        with conn:
            try:
                self.serve(conn)
            except OSError:
                pass

    def close(self):
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept: nothing listens
        self.sock.close()


def read_request(conn) -> bytes | None:
    """One request's head and body (by content-length); None at the end of the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return None
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" \
              b"transfer-encoding: chunked\r\n\r\n"


def client() -> httpx.Client:
    return httpx.Client(transport=Urllib3Transport(), timeout=5)


def test_each_chunk_is_read_as_it_comes_and_a_whole_body_keeps_its_connection():
    sent = [threading.Event() for _ in range(3)]
    read = [threading.Event() for _ in range(3)]

    def serve(conn):
        while read_request(conn) is not None:
            conn.sendall(STREAM_HEAD)
            for i in range(3):  # the next chunk only once the client has read this one
                conn.sendall(chunk(b"data: %d\n\n" % i))
                sent[i].set()
                assert read[i].wait(5)
            conn.sendall(b"0\r\n\r\n")

    srv = Server(serve)
    with client() as c:
        for _ in range(2):
            for e in sent + read:
                e.clear()
            got = []
            with c.stream("POST", srv.url + "/s", json={"a": 1}) as r:
                assert r.status_code == 200
                for i, data in enumerate(r.iter_raw()):
                    got.append(data)
                    read[i].set()
            assert got == [b"data: %d\n\n" % i for i in range(3)]
    assert srv.connections == 1  # the second request on the first connection
    srv.close()


def test_a_body_left_before_its_end_closes_its_connection():
    ended = threading.Event()

    def serve(conn):
        read_request(conn)
        conn.sendall(STREAM_HEAD + chunk(b"data: 0\n\n"))
        while conn.recv(65536):  # until the client closes (it sends nothing more)
            pass
        ended.set()

    srv = Server(serve)
    with client() as c, c.stream("GET", srv.url + "/s") as r:
        next(r.iter_raw())
    assert ended.wait(5)
    srv.close()


def test_a_json_answer_and_the_failures_as_httpx_raises_them():
    def serve(conn):
        while (req := read_request(conn)) is not None:
            if b" /json " in req:
                body = json.dumps({"ok": True}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
            elif b" /cut " in req:  # the connection dropped in the middle of the body
                conn.sendall(STREAM_HEAD + chunk(b"data: 0\n\n"))
                return
            elif b" /slow " in req:
                threading.Event().wait(2)
                return

    srv = Server(serve)
    with client() as c:
        assert c.get(srv.url + "/json").json() == {"ok": True}
        with pytest.raises(httpx.RemoteProtocolError), c.stream("GET", srv.url + "/cut") as r:
            list(r.iter_raw())
        with pytest.raises(httpx.ReadTimeout):
            c.get(srv.url + "/slow", timeout=0.2)
    srv.close()
    with client() as c, pytest.raises(httpx.ConnectError):  # nothing listens there now
        c.get(srv.url + "/json")


# -- the event stream, cut anywhere ----------------------------------------------------------
EVENTS = [{"tokens": [i], "content": "é" * i, "stop": i == 3} for i in range(4)]
EVENTS[1]["logprob"] = float("-inf")  # Python's json writes -Infinity, which JSON has not


def body(events, crlf: bool) -> bytes:
    eol = b"\r\n" if crlf else b"\n"
    out = b": a comment" + eol + eol
    for ev in events:
        out += b"data: " + json.dumps(ev, ensure_ascii=False).encode() + eol + eol
    return out + b"data: [DONE]" + eol + eol + b"data: {\"after\": 1}" + eol


def replica(pieces: list[bytes], gzipped: bool = False) -> Replica:
    def handle(request):
        headers = {"content-type": "text/event-stream"}
        if gzipped:  # the pieces are cut from the compressed body: httpx decodes it
            headers["content-encoding"] = "gzip"
        return httpx.Response(200, headers=headers, content=iter(pieces))
    return Replica("http://e", make_adapter("llama.cpp"), 5, 1, httpx.MockTransport(handle))


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12), crlf=st.booleans(),
       gzipped=st.booleans())
def test_the_events_are_the_same_however_the_bytes_are_cut(cuts, crlf, gzipped):
    data = body(EVENTS, crlf)
    if gzipped:
        data = gzip.compress(data)
    at = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *at], [*at, len(data)]) if b > a]
    rep = replica(pieces, gzipped)
    with rep.stream(HttpCall("POST", "/completion", {})) as events:
        assert list(events) == EVENTS  # nothing after [DONE]
    rep.close()


def test_an_error_event_and_a_bad_event_fail_cleanly():
    for line, error in ((b"error: {\"message\": \"no slot\"}\n\n", RemoteError),
                        (b"data: {not json\n\n", ReplicaFailure)):
        rep = replica([line])
        with pytest.raises(error), rep.stream(HttpCall("POST", "/completion", {})) as events:
            list(events)
        rep.close()
