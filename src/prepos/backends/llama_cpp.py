"""In-process back end: llama.cpp through llama-cpp-python's low-level C API.

One model and one context for the whole engine. Every session is a sequence (`seq_id`) of
its KV cache, so the steps of many sessions run as one `llama_decode` (`extend_batch`), each
token tagged with its session's sequence and position. `crop` removes a sequence's positions
from `length` on, `release` the whole sequence. The context size (`n_ctx`) is the engine's
cell budget, so the budget's "skip, never evict" is what keeps llama.cpp from running out of
cells.

Two layouts of the cache (`kv_layout`):
- "unified": one pool of `n_ctx` cells shared by every sequence. A session may grow to the
  whole pool, but each token's attention scans every occupied cell of every session (masked
  out, yet read): the more KV other sessions keep resident, the slower every step.
- "streams": a stream of `n_ctx / max_sequences` cells per sequence (as llama-server's slots).
  A step attends to its own session's cells only, and a session is capped at its stream
  (`max_context`). llama.cpp runs a batch's sequences together only where their ids are
  consecutive and their token counts equal, so rows are sent in sequence order, ids are
  handed out lowest first and small gaps in a decode batch are filled (`_fillers`); other
  batches run as several ubatches.

Idle forwards give way to a waiting request: while one runs, llama.cpp's abort callback
(polled between graph nodes) returns true once a request is queued; llama_decode then stops,
the cells it wrote are removed and `Preempted` is raised, as on the torch back end.

Exactness. llama.cpp's logits depend on how the tokens were grouped into a batch (the matrix
shapes change, so float sums round differently): the same sequence decoded alone or beside
other sessions' steps agrees to within `logit_tolerance`, not bitwise. Cropping a sequence and
running it again reproduces its logits exactly.
"""

from __future__ import annotations

import ctypes
import heapq
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from prepos.backends.base import Backend, Preempted, Step, _work
from prepos.config import KV_LAYOUTS as LAYOUTS
from prepos.config import default_threads
from prepos.errors import OverBudget, PreposError, TooManySessions

try:  # the binding is optional: without it the torch back end still serves
    import llama_cpp as _ll
except ImportError as exc:  # pragma: no cover - depends on the install
    _ll = None
    IMPORT_ERROR: str | None = f"llama-cpp-python is not installed ({exc})"
else:
    IMPORT_ERROR = None

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: sessions with a KV at once
MIN_STREAM = 256  # llama.cpp pads a stream to a multiple of 256 cells
FILL_GAP = 4  # streams: gaps of up to this many sequence ids in a decode batch are filled


class LlamaCppError(PreposError):
    code = "backend_error"


def available() -> bool:
    return _ll is not None


class SeqKV:
    """A session's handle: its sequence id in the unified cache."""

    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq


