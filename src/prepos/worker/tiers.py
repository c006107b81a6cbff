"""The KV tiers below resident: host RAM and a bounded directory on disk, for sessions whose
KV the pool moved out of the back end's cells. Each holds a session's KV state as the back
end saved it (`Backend.save`: llama.cpp's sequence state, torch's tensors), by session id.

Least recently used (stored, or read for a prefix another KV starts from) moves down first:
RAM over its budget spills its oldest states to disk, disk over its budget drops its oldest,
and a dropped session's KV is recomputed from its committed tokens (the journal's) when it
is next needed. A state file that is gone or cannot be read is forgotten as if dropped
(logged, counted `unreadable`): its session is recomputed, never failed. Owned by the model
worker, like the pool that uses it; the sizes are readable from any thread.

Each process's directory holds a lock (`flock`) while it lives; at start, directories of
processes that are gone (their lock free, or, for one without a lock, its pid gone) are
removed and counted (`reclaimed`), so a killed server's states do not stay on disk beyond
`disk_bytes`.

The states are blocks of megabytes, made and freed on every move. glibc's malloc serves a
large block from its heaps once a block that large has been freed (its mmap threshold rises
with each, up to 32 MiB), and blocks of many sizes made and freed on several threads then
leave holes that no heap returns: the process grows by far more than the tiers hold. So
blocks from `MAPPED` up are mapped one by one and unmapped when freed (`map_large_blocks`).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import platform
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("prepos.tiers")
PREFIX = "prepos-kv-"
OWNED = re.compile(rf"{PREFIX}(\d+)-.+")  # a process's directory: its pid, then mkdtemp's
LOCK = ".lock"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# blocks this large and larger are mapped on their own: a KV state is megabytes; a
# vocabulary-wide row of logits (up to a million float32) stays on the heap
MAPPED = 4 << 20


def map_large_blocks() -> bool:
    """Fix glibc's mmap threshold at `MAPPED` (for the whole process; where the C library
    is not glibc, nothing). True if set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        # the process's own symbols (glibc's among them): no search for the library
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MAPPED))
    except (OSError, AttributeError):
        return False


