"""The prefix index: a KV about to be filled starts from the longest prefix another KV of its
scope holds, resident or moved down to a lower tier (RAM, disk: its state read and left
there), on every in-process back end (and layout); what it answers from there is what a cold
forward of the same sequence gives (exact on torch, the argmax within the stated tolerance
on llama.cpp); never across owners; the KV it came from is untouched."""

from __future__ import annotations

import pytest

from prepos.config import BudgetConfig, TierConfig
from prepos.core import Request, SamplingParams
from prepos.worker.prefix import BLOCK, PrefixIndex, chain
from tests.support.helpers import greedy_agrees

GREEDY = Request(SamplingParams(max_tokens=5))


def prompt(eng, n_blocks: int = 3) -> list[int]:
    """A prompt of `n_blocks` whole blocks and then some, in the model's vocabulary."""
    ids = eng.fmt.encode("ACME 41 43 44 47 48 50, BOLT 12 11 10 9. " * 40)
    return list(ids[:n_blocks * BLOCK + 5])


def answers_as_cold(eng, seq, res) -> bool:
    return all(greedy_agrees(eng, list(seq) + res.tokens[:i], t)
               for i, t in enumerate(res.tokens))


def test_a_session_starts_from_the_prefix_another_session_holds(make_engine):
    eng = make_engine()
    shared = prompt(eng)
    a = eng.create_session("agentic", preposition=False)
    eng.complete(a, shared + [11, 12], GREEDY).result()
    b = eng.create_session("agentic", preposition=False)
    seq = shared + [13, 14, 15]
    res = eng.complete(b, seq, GREEDY).result()
    assert res.cached_prompt_tokens >= len(shared) // BLOCK * BLOCK
    assert res.timing.prefill_tokens <= len(seq) - len(shared) // BLOCK * BLOCK + 1
    assert answers_as_cold(eng, seq, res)
    # the donor is untouched: its own continuation is still a cold forward's
    again = shared + [11, 12, 16]
    res_a = eng.complete(a, again, GREEDY).result()
    assert res_a.cached_prompt_tokens >= len(shared) + 2
    assert answers_as_cold(eng, again, res_a)


def test_a_new_sessions_first_commit_starts_from_a_shared_system_prompt(make_engine):
    eng = make_engine()
    system = "You are a market analyst. Answer in one word, up, down or flat. " * 6
    a = eng.create_session("streaming", system=system, preposition=False)
    eng.append(a, "ACME 41 43 44")
    b = eng.create_session("streaming", system=system, preposition=False)
    eng.append(b, "BOLT 12 11 10")  # its ingest copies the system prompt's blocks
    system_len = len(eng.snapshot(a).tokens) - len(eng.fmt.encode(" ")) - 12  # at least this
    res = eng.query(b, "Which way?", GREEDY).result()
    assert res.cached_prompt_tokens >= min(system_len, BLOCK)
    assert answers_as_cold(eng, eng.snapshot(b).tokens + tuple(
        eng.fmt.encode(eng.fmt.frame(eng.session(b).entries(eng.snapshot(b)).user,
                                     "Which way?"))), res)


def test_a_prefix_is_never_shared_across_owners(make_engine):
    eng = make_engine()
    shared = prompt(eng)
    a = eng.create_session("agentic", preposition=False, owner="key-1")
    eng.complete(a, shared + [11], GREEDY).result()
    b = eng.create_session("agentic", preposition=False, owner="key-2")
    res = eng.complete(b, shared + [12], GREEDY).result()
    assert res.cached_prompt_tokens == 0
    c = eng.create_session("agentic", preposition=False, owner="key-1")
    assert eng.complete(c, shared + [13], GREEDY).result().cached_prompt_tokens >= BLOCK


@pytest.mark.parametrize("tiers, where", [
    (TierConfig(), "ram"), (TierConfig(ram_bytes=1, disk_bytes=1 << 30), "disk")])
def test_a_session_starts_from_the_prefix_a_moved_down_session_holds(make_engine, tiers,
                                                                      where):
    """The only KV holding a system prompt moved down a tier (for room another owner's
    session needed): a new session of its owner loads its state from there and prefills only
    the rest; the state stays in its tier and still restores its own session."""
    eng = make_engine(budget=BudgetConfig(session_cells=4096, engine_cells=200),
                      max_sequences=4, tiers=tiers)  # about one session's KV
    system = "You are a market analyst. Answer in one word, up, down or flat. " * 6

    def session(owner, line):
        sid = eng.create_session("streaming", system=system, preposition=False, owner=owner)
        eng.append(sid, line)
        return sid

    a = session("key-1", "ACME 41 43 44")
    reused = eng.metrics()["prefix_reuse"]["tokens"]
    session("key-2", "ACME 41 43 44")  # another owner's: shares nothing, needs a's room
    assert eng.metrics()["prefix_reuse"]["tokens"] == reused
    assert eng.info(a)["kv"] == where
    loads = eng.metrics()["kv_tiers"]["prefix_loads"]
    b = session("key-1", "BOLT 12 11 10")
    assert eng.metrics()["kv_tiers"]["prefix_loads"] == loads + 1
    assert eng.metrics()["prefix_reuse"]["tokens"] >= reused + 2 * BLOCK
    assert eng.info(a)["kv"] in ("ram", "disk")  # read, not taken
    for sid in (b, a):
        q = "Which way?"
        seq = list(eng.snapshot(sid).tokens) + eng.fmt.encode(
            eng.fmt.frame(eng.session(sid).entries(eng.snapshot(sid)).user, q))
        assert answers_as_cold(eng, seq, eng.query(sid, q, GREEDY).result())


def test_the_index_finds_the_deepest_block_and_forgets_what_is_cropped():
    class KV:  # the index's view of a KV: its scope, tokens and block hashes
        def __init__(self, scope, tokens, resident=True):
            self.scope, self.tokens = scope, list(tokens)
            self.handle = object() if resident else None
            self.hashes = chain(scope, tokens, 0, [], len(tokens) // BLOCK)

        def common_prefix(self, target):
            n = 0
            while n < min(len(self.tokens), len(target)) and self.tokens[n] == target[n]:
                n += 1
            return n

    index = PrefixIndex()
    long_ = KV(None, range(4 * BLOCK))
    short = KV(None, range(2 * BLOCK))
    other = KV("k", range(4 * BLOCK))
    for kv in (long_, short, other):
        index.add(kv, kv.hashes)
    me = KV(None, [])
    target = list(range(3 * BLOCK + 7)) + [-1]
    assert index.longest(me, target) == (long_, 3 * BLOCK + 7)
    index.remove(long_, long_.hashes[1:])  # long_ cropped to one block
    assert index.longest(me, target) == (short, 2 * BLOCK)
    assert index.longest(KV("k", []), target) == (other, 3 * BLOCK + 7)
    assert index.longest(me, [5] + target) == (None, 0)
    away = KV(None, range(2 * BLOCK), resident=False)  # its state in a lower tier
    index.add(away, away.hashes)
    assert index.longest(me, target) == (short, 2 * BLOCK)  # equals: the resident one
    index.remove(short, short.hashes)
    assert index.longest(me, target) == (away, 2 * BLOCK)
