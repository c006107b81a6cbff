"""A request's head, read once: the headers the front door (`front.py`) and the routes in
front of FastAPI act on."""

from __future__ import annotations

HEADER = b"x-session-id"  # the session a request names (`cluster_front.py`)
# the headers coding agents name their conversation in, first found first: on the /v1/ routes
# they name it where `x-session-id` is not sent (a value that is no valid name is ignored)
AGENT_HEADERS = (b"x-claude-code-session-id", b"session-id", b"thread-id")
IDEMPOTENCY = b"idempotency-key"
KEY = "prepos.head"  # the scope's key for its request's `Head`


class Head:
    """What the front reads of a request's headers, in one pass: the first of each named
    header, the agents' session headers, and the head's size (the request line's path and
    query and every header, as the HTTP protocol's guard counts it)."""

    __slots__ = ("host", "origin", "media", "length", "chunked", "fetch_site", "auth",
                 "session", "agents", "idempotent", "size")

    def __init__(self, scope) -> None:
        self.host = self.origin = self.media = self.length = self.fetch_site = None
        self.auth = self.session = None
        self.chunked = self.idempotent = False
        self.agents: dict[bytes, bytes] = {}
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        for name, value in scope["headers"]:
            size += len(name) + len(value) + 4
            if name == b"host":
                self.host = value if self.host is None else self.host
            elif name == b"content-length":
                self.length = value if self.length is None else self.length
            elif name == b"content-type":
                self.media = value if self.media is None else self.media
            elif name == b"authorization":
                self.auth = value if self.auth is None else self.auth
            elif name == b"origin":
                self.origin = value if self.origin is None else self.origin
            elif name == HEADER:
                self.session = value if self.session is None else self.session
            elif name == IDEMPOTENCY:
                self.idempotent = True
            elif name == b"transfer-encoding":
                self.chunked = True
            elif name == b"sec-fetch-site":
                self.fetch_site = value
            elif name in AGENT_HEADERS:
                self.agents.setdefault(name, value)
        self.size = size

    @property
    def body(self) -> bool:
        """A body is sent: a length other than 0, or one sent in chunks."""
        return self.chunked or self.length not in (None, b"0", b"")


def of(scope) -> Head:
    """The request's `Head`, read once and kept in its scope."""
    head = scope.get(KEY)
    if head is None:
        head = scope[KEY] = Head(scope)
    return head
