"""Prompt-lookup (n-gram) speculative decoding for greedy answers on back ends that verify
drafts (`Backend.verifies_drafts`: the in-process torch and llama.cpp back ends).

An agentic answer often copies from its own context: a tool result's values, a name from the
conversation, the markup of a tool call. So the tokens that follow the answer's last `n`
tokens the previous time those `n` appeared in the session's sequence (entry and answer so
far; `n` from `max_ngram` down to `min_ngram`) are a draft of what comes next, proposed with
no model (`NgramIndex`). The session's latest answers are searched too (`Session.said`, up to
`lookup_said_tokens`): a standing query asked again after an update, or an agent's answer
after the next call of the same tool, says much of what the last one said, and a streaming
session's answers never enter its context.

One forward over the last token and up to `k` drafted tokens returns the logits at each of
those positions; a draft is accepted while it equals the greedy choice at the position before
it (`accepted`), and the choice at the first disagreement (or after the last draft) is the
answer's next token too. So one forward yields 1 to k + 1 tokens, each the
one a plain greedy decode would have chosen from the same logits. Rejected drafts stay in the
KV until the next forward, whose restore crops them (the KV's common prefix).

Each accepted token goes through `Generation.add` one by one, so stop sequences, end of turn,
max tokens and cancellation end the answer at the same token as without drafts.
"""

from __future__ import annotations

import threading
from typing import Callable, Generator, Sequence

import torch

from prepos.core import SamplingParams
from prepos.decode.generation import Generation
from prepos.decode.sampling import sample, step_token
from prepos.worker.sequence import Advance, Forward, KVSequence


class NgramIndex:
    """A token sequence and, for each n-gram of length 1..max_ngram, where it last ended
    with a token after it; `propose` looks the sequence's own last n tokens up there. A
    `prior` corpus (a session's earlier answers) is indexed before the sequence: it drafts
    too, and the sequence's own occurrences, being later, win where both have the n-gram."""

    def __init__(self, tokens: Sequence[int], max_ngram: int = 3, prior: Sequence[int] = ()):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []  # the sequence
        self._all: list[int] = []  # what is indexed: the prior, then the sequence
        # per n: n-gram -> the (exclusive) end of its latest occurrence that has a follower
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self._index(prior)
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self._index(tokens)
        self.tokens.extend(tokens)

    def _index(self, tokens: Sequence[int]) -> None:
        toks = self._all
        for tok in tokens:
            end = len(toks)  # the grams ending here get `tok` as their follower
            for n in range(1, min(self.max_ngram, end) + 1):
                self._ends[n][tuple(toks[end - n:end])] = end
            toks.append(tok)

    def propose(self, k: int, min_ngram: int = 1) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the sequence's last n
        tokens, for the longest n (max_ngram down to min_ngram) that occurred before; []
        when none did. Where that continuation runs into the sequence's end, the drafts go
        on copying from themselves (a repeating pattern repeats on)."""
        toks = self._all
        if k < 1:
            return []
        for n in range(min(self.max_ngram, len(self) - 1), max(min_ngram, 1) - 1, -1):
            end = self._ends[n].get(tuple(toks[len(toks) - n:]))
            if end is not None:
                drafts = toks[end:end + k]
                while len(drafts) < k:  # end < len(toks): the index is always behind
                    drafts.append(drafts[end + len(drafts) - len(toks)])
                return drafts
        return []


def accepted(drafts: Sequence[int], choices: Sequence[int]) -> int:
    """How many drafts are accepted: the longest prefix where each draft equals the choice
    made at the position before it (`choices[i]` is the choice after the i-th token run)."""
    n = 0
    while n < len(drafts) and n < len(choices) and drafts[n] == choices[n]:
        n += 1
    return n


class LookupStats:
    """Counters across an engine's answers (any thread may read them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.proposed = 0  # drafted tokens run in a verifying forward
        self.accepted = 0  # of those, equal to the greedy choice before them
        self.verify_steps = 0  # forwards that verified drafts

    def add(self, proposed: int, accepted_: int) -> None:
        with self._lock:
            self.proposed += proposed
            self.accepted += accepted_
            self.verify_steps += 1

    def metrics(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "verify_steps": self.verify_steps}


