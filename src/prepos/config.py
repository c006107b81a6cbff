"""Frozen configuration: the engine, its confidence gate and its KV cell budget."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

KV_LAYOUTS = ("unified", "streams")  # llama.cpp's cache layouts (EngineConfig.kv_layout)


def default_threads() -> int:
    """Compute threads by default: one per physical core this process may run on (as
    llama.cpp's own default), the hyperthreads of one core counted once."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(
        os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
                      .read_text().strip())
        except OSError:  # no topology here: each CPU a core
            cores.add(str(cpu))
    return max(1, len(cores))


def default_kv_ram() -> int:
    """The host-RAM tier by default: a quarter of the machine's memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 4 << 30


@dataclass(frozen=True)
class TierConfig:
    """The KV tiers below resident (`prepos.worker.tiers`): host RAM, then a bounded
    directory on disk, then recompute from the session's committed tokens."""

    ram_bytes: int = field(default_factory=default_kv_ram)
    disk_bytes: int = 16 << 30
    disk_dir: Path | None = None  # None: the system's temporary directory

    def __post_init__(self) -> None:
        if self.ram_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("KV tier sizes must be >= 0")


@dataclass(frozen=True)
class GateConfig:
    """Algorithm 2 / Eq. 12: fire iff gap > tau and argmax in the fast-answer set.

    `answers` holds the answer strings of the fast-answer set A; the engine maps each to the
    token ids that decode to it (with and without a leading space). An empty set admits no
    token, so the relaxed fast path never fires until a calibrated gate is loaded.
    """

    tau: float = 2.0
    answers: tuple[str, ...] = ()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> GateConfig:
        raw = json.loads(Path(path).read_text())
        return cls(tau=float(raw["tau"]), answers=tuple(raw.get("answers", ())))


@dataclass(frozen=True)
class BudgetConfig:
    """KV cell budgets, in tokens. Pre-positions that would exceed them are skipped."""

    session_cells: int | None = None  # None: the model's whole context
    engine_cells: int = 262_144


