"""What a web page may send: the checks that keep a browser from driving a server it can
reach, keys or not, before any route runs.

A page the user visits can make the browser send requests to `127.0.0.1:8000`. Three checks
stop it, each refusing with a JSON error and changing nothing:

- **Host** (DNS rebinding: a page's own name made to resolve to this machine, so that the
  browser counts the server as the page's own origin and lets the page read its answers).
  The `Host` header must be an IP address (no name was resolved), `localhost` or a name under
  it, the name the server was bound to, this machine's own name where the server listens
  beyond loopback, or one of `--allowed-hosts` (`.example.com` takes its subdomains too;
  `*` takes any host). Else 403 `host_not_allowed`. Ollama and Jupyter check hosts so.
- **Origin** on every request that may change something (any method but GET, HEAD and
  OPTIONS): a browser names the page's origin in `Origin`; the request is taken only from
  the server's own origin (the console at `/ui`) or one of `--allowed-origins` (`*`: any).
  Else 403 `origin_not_allowed`. A request a browser marks `Sec-Fetch-Site: cross-site`
  without an `Origin` is refused the same way. Clients that are not browsers send neither.
- **Content-Type**: a body sent with any method but GET, HEAD and OPTIONS must be JSON
  (`application/json`, or a `+json` type); else 415 `unsupported_media_type`. A browser
  sends `text/plain`, form data and files cross-site without asking first (a CORS preflight);
  JSON it sends only after one, which this server answers only for `--allowed-origins`.
"""

from __future__ import annotations

import ipaddress
import socket

from prepos.server.http.auth import loopback
from prepos.server.http.errors import ApiError
from prepos.server.http.head import Head

SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


class CrossSite:
    """The checks for a server bound to `bound` (the `--host` it listens on), with
    `allowed_hosts` and `allowed_origins` (CORS's) taken besides."""

    def __init__(self, bound: str | None, allowed_hosts=(), allowed_origins=()):
        hosts = {h.strip().lower().rstrip(".") for h in allowed_hosts if h.strip()}
        self.any_host = "*" in hosts
        self.suffixes = tuple(h for h in hosts if h.startswith("."))
        self.hosts = {h for h in hosts if not h.startswith(".")} | {"localhost",
                                                                    "localhost.localdomain"}
        if bound:
            name = bound.strip().strip("[]").lower()
            if not _ip(name):
                self.hosts.add(name)
            if not loopback(name):  # reachable by this machine's own names too
                self.hosts.update(n.lower() for n in (socket.gethostname(), socket.getfqdn())
                                  if n)
        self.origins = {o.strip().rstrip("/").lower() for o in allowed_origins if o.strip()}
        self.any_origin = "*" in self.origins
        self._known: set[bytes] = set()  # Host headers seen and allowed (a client's are few)

    def check(self, scope, head=None) -> ApiError | None:
        """The refusal of an HTTP request's scope, or None where it may go on (`head`: its
        `head.Head`, read here where not given)."""
        head = head or Head(scope)
        host, origin = head.host, head.origin
        if host is not None and host not in self._known:
            if not self.host_allowed(host.decode("latin-1")):
                return ApiError(403, "host_not_allowed", f"this server does not answer requests "
                                f"for host {host.decode('latin-1')[:100]!r}: start it with "
                                "--allowed-hosts naming that host to allow it")
            if len(self._known) < 64:
                self._known.add(host)
        if scope["method"] in SAFE:
            return None
        if origin is not None:
            if not self.origin_allowed(origin.decode("latin-1"), host, scope):
                return _refused(origin.decode("latin-1"))
        elif head.fetch_site == b"cross-site":
            return _refused("another site")
        if head.body and not _json(head.media):
            got = "none" if head.media is None else repr(head.media.decode("latin-1")[:100])
            return ApiError(415, "unsupported_media_type", f"this route takes a JSON body: send "
                            f"Content-Type: application/json (got {got})")
        return None

    def host_allowed(self, header: str) -> bool:
        if self.any_host:
            return True
        host = _hostname(header)
        if host is None:
            return False
        if _ip(host) or host in self.hosts or host.endswith(".localhost"):
            return True
        return any(host.endswith(s) or host == s[1:] for s in self.suffixes)

    def origin_allowed(self, origin: str, host: bytes | None, scope) -> bool:
        o = origin.strip().rstrip("/").lower()
        if self.any_origin or o in self.origins:
            return True
        if host is None or o == "null":
            return False
        own = f"{scope.get('scheme', 'http')}://{host.decode('latin-1').lower()}"
        return o == own


def _refused(origin: str) -> ApiError:
    return ApiError(403, "origin_not_allowed", f"this server does not take requests that change "
                    f"something from web pages of {origin[:100]!r}: start it with "
                    "--allowed-origins naming that origin to allow them")


def _json(media: bytes | None) -> bool:
    if media is None:
        return False
    kind = media.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/")
                                           and kind.endswith(b"+json"))


def _hostname(header: str) -> str | None:
    """The host of a `Host` header, without its port; None where it is not one."""
    h = header.strip().lower()
    if h.startswith("["):  # an IPv6 literal
        end = h.find("]")
        return h[1:end] if end > 0 else None
    name, _, port = h.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


def _ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True

