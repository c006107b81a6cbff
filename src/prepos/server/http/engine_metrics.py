"""The engine's Prometheus families, read from `Engine.metrics()` at scrape time and written
as text (`exposition.Family`): pre-positions, paths, KV cells and tiers, queues, sessions,
the model worker's steps, drafts, implicit sessions and the relaxed path's risk gate.

`samples` says which family holds which value; `text` writes them. Making prometheus_client's
metric families for these each scrape (some forty objects, each name checked again) cost
more than everything else a scrape does, on the cores the model decodes on."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prepos.core import AnswerPath
from prepos.server.http.exposition import Family

# the engine's path counters by the label they are exported with: the path names of
# responses (`AnswerPath` values), the match or gate outcome after the fast path's
ENGINE_PATHS = {"fast_exact": "fast_exact", "fast_relaxed": "fast_relaxed",
                "gate_miss": "gate_miss", AnswerPath.FALL.value: "fall",
                AnswerPath.COLD.value: "cold"}

C, G = "counter", "gauge"
MODEL_INFO = Family("prepos:model_info", "The served model", G, "model")
PREPOSITION_HELP = {
    "started": "Pre-positions started (one per committed version)",
    "recorded": "Pre-positions that recorded their ready distributions",
    "consumed": "Pre-positions a request used before invalidation (hits)",
    "invalidated": "Pre-positions cleared by a mutation before any use (waste)",
    "discarded": "Pre-positions still running when their session moved on",
    "superseded": "Pre-positions whose session moved on before they started",
    "skipped": "Pre-position entries skipped for the KV cell budget",
    "preempted": "Idle chunks stopped between layers for a waiting request (redone)",
    "predecoded_tokens": "Answer tokens pre-decoded at idle after exact entries",
    "predecode_served": "Pre-decoded answer tokens served to requests",
    "predecode_wasted": "Pre-decoded answer tokens no request used before a mutation",
}
_PREPOSITIONS: dict[str, Family] = {}  # by counter name, made as the engine first reports it
HIT_RATE = Family("prepos:preposition_hit_rate",
                  "consumed / (consumed + invalidated); NaN before any", G)
BY_PATH = Family("prepos:requests_by_path", "Requests by engine path: fast_exact, "
                 "fast_relaxed (gate fired), gate_miss, fall-through, cold", C, "path")
GATE_FIRES = Family("prepos:gate_fires", "Relaxed-match gate fires (Eq. 12)", C)
GATE_MISSES = Family("prepos:gate_misses", "Relaxed-match gate misses", C)
FALL_THROUGHS = Family("prepos:fall_throughs", "Requests that resumed from a pre-paid entry "
                       "(fall-through)", C)
COLD = Family("prepos:cold_requests", "Requests that paid their whole entry (cold)", C)
CELLS_USED = Family("prepos:kv_cells_used", "KV cells (tokens) held", G)
CELLS_BUDGET = Family("prepos:kv_cells_budget", "The engine's KV cell budget", G)
TIER_SESSIONS = Family("prepos:kv_tier_sessions", "Sessions whose KV is in each tier", G,
                       "tier")
TIER_BYTES = Family("prepos:kv_tier_bytes", "Bytes held in each tier below resident", G,
                    "tier")
TIER_MOVES = Family("prepos:kv_tier_moves", "KV states moved down into a tier, or dropped "
                    "from the last", C, "into")
RESTORES = Family("prepos:kv_restores", "KVs loaded back from a tier", C)
RESTORE_SECONDS = Family("prepos:kv_restore_seconds", "Time spent loading KVs back", C)
PREFIX_LOADS = Family("prepos:kv_prefix_loads", "States read from a tier (and left there) "
                      "for the prefix another KV starts from", C)
RECOMPUTED = Family("prepos:kv_recomputed_tokens", "Tokens of KVs no tier held, prefilled "
                    "again from the session's committed tokens", C)
DEFERRED = Family("prepos:kv_deferred_forwards", "Forwards of a batch that waited a step for "
                  "resident cells", C)
LOGITS_BYTES = Family("prepos:ready_logits_bytes", "Bytes of full next-token vectors ready "
                      "records keep (--ready-logits-memory)", G)
LOGITS_STRIPPED = Family("prepos:ready_logits_stripped", "Ready records that kept their top "
                         "tokens only, for the budget", C)
PREFIX_REUSE = Family("prepos:kv_prefix_reuse", "KVs that started from the longest prefix "
                      "another KV of their key held (hits), and the tokens they did not "
                      "prefill for it", C, "what")
QUEUES = Family("prepos:queue_length", "Tasks queued on the model worker", G, "queue")
WAITING = Family("prepos:num_requests_waiting", "Foreground requests queued on the model "
                 "worker", G)
SESSIONS = Family("prepos:sessions", "Live sessions", G)
STEPS = Family("prepos:scheduler_steps", "Batched foreground steps by what they carried: "
               "decode (one-token steps and draft checks), prefill, mixed (both)", C, "kind")
STEP_SECONDS = Family("prepos:scheduler_step_seconds", "Seconds in the steps' batched "
                      "forwards (admission included), by step kind", C, "kind")
STEP_SEQUENCES = Family("prepos:scheduler_step_sequences", "Forwards the steps carried "
                        "(/ steps: the mean batch)", C)
STEP_WAITING = Family("prepos:scheduler_step_waiting", "Foreground tasks queued that a step "
                      "did not carry, summed over steps", C)
STEP_TOKENS = Family("prepos:scheduler_step_tokens", "Tokens the steps ran, by what they "
                     "were", C, "what")
PREFILL_CHUNKS = Family("prepos:scheduler_prefill_chunks", "Long forwards' chunks cut to "
                        "share a step with other streams (chunked prefill)", C)
QUANTUM_SECONDS = Family("prepos:scheduler_quantum_seconds", "The model worker's whole time "
                         "per step: the forward and the tasks' own work around it", C)
DRAFTS = Family("prepos:lookup_drafts", "Prompt-lookup drafted tokens of greedy answers: "
                "proposed (run in a verifying forward) and accepted (equal to the greedy "
                "choice)", C, "outcome")
VERIFY_STEPS = Family("prepos:lookup_verify_steps", "Forwards that verified drafted tokens", C)
IMPLICIT = Family("prepos:implicit_sessions", "Stateless chat requests by what their implicit "
                  "session did (continued a kept conversation, started one), and kept ones "
                  "evicted", C, "outcome")
VERIFIED = Family("prepos:relaxed_verified", "Relaxed-path verifications (the full path's "
                  "first token at the real entry) by outcome", C, "outcome")
UNVERIFIED = Family("prepos:relaxed_unverified", "Verifications not run, by reason (stale: "
                    "the session moved on; budget; capped; off; closed; error)", C, "reason")
CORRECTIONS = Family("prepos:relaxed_corrections", "Correction events sent for served relaxed "
                     "answers the full path disagreed with", C)
WITHHELD = Family("prepos:relaxed_withheld", "Gate fires whose class was not served relaxed "
                  "(a full answer instead)", C)
PENDING = Family("prepos:relaxed_verifications_pending", "Verifications queued", G)
CLASSES = Family("prepos:relaxed_classes", "Question classes tracked (per API key, counted "
                 "together) by status", G, "status")
CLASSES_SERVED = Family("prepos:relaxed_classes_served", "Question classes served relaxed "
                        "(promoted, or on probation with start serve)", G)
UPPER = Family("prepos:relaxed_served_false_accept_upper", "The highest Wilson 95% upper "
               "bound of the false-accept rate among the classes served relaxed; NaN when "
               "none is", G)


def text(m: dict | None, model: str) -> str:
    """The families' lines for the engine's metrics `m` (None: not loaded yet)."""
    return "".join(f.text(v) for f, v in samples(m, model))


def samples(m: dict | None, model: str) -> Iterator[tuple[Family, object]]:
    """Each family with its value (a number, or (label value, number) pairs), in the order
    they are written."""
    yield MODEL_INFO, ((model, 1.0 if m is not None else 0.0),)
    if m is None:
        return
    pre = m["prepositions"]
    for name, value in pre.items():  # every integer counter the engine keeps
        if isinstance(value, int) and not isinstance(value, bool):
            fam = _PREPOSITIONS.get(name)
            if fam is None:
                fam = _PREPOSITIONS[name] = Family(
                    f"prepos:prepositions_{name}",
                    PREPOSITION_HELP.get(name, f"Pre-positions {name}"), C)
            yield fam, value
    hit = pre.get("hit_rate")
    yield HIT_RATE, math.nan if hit is None else hit
    paths = m["paths"]
    yield BY_PATH, [(label, paths.get(counter, 0)) for label, counter in ENGINE_PATHS.items()]
    yield GATE_FIRES, paths.get("fast_relaxed", 0)
    yield GATE_MISSES, paths.get("gate_miss", 0)
    yield FALL_THROUGHS, paths.get("fall", 0)
    yield COLD, paths.get("cold", 0)
    yield CELLS_USED, m["kv_cells_used"]
    yield CELLS_BUDGET, m["kv_cells_budget"]
    yield from _tiers(m["kv_tiers"])
    kept = m["ready_logits"]
    yield LOGITS_BYTES, kept["bytes"]
    yield LOGITS_STRIPPED, kept["stripped"]
    reuse = m["prefix_reuse"]
    yield PREFIX_REUSE, (("hits", reuse["hits"]), ("tokens", reuse["tokens"]))
    yield QUEUES, (("foreground", m["queue_foreground"]), ("idle", m["queue_idle"]))
    yield WAITING, m["queue_foreground"]
    yield SESSIONS, m["sessions"]
    yield from _steps(m["scheduler"])
    lk = m["lookup"]
    yield DRAFTS, (("proposed", lk["proposed"]), ("accepted", lk["accepted"]))
    yield VERIFY_STEPS, lk["verify_steps"]
    yield IMPLICIT, m["implicit"].items()
    yield from _relaxed(m["relaxed"])


def _tiers(t: dict) -> Iterator[tuple[Family, object]]:
    """Where sessions' KV is: per tier its bytes (cells, resident) and sessions, the moves
    into each, restores and their time, tokens recomputed where no tier held a KV."""
    below = [tier for tier in ("ram", "disk") if tier in t]
    yield TIER_SESSIONS, [("resident", t["resident"]["sessions"]),
                          *((tier, t[tier]["sessions"]) for tier in below)]
    yield TIER_BYTES, [(tier, t[tier]["bytes"]) for tier in below]
    yield TIER_MOVES, t.get("moves", {}).items()
    yield RESTORES, t["restores"]
    yield RESTORE_SECONDS, t["restore_s"]
    yield PREFIX_LOADS, t["prefix_loads"]
    yield RECOMPUTED, t["recomputed_tokens"]
    yield DEFERRED, t.get("deferred", 0)


def _steps(st: dict) -> Iterator[tuple[Family, object]]:
    """The model worker's foreground steps: by kind, their forwards' seconds, what they
    carried and left queued, their tokens, chunks and the worker's whole time."""
    kinds = ("decode", "prefill", "mixed")
    yield STEPS, [(k, st["steps"].get(k, 0)) for k in kinds]
    yield STEP_SECONDS, [(k, st["step_seconds"].get(k, 0.0)) for k in kinds]
    yield STEP_SEQUENCES, st["sequences"]
    yield STEP_WAITING, st["waiting"]
    yield STEP_TOKENS, [(w, st["tokens"].get(w, 0)) for w in ("decode", "prefill")]
    yield PREFILL_CHUNKS, st["prefill_chunks"]
    yield QUANTUM_SECONDS, st["quantum_seconds"]


def _relaxed(rx: dict) -> Iterator[tuple[Family, object]]:
    """The relaxed path's online risk gate: verifications by outcome, the unverified by
    reason, corrections, and its question classes counted by status, with the highest
    false-accept upper bound among those served. No label carries a class's wording (a
    question's text): classes are counted over every API key, never named."""
    c = rx["counters"]
    yield VERIFIED, [(outcome, c.get(outcome, 0)) for outcome in ("agree", "disagree")]
    yield UNVERIFIED, [*((reason, c.get(f"dropped_{reason}", 0))
                         for reason in ("stale", "budget", "error", "closed")),
                       ("capped", c.get("unverified_capped", 0)),
                       ("off", c.get("unverified_off", 0))]
    yield CORRECTIONS, c.get("corrections", 0)
    yield WITHHELD, c.get("withheld", 0)
    yield PENDING, rx["pending"]
    yield CLASSES, rx["classes"].items()
    yield CLASSES_SERVED, rx["classes_served"]
    upper = rx["served_upper_max"]
    yield UPPER, math.nan if upper is None else upper
