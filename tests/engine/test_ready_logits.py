"""Ready records' full next-token vectors are a cache within a byte budget
(prepos.engine.logits): the least recently recorded or used record keeps its top tokens only,
still answers greedy requests on the fast path, and sends a request that needs the whole
distribution down the full path; a record's vector goes with its version."""

import gc

import torch

from prepos.core import AnswerPath, ReadyRecord, Request, SamplingParams
from prepos.engine.logits import KeptLogits, answers_from
from prepos.engine.ready import ReadySet

Q = "Which way is it moving?"
VOCAB = 1000


def record(version: int = 1) -> ReadyRecord:
    logits = torch.randn(VOCAB)
    top = torch.topk(torch.log_softmax(logits, -1), 8)
    return ReadyRecord(p=10, entry=(1, 2), logits=logits, top_ids=tuple(top.indices.tolist()),
                       top_logprobs=tuple(top.values.tolist()), gap=1.0, version=version,
                       top_text="x")


def stored(kept: KeptLogits, ready: ReadySet, key: tuple) -> None:
    rec = record(ready.version)
    assert ready.record(key, rec)
    kept.add(ready, key, rec)


def test_beyond_the_budget_the_least_recently_used_record_keeps_its_top_tokens_only():
    size = VOCAB * 4
    kept = KeptLogits(2 * size)
    a, b, c = ReadySet(1), ReadySet(1), ReadySet(1)
    stored(kept, a, ("query", "a"))
    stored(kept, b, ("query", "b"))
    kept.used_now(a, ("query", "a"))  # a was asked: b is now the least recently used
    stored(kept, c, ("query", "c"))
    assert kept.used == 2 * size and kept.stripped == 1
    assert b.records[("query", "b")].logits is None
    assert b.records[("query", "b")].top_ids  # its top tokens stay
    assert a.records[("query", "a")].logits is not None
    assert c.records[("query", "c")].logits is not None


def test_a_ready_set_that_is_gone_frees_its_share_of_the_budget():
    kept = KeptLogits(10 * VOCAB * 4)
    ready = ReadySet(1)
    stored(kept, ready, ("query", "a"))
    stored(kept, ready, ("query", "b"))
    assert kept.used == 2 * VOCAB * 4
    del ready
    gc.collect()
    assert kept.used == 0


def test_what_a_stripped_record_answers():
    rec = record()
    bare = ReadyRecord(**{**rec.__dict__, "logits": None})
    greedy = SamplingParams(max_tokens=4)
    hot = SamplingParams(max_tokens=4, temperature=0.8)
    assert answers_from(rec, hot, True) and answers_from(bare, greedy, True)
    assert not answers_from(bare, hot, True)  # needs the whole distribution
    assert not answers_from(bare, SamplingParams(max_tokens=1, top_logprobs=9), True)
    assert answers_from(bare, hot, False)  # a top-k back end samples what it has


def test_a_stripped_record_serves_greedy_fast_and_sampling_on_the_full_path(make_engine):
    probe = make_engine()
    vector = probe.backend.vocab_size * 4  # a record's float32 vector
    # room for one session's two records (its header and its standing query), not three
    eng = make_engine(ready_logits_bytes=int(2.5 * vector), predecode_tokens=0)
    first = eng.create_session("streaming", system="Market.", standing=[Q])
    eng.append(first, "AAPL 101 102 104")
    assert eng.wait_idle(300)
    second = eng.create_session("streaming", system="Market.", standing=[Q])
    eng.append(second, "MSFT 55 54 52")
    assert eng.wait_idle(300)
    assert eng.metrics()["ready_logits"]["stripped"] >= 1
    hot = Request(SamplingParams(max_tokens=1, temperature=0.7, seed=1))
    greedy = Request(SamplingParams(max_tokens=1))
    assert eng.query(second, Q, hot).result().path is AnswerPath.FAST
    res = eng.query(first, Q, greedy).result()
    assert res.path is AnswerPath.FAST  # greedy: the top tokens are enough
    assert not eng.serves_exact(first, ("query", Q), hot)
    res = eng.query(first, Q, hot).result()
    assert res.path is not AnswerPath.FAST and len(res.tokens) == 1