class LlamaCppBackend(Backend):
    name = "llama.cpp"
    full_distribution = True
    verifies_drafts = True  # a step's every token can carry the batch's logits flag
    shares_prefixes = True  # a prefix's cells shared with another sequence (llama_memory_seq_cp)
    holds_tiers = True  # a sequence's state saved and loaded (llama_state_seq_*)

    def __init__(self, gguf: str | Path, n_ctx: int = 8192, threads: int | None = None,
                 n_batch: int = 512, max_sequences: int = 64, logit_tolerance: float = 0.05,
                 kv_layout: str = "unified", context_length: int | None = None):
        if _ll is None:
            raise LlamaCppError(IMPORT_ERROR)
        if not Path(gguf).is_file():
            raise FileNotFoundError(f"no GGUF file at {gguf}")
        if n_ctx < 256:
            raise ValueError(f"n_ctx must be >= 256, got {n_ctx}")
        if kv_layout not in LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(LAYOUTS)}, got {kv_layout!r}")
        n_seq = max(1, min(max_sequences, MAX_SEQUENCES))
        if kv_layout == "streams" and n_ctx // n_seq < MIN_STREAM:
            raise ValueError(f"the streams layout gives each of {n_seq} sequences "
                             f"{n_ctx} // {n_seq} = {n_ctx // n_seq} cells; it needs at least "
                             f"{MIN_STREAM}: raise the cells (--kv-cells) or lower the sequences "
                             f"(--kv-sequences)")
        _quiet_logs()
        _ll.llama_backend_init()
        mparams = _ll.llama_model_default_params()
        self.model = _ll.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise LlamaCppError(f"llama.cpp could not load {gguf}")
        threads = threads or default_threads()
        n_batch = min(n_batch, n_ctx)
        self.n_seq = n_seq
        self.kv_layout = kv_layout
        self.scans_resident = kv_layout == "unified"  # each step scans every occupied cell
        self.max_sessions = self.n_seq  # the engine admits no more sessions than this
        if kv_layout == "streams":  # whole streams, within the cells asked for
            n_ctx = n_ctx // n_seq // MIN_STREAM * MIN_STREAM * n_seq
        cparams = _ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = self.n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = kv_layout == "unified"
        cparams.no_perf = True
        trained = int(_ll.llama_model_n_ctx_train(self.model))
        self.context = _extend(cparams, self.model, trained, context_length, gguf)
        self.ctx = _ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            _ll.llama_model_free(self.model)
            raise LlamaCppError(f"llama.cpp could not create a context of {n_ctx} cells")
        self.mem = _ll.llama_get_memory(self.ctx)
        vocab = _ll.llama_model_get_vocab(self.model)
        self.vocab_size = int(_ll.llama_vocab_n_tokens(vocab))
        self._row_bytes = self.vocab_size * ctypes.sizeof(ctypes.c_float)
        self._row_type = ctypes.c_float * self.vocab_size  # a row, read in place (`_choice`)
        self.n_ctx = int(_ll.llama_n_ctx(self.ctx))
        self.kv_cells = self.n_ctx
        self.max_context = min(int(_ll.llama_n_ctx_seq(self.ctx)),  # a stream, or the pool
                               self.context)
        self.threads = threads
        self.n_batch = n_batch
        self.max_batch = self.n_seq
        self.logit_tolerance = logit_tolerance
        self._batch = _ll.llama_batch_init(n_batch, 0, 1)
        self._free = list(range(self.n_seq))  # a heap: the lowest id first
        self._free_lock = threading.Lock()
        self._should_yield = None
        self._abort = _ll.ggml_abort_callback(self._abort_requested)
        self._closed = False

    # -- the protocol ----------------------------------------------------------------------
    def new_kv(self, key: str | None = None) -> SeqKV:
        with self._free_lock:
            if not self._free:
                raise TooManySessions(f"the llama.cpp back end holds the KV of at most "
                                      f"{self.n_seq} sessions at once")
            return SeqKV(heapq.heappop(self._free))

    def free_handles(self) -> int:
        return len(self._free)

    def release(self, kv: SeqKV) -> None:
        if self._closed:
            return
        _ll.llama_memory_seq_rm(self.mem, kv.seq, -1, -1)
        with self._free_lock:
            heapq.heappush(self._free, kv.seq)

    def crop(self, kv: SeqKV, length: int) -> None:
        if not _ll.llama_memory_seq_rm(self.mem, kv.seq, length, -1):
            raise LlamaCppError(f"llama.cpp could not crop sequence {kv.seq} to {length}")

    def copy_prefix(self, src: SeqKV, dst: SeqKV, length: int) -> None:
        """Unified: `dst` joins the cells of `src`'s first `length` positions (shared, not
        copied). Streams: `src`'s stream is copied into `dst`'s (at the next decode), then
        cropped to `length`."""
        _ll.llama_memory_seq_rm(self.mem, dst.seq, -1, -1)
        if self.kv_layout == "unified":
            _ll.llama_memory_seq_cp(self.mem, src.seq, dst.seq, 0, length)
        else:  # across streams llama.cpp copies a whole sequence only
            _ll.llama_memory_seq_cp(self.mem, src.seq, dst.seq, -1, -1)
            _ll.llama_memory_seq_rm(self.mem, dst.seq, length, -1)

    def save(self, kv: SeqKV) -> bytearray:
        size = _ll.llama_state_seq_get_size(self.ctx, kv.seq)
        data = bytearray(size)  # written in place: no copy (a session's KV: megabytes)
        written = _ll.llama_state_seq_get_data(
            self.ctx, (ctypes.c_uint8 * size).from_buffer(data), size, kv.seq)
        del data[written:]
        return data

    def load(self, data: bytes | bytearray, key: str | None = None) -> SeqKV | None:
        kv = self.new_kv(key)
        buf = ((ctypes.c_uint8 * len(data)).from_buffer(data) if isinstance(data, bytearray)
               else ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8)))  # no copy
        if not _ll.llama_state_seq_set_data(self.ctx, buf, len(data), kv.seq):
            self.release(kv)
            return None
        return kv

    def extend(self, kv: SeqKV, past: Sequence[int], tokens: Sequence[int],
               all_logits: bool = False) -> torch.Tensor:
        return self.extend_batch([(kv, past, tokens)], [all_logits])[0]

    def extend_batch(self, steps: Sequence[Step], all_logits: Sequence[bool] | None = None,
                     greedy: Sequence[bool] | None = None) -> list[torch.Tensor | int]:
        """Every step's tokens in one llama_decode (several, if they exceed n_batch), with
        the logits of each step's last token, or of every token of a step flagged in
        `all_logits` (a [len(tokens), vocab] tensor), or, for a step flagged in `greedy`,
        its greedy choice read in llama.cpp's buffer (no copy of the row)."""
        every = list(all_logits) if all_logits is not None else [False] * len(steps)
        choose = list(greedy) if greedy is not None else [False] * len(steps)
        rows = [(kv.seq, len(past) + i, tok, every[j] or i == len(tokens) - 1, j)
                for j, (kv, past, tokens) in enumerate(steps) for i, tok in enumerate(tokens)]
        rows.sort(key=lambda r: r[0])  # in sequence order (see kv_layout); stable
        fillers = self._fillers(rows) if self.kv_layout == "streams" else []
        if fillers:
            rows = sorted(rows + fillers, key=lambda r: r[0])
        out: list[torch.Tensor | None] = [None] * len(steps)
        per_step: dict[int, list[torch.Tensor]] = {j: [] for j, flag in enumerate(every) if flag}
        should_yield = getattr(_work, "should_yield", None)
        if should_yield is not None:
            self._should_yield = should_yield
            _ll.llama_set_abort_callback(self.ctx, self._abort, None)
        try:
            for lo in range(0, len(rows), self.n_batch):
                chunk = rows[lo:lo + self.n_batch]
                self._decode(chunk, steps)
                for i, (_, _, _, wanted, j) in enumerate(chunk):
                    if j in per_step:
                        per_step[j].append(self._logits(i))
                    elif wanted:
                        out[j] = self._choice(i) if choose[j] else self._logits(i)
        finally:
            for seq, pos, *_ in fillers:  # a filler's cell goes as it came
                _ll.llama_memory_seq_rm(self.mem, seq, pos, -1)
            if should_yield is not None:
                _ll.llama_set_abort_callback(self.ctx, ctypes.cast(None, _ll.ggml_abort_callback),
                                             None)
                self._should_yield = None
                _ABORTING.clear()
        for j, rows_j in per_step.items():
            out[j] = torch.stack(rows_j)
        return out  # type: ignore[return-value]

    # -- internals -------------------------------------------------------------------------
    def _fillers(self, rows: list[tuple]) -> list[tuple]:
        """Streams layout, a batch of one token per sequence: llama.cpp runs one ubatch per
        run of consecutive sequence ids, each reading the weights again. A gap of up to
        FILL_GAP ids is filled with a throwaway row per id (at the end of that sequence,
        logits not computed, removed after the forward), so the batch runs as one ubatch."""
        seqs = [r[0] for r in rows]
        if len(rows) < 2 or len(set(seqs)) != len(seqs):
            return []
        out = []
        for a, b in zip(seqs, seqs[1:]):
            if not 1 < b - a <= FILL_GAP + 1:
                continue
            for seq in range(a + 1, b):
                pos = int(_ll.llama_memory_seq_pos_max(self.mem, seq)) + 1  # 0 if empty
                if pos >= self.max_context:
                    return []  # no room in that stream: leave the batch as it is
                out.append((seq, pos, 0, False, None))
        return out

    def _decode(self, rows: list[tuple], steps: Sequence[Step]) -> None:
        b = self._batch
        for i, (seq, pos, tok, wanted, _) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = wanted  # the logits at this token are read back
        b.n_tokens = len(rows)
        rc = _ll.llama_decode(self.ctx, b)
        if rc == 0:
            return
        for kv, past, _ in steps:  # take back whatever part of the batch was written
            _ll.llama_memory_seq_rm(self.mem, kv.seq, len(past), -1)
        if rc == 2:
            raise Preempted
        if rc == 1:
            raise OverBudget("llama.cpp found no free KV cells for this batch")
        raise LlamaCppError(f"llama_decode failed with status {rc}")

    def _logits(self, i: int) -> torch.Tensor:
        """Row `i`'s logits, copied out of llama.cpp's buffer (the next decode reuses it)."""
        row = torch.empty(self.vocab_size, dtype=torch.float32)
        ctypes.memmove(row.data_ptr(), _ll.llama_get_logits_ith(self.ctx, i), self._row_bytes)
        return row

    def _choice(self, i: int) -> int:
        """Row `i`'s greedy choice, read in place: right after a step, copying the row out
        and taking its argmax cost two to four times the argmax in place (SmolLM2 on two
        cores, four probe runs: 173-276 against 71-82 µs a token)."""
        at = ctypes.cast(_ll.llama_get_logits_ith(self.ctx, i), ctypes.c_void_p).value
        return int(np.frombuffer(self._row_type.from_address(at), dtype=np.float32).argmax())

    def _abort_requested(self, _data) -> bool:
        fn = self._should_yield
        if fn is not None and fn():
            _ABORTING.set()  # llama.cpp logs the abort as a failure: expected here
            return True
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _ll.llama_batch_free(self._batch)
        _ll.llama_free(self.ctx)
        _ll.llama_model_free(self.model)


