"""What a caller may read of an engine, as methods: its sessions, what is prepared in them,
its back end's abilities and its load. The server reads an engine through these and the
fields in `FIELDS` only (`tests/docs/test_layers.py` checks it), never the scheduler, the KV pool
or the pre-positioner behind them; every change goes through `Engine`'s own methods."""

from __future__ import annotations

from collections import Counter

from prepos.core import ReadyRecord, Request, SamplingParams
from prepos.engine.logits import answers_from
from prepos.engine.predecode import Budget
from prepos.engine.ready import Predecoded
from prepos.engine.session import HEADER, Session, Snapshot

DEFAULT = Request()

# the plain fields a caller may read besides the methods: the configuration, the chat format
# (the server renders and checks messages with it), the context bound and the model's name
FIELDS = ("config", "fmt", "max_context", "model_name")


class EngineView:
    """The read-only half of `Engine` (its collaborators are set by `Engine.__init__`)."""

    # == sessions ==========================================================================
    def session(self, sid: str) -> Session:
        return self.sessions.get(sid)

    def all_sessions(self) -> list[Session]:
        return self.sessions.all()

    def session_count(self) -> int:
        return len(self.sessions)

    def has_session(self, sid: str) -> bool:  # open, or closing and not yet removed
        return self.sessions.find(sid) is not None

    @property
    def session_limit(self) -> int:  # the sessions it holds at most (the back end's bound)
        return self.sessions.max_sessions

    def info(self, sid: str) -> dict:
        s = self.sessions.get(sid)
        return {**s.info(), "kv": self.pool.tier(s.id), "relaxed": self.relaxed.info(s)}

    def snapshot(self, sid: str, version: int | None = None) -> Snapshot:
        """A committed version of a session: `version` while it is kept, else the current."""
        return self.sessions.get(sid).at(version)

    def versions(self, sid: str) -> dict[int, tuple[dict, ...]]:  # kept for rollback, oldest first
        return self.sessions.get(sid).versions()

    @property
    def keeps_conversations(self) -> bool:  # stock clients' (`Engine.converse`)
        return self.conversations.keeps

    @property
    def keeps_chains(self) -> bool:  # Responses chains (`Engine.find_chain`)
        return self.chains.keeps

    def holds_conversation(self, owner: str | None, tools, messages: list[dict]) -> bool:
        """Whether a kept conversation of this key and tools is extended by `messages`
        (in use or not)."""
        return self.conversations.holds(owner, tools, messages)

    # == what is prepared ==================================================================
    def kv_tier(self, sid: str) -> str:
        """Where the session's KV is: resident, ram, disk or none."""
        return self.pool.tier(sid)

    def kv_kept(self, sid: str) -> bool:  # False once the tiers dropped it (unbuilt: True)
        return self.pool.find(sid) is None or self.pool.tier(sid) != "none"

    def hit_rate(self, sid: str) -> float:
        """h(rho): the chance a request comes before the session's next update (what its idle
        work goes by)."""
        return self.prepositioner.worth(self.sessions.get(sid))

    def ready_header(self, sid: str) -> ReadyRecord | None:
        """The question-independent ready record of a streaming session, if recorded."""
        return self.sessions.get(sid).ready_record(HEADER)

    def ready_now(self, sid: str) -> tuple[Snapshot, dict[tuple, ReadyRecord]]:  # together
        return self.sessions.get(sid).ready_now()

    def serves_exact(self, sid: str, key: tuple, req: Request = DEFAULT) -> bool:
        """Whether `req` for entry `key` would be an exact match now: its fast path is on and
        a valid ready record holds the entry and the distribution its sampling needs."""
        s = self.sessions.get(sid)
        rec = s.ready_record(key) if (req.fast_path or s.spec.fast_path) != "off" else None
        return rec is not None and answers_from(rec, req.sampling,
                                                self.backend.full_distribution)

    def predecoding(self, sid: str, key: tuple) -> tuple[Budget | None, Predecoded | None]:
        """The answer budget the entry at `key` pre-decodes (None: it does not), and its
        answer so far (None before its record, and once its version is gone)."""
        s = self.sessions.get(sid)
        return self.prepositioner.predecoder.budget(s, key), s.current()[1].answer(key)

    # == the back end ======================================================================
    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def streams_answers(self) -> bool:
        """Whether answers are sampled on a remote engine and streamed back."""
        return self.backend.streams_answers

    @property
    def samples_in_process(self) -> bool:
        """Whether every token is sampled here from the full distribution, so a grammar or a
        logit bias can shape it."""
        return not self.backend.streams_answers and self.backend.full_distribution

    @property
    def engine_cells(self) -> int:
        """The KV cells all sessions share (a session's budget is at most this)."""
        return self.pool.engine_cells

    def check_grammar(self, sampling: SamplingParams) -> None:
        """Compile `sampling`'s grammar now: InvalidResponseFormat if this model's vocabulary
        cannot write it."""
        self.answers.grammars.check(sampling)

    # == load ==============================================================================
    def queue_lengths(self) -> tuple[int, int]:
        """Tasks waiting for a model worker: (foreground, idle)."""
        return self.scheduler.queue_lengths()

    def will_be_fast(self, sid: str, key: tuple, req: Request = DEFAULT) -> bool:
        """Whether `req` for entry `key` will be answered from a ready record with no model
        work: a one-token exact match, or a greedy one whose whole answer is pre-decoded."""
        if not self.serves_exact(sid, key, req):
            return False
        n = req.sampling.max_tokens
        if n == 1:
            return True
        answer = self.predecoding(sid, key)[1] if req.sampling.greedy else None
        return answer is not None and (answer.finish == "end" or len(answer.tokens) >= n)

    def admit(self, sid: str | None = None, key: tuple | None = None,
              req: Request = DEFAULT) -> None:
        """Admission by load, before a request's work is started: Overloaded while the
        foreground queue is full (`EngineConfig.max_queue`), unless the request, for entry
        `key` of session `sid`, needs no model work (`will_be_fast`). Changes nothing."""
        if sid is None or not self.will_be_fast(sid, key, req):
            self.backpressure.check()

    @property
    def paths(self) -> Counter[str]:
        """Answers by path so far: fast_exact, fast_relaxed, gate_miss, fall, cold."""
        return self.answers.path_counts()

    def metrics(self) -> dict:
        fg, idle = self.scheduler.queue_lengths()
        return {
            "prepositions": self.prepositioner.counters.as_dict(),
            "paths": dict(self.paths),
            "sessions": len(self.sessions),
            "kv_cells_used": self.pool.used,
            "prefix_reuse": {"hits": self.pool.index.hits, "tokens": self.pool.index.tokens},
            "kv_tiers": self.pool.metrics(),
            "kv_cells_budget": self.pool.engine_cells,
            "ready_logits": {"bytes": self.prepositioner.kept.used,
                             "budget": self.prepositioner.kept.budget,
                             "stripped": self.prepositioner.kept.stripped},
            "queue_foreground": fg, "queue_idle": idle,
            "scheduler": self.scheduler.steps.as_dict(),
            "lookup": self.lookup.stats.metrics(),
            "relaxed": self.relaxed.gate.metrics(),
            "implicit": {k: self.conversations.counts[k]
                         for k in ("continued", "started", "evicted")},
        }
