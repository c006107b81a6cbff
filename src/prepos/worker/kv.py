"""Every session's KV cache, the engine-wide budget of resident cells and the tiers below
it (`KVPool`): which KVs are resident, and room made for each batch before it runs.

Owned by the model worker; `KVPool.used` is a running count, readable from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Generator, Sequence

from prepos.backends.base import Backend
from prepos.errors import OverBudget, TooManySessions
from prepos.worker.prefix import PrefixIndex
from prepos.worker.sequence import Forward, KVSequence
from prepos.worker.tiers import Tiers


class KVPool:
    """Every session's KV cache, the engine-wide budget of resident cells, and the tiers
    below it (`Tiers`: host RAM, disk; then recompute from the session's tokens) where the
    back end holds tiers. Every batch is admitted before it runs (`admit`): its KVs come
    back resident and room is made for the cells the batch adds, all of them together:
    other sessions' speculative cells dropped first (`keeps`), then the least recently used
    idle resident KVs moved down a tier. What does not fit waits for a later quantum.
    Nothing a task is using is moved (`reserve`/`release`: the scheduler's, which marks the
    sessions whose tasks run).

    Moving a KV down loses nothing it holds, speculative cells (a pre-positioned entry, a
    pre-decoded answer) included. A tier keeps its copy of a KV brought back from it
    (`KVSequence.clean`: the prefix it holds as the KV does), so moving the KV down again
    saves nothing while the KV holds no more than that prefix; any cell added beyond it
    makes the copy stale, saved again when the KV next moves. At idle, `housekeeping` saves
    such copies ahead, so a foreground request moves idle KVs down without saving any; it
    never moves a KV down itself."""

    def __init__(self, backend: Backend, engine_cells: int, tiers: Tiers | None = None,
                 reserve: Callable[[str], bool] = lambda key: True,
                 release: Callable[[str], None] = lambda key: None,
                 idle_cells: int | None = None):
        self.backend = backend
        self.engine_cells = engine_cells
        self.tiers = tiers if backend.holds_tiers else None
        # where every forward scans every resident cell (llama.cpp's unified layout): the
        # cells idle KVs may keep resident while a foreground batch runs (None: no bound)
        self.idle_cells = idle_cells if backend.scans_resident else None
        # the cells the most recently used resident KVs may hold with no clean copy in a
        # tier (`housekeeping` saves the rest's): those a request's room-making keeps
        self.copy_beyond = self.idle_cells if self.idle_cells is not None else engine_cells // 2
        self.index = PrefixIndex()
        # what room-making keeps of another session's KV, pass by pass (the engine's: its
        # committed length, then less where its owner allows); none: nothing is cropped
        self.keeps: Sequence[Callable[[str], int]] = ()
        self._kv: dict[str, KVSequence] = {}
        self._scopes: dict[str, str | None] = {}  # a session's owner: its KVs' scope
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._saved: dict[str, int] = {}  # cells of each state a tier holds, by session
        self._reserve, self._release = reserve, release
        self._used = 0
        self._lock = threading.Lock()
        self.counts = {"restores": 0, "restore_s": 0.0, "recomputed_tokens": 0, "spills": 0,
                       "deferred": 0, "prefix_loads": 0,
                       # states saved into a tier (at idle, of those), and KVs moved down
                       # to the clean copy a tier held (nothing saved)
                       "saves": 0, "idle_saves": 0, "clean_moves": 0}

    def claim(self, sid: str, scope: str | None) -> None:
        """The scope of `sid`'s KV (its owner): prefixes are shared within a scope only."""
        self._scopes[sid] = scope

    def _resize(self, delta: int) -> None:
        with self._lock:
            self._used += delta

    def get(self, sid: str) -> KVSequence:
        kv = self._kv.get(sid)
        if kv is None:
            kv = self._kv[sid] = KVSequence(self.backend, sid, self._resize,
                                            self._scopes.get(sid), self.index,
                                            self if self.tiers is not None else None)
        if kv.handle is not None and sid in self._resident:
            self._resident.move_to_end(sid)
        return kv

    def find(self, sid: str) -> KVSequence | None:
        return self._kv.get(sid)

    def tier(self, sid: str) -> str:
        """Where a session's KV is: resident, ram, disk, or none (recomputed when needed)."""
        kv = self._kv.get(sid)
        if kv is not None and kv.handle is not None:
            return "resident"
        return (self.tiers.where(sid) if self.tiers else None) or "none"

    def drop(self, sid: str) -> None:
        self._scopes.pop(sid, None)
        self._resident.pop(sid, None)
        self._saved.pop(sid, None)
        if self.tiers is not None:
            self.tiers.discard(sid)
        kv = self._kv.pop(sid, None)
        if kv is not None:
            kv.release()

    @property
    def used(self) -> int:
        """Resident cells across all sessions (a running count: any thread may read it)."""
        return self._used

    def extra_cells(self, sid: str, target: Sequence[int]) -> int:
        """Resident cells `target` needs beyond what the session's cache holds there."""
        kv = self._kv.get(sid)
        if kv is None or kv.handle is None:
            return len(target)
        return max(0, len(target) - len(kv))

    def fits(self, sid: str, target: Sequence[int]) -> bool:
        """Whether `target` fits without moving anyone's KV (a KV not resident also needs
        a free handle)."""
        kv = self._kv.get(sid)
        if (kv is None or kv.handle is None) and self.backend.free_handles() == 0:
            return False
        return self.used + self.extra_cells(sid, target) <= self.engine_cells

    # -- admission and the tiers (on the worker) ----------------------------------------
    def admit(self, forwards: Sequence[Forward],
              plans: Sequence[tuple[int, int, int]] | None,
              moves: bool) -> list[tuple[int, int, int] | BaseException | None]:
        """Admit a batch (or an answer a remote engine streams: a forward no batch runs,
        admitted before the answer starts): resident KVs first (a decode step needs a cell;
        a KV coming back needs all of its own), each in batch order: its KV made resident
        and started from the longest prefix another KV holds (resident, or loaded from a
        lower tier), then room made for the cells it adds on top of what those admitted
        before it add (its target's end less what its KV holds).
        Once one does not fit, it and the rest wait (None), their KVs as they are; the
        first is given room even by moving the waiting ones' KVs down, and gets the error
        if not even it fits (OverBudget / TooManySessions). Returns, for each forward, its
        plan, None or the error. `moves`: other sessions' speculative cells may be dropped
        and their KVs moved down (never for idle work)."""
        order = sorted(range(len(forwards)), key=lambda i: forwards[i].kv.handle is None)
        out: list[tuple[int, int, int] | BaseException | None] = [None] * len(forwards)
        if moves and self.idle_cells is not None:
            self._quiet({f.kv.key for f in forwards})
        keep: set[str] = set()
        added = 0  # the cells the forwards admitted so far add
        for rank, i in enumerate(order):
            f = forwards[i]
            kv = f.kv
            keep.add(kv.key)
            spare = [forwards[j].kv for j in reversed(order[1:])] if rank == 0 else []
            away, held = kv.handle is None, len(kv.tokens)
            ours = self._kv.get(kv.key) is kv  # not a KV made for one use
            try:
                if away and kv.pool is self:
                    self.bring_back(kv, moves, keep, spare, added)
                    held = len(kv.tokens)
                elif away:  # a KV of no pool's, made for one use: its own handle
                    kv.ensure()
                gained = kv.reuse(f.target, lambda donor: self._load(
                    donor, kv, moves, keep, spare, added))
                same = plans is not None and not (away or gained or len(kv.tokens) != held)
                plan = plans[i] if same else f.plan()
                grow = plan[2] - len(kv.tokens) if ours else 0
                if not self._room(added + grow, False, keep, spare, moves):
                    raise OverBudget(f"the engine's KV budget of {self.engine_cells} cells "
                                     f"cannot hold session {kv.key}'s {plan[2]} tokens")
            except (OverBudget, TooManySessions) as exc:
                if rank == 0:
                    out[i] = exc
                else:
                    kv.crop(held)  # what it took over from another KV, given back
                    self.counts["deferred"] += len(order) - rank
                return out
            added += grow
            out[i] = plan
        return out

    def _quiet(self, keep: set[str]) -> None:
        """A foreground batch (the KVs of `keep`) about to be admitted: idle resident KVs
        beyond `idle_cells` moved down a tier, least recently used first, so its forward
        scans its own cells, not theirs. Done before any of the batch's KVs is loaded or
        copied: llama.cpp places new cells in the first free ones its search finds (a
        removal moves the search's start down to the lowest freed cell), and a forward scans
        every cell up to the highest in use, so a KV placed above idle ones that then moved
        down would be scanned as if they had stayed."""
        batch = sum(len(self._kv[k]) for k in keep if k in self._resident)
        while self.used - batch > self.idle_cells and self._spill_one(keep):
            pass

    def bring_back(self, kv: KVSequence, moves: bool, keep: set[str],
                   spare: Sequence[KVSequence], extra: int) -> None:
        """`kv` resident again, with room for `extra` more cells besides (`_room`; `keep`
        and `spare` as there): its state loaded from its tier, or recomputed from its
        tokens where no tier holds it."""
        sid = kv.key
        t0 = time.perf_counter()
        # read before others move down past it, and left there: the KV's clean copy
        data = self.tiers.peek(sid) if kv.tokens and sid in self._saved else None
        if not self._room(len(kv.tokens) + extra, True, keep, spare, moves):
            if self.backend.free_handles() == 0:
                raise TooManySessions(f"the {self.backend.name} back end holds no more "
                                      f"sessions' KV at once")
            raise OverBudget(f"the engine's KV budget of {self.engine_cells} cells "
                             f"cannot hold session {sid}'s {len(kv.tokens)} tokens")
        handle = self.backend.load(data, sid) if data is not None else None
        if handle is None:  # no tier held it, or it would not load: recompute it
            if sid in self._saved:
                self._lost(kv)
            handle, data = self.backend.new_kv(sid), None
        if data is None:
            self.counts["recomputed_tokens"] += len(kv.tokens)
            kv.crop(0)
        else:
            self.backend.crop(handle, len(kv.tokens))  # cropped while it was away
            self.counts["restores"] += 1
            self.counts["restore_s"] += time.perf_counter() - t0
        kv.handle, kv.clean = handle, len(kv.tokens)
        self._resize(len(kv.tokens))
        self._resident[sid] = None

    def _load(self, donor: KVSequence, into: KVSequence, moves: bool, keep: set[str],
              spare: Sequence[KVSequence], extra: int) -> object | None:
        """A new handle for `into` holding `donor`'s state, read from its tier and left there,
        with room made for all of its cells on top of `extra` (`_room`); None where that
        cannot be had. The caller crops it to the prefix it takes. Where no handle is free
        (as many sequences as clients, every one held), `into` gives up its own: the donor's
        state replaces its cells anyway."""
        cells = self._saved.get(donor.key)
        if cells is None:
            return None
        data = self.tiers.peek(donor.key)  # read first: nobody moves for a state that is lost
        if data is None:
            self._lost(donor)
            return None
        swap = into.handle is not None and self.backend.free_handles() == 0
        if not self._room(extra + cells, not swap, keep, spare, moves):
            return None
        if swap and self.backend.free_handles() == 0:
            into.crop(0)
            self.backend.release(into.handle)
            into.handle = None
        handle = self.backend.load(data, None)
        if handle is None:
            self._lost(donor)
            if into.handle is None:
                into.handle = self.backend.new_kv(into.key)
            return None
        self.counts["prefix_loads"] += 1
        return handle

    def _lost(self, kv: KVSequence) -> None:
        """`kv`'s state could not be read back from its tier: it is out of the tiers and
        the index, recomputed from its tokens when next needed."""
        self._saved.pop(kv.key, None)
        self.tiers.discard(kv.key)
        kv.clean = 0
        if kv.handle is None:
            kv._unindex(0)

    def _room(self, cells: int, handle: bool, keep: set[str], spare: Sequence[KVSequence],
              moves: bool) -> bool:
        """Whether `cells` more resident cells (and with `handle` a free handle) fit; where
        `moves`, made so first: other sessions' speculative cells dropped (`keeps`, pass by
        pass), then the least recently used idle resident KVs moved down a tier, then those
        of `spare` (a batch's waiting forwards'). The KVs of `keep` stay."""
        def fits() -> bool:
            return (self.used + cells <= self.engine_cells
                    and not (handle and self.backend.free_handles() == 0))

        if fits() or not moves:
            return fits()
        if self.used + cells > self.engine_cells:
            for keep_len in self.keeps:
                for other in list(self._resident if self.tiers else self._kv):
                    kv = self._kv[other]
                    if other in keep or len(kv) <= keep_len(other) or not self._reserve(other):
                        continue
                    try:  # never a cache a task is using
                        kv.crop(keep_len(other))
                    finally:
                        self._release(other)
                    if fits():
                        return True
        while not fits():
            if not self._spill_one(keep):
                waiting = [kv for kv in spare if kv.handle is not None and kv.key not in keep]
                if not waiting or self.tiers is None:
                    return False
                self._spill(waiting[0])
        return True

    def _spill_one(self, keep: set[str]) -> bool:
        """Move the least recently used idle resident KV (not one of `keep`) down a tier."""
        if self.tiers is None:
            return False
        for other in list(self._resident):
            if other not in keep and self._reserve(other):
                try:
                    self._spill(self._kv[other])
                finally:
                    self._release(other)
                return True
        return False

    def _spill(self, kv: KVSequence) -> None:
        """`kv` moved down a tier: to its clean copy where that holds all of it, else
        saved."""
        data = None
        if kv.key in self._saved and 0 < len(kv.tokens) <= kv.clean:
            self.counts["clean_moves"] += 1
        elif kv.tokens:
            data = self._save(kv)
        elif kv.key in self._saved:
            self._lost(kv)  # nothing of it to keep
        self.backend.release(kv.handle)
        kv.handle = None
        self._resize(-len(kv.tokens))
        self._resident.pop(kv.key, None)
        self.counts["spills"] += 1
        if data is not None:  # a state that no tier can keep is recomputed when needed
            self._put(kv, data)

    def _save(self, kv: KVSequence, idle: bool = False) -> bytes:
        self.counts["saves"] += 1  # counted together, before: a reader sees both or neither
        self.counts["idle_saves"] += idle
        return self.backend.save(kv.handle)

    # -- at idle --------------------------------------------------------------------------
    def housekeeping(self) -> Generator:
        """Idle work, one unit a step: the least recently used resident KV a foreground
        request might move down (beyond the most recently used within `copy_beyond`) that
        holds cells no clean copy holds, saved into the tiers and left resident (one a
        task is using skipped). So a request later moves it down without saving; idle work
        itself never moves a KV down. Each KV is tried once a run at each length (a state no
        tier keeps is not saved again until the next; one that grew meanwhile, by idle work
        run between the units, is)."""
        tried: dict[str, int] = {}  # the length each KV was tried at
        while (kv := self._dirty(tried)) is not None:
            tried[kv.key] = len(kv)
            if not self._reserve(kv.key):
                continue  # in use: the next housekeeping finds it again
            try:
                self._put(kv, self._save(kv, idle=True))
            finally:
                self._release(kv.key)
            yield

    def _dirty(self, tried: dict[str, int]) -> KVSequence | None:
        if self.tiers is None:
            return None
        held, dirty = 0, None
        for sid in list(self._resident)[::-1]:  # most recently used first
            kv = self._kv[sid]
            held += len(kv)
            if held > self.copy_beyond and kv.tokens and tried.get(sid) != len(kv) and (
                    sid not in self._saved or len(kv) > kv.clean):
                dirty = kv
        return dirty

    def _put(self, kv: KVSequence, data: bytes) -> None:
        """`kv`'s state into the tiers, still indexed there (other KVs may start from its
        prefix); the KVs whose state no tier keeps any longer leave the index."""
        self._saved[kv.key] = kv.clean = len(kv.tokens)
        for sid in self.tiers.put(kv.key, data):
            self._saved.pop(sid, None)
            gone = self._kv.get(sid)
            if gone is not None:
                gone.clean = 0
                if gone.handle is None:  # a resident one only lost its copy
                    gone._unindex(0)

    def metrics(self) -> dict:
        resident = {"cells": self.used, "sessions": len(self._resident),
                    "budget": self.engine_cells}
        tiers = self.tiers.sizes() if self.tiers else {}
        return {"resident": resident, **tiers, **self.counts}

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
