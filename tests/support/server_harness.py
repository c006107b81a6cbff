"""Real server processes for the end-to-end tests: `prepos serve` on a free loopback port
(the server binds port 0 and writes the port it got), waited for until /health is 200."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[2] / "src")


class ServerProc:
    def __init__(self, model: Path, workdir: Path, *args: str, journal: Path | None = None):
        self.model = Path(model)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.journal = journal
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log = self.workdir / "server.log"

    def start(self, timeout: float = 120.0, wait_ready: bool = True) -> ServerProc:
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("PREPOS_API_KEYS", None)
        journal = ["--journal", str(self.journal) if self.journal else "none"]
        cmd = [sys.executable, "-m", "prepos.cli", "serve", "--model", str(self.model),
               "--port", "0", "--port-file", str(port_file), "--log-level", "warning",
               *journal, *self.args]
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not listen in {timeout} s:\n{self.tail()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        if wait_ready:
            self.wait_ready(deadline - time.monotonic())
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready in {timeout} s:\n{self.tail()}")
            time.sleep(0.05)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        rc = self.proc.returncode
        self.proc = None
        self._logf.close()
        return rc

    def __enter__(self) -> ServerProc:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def sse_events(text: str) -> list[tuple[str, object]]:
    """Parse an SSE body into (event name, data) pairs; data is JSON where it parses."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if not data:
            continue
        raw = "\n".join(data)
        try:
            out.append((name, json.loads(raw)))
        except ValueError:
            out.append((name, raw))
    return out


def listen_events(url: str, sid: str, skip: tuple[str, ...] = (),
                  until: tuple[str, ...] = ("close",)) -> tuple[queue.Queue, threading.Thread]:
    """A session's live SSE events, (name, data) each, put on the returned queue by the
    returned daemon thread, but for the names in `skip`; it ends after an event in `until`."""
    events: queue.Queue = queue.Queue()

    def listen():
        with httpx.Client(base_url=url, timeout=120) as c, \
                c.stream("GET", f"/sessions/{sid}/events") as r:
            assert r.status_code == 200
            name = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:") and name not in skip:
                    events.put((name, json.loads(line[5:])))
                    if name in until:
                        return

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    return events, thread


def state_of(client: httpx.Client, sid: str) -> tuple:
    """A session's committed state as the server reports it: version, tokens, messages."""
    r = client.get(f"/sessions/{sid}", params={"include": "tokens,messages"})
    r.raise_for_status()
    info = r.json()
    return info["version"], tuple(info["token_ids"]), json.dumps(info["message_list"])