def _extend(cparams, model, trained: int, length: int | None, gguf) -> int:
    """The context a session may use: `length` where given (within the training context,
    as asked; past it, RoPE scaled by YaRN as llama-server's `--rope-scaling yarn --rope-scale
    F --yarn-orig-ctx T` scales it, F = length / T), else the training context."""
    if length is None or length <= trained:
        return trained if length is None else max(1, length)
    if _ll.llama_model_rope_type(model) == _ll.LLAMA_ROPE_TYPE_NONE:
        raise ValueError(f"--context-length {length} is past {gguf}'s training context of "
                         f"{trained} tokens, and its positions are not RoPE: it cannot be "
                         "extended")
    cparams.rope_scaling_type = _ll.LLAMA_ROPE_SCALING_TYPE_YARN
    cparams.rope_freq_scale = trained / length
    cparams.yarn_orig_ctx = trained
    return length


_LOG_CB = None
_ABORTING = threading.Event()  # an idle forward was stopped on purpose: its failure is no news
# a pool larger than the model's training context: sessions are capped at it (max_context)
_NO_NEWS = b"possible training context overflow\n"


def _quiet_logs() -> None:
    """llama.cpp logs every load to stderr; keep warnings and errors only."""
    global _LOG_CB
    if _LOG_CB is not None:
        return

    def log(level: int, text: bytes, _data) -> None:
        if level in (3, 4) and not _ABORTING.is_set() and not text.endswith(_NO_NEWS):
            os.write(2, text)  # GGML_LOG_LEVEL_WARN, _ERROR

    _LOG_CB = _ll.llama_log_callback(log)
    _ll.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def describe() -> dict[str, Any]:
    """What the installed binding was built with (for benchmarks and `prepos info`)."""
    if _ll is None:
        return {"available": False, "reason": IMPORT_ERROR}
    return {"available": True, "version": _ll.__version__,
            "system_info": _ll.llama_print_system_info().decode(errors="replace").strip()}
