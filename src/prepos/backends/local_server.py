"""A server process on loopback, started for tests and benchmarks: a free port, the process
with its log, health polled until 200, stopped or killed (the whole process group where the
server forks workers). `llama_server.py` and `vllm_server.py` say what to run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


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


class LocalServer:
    """One server process on 127.0.0.1. A subclass gives `args()` and may give `env()`;
    `what`, `poll_interval` and `default_wait` say how it is named and awaited."""

    what = "server"
    poll_interval = 0.1
    default_wait = 60.0
    own_group = False  # signal the whole process group (servers that fork workers)
    stop_grace = 10.0  # seconds a SIGTERM is given before SIGKILL

    def __init__(self, port: int | None, log: str | Path | None):
        self.port = port or free_port()
        self.log = Path(log) if log else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None

    def start(self, wait: float | None = None):
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args(), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env(),
                                     start_new_session=self.own_group)
        self.wait_healthy(self.default_wait if wait is None else wait)
        return self

    def wait_healthy(self, wait: float) -> None:
        wait_for_health(self.proc, self.url, wait, self.what, self.log, self.poll_interval)

    def _signal(self, sig: int, grace: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig) if self.own_group else proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL) if self.own_group else proc.kill()
            proc.wait(timeout=30)

    def kill(self) -> None:
        """Dies at once, the way a crashed replica does."""
        self._signal(signal.SIGKILL, 30)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, self.stop_grace)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
