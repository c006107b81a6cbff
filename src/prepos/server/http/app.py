"""The HTTP app and `prepos serve` (its options: `options.py`)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from prepos.server.anthropic.routes import routes as messages_routes
from prepos.server.cluster import default_url
from prepos.server.http import errors, openapi, results
from prepos.server.http import response_bodies as R
from prepos.server.http.auth import open_warning
from prepos.server.http.cluster_front import ClusterFront
from prepos.server.http.console import routes as console_routes
from prepos.server.http.cross_site import CrossSite
from prepos.server.http.fast import FastRoute
from prepos.server.http.front import App, Sizes
from prepos.server.http.guard import guarded_protocol
from prepos.server.http.metrics import CONTENT_TYPE
from prepos.server.http.options import config_from_args, parse_args
from prepos.server.http.results import JSONBody
from prepos.server.http.routing import Routes
from prepos.server.http.sessions import routes as sessions_routes
from prepos.server.http.state import ServerConfig, ServerState
from prepos.server.openai.conversations_api import routes as conversations_routes
from prepos.server.openai.responses import routes as responses_routes
from prepos.server.openai.routes import routes as openai_routes
from prepos.server.store.database import StoreHeld, hold, is_url, redacted

log = logging.getLogger("prepos.server")


def create_app(config: ServerConfig, engine_factory=None) -> App:
    state = ServerState(config, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(state.stop)

    app = App(title="prepos", version="0.1.0", lifespan=lifespan,
              description="A stateful-session LLM server that answers before it is asked.")
    app.state.prepos = state
    respond = errors.install(app, on_error=state.metrics.refused)
    if not config.allowed_origins:  # CORS adds its headers to every response
        app.fast_route = FastRoute(state, respond)
    # x-session-id both ways; with a shared store, who serves the session
    app.front = state.front = ClusterFront(respond)
    app.cross_site = CrossSite(config.host, config.allowed_hosts, config.allowed_origins)
    app.sizes = Sizes(config.limits.max_body_bytes, config.limits.max_header_bytes)

    own = Routes()

    @own.add("GET", "/health", 70, summary="Whether the model is loaded", response=R.Health,
             others={503: R.HealthPending}, public=True)
    async def health(request: Request):
        eng = state.loaded
        if eng is None or state.status != "ready":
            body = {"status": state.status, "model": state.model_name}
            if state.error:
                body["error"] = state.error
            return Response(json.dumps(body), 503, media_type="application/json",
                            headers={"Retry-After": "1"})
        cluster = state.cluster.health() if state.cluster is not None else None
        if cluster is not None and not cluster["serving"]:  # its lease lapsed: route away
            return JSONBody({"status": "lapsed", "model": state.model_name,
                                  "cluster": cluster}, 503, {"Retry-After": "1"})
        tiers, admission = eng.metrics()["kv_tiers"], state.admission
        body = {"status": "ok", "model": state.model_name,
                "sessions": admission.persistent_sessions(eng),
                "max_sessions": admission.session_cap,
                "restored": state.restored, "journal": config.journal is not None,
                "kv": {t: tiers[t] for t in ("resident", "ram", "disk") if t in tiers}}
        if cluster is not None:
            body["cluster"] = cluster
        if config.journal is not None and state.keys.admits(request):  # the path: keys only
            body["journal_path"] = redacted(config.journal)
        return JSONBody(body)

    @own.add("GET", "/metrics", 70, summary="Prometheus metrics", response={"type": "string"},
             media="text/plain", public=True, errors=(401,))
    async def metrics(request: Request):  # as the straight line answers it (fast.py)
        return Response(state.scrape(request.headers.get("authorization")),
                        media_type=CONTENT_TYPE)

    api = Routes()
    api.routes = [*sessions_routes.routes, *openai_routes.routes, *responses_routes.routes,
                  *conversations_routes.routes, *own.routes, *console_routes.routes]
    api.routes += messages_routes.routes  # the Anthropic Messages API
    app.router.routes[:0] = api.ordered()  # before FastAPI's own (docs), hot routes first
    openapi.install(app, api.routes)  # /openapi.json: every route above
    if config.allowed_origins:  # browser clients: preflight answered, responses allowed
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=list(results.EXPOSED), max_age=600)
    return app


def main(argv: list[str] | None = None, around: Callable[[FastAPI], Any] | None = None) -> int:
    """`prepos serve`. `around(app)`, where given, is the ASGI app served instead of prepos's
    own (benchmarks/fast_http.py serves reference endpoints beside it with these settings)."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: "
                        "%(message)s")
    from prepos.engine import resolve_model
    from prepos.errors import InvalidInput

    try:
        resolve_model(args.model)
    except InvalidInput as exc:
        print(f"prepos serve: no model at {args.model}: {exc}. Train the bundled model first "
              "(`prepos train`) or pass --model DIR, FILE.gguf or smollm2.", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as exc:  # an option out of its range
        print(f"prepos serve: {exc}", file=sys.stderr)
        return 2
    if config.journal is not None and not is_url(config.journal):
        try:  # one server per journal: held until this process ends
            hold(config.journal)
        except StoreHeld as exc:
            print(f"prepos serve: {exc}", file=sys.stderr)
            return 2
    # the model worker runs Python between its kernels; a request arriving then waits for the
    # GIL up to the switch interval (5 ms by default): keep that wait well under the fast
    # path's budget
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if (warning := open_warning(args.host, config.api_keys)) is not None:
        log.warning(warning)
    app = create_app(config)
    state: ServerState = app.state.prepos
    # the guard bounds a request's head and the time it takes to arrive, so half-sent
    # requests and huge headers cannot hold the server
    served = app if around is None else around(app)
    uv = uvicorn.Config(served, host=args.host, port=args.port, log_level=args.log_level,
                        access_log=args.access_log, timeout_graceful_shutdown=5,
                        timeout_keep_alive=args.keep_alive,
                        http=guarded_protocol(args.request_timeout, args.max_header_bytes))
    server = _Server(uv, state, args.port_file)
    state.on_failure = server.fail
    print(f"prepos: serving {config.model} on http://{args.host}:{args.port} (journal: "
          f"{redacted(config.journal) if config.journal else 'off'}; API keys: "
          f"{len(config.api_keys) or 'off'})",
          file=sys.stderr, flush=True)
    server.run()
    failed = state.status == "failed" or server.failed
    print(f"prepos: stopped{' (the model failed to load)' if failed else ''}", file=sys.stderr,
          flush=True)
    return 1 if failed else 0


class _Server:
    """uvicorn's Server, plus: end SSE subscriptions as soon as shutdown begins (they would
    hold the graceful shutdown open), publish the bound port, stop when loading fails, and
    tick once a second, not ten times.

    uvicorn's main loop wakes every 100 ms to see whether it should stop and, every tenth
    time, to write the `date` header's second. Each wake costs the event loop a few hundred
    microseconds of CPU here (its code cold after the model's step has been through the
    caches): two thirds of the loop's own CPU while it streams, and all of it idle. Here it
    ticks each second (the date header keeps its second's resolution), and a signal to stop
    or `fail` wakes it at once."""

    def __init__(self, config, state: ServerState, port_file: Path | None):
        import uvicorn

        class Server(uvicorn.Server):
            tick: asyncio.Future | None = None  # the main loop's wait for its next tick

            def handle_exit(self, sig, frame):
                # as uvicorn's, but a signal that asked for a graceful stop is not raised
                # again afterwards: a clean shutdown exits 0
                loop = state.loop
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(state.subscriptions.shutdown)
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    self.should_exit = True
                self.wake()

            def wake(self) -> None:
                """The main loop's next tick now (from any thread)."""
                loop, tick = state.loop, self.tick
                if tick is not None and loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(_settle, tick)

            async def main_loop(self) -> None:
                # uvicorn's, each tick counted as ten of its own
                loop, counter = asyncio.get_running_loop(), 0
                while not await self.on_tick(counter):
                    counter = (counter + 10) % 864000
                    self.tick = tick = loop.create_future()
                    if self.should_exit:  # asked since the tick: `wake` saw the one before
                        continue
                    timer = loop.call_later(1.0, _settle, tick)
                    await tick
                    timer.cancel()

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.servers:
                    port = self.servers[0].sockets[0].getsockname()[1]
                    state.url = default_url(config.host, port)
                    state.bound.set()
                if port_file is not None and self.servers:
                    tmp = port_file.with_name(port_file.name + ".tmp")
                    tmp.write_text(str(port))
                    tmp.replace(port_file)
                    print(f"prepos: listening on port {port}", file=sys.stderr, flush=True)

        self.server = Server(config)
        self.failed = False

    def fail(self) -> None:
        self.failed = True
        self.server.should_exit = True
        self.server.wake()

    def run(self) -> None:
        self.server.run()


def _settle(tick: asyncio.Future) -> None:
    if not tick.done():
        tick.set_result(None)


if __name__ == "__main__":
    sys.exit(main())
