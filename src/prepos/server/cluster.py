"""Several nodes on one shared store: who serves a session.

A node joins (`join`) when its store is shared (PostgreSQL). The HTTP layer's
`ClusterFront` (`server/http/cluster_front.py`) asks `Cluster` about each request that names
a session:
- this node owns the session (its lease held with margin): served here, no store access;
- the session is free or its owner dead: claimed (`Leases.claim`), loaded from the store
  where this node's copy is not the store's (its KV recomputed, pre-positioned again), served;
- another node owns it: the request is forwarded to it, once (a forwarded request that
  finds another owner again gets 409 `session_moved` naming the node, never its URL); an
  owner that does not answer (refuses the connection, or breaks it off before answering a
  request that may run again: a read, or one with an `Idempotency-Key`) is waited out until
  its lease expires, then taken over, and the request is answered here; past the lease + 1 s,
  503 `takeover_timeout` with `Retry-After`; meanwhile the session is loaded here and its KV
  rebuilt (`Cluster.warm`), unserved, so the takeover finds it ready.
Nothing of that runs for a request whose API key is missing or not valid (401 first), nor for
one of a key the store's session is not owned by (the app answers 404). Forwarding, and which
requests count as forwarded: `server/http/forwarding.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

from prepos.engine import is_ephemeral
from prepos.errors import PreposError
from prepos.server.http.cluster_front import CLIENT_NAMED, SESSION_ID
from prepos.server.http.errors import ApiError
from prepos.server.http.forwarding import Forwarder, shared_secret
from prepos.server.names import public, scoped
from prepos.server.store.database import Database
from prepos.server.store.journal import Journal
from prepos.server.store.lease import Claim, LeaseConfig, Leases

log = logging.getLogger("prepos.server.cluster")


def mark(sid: str, stage: str) -> None:
    """A step of a takeover, on the wall clock (benchmarks/cluster.py lines them up)."""
    log.info("takeover %s at %.3f: %s", sid, time.time(), stage)


class Cluster:
    """This node's part of a cluster: its leases, takeovers and forwarding."""

    def __init__(self, state, engine, journal: Journal, db: Database, config: LeaseConfig):
        self.state = state
        self.engine = engine
        self.journal = journal
        self.leases = Leases(db, config, on_lapse=self._give_up)
        self.config = config
        self.forwarder = Forwarder(shared_secret(db), self.leases.node,
                                   state.config.limits.max_body_bytes)
        self.takeovers = 0
        self._locks: dict[str, asyncio.Lock] = {}
        # copies being closed here, their lease kept: why (their subscriptions' `end` reason)
        self._dropping: dict[str, str] = {}
        self.directory = None  # the stateless conversations' (server/store/directory.py)
        journal.fence = self.leases.fence
        engine.subscribe(self._on_event)
        state.subscriptions.closing_reason = self._dropping.get

    def start(self, url: str) -> None:
        self.leases.start(url)

    def stop(self) -> None:
        self.leases.stop()

    async def may_claim(self, name: str, scope) -> str | None:
        """The id of the caller's session `name` (`scoped`) where the request may make this
        node claim or take it over, else None: a valid key (401 otherwise, before any lease
        or store work) of the session's owner where the store has the session (else no
        lease is touched: the app answers 404). An OpenAI request naming no stored session
        names a conversation of the client's: served here, no lease (the app answers it
        statelessly)."""
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization") or (  # Anthropic's clients send x-api-key
            b"Bearer " + headers[b"x-api-key"] if b"x-api-key" in headers else b"")
        owner = self.state.keys.owner_of(auth.decode("latin-1") or None)
        client_named = scope["path"] in CLIENT_NAMED
        for sid in dict.fromkeys((scoped(owner, name), name)):  # as `session_named` finds it
            if self.leases.owns(sid) or owner is None and not client_named:
                return sid
            row = await self.state.run(lambda sid=sid: self.leases.db.q(
                "SELECT spec FROM sessions WHERE id=?", (sid,)).fetchone())
            if row is None:
                continue
            try:
                stored = json.loads(row[0]).get("owner")
            except (ValueError, AttributeError):
                return sid
            if stored == owner:
                return sid
        # not stored (yet): the lease says who makes it
        return None if client_named else scoped(owner, name)

    async def serve_here(self, sid: str, scope) -> bool:
        """Whether this node serves `sid` now: owned, or claimed (and loaded) now. While a
        dead owner's lease runs out, the session is loaded and its KV rebuilt here (`warm`),
        not served: at the claim only what was committed since is redone."""
        leases = self.leases
        if leases.owns(sid):
            return True
        lock = self._locks.setdefault(sid, asyncio.Lock())
        warming = None
        async with lock:
            try:
                deadline = asyncio.get_running_loop().time() + self.config.lease_s + 1
                while True:
                    claim: Claim = await self.state.run(leases.claim, sid)
                    if claim.ours:
                        if claim.fresh:
                            mark(sid, "claimed")
                            if warming is not None:  # take_over checks what it left
                                await asyncio.gather(warming, return_exceptions=True)
                            await self.state.run(self.take_over, sid)
                        warming = None
                        return True
                    dead = scope.setdefault("prepos.dead", set())
                    forwarded = scope.get("prepos.forwarded", False)
                    if not forwarded and claim.url and claim.url not in dead:
                        scope["prepos.owner"] = claim
                        return False
                    if forwarded and claim.url not in dead:
                        raise ApiError(409, "session_moved", f"session {public(sid)} is owned "
                                       f"by node {claim.node}, which did not take this "
                                       "request; retry",
                                       headers={"Retry-After": "1"})
                    if asyncio.get_running_loop().time() > deadline:
                        raise ApiError(503, "takeover_timeout", f"session {public(sid)}'s "
                                       f"owner node {claim.node} does not answer and its "
                                       "lease did not run out in time; retry",
                                       headers={"Retry-After": "1"})
                    if warming is None:
                        mark(sid, f"waiting (owner {claim.node}, {claim.expires_in:.3f} s left)")
                        warming = asyncio.ensure_future(self.state.run(self.warm, sid))
                    await asyncio.sleep(min(claim.expires_in + 0.05, 0.5))
            finally:
                if warming is not None:  # claimed by another node, or given up: not ours
                    await asyncio.gather(warming, return_exceptions=True)
                    await self.state.run(self.unwarm, sid)
                if len(self._locks) > 4096:
                    self._locks = {k: v for k, v in self._locks.items() if v.locked()}

    def warm(self, sid: str) -> None:
        """Load `sid` from the store and rebuild its KV (foreground: a request waits for it),
        then pre-position it, before this node owns it. Nothing is written and nothing is
        served from it until the claim (`ClusterFront` serves only owned sessions), and `take_over`
        keeps it only if it is still the store's latest."""
        if self.engine.has_session(sid):
            return
        found = self.journal.load_one(sid)
        if found is None:
            return
        _, spec, history = found
        mark(sid, "warming")
        self.engine.restore_session(sid, spec, history, warm=True)
        mark(sid, "warm")

    def unwarm(self, sid: str) -> None:
        """A warmed copy of `sid` this node did not get to own: closed (the store's rows
        stay)."""
        if sid not in self.leases.owned:
            self._drop(sid, "moved")

    def take_over(self, sid: str) -> None:
        """Load `sid` from the store unless this node's copy is the store's: its KV is
        recomputed at idle priority and it is pre-positioned again."""
        found = self.journal.load_one(sid)
        mark(sid, "loaded")
        eng = self.engine
        if found is None:  # not in the store: nothing to own
            self.leases.release(sid)
            self._drop(sid, "moved")
            return
        _, spec, history = found
        if eng.has_session(sid):
            try:
                snap = eng.snapshot(sid)
                if snap.version == history[-1][0] and list(snap.messages) == history[-1][1]:
                    self.takeovers += 1
                    mark(sid, "kept this node's copy: the store's latest")
                    return  # this node's copy is the store's: keep it, and its KV
            except PreposError:
                pass
            self._drop(sid, "moved")
            found = self.journal.load_one(sid)  # closing the copy forgot the store's rows
            if found is None:
                self.leases.release(sid)
                return
            _, spec, history = found
        eng.restore_session(sid, spec, history)
        self.takeovers += 1
        mark(sid, "restored")
        log.info("node %s took session %s over at version %d", self.leases.node, sid,
                 history[-1][0])

    def _drop(self, sid: str, why: str) -> None:
        """Close this node's copy of `sid`, leaving the store's rows, and wait until its KV
        is gone (so a session restored with the same id starts clean); its subscriptions
        end with `why` (`lease_lost`, `moved`)."""
        eng = self.engine
        if not eng.has_session(sid):
            return
        self.journal.moving.add(sid)
        self._dropping[sid] = why  # the journal forgets `moving` in its own close listener
        try:
            eng.close_session(sid)
        except PreposError:
            self.journal.moving.discard(sid)
            return
        finally:
            self._dropping.pop(sid, None)
        eng.settle(sid)

    def _give_up(self, sids: list[str]) -> None:
        for sid in sids:
            self._drop(sid, "lease_lost")

    def _on_event(self, event: str, s, payload) -> None:
        if event == "close" and s.id not in self._dropping and s.id in self.leases.owned:
            try:
                self.leases.release(s.id)
            except Exception as exc:
                log.warning("lease of closed session %s not released: %s", s.id, exc)

    async def forward(self, sid: str, scope, receive, send) -> bool:
        """The request, answered by the owner's node (`Forwarder.forward`)."""
        return await self.forwarder.forward(scope["prepos.owner"], sid, scope, receive, send)

    def health(self) -> dict:
        leases = self.leases
        return {"node": leases.node, "epoch": leases.epoch, "serving": leases.serving(),
                "owned": len(leases.owned), "takeovers": self.takeovers,
                "forwarded": self.forwarder.count, "lapses": leases.lapses,
                "conversation_hops": self.directory.hops if self.directory else 0,
                "conversations_published": self.directory.published if self.directory else 0}


