"""The HTTP app and `prepos serve`.

    prepos serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--journal PATH] ...

The server listens at once and loads the model (and restores the journal's sessions) in
the background: `GET /health` answers 503 until it is ready, then 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
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

from prepos.config import (
    KV_LAYOUTS,
    BudgetConfig,
    EngineConfig,
    RelaxedConfig,
    TierConfig,
    default_threads,
)
from prepos.paths import DEFAULT_MODEL
from prepos.server import errors, openapi, results
from prepos.server import responses as R
from prepos.server.auth import Keys, load_keys, open_warning
from prepos.server.cluster import Front, default_url
from prepos.server.console import routes as console_routes
from prepos.server.conversations_api import routes as conversations_routes
from prepos.server.fast import App, StraightLine
from prepos.server.guard import MAX_HEADER_BYTES, guarded_protocol, h11_buffer
from prepos.server.lease import LeaseConfig
from prepos.server.limits import BodyLimit, Limits
from prepos.server.metrics import CONTENT_TYPE
from prepos.server.openai import routes as openai_routes
from prepos.server.responses_api import routes as responses_routes
from prepos.server.results import JSONBody
from prepos.server.routing import Routes
from prepos.server.sessions import routes as sessions_routes
from prepos.server.state import ServerConfig, ServerState
from prepos.server.store import StoreHeld, hold, is_url, redacted

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
    respond = errors.install(app, on_error=lambda err: state.metrics.errors.labels(
        str(err.status), err.code).inc())
    if not config.allowed_origins:  # CORS adds its headers to every response
        app.straight = StraightLine(state, respond)
    # x-session-id both ways; with a shared store, who serves the session
    app.front = state.front = Front(respond, config.limits.max_body_bytes)

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
        tiers, places = eng.metrics()["kv_tiers"], state.places
        body = {"status": "ok", "model": state.model_name,
                "sessions": places.persistent_sessions(eng), "max_sessions": places.session_cap,
                "restored": state.restored, "journal": config.journal is not None,
                "kv": {t: tiers[t] for t in ("resident", "ram", "disk") if t in tiers}}
        if cluster is not None:
            body["cluster"] = cluster
        if config.journal is not None and state.keys.admits(request):  # the path: keys only
            body["journal_path"] = redacted(config.journal)
        return JSONBody(body)

    scrapers = Keys(config.metrics_keys, "metrics key")  # none: /metrics is public

    @own.add("GET", "/metrics", 70, summary="Prometheus metrics", response={"type": "string"},
             media="text/plain", public=True, errors=(401,))
    async def metrics(request: Request):
        scrapers.owner(request)  # 401 without a metrics key, where there are some
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    api = Routes()
    api.routes = [*sessions_routes.routes, *openai_routes.routes, *responses_routes.routes,
                  *conversations_routes.routes, *own.routes, *console_routes.routes]
    app.router.routes[:0] = api.ordered()  # before FastAPI's own (docs), hot routes first
    openapi.install(app, api.routes)  # /openapi.json: every route above
    app.add_middleware(BodyLimit, max_bytes=config.limits.max_body_bytes,
                       max_header_bytes=config.limits.max_header_bytes)
    if config.allowed_origins:  # browser clients: preflight answered, responses allowed
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=list(results.EXPOSED), max_age=600)
    return app


def size(text: str) -> int:
    """A size in bytes: an integer, or one with a K, M or G suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4G, 512M)") from None


