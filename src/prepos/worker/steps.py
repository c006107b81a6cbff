"""What the scheduler's foreground steps carried, counted as they run (the engine's metrics
read them: `prepos:scheduler_*`)."""

from __future__ import annotations

from collections import Counter

from prepos.worker.sequence import Forward


def decodes(f: Forward, plan: tuple[int, int, int]) -> bool:
    """A decode step (one token) or a check of drafted tokens, not a prefill."""
    return plan[2] - plan[1] == 1 or (f.logits_from or 0) > 0


class Steps:
    """Steps and the seconds of their batched forwards by kind (`decode`: one-token steps and
    draft checks only, `prefill`: longer forwards only, `mixed`: both), the forwards they
    carried, the foreground tasks queued that a step did not carry, tokens by what they
    were, the forwards cut to share a step (chunks), and the worker's whole time per step
    (the tasks' own Python around the forward: sampling, detokenizing, streaming out)."""

    def __init__(self) -> None:
        # every key made now: the metrics copy these dicts from another thread
        self.count: Counter[str] = Counter(decode=0, prefill=0, mixed=0)
        self.seconds: Counter[str] = Counter(decode=0.0, prefill=0.0, mixed=0.0)
        self.sequences = 0
        self.waiting = 0
        self.tokens: Counter[str] = Counter(decode=0, prefill=0)
        self.chunks = 0
        self.quantum_s = 0.0

    @property
    def total(self) -> int:
        return sum(self.count.values())

    def record(self, ran: list[tuple[Forward, tuple[int, int, int]]], waiting: int,
               step_s: float, quantum_s: float) -> None:
        """One step: the forwards it ran (not those that waited for room: they count as
        waiting, with the tasks the cap left out and those queued)."""
        kinds = [decodes(f, p) for f, p in ran]
        kind = "decode" if all(kinds) else "prefill" if not any(kinds) else "mixed"
        self.count[kind] += 1
        self.seconds[kind] += step_s
        self.sequences += len(ran)
        self.waiting += waiting
        for (f, (_, start, stop)), d in zip(ran, kinds):
            self.tokens["decode" if d else "prefill"] += stop - start
            self.chunks += f.max_tokens is not None and not d and stop < len(f.target)
        self.quantum_s += quantum_s

    def as_dict(self) -> dict:
        return {"steps": dict(self.count), "step_seconds": dict(self.seconds),
                "sequences": self.sequences, "waiting": self.waiting,
                "tokens": dict(self.tokens), "prefill_chunks": self.chunks,
                "quantum_seconds": self.quantum_s}
