"""Running llama.cpp's `llama-server` locally: find the binary built by
`scripts/build_llama_server.sh`, start replicas on loopback ports, wait for health, stop and
restart them. Used by the integration tests and the remote benchmark."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prepos.backends.local_server import LocalServer
from prepos.paths import ROOT


def find_binary() -> Path | None:
    """$PREPOS_LLAMA_SERVER, else the newest cached build under $LLAMA_CACHE (or
    .cache/llama-server, or `.ci/run`'s ~/.cache/prepos-llama-server), else `llama-server`
    on PATH."""
    env = os.environ.get("PREPOS_LLAMA_SERVER")
    if env:
        p = Path(env)
        return p if p.is_file() and os.access(p, os.X_OK) else None
    caches = ([Path(os.environ["LLAMA_CACHE"])] if os.environ.get("LLAMA_CACHE") else
              [ROOT / ".cache" / "llama-server", Path.home() / ".cache" / "prepos-llama-server"])
    for cache in caches:
        found = sorted(cache.glob("*/bin/llama-server"),
                       key=lambda p: float(p.parent.parent.name.split(".")[0])
                       if p.parent.parent.name.split(".")[0].isdigit() else 0.0)
        if found:
            return found[-1]
    which = shutil.which("llama-server")
    return Path(which) if which else None


class LlamaServer(LocalServer):
    """One `llama-server` process on 127.0.0.1."""

    what = "llama-server"

    def __init__(self, binary: str | Path, model: str | Path, port: int | None = None,
                 slots: int = 4, ctx_per_slot: int = 2048, threads: int = 1,
                 extra: tuple[str, ...] = (), log: str | Path | None = None):
        super().__init__(port, log)
        self.binary, self.model = str(binary), str(model)
        self.slots, self.ctx, self.threads = slots, ctx_per_slot, threads
        self.extra = extra

    def args(self) -> list[str]:
        return [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(self.slots), "-c", str(self.ctx * self.slots),
                "-t", str(self.threads), "-tb", str(self.threads), "--no-warmup",
                *self.extra]