def default_journal(model: Path) -> Path:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "prepos" / f"{Path(model).name}.sqlite3"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prepos serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="an HF model directory, a .gguf file or a known model's name "
                   "(smollm2) (default: the bundled %(default)s)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp"],
                   help="auto: llama.cpp where it is installed (GGUF files always), else torch")
    p.add_argument("--kv-cells", type=int, default=EngineConfig.kv_cells,
                   help="llama.cpp: the resident KV cells all sessions share (default "
                   "%(default)s; the rest of their KV waits in the tiers below)")
    p.add_argument("--kv-sequences", type=int, default=EngineConfig.max_sequences,
                   help="llama.cpp: sessions holding a KV at once (at most 256)")
    p.add_argument("--kv-layout", default=EngineConfig.kv_layout, choices=KV_LAYOUTS,
                   help="llama.cpp: unified (one pool; every step scans all sessions' cells) "
                   "or streams (kv-cells / kv-sequences cells per session, each step scans "
                   "its own: faster with many sessions resident or decoding at once)")
    p.add_argument("--kv-idle-cells", type=int, default=EngineConfig.kv_idle_cells,
                   help="llama.cpp, unified layout: the cells idle sessions keep resident "
                   "while a request runs; the rest move to the RAM tier, least recently used "
                   "first (default %(default)s; -1: no bound but --kv-cells)")
    p.add_argument("--kv-ram", type=size, default=None,
                   help="bytes of host RAM for the KV of sessions not resident (K/M/G "
                   "suffixes; default: a quarter of the machine's memory)")
    p.add_argument("--ready-logits-memory", type=size,
                   default=EngineConfig.ready_logits_bytes,
                   help="bytes of full next-token vectors prepared answers keep, most recently "
                   "used first (K/M/G; default 512M); beyond it a prepared answer keeps its "
                   "top tokens: greedy requests are answered from it, others take the full "
                   "path")
    p.add_argument("--kv-disk", type=size, default=TierConfig().disk_bytes,
                   help="bytes of disk for the KV below RAM (default 16G); beyond it a "
                   "session's KV is recomputed from its committed tokens when needed")
    p.add_argument("--kv-dir", type=Path, default=None,
                   help="where the disk tier's files go (default: the system's temporary "
                   "directory; removed when the server stops)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument("--served-model-name", help="the model id of /v1 (default: the dir name)")
    p.add_argument("--journal", help="SQLite journal path (default: "
                   "$XDG_STATE_HOME/prepos/<model>.sqlite3); 'none' disables persistence")
    p.add_argument("--store", dest="journal", help="the session store: a SQLite path (as "
                   "--journal) or a postgresql:// URL, shared by several nodes that own "
                   "sessions by lease")
    p.add_argument("--store-timeout", type=float, default=2.0, help="seconds a write may "
                   "wait for the store (a locked or slow one); then the request is refused "
                   "with 503 store_unavailable and nothing is committed (default %(default)s)")
    p.add_argument("--node-id", default="", help="this node's name in a shared store "
                   "(default: a new random one per process)")
    p.add_argument("--advertise-url", help="where the other nodes reach this one (default: "
                   "http://HOST:PORT as bound)")
    p.add_argument("--lease-seconds", type=float, default=LeaseConfig.lease_s,
                   help="a node's lease on its sessions: another node takes them over this "
                   "long after it stops renewing (default %(default)s)")
    p.add_argument("--renew-seconds", type=float, default=LeaseConfig.renew_s,
                   help="how often the lease is renewed (default %(default)s)")
    p.add_argument("--api-key", action="append", default=[],
                   help="accept this Bearer key (repeatable; also PREPOS_API_KEYS, comma-"
                   "separated); with none given the server is open")
    p.add_argument("--api-keys-file", help="file of keys, one a line")
    p.add_argument("--metrics-key", action="append", default=[],
                   help="GET /metrics needs this Bearer key (repeatable; also "
                   "PREPOS_METRICS_KEYS; give an API key here to let its holder scrape); "
                   "with none given /metrics is public")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="compute threads (default: one per physical core this process may "
                   "run on, as llama.cpp's own default)")
    p.add_argument("--no-preposition", action="store_true",
                   help="never pre-position (every request pays its entry: the baseline)")
    p.add_argument("--predecode-tokens", type=int, default=EngineConfig.predecode_tokens,
                   help="after an exact entry is pre-positioned (a standing query, the turn "
                        "after a user message or tool result), decode its greedy answer at "
                        "idle up to this many tokens (a session's answer_max_tokens "
                        "overrides it; 0: off)")
    p.add_argument("--predecode-min-hit", type=float, default=EngineConfig.predecode_min_hit,
                   help="pre-decode an entry, or bring a session's KV back from RAM or disk "
                        "to pre-position it, only while the chance h = rho / (1 + rho) that a "
                        "request comes before the next update (rho: its session's requests per "
                        "update, as observed) is at least this (0: always)")
    p.add_argument("--lookup-tokens", type=int, default=EngineConfig.lookup_tokens,
                   help="prompt-lookup draft tokens verified per forward of a greedy answer "
                        "(0: off)")
    p.add_argument("--lookup-said-tokens", type=int, default=EngineConfig.lookup_said_tokens,
                   help="tokens of a session's latest answers its next greedy answer drafts "
                        "from besides its context (0: the context only)")
    p.add_argument("--relaxed-r-max", type=float, default=RelaxedConfig.r_max,
                   help="the relaxed fast path's risk budget: a question class is served "
                        "while its verified false-accept rate's Wilson upper bound is within")
    p.add_argument("--relaxed-start", default=RelaxedConfig.start, choices=["cold", "serve"],
                   help="a new question class on the relaxed path: answered by the full path, "
                        "its answers the evidence, until promoted (cold, the default: no "
                        "unverified exposure), or served relaxed on probation, each answer "
                        "verified after it is served and corrected if wrong (serve)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-sessions", type=int, default=Limits.max_sessions,
                   help="sessions the server keeps (journalled; their KV in the tiers)")
    p.add_argument("--max-sessions-per-key", type=int)
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="most tokens a request may generate")
    p.add_argument("--default-max-tokens", type=int, default=64,
                   help="tokens a session-API request generates when it names no max_tokens "
                        "(an OpenAI request without one takes the rest of the context, up "
                        "to --max-tokens)")
    p.add_argument("--max-input-tokens", type=int, default=8192,
                   help="most tokens of input text in one request")
    p.add_argument("--max-session-tokens", type=int,
                   help="most tokens a session may hold (default: the model's context)")
    p.add_argument("--max-session-cells", type=int, default=BudgetConfig.session_cells,
                   help="default per-session KV cell budget")
    p.add_argument("--max-kv-cells", type=int, default=BudgetConfig.engine_cells,
                   help="the engine's KV cell budget")
    p.add_argument("--max-queue", type=int, default=256,
                   help="foreground requests queued on the model worker before 429")
    p.add_argument("--switch-interval-ms", type=float, default=0.5,
                   help="the interpreter's thread switch interval (default %(default)s ms)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--allowed-origins", default="",
                   help="CORS: comma-separated browser origins allowed to call the API "
                   "('*' for any; default: none, no CORS headers)")
    p.add_argument("--implicit-memory", type=size, default=ServerConfig.implicit_memory,
                   help="bytes of bookkeeping (tokens, text, messages; their KV is the "
                   "tiers') for stateless chat conversations kept as implicit sessions, so a "
                   "stock client's next turn pays only its new messages; a kept one whose KV "
                   "the tiers dropped is closed (K/M/G; 0: none kept; default 1G)")
    p.add_argument("--implicit-sessions", type=int, default=None,
                   help="at most this many implicit sessions too (default: no count, only "
                   "--implicit-memory; 0: none kept)")
    p.add_argument("--response-sessions", type=int, default=ServerConfig.response_sessions,
                   help="stored Responses API chains kept as sessions, least recently used "
                   "closed first (their responses stay stored; 0: none; default %(default)s)")
    p.add_argument("--responses-bytes", type=size, default=ServerConfig.responses_bytes,
                   help="bytes of stored responses per API key, the oldest evicted first, "
                   "and as many of conversations (K/M/G suffixes; default 256M)")
    p.add_argument("--responses-ttl", type=float, default=ServerConfig.responses_ttl,
                   help="seconds a stored response is kept (default 30 days)")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a client may take to send one whole request (headers and "
                   "body); slower ones are closed (default %(default)s)")
    p.add_argument("--max-header-bytes", type=int, default=MAX_HEADER_BYTES,
                   help="most bytes of a request's line and headers (431 beyond; default "
                   "%(default)s)")
    p.add_argument("--keep-alive", type=float, default=60.0,
                   help="seconds an idle keep-alive connection stays open")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    for flag in ("lookup_tokens", "lookup_said_tokens", "implicit_sessions", "implicit_memory",
                 "response_sessions", "ready_logits_memory"):
        if (getattr(args, flag) or 0) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got "
                             f"{getattr(args, flag)}")
    if not 0 < args.responses_ttl < float("inf"):
        raise ValueError(f"--responses-ttl must be a number of seconds > 0, got "
                         f"{args.responses_ttl}")
    if args.journal is None:
        journal: Path | str | None = default_journal(args.model)
    elif is_url(args.journal):
        journal = args.journal
    elif args.journal.lower() in ("none", ""):
        journal = None
    else:
        journal = Path(args.journal)
    engine = EngineConfig(device=args.device, dtype=args.dtype, threads=args.threads,
                          backend=args.backend, kv_cells=args.kv_cells,
                          max_sequences=args.kv_sequences, kv_layout=args.kv_layout,
                          kv_idle_cells=None if args.kv_idle_cells < 0 else args.kv_idle_cells,
                          tiers=TierConfig(**({} if args.kv_ram is None
                                              else {"ram_bytes": args.kv_ram}),
                                           disk_bytes=args.kv_disk, disk_dir=args.kv_dir),
                          max_context=args.max_session_tokens,
                          preposition=not args.no_preposition,
                          predecode_tokens=max(0, args.predecode_tokens),
                          predecode_min_hit=args.predecode_min_hit,
                          ready_logits_bytes=args.ready_logits_memory,
                          budget=BudgetConfig(args.max_session_cells, args.max_kv_cells),
                          lookup_tokens=args.lookup_tokens,
                          lookup_said_tokens=args.lookup_said_tokens,
                          relaxed=RelaxedConfig(r_max=args.relaxed_r_max,
                                                start=args.relaxed_start))
    limits = Limits(max_body_bytes=args.max_body_bytes, max_sessions=args.max_sessions,
                    max_sessions_per_key=args.max_sessions_per_key, max_tokens=args.max_tokens,
                    default_max_tokens=min(args.default_max_tokens, args.max_tokens),
                    max_input_tokens=args.max_input_tokens, max_queue=args.max_queue,
                    max_header_bytes=args.max_header_bytes)
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    if not args.store_timeout > 0:
        raise ValueError(f"--store-timeout must be > 0, got {args.store_timeout}")
    return ServerConfig(model=args.model, engine=engine, journal=journal,
                        store_timeout=args.store_timeout,
                        api_keys=load_keys(args.api_key, args.api_keys_file),
                        metrics_keys=load_keys(args.metrics_key, env="PREPOS_METRICS_KEYS"),
                        served_model_name=args.served_model_name, limits=limits,
                        allowed_origins=origins, request_timeout=args.request_timeout,
                        implicit_memory=args.implicit_memory,
                        implicit_sessions=args.implicit_sessions,
                        response_sessions=args.response_sessions,
                        responses_bytes=args.responses_bytes, responses_ttl=args.responses_ttl,
                        lease=LeaseConfig(args.node_id, args.lease_seconds, args.renew_seconds,
                                          min(1.0, args.lease_seconds / 4)),
                        advertise_url=args.advertise_url)