@dataclass(frozen=True)
class RelaxedConfig:
    """The relaxed fast path's online risk gate (`prepos.gate.relaxed`): which question classes
    it serves, from verified evidence, within the risk budget `r_max`."""

    r_max: float = 0.15  # a class is served while its Wilson 95% upper bound is within this
    min_verified: int = 24  # verified answers before a class's own evidence alone decides
    # a new class: "cold" (the full path, its answers verified for free, until promoted) or
    # "serve" (relaxed on probation, each answer verified after it is served)
    start: str = "cold"
    verify: bool = True  # shadow-verify served relaxed answers at idle priority
    window: int = 512  # the latest verified outcomes a class's estimate rests on
    max_classes: int = 256  # classes tracked per owner (least recently asked forgotten)
    session_pending: int = 4  # verifications queued per session at once; beyond: unverified
    owner_pending: int = 64  # the same, across one owner's (API key's) sessions

    def __post_init__(self) -> None:
        if not 0.0 < self.r_max < 1.0:
            raise ValueError(f"relaxed r_max must be in (0, 1), got {self.r_max!r}")
        if self.start not in ("serve", "cold"):
            raise ValueError(f"relaxed start must be serve or cold, got {self.start!r}")
        if min(self.min_verified, self.window, self.max_classes, self.session_pending,
               self.owner_pending) < 1:
            raise ValueError("relaxed counts and caps must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"
    chunk_tokens: int = 8  # idle work runs in chunks of this many tokens, yielding between them
    max_context: int | None = None  # default: the model's max_position_embeddings
    # llama.cpp: the model's context, extended past its training context with YaRN (RoPE
    # models only); the resident cells hold at least one session of it. None: as trained
    context_length: int | None = None
    shift_keep: float = 0.5  # a window shift keeps this fraction of the context for data
    reserve_tokens: int = 64  # head-room a streaming session keeps for a query and its answer
    max_versions: int = 1024  # committed versions kept for rollback per session
    preposition: bool = True  # pre-position on idle after each committed update
    # a request that needs model work is refused (Overloaded) while this many foreground
    # tasks are queued for the model worker (`Engine.admit`)
    max_queue: int = 256
    # then pre-decode each exact entry's greedy answer at idle, up to this many tokens (a
    # session's answer_tokens overrides it; `prepos.engine.predecode`); 0: off
    predecode_tokens: int = 64
    # ... where it pays: an entry whose requests come before the next update with a chance
    # h(rho) = rho / (1 + rho) below this (rho: its session's requests per update) is not
    predecode_min_hit: float = 0.2
    # the full next-token vectors ready records keep, in bytes, most recently used first
    # (beyond it a record keeps its top tokens: greedy requests only; `prepos.engine.logits`)
    ready_logits_bytes: int = 512 << 20
    # greedy answers on back ends that verify drafts: up to this many tokens drafted per
    # forward from the session's own context (prompt lookup, `prepos.decode.lookup`); 0: off
    lookup_tokens: int = 8
    lookup_ngram: int = 3  # the longest n-gram matched (then shorter, down to lookup_min_ngram)
    lookup_min_ngram: int = 2  # one-token matches draft too often where the answer does not copy
    lookup_max_batch: int = 2  # drafts only while at most this many foreground tasks run
    lookup_said_tokens: int = 1024  # drafts from this many tokens of a session's latest answers
    gate: GateConfig = field(default_factory=GateConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    backend: str = "auto"  # auto | torch | llama.cpp (see prepos.engine.loading)
    threads: int | None = None  # compute threads (None: the back end's default)
    # llama.cpp: the resident cells all sessions share (the rest of their KV in the tiers);
    # every step of the unified layout scans the occupied ones (docs/ARCHITECTURE.md)
    kv_cells: int = 8192
    # the tokens of one batched step: every decoding stream's next token first, then prompts
    # (a long one in chunks) in the rest, as llama-server's -b and vLLM's
    # --max-num-batched-tokens bound theirs (`prepos.worker.scheduler`)
    batch_tokens: int = 2048
    # a step from idle waits at most this long for requests still on their way into the
    # engine, so requests sent together start in one step (`prepos.worker.scheduler`)
    batch_wait_ms: float = 50.0
    max_sequences: int = 256  # llama.cpp: sessions holding a KV at once (at most 256)
    # llama.cpp: "unified" (one pool: a session may use all of it, every step scans every
    # session's cells) or "streams" (kv_cells / max_sequences per session, scanned alone)
    kv_layout: str = "unified"
    # unified layout: the cells idle sessions keep resident while a request runs (the rest
    # move down to the RAM tier, least recently used first, to the copies idle time saved);
    # None: no bound but kv_cells. 0: a request's steps scan its own cells only (six idle
    # sessions of 170 tokens cost a SmolLM2 step 8% on two cores)
    kv_idle_cells: int | None = 0
    tiers: TierConfig = field(default_factory=TierConfig)
    # sessions at most (on back ends whose KV does not move down tiers, at most what they
    # hold); a server sets it to its --max-sessions and a queue's stateless ones
    max_sessions: int = 1_000_000
    workers: int = 1  # model-worker threads: 1 in process; more for remote back ends
    idle_workers: int | None = None  # at most this many idle steps at once (default: workers)
    # back ends that return top-k logprobs only (remote engines): allow temperature sampling
    # renormalized within the top-k; off by default, so such back ends serve greedy only
    topk_sampling: bool = False
    relaxed: RelaxedConfig = field(default_factory=RelaxedConfig)
    # stateless conversations kept as implicit sessions (`prepos.engine.implicit`): the bytes
    # of their bookkeeping (their KV is the tiers'; 0: none kept), at most this many (None: no
    # count)
    implicit_memory: int = 1 << 30
    implicit_sessions: int | None = None
    # Responses API chains (`previous_response_id`) kept as persistent sessions on a client's
    # behalf: at most this many (None: no count; 0: none kept), their bookkeeping's bytes
    # bounded as the kept conversations' are (`implicit_memory`)
    response_sessions: int | None = None
