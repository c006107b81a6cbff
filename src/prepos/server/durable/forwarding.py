"""A request forwarded to the node that owns its session (`Forwarder`): its body read up to the
server's body limit (413 beyond), its headers but the hop-by-hop ones, `x-prepos-forwarded`
signed with the cluster's secret (HMAC-SHA256; kept in the store's `meta` table, so every node
has it and no client does), the owner's answer streamed back. A request that arrives with that
header counts as forwarded only where it verifies; else the header is dropped, as if never
sent."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

from prepos.server.durable.lease import Claim
from prepos.server.durable.store import Database
from prepos.server.http.auth import public
from prepos.server.http.errors import ApiError

log = logging.getLogger("prepos.server.cluster")
FORWARDED = b"x-prepos-forwarded"
HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade",
       b"proxy-connection", b"content-length"}


class Forwarder:
    def __init__(self, secret: bytes, node: str, max_body: int):
        self.secret, self.node, self.max_body = secret, node, max_body
        self.count = 0
        self._client = None

    def client(self):
        """The HTTP client requests are forwarded to other nodes with."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=2.0))
        return self._client

    def header(self, scope, sid: str) -> tuple[bytes, bytes]:
        """The signed `x-prepos-forwarded` of a request this node forwards (`sid` "": a
        stateless one)."""
        return FORWARDED, f"{self.node}:{self.sign(self.node, scope, sid)}".encode()

    def sign(self, node: str, scope, sid: str) -> str:
        msg = "\n".join((node, scope["method"], scope["path"], sid)).encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    def verify(self, scope, sid: str | None) -> None:
        """`prepos.forwarded`: whether another node of this cluster forwarded the request
        (its header verifies); a header that does not is dropped."""
        value = dict(scope["headers"]).get(FORWARDED)
        if value is None:
            return
        node, _, mac = value.decode("latin-1").rpartition(":")
        ok = bool(node) and hmac.compare_digest(mac.encode(),
                                                self.sign(node, scope, sid or "").encode())
        scope["prepos.forwarded"] = ok
        if not ok:
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != FORWARDED]
            log.warning("a request for session %s came with an %s header that does not "
                        "verify: dropped", sid, FORWARDED.decode())

    async def forward(self, claim: Claim, sid: str, scope, receive, send) -> bool:
        """The request, answered by the owner's node; False where that node refused the
        connection, or broke it off before answering a request that may run again
        (`redoable`): nothing was sent, the caller waits its lease out and takes over."""
        import httpx

        client = self.client()
        body = scope.get("prepos.body")
        chunks = scope.setdefault("prepos.chunks", [])
        while body is None:  # kept whole: served here after all if the owner refuses
            message = await receive()
            if message["type"] != "http.request":
                return True  # the client left
            chunks.append(message.get("body", b""))
            scope["prepos.read"] = scope.get("prepos.read", 0) + len(chunks[-1])
            if scope["prepos.read"] > self.max_body:
                raise ApiError(413, "body_too_large", f"the body is over this server's "
                               f"limit of {self.max_body} bytes")
            if not message.get("more_body", False):
                body = scope["prepos.body"] = b"".join(chunks)
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP and k != FORWARDED]
        headers.append(self.header(scope, public(sid)))  # as the owner reads the request
        target = claim.url.rstrip("/") + scope["path"]
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        self.count += 1
        try:
            req = client.build_request(scope["method"], target, headers=headers, content=body)
            upstream = await client.send(req, stream=True)
        except httpx.ConnectError as exc:
            log.info("session %s: its owner %s refused the connection (%r); waiting its lease "
                     "out", sid, claim.node, exc)
            scope["prepos.dead"].add(claim.url)
            return False
        except httpx.TransportError as exc:
            if redoable(scope):  # it died with the request: taken over here, run again
                log.info("session %s: its owner %s broke off %r; waiting its lease out",
                         sid, claim.node, exc)
                scope["prepos.dead"].add(claim.url)
                return False
            log.warning("session %s: forwarding to %s failed: %r", sid, claim.node, exc)
            raise ApiError(503, "owner_unreachable", f"session {public(sid)}'s owner node "
                           f"{claim.node} did not answer, and this request has no "
                           "Idempotency-Key: it may have committed; retry with one",
                           headers={"Retry-After": "1"}) from None
        try:
            out = [(k.encode("latin-1"), v.encode("latin-1"))
                   for k, v in upstream.headers.multi_items() if k.encode() not in HOP]
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": out})
            async for chunk in upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await upstream.aclose()
        return True


def redoable(scope) -> bool:
    """Whether a request its owner broke off (a connection that failed once sent: the node
    died with it) may run again on the node that takes the session over: a read, or a
    mutation with an `Idempotency-Key` (its commit, if any, is found by its key)."""
    return scope["method"] in ("GET", "HEAD") or any(
        k == b"idempotency-key" for k, _ in scope["headers"])


def shared_secret(db: Database) -> bytes:
    """The key every node of the store signs forwarded requests with: made by the first
    node, kept in the store's `meta` table."""
    db.q("INSERT INTO meta VALUES ('cluster_secret', ?) ON CONFLICT (key) DO NOTHING",
         (secrets.token_hex(32),))
    return bytes.fromhex(db.q("SELECT value FROM meta WHERE key='cluster_secret'"
                              ).fetchone()[0])