def main(argv: list[str] | None = None, around: Callable[[FastAPI], Any] | None = None) -> int:
    """`prepos serve`. `around(app)`, where given, is the ASGI app served instead of prepos's
    own (benchmarks/fast_http.py serves reference endpoints beside it with these settings)."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: "
                        "%(message)s")
    from prepos.engine.loading import resolve_model
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
    # h11 (not httptools): it bounds a request's head, and the guard adds a deadline for
    # the whole request, so half-sent requests and huge headers cannot hold the server
    served = app if around is None else around(app)
    uv = uvicorn.Config(served, host=args.host, port=args.port, log_level=args.log_level,
                        access_log=args.access_log, timeout_graceful_shutdown=5,
                        timeout_keep_alive=args.keep_alive,
                        http=guarded_protocol(args.request_timeout, args.max_header_bytes),
                        h11_max_incomplete_event_size=h11_buffer(args.max_header_bytes))
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
    hold the graceful shutdown open), publish the bound port, and stop when loading fails."""

    def __init__(self, config, state: ServerState, port_file: Path | None):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                # as uvicorn's, but a signal that asked for a graceful stop is not raised
                # again afterwards: a clean shutdown exits 0
                loop = state.loop
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(state.hub.shutdown)
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    self.should_exit = True

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

    def run(self) -> None:
        self.server.run()


if __name__ == "__main__":
    sys.exit(main())
