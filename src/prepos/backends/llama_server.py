"""Running llama.cpp's `llama-server` locally: find the binary built by
`scripts/build_llama_server.sh`, start replicas on loopback ports, wait for health, stop and
restart them. Used by the integration tests and the remote benchmark."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen | None, url: str, wait: float, what: str,
                    log: Path | None, interval: float) -> None:
    """Until `url`/health answers 200; raise if the process exits or `wait` seconds pass."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}"
                               + (f"; see {log}" if log else ""))
        try:
            if httpx.get(url + "/health", timeout=max(1.0, 4 * interval)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{what} on {url} not healthy after {wait}s")


class LlamaServer:
    """One `llama-server` process on 127.0.0.1."""

    def __init__(self, binary: str | Path, model: str | Path, port: int | None = None,
                 slots: int = 4, ctx_per_slot: int = 2048, threads: int = 1,
                 extra: tuple[str, ...] = (), log: str | Path | None = None):
        self.binary, self.model = str(binary), str(model)
        self.port = port or free_port()
        self.slots, self.ctx, self.threads = slots, ctx_per_slot, threads
        self.extra = extra
        self.log = Path(log) if log else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        return [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(self.slots), "-c", str(self.ctx * self.slots),
                "-t", str(self.threads), "-tb", str(self.threads), "--no-warmup",
                *self.extra]

    def start(self, wait: float = 60.0) -> LlamaServer:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args(), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.wait_healthy(wait)
        return self

    def wait_healthy(self, wait: float) -> None:
        wait_for_health(self.proc, self.url, wait, "llama-server", self.log, 0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
