"""A streamed body written by its producer's thread (`server/http/direct.py`), on a real TCP
connection: every chunk arrives once, in order, framed as HTTP/1.1 chunked data, also when
the reader is slow (the socket takes a chunk in part and the rest goes by the event loop's
transport), and a failed stream ends in the chunk generator's own last chunks. No timing:
the reader starts only once every event has been pushed."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from prepos.core import AnswerPath, Match, Result
from prepos.decode.stream import Stream, TokenEvent
from prepos.server.http.direct import DirectBody


async def chunks(source):
    yield b"first"
    try:
        async for ev in source:
            if ev.text:  # an event with no text makes no chunk
                yield ev.text.encode()
    except RuntimeError as exc:
        yield b"error: " + str(exc).encode()
    yield b"last"


def unchunk(raw: bytes) -> list[bytes]:
    out = []
    while raw:
        size, _, raw = raw.partition(b"\r\n")
        n = int(size, 16)
        out.append(raw[:n])
        assert raw[n:n + 2] == b"\r\n"
        raw = raw[n + 2:]
    return out


def serve_one(events: list[TokenEvent], fail: bool, pushed: threading.Event, make=chunks):
    """A connection handler whose body is `events` written directly by a producer thread,
    through `make`'s chunks; and the outcome it fills in."""
    outcome: dict = {}

    async def handler(reader, writer):
        transport = writer.transport
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                       4096)
        stream = Stream()
        body = DirectBody(stream, make, transport, None)

        def produce():
            for ev in events:
                stream.push(ev)
            if fail:
                stream.fail(RuntimeError("the engine went away"))
            else:
                stream.finish(Result(AnswerPath.COLD, Match.NONE))
            pushed.set()

        threading.Thread(target=produce).start()
        try:
            await body.run()
        except RuntimeError as exc:
            outcome["error"] = exc
        outcome["via_loop"] = body.via_loop
        outcome["cancelled"] = stream.cancelled
        await writer.drain()
        writer.close()

    return handler, outcome


@pytest.mark.parametrize("fail", [False, True])
def test_every_chunk_once_in_order_to_a_slow_reader(fail):
    texts = [f"{i:04d}" + "x" * 5000 if i % 7 else "" for i in range(200)]
    events = [TokenEvent(i, t) for i, t in enumerate(texts)]
    pushed = threading.Event()
    handler, outcome = serve_one(events, fail, pushed)
    received = run(handler, pushed)
    want = [b"first", *[t.encode() for t in texts if t]]
    want += [b"error: the engine went away"] if fail else []
    assert unchunk(received) == want + [b"last"]
    # 1 MB through buffers of a few KB: the socket took a chunk in part
    assert outcome["via_loop"] and not outcome["cancelled"]


def run(handler, pushed: threading.Event) -> bytes:
    """What a reader of one connection to `handler` receives, reading once `pushed`."""
    received = bytearray()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def read():
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", port))
                assert pushed.wait(60)  # every event pushed before a byte is read
                while data := s.recv(65536):
                    received.extend(data)

        await asyncio.to_thread(read)
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    return bytes(received)


def test_chunks_that_await_anything_else_fail_loudly_and_cancel_the_stream():
    async def waits(source):
        yield b"first"
        await asyncio.sleep(0)  # not one of its events: it cannot run on the producer
        async for ev in source:
            yield ev.text.encode()

    pushed = threading.Event()
    handler, outcome = serve_one([TokenEvent(1, "a")], False, pushed, waits)
    assert unchunk(run(handler, pushed)) == [b"first"]
    assert "awaited" in str(outcome["error"]) and outcome["cancelled"]
