"""Ownership by lease in the shared store: one owner node per session at a time.

A node is alive while its row in `nodes` is: `(node, epoch, expires, url)`, renewed every
`renew_s` by a conditional update that succeeds only while the row has not expired, on the
database's clock. A session's owner is a row in `leases`: `(sid, node, node_epoch)`, valid
while that node is alive *in that epoch*. So a node renews one row for all its sessions, and
an epoch that lapsed is dead for good: the node registers again with the next epoch, owning
nothing.

Claiming a session (`claim`), each step a conditional statement, first writer wins:
- no lease row: insert one naming this node (on conflict, nothing: someone was first);
- the owner alive: not ours, the owner's node and URL are returned (the caller forwards);
- the owner's row expired: fence it, `epoch = epoch + 1 WHERE epoch = its AND expires <=
  now` (a renewal racing this is ordered by the row lock: one of them finds nothing to do);
- the owner's epoch dead: `UPDATE leases ... WHERE node = old AND node_epoch = old`.

No split brain: a node serves only while `serving()`, i.e. while its last successful renewal,
timed from *before* it was sent, plus the lease, minus a margin, is still ahead. Once it is
not (its epoch lapsed, or no renewal got through: the store unreachable, or slow), the
sessions it owned are given up (`on_lapse`: closed here, their subscriptions ended). The
database's expiry is later than that, so the node has stopped serving before anyone can
fence it. And every journal write checks in its own transaction (`fence`, holding the rows
`FOR SHARE`) that the node still owns the session: a write after a takeover is refused.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from prepos.errors import PreposError
from prepos.server.store.database import Database

log = logging.getLogger("prepos.server.lease")


class LeaseLost(PreposError):
    """This node no longer owns the session (or its own lease lapsed): nothing was
    written; the request may be retried (the router reaches the owner)."""

    code = "lease_lost"


@dataclass(frozen=True)
class Claim:
    ours: bool
    fresh: bool = False  # taken from no one or a dead owner: load the session from the store
    node: str | None = None  # the owner, where not ours
    url: str | None = None
    expires_in: float = 0.0  # seconds until the owner's lease expires, where not ours


@dataclass(frozen=True)
class LeaseConfig:
    node: str = ""  # "" : a new random id per process
    lease_s: float = 4.0
    renew_s: float = 1.0
    margin_s: float = 1.0

    def __post_init__(self):
        if not self.lease_s > self.renew_s + self.margin_s > self.renew_s > 0:
            raise ValueError(f"the lease ({self.lease_s} s) must exceed the renew interval "
                             f"({self.renew_s} s) plus the margin ({self.margin_s} s)")


class Leases:
    def __init__(self, db: Database, config: LeaseConfig,
                 on_lapse: Callable[[list[str]], None] = lambda sids: None):
        self.db = db
        self.config = config
        self.node = config.node or f"node-{uuid.uuid4().hex[:12]}"
        self.on_lapse = on_lapse  # called with the sessions an epoch that lapsed owned
        self.owned: set[str] = set()
        self.epoch = 0
        self.url = ""
        self.valid_until = 0.0  # time.monotonic() past which this node serves no session
        self.lapses = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: threading.Thread | None = None
        self._lapsing = threading.Lock()

    # -- liveness ----------------------------------------------------------------------------
    def start(self, url: str) -> None:
        self.url = url
        self.register()
        self._thread = threading.Thread(target=self._beat, name="prepos-lease", daemon=True)
        self._thread.start()
        self._watch = threading.Thread(target=self._watching, name="prepos-lease-watch",
                                       daemon=True)
        self._watch.start()

    def register(self) -> None:
        """A new epoch for this node: it owns nothing yet."""
        t = time.monotonic()
        row = self.db.q("INSERT INTO nodes VALUES (?, 1, NOW + ?, ?) ON CONFLICT (node) DO "
                        "UPDATE SET epoch=nodes.epoch+1, expires=excluded.expires, "
                        "url=excluded.url RETURNING epoch",
                        (self.node, self.config.lease_s, self.url)).fetchone()
        self.owned.clear()
        self.epoch = int(row[0])
        self.valid_until = t + self.config.lease_s
        log.info("node %s: epoch %d at %s", self.node, self.epoch, self.url)

    def renew(self) -> bool:
        t = time.monotonic()
        n = self.db.q("UPDATE nodes SET expires = NOW + ? WHERE node=? AND epoch=? AND "
                      "expires > NOW", (self.config.lease_s, self.node, self.epoch)).rowcount
        if n == 1:
            self.valid_until = t + self.config.lease_s
            return True
        self.lapse("lapsed")
        self.register()
        return False

    def lapse(self, why: str) -> None:
        """This node stopped serving: the sessions it owned are given up (`on_lapse`)."""
        with self._lapsing:
            lost = sorted(self.owned)
            self.owned.clear()
            if not lost and not self.valid_until:
                return  # given up already
            self.valid_until = 0.0
            self.lapses += 1
        log.error("node %s: epoch %d %s; its %d sessions are given up", self.node, self.epoch,
                  why, len(lost))
        self.on_lapse(lost)

    def _beat(self) -> None:
        while not self._stop.wait(self.config.renew_s):
            try:
                self.renew()
            except Exception as exc:  # the store is unreachable: serving stops as time runs
                log.error("node %s: lease not renewed: %s", self.node, exc)

    def _watching(self) -> None:
        """Past its serving time without a renewal (one failing, or one that hangs), the
        node gives its sessions up at once, so their subscribers are not left on a node that
        no longer serves them."""
        while not self._stop.wait(self.config.margin_s / 2):
            if self.owned and not self.serving():
                self.lapse("was not renewed in time")

    def serving(self) -> bool:
        return time.monotonic() < self.valid_until - self.config.margin_s

    def owns(self, sid: str) -> bool:
        return sid in self.owned and self.serving()

    def stop(self) -> None:
        """Stop renewing and let the node's lease expire (a clean stop: no waiting for it)."""
        self._stop.set()
        for thread in (self._thread, self._watch):
            if thread is not None:
                thread.join(timeout=5)
        try:
            self.db.q("UPDATE nodes SET expires = NOW WHERE node=? AND epoch=?",
                      (self.node, self.epoch))
        except Exception as exc:
            log.warning("node %s: lease not given back: %s", self.node, exc)

    # -- sessions ----------------------------------------------------------------------------
    def claim(self, sid: str) -> Claim:
        """Own `sid` if it is free or its owner is dead; else who owns it."""
        if not self.serving():
            raise LeaseLost(f"node {self.node} is not serving: its own lease lapsed")
        db = self.db
        for _ in range(8):
            row = db.q("SELECT l.node, l.node_epoch, n.epoch, n.url, n.expires - NOW FROM "
                       "leases l LEFT JOIN nodes n ON n.node = l.node WHERE l.sid=?",
                       (sid,)).fetchone()
            if row is None:
                if db.q("INSERT INTO leases VALUES (?, ?, ?) ON CONFLICT (sid) DO NOTHING",
                        (sid, self.node, self.epoch)).rowcount == 1:
                    return self._won(sid, fresh=True)
                continue
            owner, owner_epoch, node_epoch, url, left = row
            if owner == self.node and owner_epoch == self.epoch:
                return self._won(sid, fresh=False)
            if node_epoch == owner_epoch and left is not None and left > 0:
                return Claim(False, node=owner, url=url, expires_in=float(left))
            if node_epoch == owner_epoch:  # expired, not fenced yet: fence it
                log.info("node %s at %.3f: fencing node %s (epoch %d) for session %s",
                         self.node, time.time(), owner, owner_epoch, sid)
                db.q("UPDATE nodes SET epoch = epoch + 1 WHERE node=? AND epoch=? AND "
                     "expires <= NOW", (owner, owner_epoch))
                continue
            if db.q("UPDATE leases SET node=?, node_epoch=? WHERE sid=? AND node=? AND "
                    "node_epoch=?", (self.node, self.epoch, sid, owner,
                                     owner_epoch)).rowcount == 1:
                return self._won(sid, fresh=True)
        raise LeaseLost(f"session {sid}: its lease is contended; retry")

    def _won(self, sid: str, fresh: bool) -> Claim:
        fresh = fresh or sid not in self.owned
        self.owned.add(sid)
        return Claim(True, fresh=fresh)

    def release(self, sid: str) -> None:
        """Give up `sid` (closed, or not in the store)."""
        self.owned.discard(sid)
        self.db.q("DELETE FROM leases WHERE sid=? AND node=? AND node_epoch=?",
                  (sid, self.node, self.epoch))

    def fence(self, db: Database, sid: str) -> None:
        """Inside a journal write's transaction: refuse it unless this node, alive in its
        epoch on the store's clock, owns `sid` (a new session's lease is taken here). The
        rows stay locked until the write commits, so no takeover passes it."""
        if sid not in self.owned:
            db.q("INSERT INTO leases VALUES (?, ?, ?) ON CONFLICT (sid) DO NOTHING",
                 (sid, self.node, self.epoch))
        ok = db.q("SELECT 1 FROM nodes n JOIN leases l ON l.node = n.node AND "
                  "l.node_epoch = n.epoch WHERE l.sid=? AND n.node=? AND n.epoch=? AND "
                  "n.expires > NOW" + db.lock_row, (sid, self.node, self.epoch)).fetchone()
        if ok is None:
            self.owned.discard(sid)
            raise LeaseLost(f"session {sid} is no longer owned by node {self.node}")
        self.owned.add(sid)
