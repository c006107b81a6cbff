"""The facade: `Engine`, wired from its collaborators, made of a session part
(`mutations.py`), a request part (`requests.py`, where `query` reads as Algorithm 2) and a
read-only view (`view.py`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from prepos.backends.base import Backend
from prepos.chat.format import ChatFormat
from prepos.config import EngineConfig, GateConfig
from prepos.core import Result
from prepos.decode.lookup import Lookup
from prepos.engine.admission import Backpressure, Room
from prepos.engine.answers import Answers
from prepos.engine.implicit import ImplicitSessions
from prepos.engine.loading import load_parts
from prepos.engine.mutations import Mutations
from prepos.engine.prepositioner import MAX_YIELDS, Prepositioner
from prepos.engine.requests import Requests
from prepos.engine.session import Session, SessionStore
from prepos.engine.view import EngineView
from prepos.gate.calibrated import Gate
from prepos.gate.relaxed import Relaxed
from prepos.worker.kv import KVPool
from prepos.worker.scheduler import Scheduler
from prepos.worker.tiers import Tiers


class Engine(Mutations, Requests, EngineView):
    def __init__(self, backend: Backend, fmt: ChatFormat, config: EngineConfig | None = None,
                 model_name: str = "model"):
        config = config or EngineConfig()
        self.backend = backend
        self.fmt = fmt
        self.model_name = model_name
        self.max_context = min(config.max_context or backend.max_context, backend.max_context)
        if config.budget.session_cells is None:  # a session may use the whole context
            config = replace(config, budget=replace(config.budget,
                                                    session_cells=self.max_context))
        self.config = config
        self.gate = Gate(config.gate, fmt)
        self.sessions = SessionStore(config.max_sessions if backend.holds_tiers else min(
            config.max_sessions, backend.max_sessions or SessionStore.DEFAULT_MAX))
        self.scheduler = Scheduler(config.workers, config.idle_workers, backend.max_batch,
                                   config.batch_tokens, config.batch_wait_ms / 1e3)
        t = config.tiers
        self.pool = KVPool(backend, min(config.budget.engine_cells,
                                        backend.kv_cells or config.budget.engine_cells),
                           Tiers(t.ram_bytes, t.disk_bytes, t.disk_dir)
                           if backend.holds_tiers else None,
                           self.scheduler.reserve, self.scheduler.release, config.kv_idle_cells)
        self.scheduler.housekeeping = self.pool.housekeeping if self.pool.tiers else None
        self.room = Room(self.max_context, config.budget.session_cells, self.pool, self.sessions)
        self.prepositioner = Prepositioner(fmt, self.pool, config.chunk_tokens,
                                           config.budget.session_cells, self._emit,
                                           config.predecode_tokens, self.max_context,
                                           config.predecode_min_hit, config.ready_logits_bytes)
        self.lookup = Lookup(config.lookup_tokens, config.lookup_ngram,  # greedy drafts
                             config.lookup_min_ngram, config.lookup_max_batch,
                             self.scheduler.foreground)
        self.backpressure = Backpressure(config.max_queue,
                                         lambda: self.scheduler.queue_lengths()[0])
        # called with every finished result
        self.observers: list[Callable[[Result], None]] = [self.backpressure.observe]
        # called as fn(event, session, payload) for "create", "commit" (payload: the new
        # Snapshot), "record" ((key, ReadyRecord)), "predecoded" ((key, Predecoded): a
        # pre-decoded answer ended) and "close"; keep them quick
        self.listeners: list[Callable[[str, Session, object], None]] = []
        self.answers = Answers(fmt, backend, self.pool, self.scheduler, self.prepositioner,
                               self.lookup, self.room, self._observe)
        self.relaxed = Relaxed(config.relaxed, fmt, self.pool, self.scheduler.submit,
                               config.chunk_tokens, MAX_YIELDS, config.budget.session_cells,
                               lambda: self.prepositioner.in_flight,
                               lambda s, ev: self._emit("correction", s, ev))
        # kept on clients' behalf, each found by its conversation's hash: stock clients'
        # conversations (ephemeral sessions) and Responses chains (persistent ones)
        self.conversations = ImplicitSessions(lambda: self, self._close_kept,
                                              config.implicit_memory, config.implicit_sessions)
        self.chains = ImplicitSessions(lambda: self, self._close_kept, config.implicit_memory,
                                       config.response_sessions)

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load a local model: an HF causal-LM directory, a GGUF file or a known model's name
        (`smollm2`), on the back end `config.backend` names (see `prepos.engine.loading`). Nothing
        is fetched from a hub."""
        parts = load_parts(path, config)
        return cls(parts.backend, parts.fmt, parts.config, model_name=parts.model_name)

    # == helpers ===========================================================================
    def _emit(self, event: str, s: Session, payload: object) -> None:
        for fn in self.listeners:
            fn(event, s, payload)

    def _observe(self, res: Result) -> None:
        for fn in self.observers:
            fn(res)

    def _call(self, gen, key: str | None = None) -> None:
        """Run a task at foreground priority and wait for it."""
        err: list[BaseException] = []
        task = self.scheduler.submit(gen, key=key, on_error=err.append)
        task.done.wait()
        if err:
            raise err[0]

    # == wiring ============================================================================
    def subscribe(self, listener: Callable[[str, Session, object], None]) -> None:
        """`listener(event, session, payload)` on every create, commit, ready, answer,
        correction and close, on the thread that made it."""
        self.listeners.append(listener)

    def observe(self, observer: Callable[[Result], None]) -> None:
        """`observer(result)` for every finished answer."""
        self.observers.append(observer)

    def write_ahead(self, durable) -> None:
        """Every session's creation, commits and closing written to `durable` (the journal)
        before each takes effect."""
        self.sessions.durable = durable

    def new_session_id(self) -> str:
        return self.sessions.new_id()

    def settle(self, sid: str, timeout: float = 30.0) -> None:
        """Wait until the work queued for `sid` so far (its KV's drop, after a close) is done."""
        def settled():
            return
            yield

        self.scheduler.submit(settled(), key=sid).done.wait(timeout=timeout)

    def set_gate(self, config: GateConfig) -> None:
        """Load a (re)calibrated gate; it applies to the next request."""
        self.gate = Gate(config, self.fmt)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.scheduler.wait_idle(timeout)

    def close(self) -> None:
        self.scheduler.close()
        self.pool.close()
        getattr(self.backend, "close", lambda: None)()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


load_engine = Engine.from_pretrained  # a local model (directory, GGUF file or known name)
