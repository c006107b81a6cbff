"""The facade: sessions, requests, metrics. `query` reads as Algorithm 2."""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
from pathlib import Path
from typing import Callable, Sequence

from prepos.backends.base import Backend
from prepos.chat.format import ChatFormat, normalize_tool_call
from prepos.config import EngineConfig, GateConfig
from prepos.core import Request, Result, SamplingParams
from prepos.decode.lookup import Lookup
from prepos.decode.stream import Stream
from prepos.engine import conversation
from prepos.engine.admission import Room, check_request, check_session, one_turn, prompt_ids
from prepos.engine.answers import Answers
from prepos.engine.conversation import ChatPlan
from prepos.engine.implicit import ImplicitSessions
from prepos.engine.loading import load_parts
from prepos.engine.logits import answers_from, keeps_top
from prepos.engine.prepositioner import MAX_YIELDS, Prepositioner
from prepos.engine.ready import ReadySet
from prepos.engine.session import (
    AGENTIC,
    HEADER,
    STREAMING,
    TURN,
    Session,
    SessionSpec,
    SessionStore,
    Snapshot,
    query_key,
)
from prepos.engine.view import DEFAULT, EngineView
from prepos.errors import Conflict, InvalidInput, OverBudget, PreposError
from prepos.gate.calibrated import Gate
from prepos.gate.relaxed import Relaxed
from prepos.worker.kv import Forward, KVPool
from prepos.worker.scheduler import Scheduler
from prepos.worker.tiers import Tiers


