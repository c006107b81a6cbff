"""A request forwarded to the node that owns its session (`Forwarder`): its body read up to the
server's body limit (413 beyond), its headers but the hop-by-hop ones, `x-prepos-forwarded`
signed with the cluster's secret (HMAC-SHA256; kept in the store's `meta` table, so every node
has it and no client does), the owner's answer streamed back.

The signature covers the forwarding node, a timestamp, a nonce, the method, path, query, the
session and the SHA-256 of the body, so it is bound to its one request: a request that
arrives with the header counts as forwarded only where it verifies (else the header is
dropped, as if never sent), and a verifying one is refused (403 `forwarding_refused`) where
its timestamp is more than `WINDOW_S` from this node's clock or its nonce was seen before.

A stateless conversation kept by another node (`store/directory.py`) is answered by that node
the same way, once (`hop`)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from prepos.engine import conversation_keys
from prepos.server.http.arrival import arrived
from prepos.server.http.errors import ApiError
from prepos.server.names import public
from prepos.server.store.database import Database
from prepos.server.store.lease import Claim

log = logging.getLogger("prepos.server.cluster")
FORWARDED = b"x-prepos-forwarded"
WINDOW_S = 60.0  # how far a forwarded request's timestamp may be from this node's clock
HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade",
       b"proxy-connection", b"content-length"}


class Forwarder:
    def __init__(self, secret: bytes, node: str, max_body: int):
        self.secret, self.node, self.max_body = secret, node, max_body
        self.count = 0
        self._client = None
        self._seen: dict[str, float] = {}  # nonces verified lately: their timestamps

    def client(self):
        """The HTTP client requests are forwarded to other nodes with."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=2.0))
        return self._client

    def header(self, scope, sid: str, body: bytes) -> tuple[bytes, bytes]:
        """The signed `x-prepos-forwarded` of a request this node forwards (`sid` "": a
        stateless one): `node:timestamp:nonce:mac`."""
        ts, nonce = f"{time.time():.3f}", secrets.token_hex(12)
        mac = self.sign(self.node, ts, nonce, scope, sid, body)
        return FORWARDED, f"{self.node}:{ts}:{nonce}:{mac}".encode()

    def sign(self, node: str, ts: str, nonce: str, scope, sid: str, body: bytes) -> str:
        msg = "\n".join((node, ts, nonce, scope["method"], scope["path"],
                         scope.get("query_string", b"").decode("latin-1"), sid,
                         hashlib.sha256(body).hexdigest())).encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    async def verify(self, scope, sid: str | None, receive) -> None:
        """`prepos.forwarded`: whether another node of this cluster forwarded the request
        (its header verifies, over the body: read here, kept in `prepos.body` for the app);
        a header that does not verify is dropped; one that verifies but is stale or seen
        before is refused."""
        value = dict(scope["headers"]).get(FORWARDED)
        if value is None:
            return
        body = await read_body(scope, receive, self.max_body)
        node, ts, nonce, mac = (value.decode("latin-1").rsplit(":", 3) + ["", "", ""])[:4] \
            if value.count(b":") >= 3 else ("", "", "", "")
        ok = bool(node) and hmac.compare_digest(
            mac.encode(), self.sign(node, ts, nonce, scope, sid or "", body).encode())
        scope["prepos.forwarded"] = ok
        if not ok:
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != FORWARDED]
            log.warning("a request for session %s came with an %s header that does not "
                        "verify: dropped", sid, FORWARDED.decode())
            return
        now = time.time()
        try:
            stale = abs(now - float(ts)) > WINDOW_S
        except ValueError:
            stale = True
        if stale or nonce in self._seen:
            raise ApiError(403, "forwarding_refused", "a forwarded request's signature is "
                           f"{'stale' if stale else 'used already'}: each is good for one "
                           f"request within {WINDOW_S:g} s")
        if len(self._seen) >= 4096:  # the ones past the window can no longer verify
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * WINDOW_S}
        self._seen[nonce] = now

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
        headers.append(self.header(scope, public(sid), body))  # as the owner reads it
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


async def read_body(scope, receive, most: int) -> bytes:
    """The request's body, whole (413 over `most` bytes), kept in `prepos.body`."""
    if "prepos.body" in scope:
        return scope["prepos.body"]
    chunks, n = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        n += len(chunks[-1])
        if n > most:
            raise ApiError(413, "body_too_large", f"the body is over this server's limit of "
                           f"{most} bytes")
        if not message.get("more_body", False):
            break
    body = scope["prepos.body"] = b"".join(chunks)
    return body


def replaying(raw: bytes, receive):
    """`receive` with the body, already read, given again first."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


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


async def hop(state, request: Request, owner: str | None, tools: list[dict],
              msgs: list[dict]) -> Response | None:
    """The answer of the node that keeps this stateless conversation, where another live
    node does and no conversation kept here is extended by it; None: answer it here."""
    cluster = state.cluster
    directory = cluster.directory if cluster is not None else None
    if directory is None or request.scope.get("prepos.forwarded") or \
            state.loaded.holds_conversation(owner, tools, msgs):
        return None
    try:
        url = await state.run(directory.owner, conversation_keys(owner, tools, msgs))
    except Exception as exc:  # the store is away: answered here
        log.warning("conversation lookup failed: %s", exc)
        return None
    if url is None:
        return None
    arrived(request.scope)  # its work is another node's
    import httpx

    client = cluster.forwarder.client()
    headers = [(k, v) for k, v in request.headers.raw if k not in HOP and k != FORWARDED]
    body = await request.body()
    headers.append(cluster.forwarder.header(request.scope, "", body))
    try:
        upstream = await client.send(client.build_request(
            "POST", url.rstrip("/") + request.url.path + (
                f"?{request.url.query}" if request.url.query else ""), headers=headers,
            content=body), stream=True)
    except httpx.TransportError as exc:  # dead or away: answered here, prefilled once
        log.info("conversation's node %s did not answer (%r): answered here", url, exc)
        return None
    directory.hops += 1

    async def body():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    out = {k: v for k, v in upstream.headers.items() if k.encode() not in HOP}
    return Relayed(body(), status_code=upstream.status_code, headers=out)


class Relayed(StreamingResponse):
    """Another node's answer streamed through this one. That node ran the request, so it
    records the result for the request's `Idempotency-Key` (sent on with the request);
    this node records nothing of it."""
