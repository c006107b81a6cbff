"""The KV tiers below resident: host RAM and a bounded directory on disk, for sessions whose
KV the pool moved out of the back end's cells. Each holds a session's KV state as the back
end saved it (`Backend.save`: llama.cpp's sequence state, torch's tensors), by session id.

Least recently used (stored, or read for a prefix another KV starts from) moves down first:
RAM over its budget spills its oldest states to disk, disk over its budget drops its oldest,
and a dropped session's KV is recomputed from its committed tokens (the journal's) when it
is next needed. Owned by the model worker, like the pool that uses it; the sizes are
readable from any thread.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path


class Tiers:
    def __init__(self, ram_bytes: int, disk_bytes: int, disk_dir: Path | None = None):
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        root = Path(disk_dir) if disk_dir is not None else Path(tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"prepos-kv-{os.getpid()}-", dir=root))
        self._ram: OrderedDict[str, bytes] = OrderedDict()
        self._disk: OrderedDict[str, int] = OrderedDict()  # sid -> bytes in its file
        self.ram_used = self.disk_used = 0
        self.moves = {"ram": 0, "disk": 0, "dropped": 0}  # states moved into each, dropped
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
            if len(state) <= self.disk_bytes:
                self._write(old, state)
            else:
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
            return self._path(sid).read_bytes()
        return None

    def take(self, sid: str) -> bytes | None:
        """A session's state, out of its tier (None if no tier holds it)."""
        if sid in self._ram:
            with self._lock:
                data = self._ram.pop(sid)
                self.ram_used -= len(data)
            return data
        if sid in self._disk:
            data = self._path(sid).read_bytes()
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
                             "budget": self.disk_bytes},
                    "moves": dict(self.moves)}

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _pop_ram(self) -> tuple[str, bytes]:
        with self._lock:
            sid, data = self._ram.popitem(last=False)
            self.ram_used -= len(data)
        return sid, data

    def _write(self, sid: str, data: bytes) -> None:
        tmp = self._path(sid).with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(self._path(sid))
        with self._lock:
            self._disk[sid] = len(data)
            self.disk_used += len(data)
            self.moves["disk"] += 1

    def _remove_file(self, sid: str) -> None:
        with self._lock:
            self.disk_used -= self._disk.pop(sid)
        self._path(sid).unlink(missing_ok=True)

    def _path(self, sid: str) -> Path:
        return self.dir / f"{sid}.kv"