class Tiers:
    def __init__(self, ram_bytes: int, disk_bytes: int, disk_dir: Path | None = None):
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        map_large_blocks()
        root = Path(disk_dir) if disk_dir is not None else Path(tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        self.reclaimed = reclaim(root)  # {"dirs", "bytes"} of processes that are gone
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        self._lock_fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held while this process lives
        self._ram: OrderedDict[str, bytes] = OrderedDict()
        self._disk: OrderedDict[str, int] = OrderedDict()  # sid -> bytes in its file
        self.ram_used = self.disk_used = 0
        # states moved into each, dropped from the last, lost (a file gone or unreadable)
        self.moves = {"ram": 0, "disk": 0, "dropped": 0, "unreadable": 0}
        self._lock = threading.Lock()  # sizes read from other threads

    def where(self, sid: str) -> str | None:
        return "ram" if sid in self._ram else "disk" if sid in self._disk else None

    def put(self, sid: str, data: bytes) -> list[str]:
        """Keep a session's state in RAM, moving the oldest down to make room; returns the
        sessions whose state no tier could keep (dropped: recomputed when needed)."""
        self.discard(sid)
        with self._lock:
            self._ram[sid] = data
            self.ram_used += len(data)
            self.moves["ram"] += 1
        dropped = []
        while self.ram_used > self.ram_bytes and self._ram:
            old, state = self._pop_ram()
            if len(state) > self.disk_bytes or not self._write(old, state):
                dropped.append(old)
        while self.disk_used > self.disk_bytes and self._disk:
            old = next(iter(self._disk))
            self._remove_file(old)
            dropped.append(old)
        with self._lock:
            self.moves["dropped"] += len(dropped)
        return dropped

    def peek(self, sid: str) -> bytes | None:
        """A session's state, left in its tier (a read counts as a use: it moves to the
        end of the line to move down); None if no tier holds it."""
        if sid in self._ram:
            with self._lock:
                self._ram.move_to_end(sid)
            return self._ram[sid]
        if sid in self._disk:
            with self._lock:
                self._disk.move_to_end(sid)
            return self._read(sid)
        return None

    def take(self, sid: str) -> bytes | None:
        """A session's state, out of its tier (None if no tier holds it)."""
        if sid in self._ram:
            with self._lock:
                data = self._ram.pop(sid)
                self.ram_used -= len(data)
            return data
        if sid in self._disk:
            data = self._read(sid)
            if data is not None:
                self._remove_file(sid)
            return data
        return None

    def discard(self, sid: str) -> None:
        if sid in self._ram:
            with self._lock:
                self.ram_used -= len(self._ram.pop(sid))
        if sid in self._disk:
            self._remove_file(sid)

    def sizes(self) -> dict:
        with self._lock:
            return {"ram": {"bytes": self.ram_used, "sessions": len(self._ram),
                            "budget": self.ram_bytes},
                    "disk": {"bytes": self.disk_used, "sessions": len(self._disk),
                             "budget": self.disk_bytes, "reclaimed": dict(self.reclaimed)},
                    "moves": dict(self.moves)}

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _pop_ram(self) -> tuple[str, bytes]:
        with self._lock:
            sid, data = self._ram.popitem(last=False)
            self.ram_used -= len(data)
        return sid, data

    def _write(self, sid: str, data: bytes) -> bool:
        """`sid`'s state into its file; False where it could not be written (dropped)."""
        tmp = self._path(sid).with_suffix(".tmp")
        try:
            tmp.write_bytes(data)
            tmp.replace(self._path(sid))
        except OSError as exc:
            log.warning("KV state of session %s not written to disk (%s): dropped", sid, exc)
            tmp.unlink(missing_ok=True)
            return False
        with self._lock:
            self._disk[sid] = len(data)
            self.disk_used += len(data)
            self.moves["disk"] += 1
        return True

    def _read(self, sid: str) -> bytes | None:
        """The state in `sid`'s file; where it is gone or cannot be read, None and the file
        forgotten (its session is recomputed)."""
        try:
            return self._path(sid).read_bytes()
        except OSError as exc:
            log.warning("KV state of session %s lost (%s): recomputed from its tokens", sid, exc)
            with self._lock:
                self.moves["unreadable"] += 1
            self._remove_file(sid)
            return None

    def _remove_file(self, sid: str) -> None:
        with self._lock:
            self.disk_used -= self._disk.pop(sid)
        try:
            self._path(sid).unlink(missing_ok=True)
        except OSError as exc:  # not a file any more: it is forgotten all the same
            log.warning("KV state file of session %s not removed: %s", sid, exc)

    def _path(self, sid: str) -> Path:
        return self.dir / f"{sid}.kv"


def reclaim(root: Path) -> dict:
    """Remove the KV directories under `root` whose process is gone; their count and bytes."""
    out = {"dirs": 0, "bytes": 0}
    for path in root.glob(f"{PREFIX}*"):
        m = OWNED.fullmatch(path.name)
        if m is None or not path.is_dir() or not _abandoned(path, int(m[1])):
            continue
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            out["dirs"] += 1
            out["bytes"] += size
    if out["dirs"]:
        log.info("removed %d KV directories of processes that are gone (%d bytes) from %s",
                 out["dirs"], out["bytes"], root)
    return out


def _abandoned(path: Path, pid: int) -> bool:
    """Whether no living process holds `path`: its lock is free (a lock goes with its
    process, whatever became of the pid); without one (being made, or of an older
    prepos), its pid is no process's."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR)
    except FileNotFoundError:
        if pid == os.getpid():
            return False  # being made by this process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process
            return False
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held: its process lives
        return False
    finally:
        os.close(fd)
