"""The ASGI layer in front of the whole app (the fast route included): the session a
request names, and who serves it.

`ClusterFront` finds the session a request names (the `x-session-id` header, the
`/sessions/{id}` path, or an OpenAI body's `session_id`; the header alone names it for the
OpenAI routes too, and there the headers coding agents name their conversation in stand for it
where `x-session-id` is not sent: Claude Code's `x-claude-code-session-id`, Codex's
`session-id` and `thread-id`) and puts `x-session-id` on the response, so a router can hash
on it both ways. On a node of a cluster (`prepos.server.cluster`) it also asks the cluster who
serves the request: here, or the owner it is forwarded to (`forwarding.py`).
"""

from __future__ import annotations

import json
import logging
import re
import time

from prepos.errors import PreposError
from prepos.server.http.errors import ApiError, as_api_error
from prepos.server.http.forwarding import replaying
from prepos.server.http.head import AGENT_HEADERS, HEADER, of

log = logging.getLogger("prepos.server.cluster")
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
SLOW_S = 5.0  # a request on a session slower than this is logged
NAMED_IN_BODY = ("/v1/chat/completions", "/v1/completions")
CLIENT_NAMED = (*NAMED_IN_BODY, "/v1/responses")  # a name no session has is the client's


def named_session(scope) -> tuple[str | None, bool]:
    """The session id the path or `x-session-id` names, and whether the header gave it;
    400 where they differ."""
    head = of(scope)
    header = None if head.session is None else head.session.decode("latin-1").strip() or None
    path = scope["path"]
    if header is None and head.agents and path.startswith("/v1/"):
        agents = {k: v.decode("latin-1").strip() for k, v in head.agents.items()}
        header = next((agents[h] for h in AGENT_HEADERS if SESSION_ID.fullmatch(
            agents.get(h, ""))), None)
    in_path = None
    if path.startswith("/sessions/"):
        in_path = path[len("/sessions/"):].split("/", 1)[0] or None
    if header is not None and not SESSION_ID.fullmatch(header):
        raise ApiError(400, "invalid_session_id", "x-session-id must be 1-128 letters, "
                       f"digits and ._:- (starting with a letter or digit), got {header[:140]!r}")
    if in_path is not None and not SESSION_ID.fullmatch(in_path):
        in_path = None  # no session's id: the route answers 404
    if header and in_path and header != in_path:
        raise ApiError(400, "session_id_mismatch", f"x-session-id {header!r} names another "
                       f"session than the path's {in_path!r}")
    return in_path or header, header is not None


class ClusterFront:
    """The ASGI layer in front of the app: the session's id both ways, and ownership where
    the store is shared (`cluster`, set once the node has joined)."""

    def __init__(self, respond):
        self.respond = respond  # an ApiError as the app's JSON error response
        self.cluster = None  # the node's `prepos.server.cluster.Cluster`

    async def __call__(self, scope, receive, send, app) -> None:
        t0 = time.monotonic()
        sent = receive  # the client's body, as sent
        try:
            sid, from_header = named_session(scope)
            cluster = self.cluster
            if scope["method"] == "POST" and scope["path"] in NAMED_IN_BODY and (
                    from_header or cluster is not None) and of(scope).length is not None:
                # a declared length, within the limit (the front door refused the rest)
                sid, receive = await with_body_session(sid, receive)
            if cluster is not None:
                await cluster.forwarder.verify(scope, sid, receive)
            if cluster is not None and sid is not None and not (
                    scope["method"] == "POST" and scope["path"] == "/sessions") and \
                    (held := await cluster.may_claim(sid, scope)) is not None:
                while not await cluster.serve_here(held, scope):
                    if await cluster.forward(held, scope, receive, send):
                        slow(scope, sid, t0, "forwarded")
                        return  # the owner answered; else it is dead: wait it out
            if "prepos.body" in scope:  # read to verify it, or for a forward that found no one
                receive = replaying(scope["prepos.body"], sent)
        except (ApiError, PreposError) as exc:  # before any byte of a response was sent
            err = exc if isinstance(exc, ApiError) else as_api_error(exc)
            if err.status == 503:  # a lease lost or contended: retry shortly
                err.headers.setdefault("Retry-After", "1")
            return await self.respond(err, scope["path"])(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                found = sid
                for name, value in headers:
                    if name == b"x-prepos-session" or (found is None and name == b"location"
                                                       and value.startswith(b"/sessions/")):
                        found = value.decode("latin-1").rsplit("/", 1)[-1]
                        found = found if SESSION_ID.fullmatch(found) else None
                if found is not None:
                    headers.append((HEADER, found.encode("latin-1")))
                    if cluster is not None:  # who served it
                        headers.append((b"x-prepos-node", cluster.leases.node.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, tagged)
        if cluster is not None and sid is not None:
            slow(scope, sid, t0, "served here")


def slow(scope, sid: str, t0: float, how: str) -> None:
    """A request on a session that took long is logged (a takeover's wait, a recompute)."""
    took = time.monotonic() - t0
    if took > SLOW_S:
        log.warning("session %s: %s %s %s in %.1f s", sid, scope["method"], scope["path"],
                    how, took)


async def with_body_session(sid: str | None, receive):
    """An OpenAI body's `session_id`, or the header's written into a body that has none;
    the body replayed to the app."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return sid, receive
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    raw = b"".join(chunks)
    if sid is not None or b'"session_id"' in raw:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the route says what is wrong with it
        if isinstance(body, dict):
            named = body.get("session_id")
            if sid is not None and named is not None and named != sid:
                raise ApiError(400, "session_id_mismatch", f"x-session-id {sid!r} names "
                               f"another session than the body's {named!r}", "session_id")
            if named is None and sid is not None:
                raw = json.dumps({**body, "session_id": sid}).encode()
            sid = named if isinstance(named, str) and SESSION_ID.fullmatch(named) else sid
    return sid, replaying(raw, receive)
