"""The server's state: its configuration, the engine once loaded, the journal, the SSE hub,
metrics, keys and limits, and the helpers every route uses: a request's context (`RequestContext`),
session lookup; its session admission (`session_admission.py`)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from prepos.config import EngineConfig
from prepos.core import Request as EngineRequest
from prepos.core import Result
from prepos.decode.stream import Stream
from prepos.engine import Engine, Session, is_ephemeral
from prepos.errors import PreposError, SessionNotFound
from prepos.server.http.auth import Keys
from prepos.server.http.errors import ApiError, validation_error
from prepos.server.http.idempotency import KeyedRequests, attempt_of
from prepos.server.http.limits import Limits, share
from prepos.server.http.metrics import Metrics
from prepos.server.http.session_admission import SessionAdmission
from prepos.server.http.sse import Subscriptions, disconnected
from prepos.server.names import SCOPE, scoped
from prepos.server.store import idempotency
from prepos.server.store import responses as responses_store
from prepos.server.store.database import Database
from prepos.server.store.journal import Journal
from prepos.server.store.lease import LeaseConfig

log = logging.getLogger("prepos.server")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
INLINE_BYTES = 16384  # text or bodies up to this size are handled on the event loop


# `prepos serve --backend` names of the remote engines: their kind in `prepos.backends.remote`
REMOTE_ENGINES = {"llama-server": "llama.cpp", "vllm": "vllm", "sglang": "sglang"}


@dataclass(frozen=True)
class RemoteEngine:
    """A running engine the server fronts: its kind, replicas' base URLs, served model name
    (None: the engine's only one), and whether background work gives way to every foreground
    request there even where the engine schedules by priority."""

    kind: str
    urls: tuple[str, ...]
    model: str | None = None
    give_way: bool = False


@dataclass
class ServerConfig:
    model: Path  # in front of a remote engine: the same model, for its tokenizer and template
    engine: EngineConfig = field(default_factory=EngineConfig)
    remote: RemoteEngine | None = None  # None: the model runs in process
    journal: Path | None = None  # None: no persistence
    store_timeout: float = 2.0  # seconds a write may wait for the store (then a 503)
    api_keys: tuple[str, ...] = ()
    metrics_keys: tuple[str, ...] = ()  # GET /metrics needs one of these (none: public)
    served_model_name: str | None = None
    limits: Limits = field(default_factory=Limits)
    threads: int = 256  # threads that wait on engine work for the event loop
    cpu_threads: int = 2  # threads that tokenize and parse large inputs off the event loop
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed ("*": any)
    host: str | None = "127.0.0.1"  # the address listened on (`cross_site.py` checks Host by it)
    allowed_hosts: tuple[str, ...] = ()  # Host names taken besides ("*": any)
    request_timeout: float = 30.0  # seconds a client may take to send one whole request
    responses_bytes: int = responses_store.MAX_BYTES  # stored responses' bytes per key
    responses_ttl: float = responses_store.TTL_S  # seconds a stored response is kept
    idempotency_ttl: float = idempotency.TTL_S  # seconds an Idempotency-Key's result is kept
    idempotency_keys: int = idempotency.KEEP  # results kept per API key
    idempotency_bytes: int = idempotency.MAX_BYTES  # bytes of results kept per API key
    lease: LeaseConfig = field(default_factory=LeaseConfig)  # with a shared store
    advertise_url: str | None = None  # where other nodes forward to (default: bound address)


@dataclass
class RequestContext:
    """One request's context: the server state, the engine, the caller's owner id, the
    validated body, and the session of routes that name one."""

    state: ServerState
    engine: Engine
    owner: str | None
    body: Any = None
    session: Session | None = None
    # the request's Idempotency-Key attempt (None: no key): the origin of every write it makes
    origin: object = None

    @property
    def sid(self) -> str:
        return self.session.id

    async def check_input(self, text: str, what: str) -> None:
        await self.state.check_input(self.engine, text, what)


class ServerState:
    def __init__(self, config: ServerConfig,
                 engine_factory: Callable[[ServerConfig], Engine] | None = None):
        lim, made = config.limits, config.engine  # the engine config (not an engine)
        # the engine holds the persistent sessions and a queue's stateless ones
        config = replace(config, engine=replace(made, max_sessions=min(
            made.max_sessions, lim.max_sessions + made.max_queue)))
        self.config = config
        self.limits = config.limits
        self.keys = Keys(config.api_keys)
        self.scrapers = Keys(config.metrics_keys, "metrics key")  # none: /metrics is public
        model = Path(config.model)  # the directory's name, a GGUF file's stem, or `smollm2`
        self.model_name = config.served_model_name or (
            model.stem if model.suffix == ".gguf" else model.name)
        self.metrics = Metrics(self.model_name)
        self.subscriptions = Subscriptions(self.metrics, self.limits.max_subscribers,
                       share(self.limits.max_subscribers, self.limits.max_subscribers_per_key,
                             len(config.api_keys)))
        self.journal: Journal | None = None
        self.idempotency: KeyedRequests | None = None  # once loaded: in the store
        self.loaded: Engine | None = None  # the engine, once loaded
        self.status = "loading"
        self.error: str | None = None
        self.restored = 0
        self.admission = SessionAdmission(self.limits, self.metrics, len(config.api_keys))
        self.created = int(time.time())  # the model's "created" time in /v1/models
        self.loop: asyncio.AbstractEventLoop | None = None
        self.executor = ThreadPoolExecutor(max_workers=config.threads,
                                           thread_name_prefix="prepos-wait")
        # CPU work a request brings (tokenizing, parsing a large body) runs here, off the
        # event loop and bounded: at most `cpu_threads` such jobs at once
        self.cpu = ThreadPoolExecutor(max_workers=config.cpu_threads,
                                      thread_name_prefix="prepos-cpu")
        self._factory = engine_factory or _load_engine
        self._loader: threading.Thread | None = None
        self.on_failure: Callable[[], None] | None = None
        self.cluster = None  # server/cluster.py's Cluster, with a shared store
        self.front = None  # the app's cluster.ClusterFront, which serves its requests once joined
        self.bound = threading.Event()  # set once listening, `url` the address bound
        self.url = ""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load the engine and restore the journal off the event loop: /health says 503
        until it is done."""
        self.loop = loop
        loop.set_default_executor(self.executor)  # Stream.aiter waits in it
        self._loader = threading.Thread(target=self._load, name="prepos-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._factory(self.config)
            self.admission.cap(engine)
            engine.observe(self.metrics.observe)
            if self.config.journal is not None:
                self.journal = Journal(self.config.journal, engine.config.max_versions,
                                       metrics=self.metrics,
                                       timeout=self.config.store_timeout)
                previous = self.journal.check_model(self.model_name)
                if previous:
                    log.warning("journal %s was written with model %s; restoring its sessions "
                                "with %s", self.config.journal, previous, self.model_name)
                self.journal.attach(engine)
                if self.journal.shared:  # several nodes: sessions loaded when asked for
                    from prepos.server.cluster import join
                    from prepos.server.store.directory import Directory
                    self.cluster = join(self, engine, self.journal)
                    self.cluster.directory = Directory(
                        Database(self.config.journal, migrate=False), self.cluster.leases.node)
                    engine.publish_conversations(self.cluster.directory.publish)
            self.idempotency = KeyedRequests(idempotency.Records(
                self.journal.db if self.journal is not None else Database(None),
                self.config.idempotency_ttl, self.config.idempotency_keys,
                self.config.idempotency_bytes))
            self.subscriptions.attach(engine, self.loop)
            self.metrics.engine = engine
            if self.journal is not None and self.cluster is None:
                self._restore(engine, self.journal)
            gc.collect()
            gc.freeze()  # the model and libraries: out of the collector's way for good
            self.loaded = engine
            self.status = "ready"
            log.info("prepos ready: model %s, %d sessions restored, %.1f s", self.model_name,
                     self.restored, time.perf_counter() - t0)
        except BaseException as exc:
            self.status = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("prepos failed to load: %s", self.error)
            if self.on_failure is not None:
                self.on_failure()

    def _restore(self, engine: Engine, journal: Journal) -> None:
        for sid, spec, history in journal.load():
            try:
                engine.restore_session(sid, spec, history)
                self.restored += 1
            except PreposError as exc:
                journal.forget(sid)
                log.error("session %s not restored: %s", sid, exc)

    def stop(self) -> None:
        self.status = "stopping"
        self.subscriptions.shutdown()
        if self._loader is not None:
            self._loader.join(timeout=60)
        if self.cluster is not None:
            self.cluster.stop()
            if self.cluster.directory is not None:
                self.cluster.directory.close()
        if self.loaded is not None:
            self.loaded.close()
        if self.journal is not None:
            self.journal.close()
        elif self.idempotency is not None:
            self.idempotency.records.db.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.cpu.shutdown(wait=False, cancel_futures=True)

    # -- per request -----------------------------------------------------------------------
    @staticmethod
    def of(request: Request) -> ServerState:
        return request.app.state.prepos

    @classmethod
    async def open(cls, request: Request, model: type[BaseModel] | None = None,
                   sid: str | None = None, kind: str | None = None) -> RequestContext:
        """A Starlette request's context (`call`), its body parsed as `model`."""
        state = cls.of(request)

        async def body():
            return await state.parse(await request.body(), model)

        return await state.call(request.headers.get("authorization"),
                                body if model is not None else None, sid, kind,
                                attempt_of(request))

    async def call(self, authorization: str | None, body: Callable[[], Awaitable[Any]] | None,
                   sid: str | None = None, kind: str | None = None,
                   origin: object = None) -> RequestContext:
        """A request's context, refused in this order: 503 while loading, 401 for a bad key
        (`authorization`, the request's header), 404 for no session `sid` (of this key), 400
        for a bad body (`body()`, the request's, read and parsed), 409 for a session of
        another kind."""
        eng = self.engine
        owner = self.keys.owner_of(authorization)
        s = self.session(eng, sid, owner) if sid is not None else None
        parsed = await body() if body is not None else None
        if kind is not None:
            s.require(kind)
        return RequestContext(self, eng, owner, parsed, s, origin)

    @property
    def engine(self) -> Engine:
        """The engine; 503 while it loads or if it failed to."""
        eng = self.loaded
        if eng is None:
            if self.status == "failed":
                raise ApiError(503, "load_failed", f"the model failed to load: {self.error}")
            raise ApiError(503, "loading", "the model is loading; retry shortly",
                           headers={"Retry-After": "1"})
        return eng

    def owner(self, request: Request) -> str | None:
        return self.keys.owner(request)

    def session(self, engine: Engine, sid: str, owner: str | None,
                param: str | None = None) -> Session:
        """The caller's session `sid`: 404 for none, another key's or an ephemeral one (the
        same answer for all three, so a key learns nothing of others' sessions)."""
        s = self.session_named(engine, sid, owner)
        if s is None:
            raise ApiError(404, "session_not_found", f"no session {sid!r}", param)
        return s

    def session_named(self, engine: Engine, sid: str, owner: str | None) -> Session | None:
        """The caller's session named `sid` (in its key's namespace, `scoped`; or by the bare
        name, as a keyed session made before names were scoped is kept), None where it names
        none of the caller's."""
        if is_ephemeral(sid) or SCOPE in sid:
            return None
        for key in dict.fromkeys((scoped(owner, sid), sid)):
            try:
                s = engine.session(key)
            except SessionNotFound:
                continue
            if self.visible(s, owner):
                return s
        return None

    @staticmethod
    def visible(s: Session, owner: str | None) -> bool:
        """Whether the caller with key `owner` may see session `s`: its own, never an
        ephemeral one (a stateless request's)."""
        return not is_ephemeral(s.id) and (owner is None or s.spec.owner == owner)

    def scrape(self, authorization: str | None) -> bytes:
        """GET /metrics's text, for a request with this Authorization header (401 without a
        metrics key, where there are some). Written on the event loop (`Exposition`, the
        engine's families and `Buckets` keep the text that stays the same): no thread hop."""
        self.scrapers.owner_of(authorization)
        return self.metrics.render()

    async def parse(self, raw: bytes, model: type[M]) -> M:
        """A request body as `model`: 400 naming the problem."""
        if not raw:
            raise ApiError(400, "missing_body", f"this endpoint needs a JSON body "
                           f"({model.__name__})")
        try:
            if len(raw) <= INLINE_BYTES:
                return model.model_validate_json(raw)
            return await asyncio.get_running_loop().run_in_executor(
                self.cpu, model.model_validate_json, raw)
        except ValidationError as exc:
            err = validation_error(exc)
            if err.code == "invalid_request" and raw.lstrip()[:1] != b"{":
                err = ApiError(400, "invalid_request", "the body must be a JSON object")
            raise err from None

    async def check_input(self, engine: Engine, text: str, what: str,
                          context: bool = False) -> None:
        """`Limits.check_input`: text short enough is never tokenized; longer text is
        tokenized off the event loop, in the bounded CPU pool."""
        limit = self.limits.input_limit(engine)
        if len(text) <= limit and len(text.encode()) <= limit:
            return
        await asyncio.get_running_loop().run_in_executor(
            self.cpu, self.limits.check_input, engine, text, what, context)

    async def run(self, fn, *args):
        """Run blocking engine work (rendering, waiting for the worker) off the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def committing(self, fn, *args):
        """`fn(*args)`, which commits: off the loop where the journal writes it ahead (the
        commit waits for the store), at once where nothing is journalled."""
        if self.journal is None:
            return fn(*args)
        return await self.run(fn, *args)

    async def result(self, stream, receive) -> Result:
        """The stream's result. `receive`, the request's ASGI receive: a client that leaves
        before the result is ready cancels the stream (no more model work for it)."""
        if stream.done:
            return stream.result()
        work = asyncio.ensure_future(self.run(stream.result))
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                stream.cancel()
            return await work
        finally:
            gone.cancel()

    async def start_exact(self, engine: Engine, sid: str, key: tuple, req: EngineRequest,
                          start: Callable[[], Stream], size: int = 0,
                          commits: bool = False) -> Stream:
        """`start()` a request for entry `key`, once the engine admits it (`Engine.admit`:
        refused for backpressure unless it needs no model work). It runs on the event loop
        (no thread hop: a fast answer is written at once) unless it `commits` (its commit
        waits for the store) or its text, `size` characters, is long enough that tokenizing
        it would hold the loop up."""
        engine.admit(sid, key, req)
        if commits:
            return await self.committing(start)
        if size <= INLINE_BYTES:
            return start()
        return await asyncio.get_running_loop().run_in_executor(self.cpu, start)


def _load_engine(config: ServerConfig) -> Engine:
    from prepos.engine import resolve_model
    from prepos.errors import InvalidInput

    try:
        path = resolve_model(config.model)
    except InvalidInput as exc:
        raise FileNotFoundError(str(exc)) from None
    if config.remote is not None:
        from prepos.engine import remote_engine

        r = config.remote
        return remote_engine(r.kind, r.urls, path, config.engine, model=r.model,
                             give_way=r.give_way)
    return Engine.from_pretrained(path, config.engine)