class Lookup:
    """The engine's prompt-lookup decoder: up to `k` drafted tokens per forward (0: off),
    matched on n-grams of `max_ngram` down to `min_ngram` tokens, while at most `max_batch`
    foreground tasks (answers, commits) run or wait (`running()`: the scheduler's count).

    A verifying forward costs more than a plain step by every row it adds (on two CPU cores,
    a Q4 SmolLM2-135M, in a one-off probe: 1.6x a step for one draft, 3.2x for four, 4.8x
    for eight), so drafts pay only inside a span the answer copies, and only while few
    tasks share the forward: beside other sessions' steps, each draft row delays them all.
    Within an answer the width adapts: it starts at `START`, doubles (up to `k`) while
    drafts are accepted whole, and falls to what was accepted when one is refused. An answer
    read token by token as it comes (`Stream.paced`: streamed to a client) drafts nothing:
    its reader would see each refused draft's wider forward as a stall."""

    START = 2

    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 2, max_batch: int = 2,
                 running: Callable[[], int] = lambda: 1):
        if k < 0 or not 1 <= min_ngram <= max_ngram or max_batch < 1:
            raise ValueError(f"lookup needs k >= 0, 1 <= min_ngram <= max_ngram and "
                             f"max_batch >= 1, got {k}, {min_ngram}, {max_ngram}, {max_batch}")
        self.k = k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_batch = max_batch
        self.running = running
        self.stats = LookupStats()

    def applies(self, sampling: SamplingParams, verifies: bool) -> bool:
        """Greedy (no penalties, biases or response format: `greedy` says so), the back end
        verifies drafts, drafting is on."""
        return self.k > 0 and verifies and sampling.greedy

    def decode(self, kv: KVSequence, seq: tuple[int, ...], out: Generation,
               sampling: SamplingParams, rng, said: Sequence[int] = ()
               ) -> Generator[Forward, Advance, None]:
        """The rest of a greedy answer after `seq` and `out`'s tokens, one forward per
        quantum: the last token and its drafts where the context (or `said`, the session's
        earlier answers) has a match, else the last token alone (a plain step)."""
        index = NgramIndex(seq + tuple(out.tokens), self.max_ngram, prior=said)
        width = min(self.START, self.k)
        while True:
            ctx = index.tokens
            room = sampling.max_tokens - len(out.tokens) - 1  # the forward's own token aside
            drafts = (index.propose(min(width, room), self.min_ngram)
                      if self.running() <= self.max_batch and not out.stream.paced else [])
            if not drafts:
                step = yield Forward(kv, tuple(ctx), greedy=out.greedy)
                tok = step_token(step, sampling, rng)
                index.extend([tok])
                if out.add(tok, step.logits):
                    return
                continue
            step = yield Forward(kv, (*ctx, *drafts), logits_from=len(ctx) - 1)
            n_ok, done = self._take(step.logits, drafts, out, index, sampling, rng)
            if done:
                return
            width = min(self.k, 2 * width) if n_ok == len(drafts) else max(1, n_ok)

    def _take(self, rows: torch.Tensor, drafts: list[int], out: Generation, index: NgramIndex,
              sampling: SamplingParams, rng) -> tuple[int, bool]:
        """Emit the greedy choice at each verified position, up to the first that disagrees
        with its draft (that choice included): (drafts accepted, the answer finished)."""
        choices = [sample(rows[i], sampling, rng) for i in range(len(drafts) + 1)]
        n_ok = accepted(drafts, choices)
        self.stats.add(len(drafts), n_ok)
        for i in range(n_ok + 1):
            index.extend([choices[i]])
            if out.add(choices[i], rows[i]):
                return n_ok, True
        return n_ok, False
