"""The replicas' HTTP transport: httpx's client API over urllib3's connection pools.

A relayed token is one server-sent event read from the engine's stream, and its reading runs
on the cores the engine decodes on. httpx's own transport (httpcore and h11) spends about
twice what urllib3 does on each such event (http.client's reader under it); so `Replica`'s
httpx client sends through this transport, the one httpx's documentation points to for
urllib3. Its failures are raised as httpx's exceptions, so a caller handles one family
whichever transport (tests give an `httpx.MockTransport`).

A body closed before its end closes its connection (an engine aborts a request whose client
left); one read to its end puts the connection back in the pool."""

from __future__ import annotations

import contextlib
from typing import Iterator

import httpx
import urllib3
from urllib3 import exceptions as u3


@contextlib.contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    try:
        yield
    except u3.NewConnectionError as exc:  # refused, unreachable (urllib3 makes it a
        raise httpx.ConnectError(str(exc), request=request) from exc  # ConnectTimeoutError)
    except u3.ConnectTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc), request=request) from exc
    except u3.ReadTimeoutError as exc:
        raise httpx.ReadTimeout(str(exc), request=request) from exc
    except u3.ProtocolError as exc:  # closed or reset: a pooled connection the server dropped
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except (u3.HTTPError, OSError) as exc:
        raise httpx.NetworkError(str(exc), request=request) from exc


class _Body(httpx.SyncByteStream):
    def __init__(self, response: urllib3.BaseHTTPResponse, request: httpx.Request):
        self.response = response
        self.request = request

    def __iter__(self) -> Iterator[bytes]:
        r = self.response
        with _as_httpx(self.request):  # each chunk as it comes (an event, from an engine)
            yield from (r.read_chunked(decode_content=False) if r.chunked
                        else r.stream(65536, decode_content=False))

    def close(self) -> None:
        if not self.response.closed:  # left before its end: the connection is not reused
            self.response.close()
        self.response.release_conn()


class Urllib3Transport(httpx.BaseTransport):
    """Pooled connections (`maxsize` kept per host); no retries or redirects of its own."""

    def __init__(self, maxsize: int = 32):
        self.pools = urllib3.PoolManager(maxsize=maxsize, retries=False)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout") or {}
        with _as_httpx(request):
            r = self.pools.urlopen(
                request.method, str(request.url), body=request.read(),
                headers=urllib3.HTTPHeaderDict(request.headers.multi_items()),
                redirect=False, retries=False, preload_content=False, decode_content=False,
                timeout=urllib3.Timeout(connect=t.get("connect"), read=t.get("read")))
        return httpx.Response(r.status, headers=list(r.headers.items()),
                              stream=_Body(r, request))

    def close(self) -> None:
        self.pools.clear()