def check_new_id(state, engine, name: str, owner: str | None) -> str:
    """The id of a new session a client named: the name well formed, and no session of the
    caller's by that name, here or, with a shared store, anywhere (its lease is claimed for
    it now); another key's session of the same name is another session."""
    if not SESSION_ID.fullmatch(name) or is_ephemeral(name):
        raise ApiError(400, "invalid_session_id", "x-session-id must be 1-128 letters, digits "
                       f"and ._:- (starting with a letter or digit), got {name[:140]!r}")
    sid = scoped(owner, name)
    taken = engine.has_session(sid) or sid in state.admission.creating or (
        state.session_named(engine, name, owner) is not None)
    if not taken and state.cluster is not None:
        taken = not state.cluster.leases.claim(sid).ours or state.journal.exists(sid)
    if taken:
        raise ApiError(409, "session_exists", f"a session {name!r} exists already")
    return sid


def join(state, engine, journal: Journal) -> Cluster:
    """Join the nodes sharing the store, once the server listens: from then on this node
    claims the sessions it is asked for (none is restored at start)."""
    cluster = Cluster(state, engine, journal, Database(state.config.journal),
                      state.config.lease)
    if not state.bound.wait(120):
        raise RuntimeError("the server did not listen within 120 s")
    cluster.start(state.config.advertise_url or state.url)
    if state.front is not None:
        state.front.cluster = cluster
    return cluster


def default_url(host: str, port: int) -> str:
    """The URL other nodes forward to, where none is given: the bound address, or this
    machine's name where the server listens on every interface."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"
