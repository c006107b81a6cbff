"""The coding agents as a user runs them, against a real server: where their pinned builds
are (`scripts/install_agents.sh`), and `Recorder`, a pass-through proxy between an agent and
the server that keeps every exchange (its status, request body and response body), so a test
reads what the agent sent and what it was answered, never the agent's own output."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.server_harness import sse_events

AGENTS = Path(os.environ.get("AGENTS_CACHE", Path.home() / ".cache" / "prepos-agents"))
HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length"}


def agent(name: str) -> Path | None:
    """The installed agent's executable (claude, codex, opencode), or None."""
    path = AGENTS / "node_modules" / ".bin" / name
    return path if path.exists() else None


def missing(name: str) -> str:
    return (f"LOUD SKIP: {name} is not installed in {AGENTS} (run scripts/install_agents.sh, "
            "which needs npm)")


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    request: dict | None
    body: bytes

    def events(self) -> list[tuple[str, object]]:
        """The response's server-sent events: (name, data parsed as JSON where it parses)."""
        return sse_events(self.body.decode(errors="replace"))


@dataclass
class Recorder:
    """A proxy on a loopback port to `target`, recording each exchange in `seen`."""

    target: str
    seen: list[Exchange] = field(default_factory=list)
    url: str = ""

    def __enter__(self) -> Recorder:
        import uvicorn

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            headers = [(k.decode(), v.decode()) for k, v in scope["headers"]
                       if k.decode().lower() not in HOP]
            query = scope.get("query_string", b"").decode()
            url = self.target + scope["path"] + (f"?{query}" if query else "")
            async with httpx.AsyncClient(timeout=600) as client:
                async with client.stream(scope["method"], url, headers=headers,
                                         content=body) as r:
                    await send({"type": "http.response.start", "status": r.status_code,
                                "headers": [(k.encode(), v.encode()) for k, v in
                                            r.headers.multi_items() if k.lower() not in HOP]})
                    got = b""
                    async for chunk in r.aiter_raw():
                        got += chunk
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                    await send({"type": "http.response.body", "body": b""})
            try:
                request = json.loads(body) if body else None
            except ValueError:
                request = None
            self.seen.append(Exchange(scope["method"], scope["path"], r.status_code, request,
                                      got))

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        while not self._server.started:
            threading.Event().wait(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)



def run(cmd: list, cwd: Path, env: dict, timeout: float = 600):
    """Run an agent's command; its completed process (output kept for the assertion)."""
    import subprocess

    # PWD too: OpenCode takes its project's folder from it, not from the process's cwd
    return subprocess.run([str(c) for c in cmd], cwd=cwd,
                          env={**os.environ, "PWD": str(cwd), **env},
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)

