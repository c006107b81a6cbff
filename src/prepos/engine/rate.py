"""How often a session is asked between its updates: the paper's rho (requests per update)
and h(rho) = rho / (1 + rho) (Eq. 8), the chance a request comes before the next update.

Counted per session and per exact entry (what a pre-decode of that entry's answer is worth)
and per session over every request (what any pre-position of it is worth: idle work runs in
that order, `Engine._committed`). Counts decay by `DECAY` at every update, so a session's
recent behaviour weighs most, from a prior of one request per update (a new session is
worth pre-positioning).
"""

from __future__ import annotations

import threading
from weakref import WeakKeyDictionary

from prepos.engine.session import Session


class QueryRate:
    DECAY = 0.9
    UPDATES = ("updates",)
    ANY = ("any",)  # every request on the session, whatever its entry

    def __init__(self, min_hit: float):
        self.min_hit = min_hit
        self._seen: WeakKeyDictionary[Session, dict[tuple, float]] = WeakKeyDictionary()
        self._lock = threading.Lock()

    def update(self, s: Session) -> None:
        with self._lock:
            counts = self._seen.setdefault(s, {})
            for k in counts:
                counts[k] *= self.DECAY
            counts[self.UPDATES] = counts.get(self.UPDATES, 0.0) + 1.0

    def asked(self, s: Session, key: tuple = ANY) -> None:
        """A request on the session (ANY), or an exact one for the entry at `key` (which
        counts toward ANY too)."""
        with self._lock:
            counts = self._seen.setdefault(s, {})
            counts[key] = counts.get(key, 0.0) + 1.0
            if key != self.ANY:
                counts[self.ANY] = counts.get(self.ANY, 0.0) + 1.0

    def rho(self, s: Session, key: tuple = ANY) -> float:
        with self._lock:
            counts = self._seen.get(s, {})
            return (counts.get(key, 0.0) + 1.0) / (counts.get(self.UPDATES, 0.0) + 1.0)

    def hit(self, s: Session, key: tuple = ANY) -> float:
        """h(rho): the chance a request (for `key`) comes before the next update."""
        rho = self.rho(s, key)
        return rho / (1.0 + rho)

    def pays(self, s: Session, key: tuple = ANY) -> bool:
        """h(rho) reaches `min_hit`."""
        return self.hit(s, key) >= self.min_hit
