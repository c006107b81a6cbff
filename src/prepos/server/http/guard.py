"""The HTTP protocol's guard: uvicorn's httptools protocol (llhttp, the parser Node.js uses)
with the bounds a public server needs.

- A request's line and headers are at most `max_header_bytes` (431, a JSON error, then the
  connection closes): without it a client could send headers without end.
- A whole request, headers and body, must arrive within `request_timeout` seconds of its
  first byte (a new connection counts from its opening): a half-sent request is answered
  408 and closed instead of holding a connection (and its memory) open forever.
- A request the parser cannot read is answered 400 with a JSON error, as every other.

Idle keep-alive connections are closed by uvicorn's own `timeout_keep_alive`. httptools,
not h11: a request's parse and its response's head cost a fraction of h11's pure Python,
on the cores the model decodes on.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from prepos.server.http.direct import TRANSPORT
from prepos.server.http.errors import error_body

MAX_HEADER_BYTES = 64 * 1024


def guarded_protocol(request_timeout: float, max_header_bytes: int = MAX_HEADER_BYTES):
    """A protocol class for uvicorn's `http=` with these bounds."""

    class Guarded(GuardedHttp):
        timeout = request_timeout
        max_head = max_header_bytes

    return Guarded


class GuardedHttp(HttpToolsProtocol):
    timeout = 30.0
    max_head = MAX_HEADER_BYTES

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head = 0  # bytes read while a request's line and headers were incomplete
        self._in_head = True  # the next bytes read belong to a request's head
        self._deadline = None
        # plain TCP: a streamed body may be written around the transport (`direct.py`)
        plain = transport.get_extra_info("sslcontext") is None and \
            transport.get_extra_info("socket") is not None
        self._plain = transport if plain else None
        self._arm()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def data_received(self, data: bytes) -> None:
        if self._in_head:  # a request's line and headers, not all read yet
            self._arm()
            self._head += len(data)
        super().data_received(data)
        if self._in_head and self._head > self.max_head and not self.transport.is_closing():
            self._refuse(431, "headers_too_large", f"the request line and headers are over "
                         f"this server's limit of {self.max_head} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._plain is not None:
            self.scope[TRANSPORT] = self._plain

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()  # the whole request is in
        self._in_head = True
        super().on_message_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "invalid_request", f"{msg} (not a well-formed HTTP/1.1 request)")

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


_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}
