"""The HTTP protocol's guard: uvicorn's h11 protocol with two bounds a public server needs.

- A request's line and headers are at most `max_header_bytes` (431, a JSON error, then the
  connection closes): without it a client could send headers without end.
- A whole request, headers and body, must arrive within `request_timeout` seconds of its
  first byte (a new connection counts from its opening): a half-sent request is answered
  408 and closed instead of holding a connection (and its memory) open forever.

Idle keep-alive connections are closed by uvicorn's own `timeout_keep_alive`.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from prepos.server.http.direct import TRANSPORT
from prepos.server.http.errors import error_body

MAX_HEADER_BYTES = 64 * 1024
READ_BYTES = 256 * 1024  # the most one socket read hands the protocol (asyncio's)


def h11_buffer(max_header_bytes: int) -> int:
    """h11's own bound on an incomplete head: above the guard's, so the guard answers
    first (with its JSON 431) even when a read brings body bytes after the head."""
    return max_header_bytes + READ_BYTES


def guarded_protocol(request_timeout: float, max_header_bytes: int = MAX_HEADER_BYTES):
    """An h11 protocol class for uvicorn's `http=` with these bounds."""

    class Guarded(GuardedH11):
        timeout = request_timeout
        max_head = max_header_bytes

    return Guarded


class GuardedH11(H11Protocol):
    timeout = 30.0
    max_head = MAX_HEADER_BYTES

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head = 0  # bytes of the request line and headers seen so far
        self._deadline = None
        # plain TCP: a streamed body may be written around the transport (`direct.py`)
        plain = transport.get_extra_info("sslcontext") is None and \
            transport.get_extra_info("socket") is not None
        self._plain = transport if plain else None
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self._plain is not None and self.cycle is not None:
            self.cycle.scope.setdefault(TRANSPORT, self._plain)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a new request's line and headers
            self._arm()
            self._head += len(data)
        super().data_received(data)
        reading = self.conn.their_state
        if reading is h11.IDLE:
            if self._head > self.max_head and not self.transport.is_closing():
                self._refuse(431, "headers_too_large", f"the request line and headers are "
                             f"over this server's limit of {self.max_head} bytes")
            return
        self._head = 0
        if reading in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()  # the whole request is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self._head = 0

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete and \
                self.cycle.response_started:
            self.transport.close()  # a response is under way: nothing more can be said
            return
        self._refuse(408, "request_timeout", f"the request did not arrive within "
                     f"{self.timeout:g} s")

    def _refuse(self, status: int, code: str, message: str) -> None:
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() reports a disconnect
            self.cycle.message_event.set()
        body = json.dumps(error_body(status, code, message)).encode()
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        if not (self.cycle is not None and self.cycle.response_started):
            self.transport.write(head + body)
        self.transport.close()


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}