class Engine(EngineView):
    def __init__(self, backend: Backend, fmt: ChatFormat, config: EngineConfig | None = None,
                 model_name: str = "model"):
        self.config = config = config or EngineConfig()
        self.backend = backend
        self.fmt = fmt
        self.model_name = model_name
        self.max_context = min(config.max_context or backend.max_context, backend.max_context)
        self.gate = Gate(config.gate, fmt)
        self.sessions = SessionStore(config.max_sessions if backend.holds_tiers
                                     else backend.max_sessions or SessionStore.DEFAULT_MAX)
        self.scheduler = Scheduler(config.workers, config.idle_workers, backend.max_batch,
                                   backend.max_batch_tokens)
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
        self.observers: list[Callable[[Result], None]] = []  # called with every finished result
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
        # stock clients' conversations, kept as implicit sessions found by their hash
        self.conversations = ImplicitSessions(lambda: self, self._close_kept,
                                              config.implicit_memory, config.implicit_sessions)

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load a local model: an HF causal-LM directory, a GGUF file or a known model's name
        (`smollm2`), on the back end `config.backend` names (see `prepos.engine.loading`). Nothing
        is fetched from a hub."""
        parts = load_parts(path, config)
        return cls(parts.backend, parts.fmt, parts.config, model_name=parts.model_name)

    # == sessions ==========================================================================
    def create_session(self, kind: str, system: str | None = None, tools: Sequence[dict] = (),
                       standing: Sequence[str] = (), fast_path: str = "exact",
                       preposition: bool = True, budget_cells: int | None = None,
                       owner: str | None = None, relaxed_queries: Sequence[str] = (),
                       r_max: float | None = None, answer_tokens: int | None = None,
                       answer_stop: Sequence[str] = ()) -> str:
        """A new session; `owner`: the API key that made it (journalled; the server checks it);
        `answer_tokens`, `answer_stop`: its exact entries' answer budget, pre-decoded at idle."""
        spec = SessionSpec(kind, system, tuple(tools), tuple(standing), fast_path, preposition,
                           budget_cells, owner=owner, relaxed_queries=tuple(relaxed_queries),
                           r_max=r_max, answer_tokens=answer_tokens,
                           answer_stop=tuple(answer_stop))
        return self.restore_session(self.sessions.new_id(), spec)

    def restore_session(self, sid: str, spec: SessionSpec, history: Sequence[tuple[int,
                        Sequence[dict]]] = (), warm: bool = False) -> str:
        """A session with a given id, optionally from journalled history ((version, messages),
        the last current). Its KV is rebuilt by the pre-position job at idle priority (`warm`:
        first in the foreground, waited for); ready records are recomputed, never restored."""
        check_session(spec, history, self.fmt)
        c = self.config
        self.pool.claim(sid, spec.owner)
        s = Session(sid, spec, self.fmt, self.max_context, c.max_versions, c.shift_keep,
                    c.reserve_tokens, history, check_commit=self.room.check_commit,
                    said_tokens=c.lookup_said_tokens if self.lookup.k else 0)
        self.sessions.add(s)
        self._emit("create", s, s.snap)
        self._committed(s, s.snap, None, wait=warm)
        return s.id

    def close_session(self, sid: str, expected_version: int | None = None) -> None:
        with self.sessions.get(sid).expecting(expected_version):
            s = self.sessions.remove(sid)
        s.invalidate()
        self.relaxed.gate.forget(s.id)
        self._emit("close", s, None)

        def drop():
            self.pool.drop(s.id)
            yield

        self.scheduler.submit(drop(), key=s.id)

    def trim(self, sid: str) -> None:
        """Drop the session's speculative KV cells (its commits and ready records kept); waits."""
        s = self.sessions.get(sid)

        def crop():
            self.pool.get(s.id).crop(len(s.snap.tokens))
            yield

        self._call(crop(), key=s.id)

    # == mutations =========================================================================
    def append(self, sid: str, text: str, wait=True, expected_version=None) -> int:
        """Streaming: commit a data message (the window shifted when the context is full), with
        `wait` once in the KV. `expected_version` (any mutation): Conflict unless it is there."""
        s = self.sessions.get(sid)
        self.fmt.check_text(text, "data")
        with s.expecting(expected_version):
            snap, dropped = s.append(text)
        self._committed(s, snap, dropped, wait)
        return snap.version

    def rollback(self, sid: str, version: int, wait=True, expected_version=None) -> int:
        s = self.sessions.get(sid)
        with s.expecting(expected_version):
            snap, dropped = s.rollback(version)
        if dropped is not None:  # None: it was at that version already, nothing committed
            self._committed(s, snap, dropped, wait)
        return snap.version

    def shift(self, sid: str, drop: int | None = None, wait=True, expected_version=None) -> int:
        s = self.sessions.get(sid)
        with s.expecting(expected_version):
            snap, dropped = s.shift(drop)
        self._committed(s, snap, dropped, wait)
        return snap.version

    def add_message(self, sid: str, role: str, content: str,
                    tool_calls: Sequence[dict] | None = None, wait: bool = True,
                    expected_version: int | None = None) -> int:
        """Agentic: commit a message without generating (user, tool, or a client's assistant)."""
        s = self.sessions.get(sid)
        self.fmt.check_text(content, "content")
        msg: dict = {"role": role, "content": content}
        if tool_calls:
            if role != "assistant":
                raise InvalidInput("only assistant messages carry tool_calls")
            msg["tool_calls"] = [normalize_tool_call(c) for c in tool_calls]
            self.fmt.check_text(json.dumps(msg["tool_calls"]), "tool_calls")
        snap, dropped = s.add_message(msg, expected_version=expected_version)
        self._committed(s, snap, dropped, wait)
        return snap.version

    def _committed(self, s: Session, snap: Snapshot, dropped: ReadySet | None, wait) -> None:
        """After every commit: settle the dropped pre-position, ingest, pre-position."""
        self.prepositioner.invalidated(dropped, s.id)
        if dropped is not None:
            self._emit("commit", s, snap)
        if wait and snap.tokens:  # the commit stands: its KV is a cache, rebuilt when needed
            with contextlib.suppress(OverBudget):
                self._call(self._ingest(s, snap), key=s.id)
        if self.config.preposition and s.spec.preposition:
            _, ready = s.current()
            if ready.version == snap.version and ready.valid:
                self.prepositioner.scheduled(ready)
                self.scheduler.submit(self.prepositioner.job(s, snap, ready), idle=True,
                                      key=s.id, priority=self.prepositioner.worth(s))

    def _ingest(self, s: Session, snap: Snapshot):
        kv = self.pool.get(s.id)
        if kv.common_prefix(snap.tokens) < len(snap.tokens):
            yield Forward(kv, snap.tokens)

    # == requests (Algorithm 2) ============================================================
    # Each returns the answer's Stream at once (iterate it, or `.result()` for the Result).
    def _checked(self, req: Request) -> SamplingParams:  # before any state changes
        return check_request(req, self.backend, self.config.topk_sampling, self.answers.grammars)

    def query(self, sid: str, question: str, req: Request = DEFAULT) -> Stream:
        """Streaming: answer an ad-hoc or standing query. Never blocks on model work."""
        t0 = time.perf_counter()
        sampling = self._checked(req)
        s = self.sessions.get(sid)
        s.require(STREAMING)
        if not isinstance(question, str) or not question.strip():
            raise InvalidInput("question must be a non-empty string")
        self.fmt.check_text(question, "question")
        mode = req.fast_path or s.spec.fast_path
        snap, ready = s.current()
        header = ready.records.get(HEADER)
        evidence = None  # a withheld relaxed answer's full answer, as verified evidence
        if mode != "off":
            key = query_key(question)
            rec = ready.records.get(key)
            if rec is not None:  # realized entry == pre-positioned entry: zero added risk
                if answers_from(rec, sampling, self.backend.full_distribution):
                    return self.answers.exact(s, snap, ready, key, rec, sampling,
                                              req.logprobs, t0)
            elif mode == "relaxed" and header is not None and not sampling.shaped:
                kept = keeps_top(header, sampling.top_logprobs, self.backend.full_distribution)
                if kept and self.gate.fires(header):  # Eq. 12, then the class's verified risk
                    d = self.relaxed.decide(s, question, header)
                    if d.serve:  # one cached token, no scheduler; verified at idle
                        stream = self.answers.relaxed(ready, header, sampling, req.logprobs,
                                                      t0, d.answer_id)
                        self.relaxed.served(s, snap, question, header, d)
                        self.prepositioner.asked(s)
                        return stream
                    evidence = self.relaxed.withheld(s, snap, question, header, d,
                                                     sampling.greedy)
                else:
                    self.answers.count("gate_miss")
        self.prepositioner.asked(s)  # an exact answer counted its entry's request (and this)
        ent = s.entries(snap)
        entry = self.fmt.encode(self.fmt.frame(ent.user, question))
        return self.answers.prefill(s, snap.tokens + tuple(entry), len(snap.tokens),
                                    snap.version, ready, sampling, req.logprobs, t0,
                                    gap=header.gap if header is not None else None,
                                    on_finish=evidence)

    def turn(self, sid: str, user: str | None = None, req: Request = DEFAULT) -> Stream:
        """Agentic: commit `user` (if given), generate the assistant turn, commit it. A turn
        that ends in a tool call leaves the session awaiting a tool result. With
        `req.expected_version`, refuse (Conflict) if the session is at another version."""
        return self._agentic(sid, {"role": "user", "content": user} if user is not None else None,
                             req)

    def tool_result(self, sid: str, content: str, req: Request = DEFAULT) -> Stream:
        """Agentic: commit a tool result, resume delta-only from the pre-positioned envelope."""
        return self._agentic(sid, {"role": "tool", "content": content}, req)

    @one_turn  # called with the session's id: SessionBusy while another turn runs
    def _agentic(self, s: Session, message: dict | None, req: Request) -> Stream:
        t0 = time.perf_counter()
        sampling = self._checked(req)
        s.require(AGENTIC)
        mode = req.fast_path or s.spec.fast_path
        self.prepositioner.asked(s)
        base, ready = s.current()
        if req.expected_version is not None and base.version != req.expected_version:
            raise Conflict(f"session {s.id} is at version {base.version}, not "
                           f"{req.expected_version}")
        if message is None:
            if s.awaiting_tool:
                raise InvalidInput(f"session {s.id} awaits a tool result, not a new turn")
            turn = ready.records.get(TURN)
            if mode != "off" and turn is not None and answers_from(
                    turn, sampling, self.backend.full_distribution):
                return self.answers.exact(s, base, ready, TURN, turn, sampling, req.logprobs,
                                          t0, on_finish=self._commit_answer(s, base.version))
            snap, dropped = base, None
        else:
            self.fmt.check_text(message["content"], "user" if message["role"] == "user"
                                else "content")
            n_header = len(s.entries(base).header)
            snap, dropped = s.add_message(  # the request's delta, committed if it fits
                message, expected_version=req.expected_version,
                check=lambda n: self.room.check(s, n + n_header, sampling), turn=True)
            self._emit("commit", s, snap)
        header = s.entries(snap).header
        return self.answers.prefill(s, snap.tokens + header, len(base.tokens), snap.version,
                                    dropped if dropped is not None else ready, sampling,
                                    req.logprobs, t0,
                                    on_finish=self._commit_answer(s, snap.version),
                                    settle_dropped=dropped is not None)

    def _commit_answer(self, s: Session, version: int) -> Callable[[Result], None]:
        ctx = contextvars.copy_context()  # the answer commits in its request's context

        def commit(res: Result) -> None:
            if res.finish_reason == "cancelled":  # the client left: the turn never happened
                return
            content, calls = self.fmt.parse_tool_calls(res.text)
            res.tool_calls = calls
            msg: dict = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = calls
            snap, dropped = ctx.run(s.add_message, msg, expected_version=version, turn=True)
            self._committed(s, snap, dropped, wait=False)

        return commit

    def complete(self, sid: str, prompt: str | Sequence[int], req: Request = DEFAULT) -> Stream:
        """Raw completion: continue `prompt` exactly as given (text, tokenized with no chat
        template, or token ids taken as they are) on the session's KV, without touching its
        conversation. The stateless /v1/completions."""
        t0 = time.perf_counter()
        sampling = self._checked(req)
        s = self.sessions.get(sid)
        snap, ready = s.current()
        seq = prompt_ids(prompt, self.fmt, self.backend.vocab_size)
        return self.answers.prefill(s, seq, len(snap.tokens), snap.version, ready, sampling,
                                    req.logprobs, t0, prompt_logprobs=req.prompt_logprobs)

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

    # == a conversation sent whole (engine/conversation.py) ================================
    def plan_chat(self, sid: str, messages: list[dict], rollback: bool = False) -> ChatPlan:
        """Where a whole conversation meets agentic session `sid`, before anything changes:
        ConversationError where it diverges (unless `rollback`) or is out of order."""
        return conversation.plan(self, sid, messages, rollback)

    def chat(self, plan: ChatPlan, req: Request = DEFAULT) -> Stream:
        """Commit what `plan` says the session lacks, then answer (a turn or a tool result)."""
        return conversation.carry_out(self, plan, req)

    def converse(self, owner: str | None, messages: list[dict], tools: Sequence[dict] = (),
                 req: Request = DEFAULT) -> Stream:
        """A stock client's conversation, sent whole with no session named: continued on the
        kept session of this key and tools it extends (leased to it until its answer ends,
        then indexed under what it committed), or on a new one kept for its next turn."""
        kept = self.conversations
        sid = kept.find(self, owner, tools, messages)
        if sid is None:
            system = messages[0]["content"] if messages[0]["role"] == "system" else None
            sid = kept.start(SessionSpec(AGENTIC, system, tuple(tools), (), "exact", True,
                                         None, owner=owner, implicit=True))
        try:
            stream = self.chat(self.plan_chat(sid, messages), req)
        except BaseException:
            kept.release(sid)
            raise
        stream.on_end(lambda: kept.release(sid))
        return stream

    def evict_conversation(self) -> bool:  # the least recently used free one; False: none
        return self.conversations.evict_one()

    def publish_conversations(self, publish: Callable[[str, bytes | None], None]) -> None:
        """`publish(sid, hash)` at every change of what a kept conversation is indexed under
        (None once it is gone): the cluster's directory."""
        self.conversations.publish = publish

    def _close_kept(self, sid: str) -> None:
        with contextlib.suppress(PreposError):
            self.close_session(sid)

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

    def limit_sessions(self, n: int) -> None:  # at most the back end's bound
        self.sessions.max_sessions = min(n, self.sessions.max_sessions)

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
