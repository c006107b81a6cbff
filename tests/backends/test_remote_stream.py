"""Streamed answers on the remote back end, against the engines' schemas (remote_fakes.py):
one request per answer, the engine's own sampling, stop tokens, cancellation by closing the
stream, failover before the first token and a clean error after it, background priority
only where the engine accepts it, and the engine's own context length."""

from __future__ import annotations

import httpx
import pytest
import torch

from prepos.backends.base import idle_work
from prepos.backends.remote import (
    AnswerInterrupted,
    BackendUnavailable,
    RemoteBackend,
    RemoteError,
    make_adapter,
)
from prepos.backends.remote_adapters import LlamaCppAdapter
from prepos.core import SamplingParams
from prepos.worker.sequence import KVSequence
from tests.support.remote_fakes import FakeCluster, hash_logits

KINDS = ["llama.cpp", "vllm", "sglang"]
PROMPT = [1, 2, 3, 4, 5]


def backend(cluster: FakeCluster, **kw) -> RemoteBackend:
    kw.setdefault("health_interval", None)
    return RemoteBackend(make_adapter(cluster.kind, background_priority=5), cluster.urls,
                         vocab_size=50, top_k=4, transport=cluster.transport, **kw)


def greedy(fn, prompt, n):
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(int(torch.argmax(fn(seq))))
        seq.append(out[-1])
    return out


def prompt_of(body: dict) -> list[int]:
    return body.get("prompt", body.get("input_ids"))


@pytest.mark.parametrize("kind", KINDS)
def test_one_request_per_answer_greedy_topk_and_mirror(kind):
    fn = hash_logits()
    cl = FakeCluster(kind, fn, ["a"])
    be = backend(cl)
    kv = KVSequence(be, key="s")
    want = greedy(fn, PROMPT, 6)
    got = list(kv.stream(PROMPT, SamplingParams(top_logprobs=3), 6, frozenset()))
    assert [t for t, _ in got] == want
    assert len(cl.replicas["a"].requests) == 1  # one streamed request for the whole answer
    seq = list(PROMPT)
    for tok, dist in got:  # each token's top-k: the raw model distribution there
        ref = torch.topk(torch.log_softmax(fn(seq), -1), 3)
        assert dist.logits is None and dist.top_ids[:3] == tuple(ref.indices.tolist())
        seq.append(tok)
    assert kv.tokens == PROMPT + want[:-1]  # what the engine's cache holds
    assert be.metrics()["replicas"]["http://a"]["streams"] == 1
    be.close()


@pytest.mark.parametrize("kind", KINDS)
def test_stop_token_ends_the_answer_and_is_delivered(kind):
    fn = hash_logits()
    want = greedy(fn, PROMPT, 8)
    stop = want[2]
    if stop in want[:2]:
        pytest.skip("the stand-in model repeats its token")
    # llama.cpp stops by itself only on the model's end-of-generation tokens
    for eog in (frozenset({stop}), frozenset()):
        cl = FakeCluster(kind, fn, ["a"], eog=eog)
        be = backend(cl)
        got = [t for t, _ in be.stream_answer(be.new_kv("s"), PROMPT, SamplingParams(), 8,
                                              frozenset({stop}))]
        assert got == want[:3]
        # the engine generated no further than the stop (llama.cpp past a non-EOG stop id:
        # prepos closed the stream; the fake generates one event ahead at most)
        assert cl.replicas["a"].generated[-1] <= 4
        be.close()


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_is_the_engines_seeded_and_sent_explicitly(kind):
    cl = FakeCluster(kind, hash_logits(), ["a"])
    be = backend(cl)
    hot = SamplingParams(temperature=1.3, top_k=0, top_p=1.0, seed=11)
    runs = [[t for t, _ in be.stream_answer(be.new_kv(f"s{i}"), PROMPT, hot, 12, frozenset())]
            for i in range(2)]
    assert runs[0] == runs[1]  # seeded: reproducible
    assert runs[0] != greedy(hash_logits(), PROMPT, 12)
    body = cl.replicas["a"].requests[-1]
    sp = body.get("sampling_params", body)
    assert sp["temperature"] == 1.3 and sp["top_p"] == 1.0 and sp["min_p"] == 0.0
    assert sp.get("seed", sp.get("sampling_seed")) == 11
    if kind == "llama.cpp":
        assert body["samplers"] == ["top_k", "temperature", "top_p"] and body["top_k"] == 0
    else:
        assert sp["ignore_eos"] is True
    be.close()


@pytest.mark.parametrize("kind", KINDS)
def test_closing_the_stream_aborts_at_the_engine(kind):
    cl = FakeCluster(kind, hash_logits(), ["a"])
    be = backend(cl)
    events = be.stream_answer(be.new_kv("s"), PROMPT, SamplingParams(), 40, frozenset())
    for _ in range(3):
        next(events)
    events.close()
    assert cl.replicas["a"].generated[-1] < 10  # not generated to the end
    if kind == "sglang":  # the one engine with an abort API is also told
        assert cl.replicas["a"].aborts and cl.replicas["a"].aborts[-1].startswith("prepos-s-")
    assert be.metrics()["replicas"]["http://a"]["healthy"]
    be.close()


@pytest.mark.parametrize("kind", KINDS)
def test_failover_before_the_first_token_and_a_clean_error_after(kind):
    fn = hash_logits()
    cl = FakeCluster(kind, fn, ["a", "b"])
    be = backend(cl)
    kv = be.new_kv("s")
    home = be.replica_for("s")
    host = home.url.removeprefix("http://")
    other = "b" if host == "a" else "a"
    cl.replicas[host].up = False  # down before the answer: moves, whole prompt, no error
    got = [t for t, _ in be.stream_answer(kv, PROMPT, SamplingParams(), 5, frozenset())]
    assert got == greedy(fn, PROMPT, 5)
    assert prompt_of(cl.replicas[other].requests[-1]) == PROMPT
    assert kv.replica.url == f"http://{other}" and be.moves == 1

    cl.replicas[other].fail_after = 2  # dies mid-answer, and the first replica is down
    events = be.stream_answer(kv, PROMPT, SamplingParams(), 5, frozenset())
    assert [next(events)[0] for _ in range(2)] == got[:2]
    with pytest.raises(AnswerInterrupted) as err:
        next(events)
    assert isinstance(err.value, BackendUnavailable) and "not resumed" in str(err.value)
    m = be.metrics()["replicas"][f"http://{other}"]
    assert m["interrupted"] == 1 and not m["healthy"]

    cl.replicas[host].up = True  # the next answer goes to the replica that is back
    be.check_health()
    cl.replicas[other].fail_after = None
    assert [t for t, _ in be.stream_answer(kv, PROMPT, SamplingParams(), 5,
                                           frozenset())] == got
    assert kv.replica is home
    be.close()


def test_background_priority_only_where_the_engine_accepts_it():
    cl = FakeCluster("vllm", hash_logits(), ["a"])
    be = backend(cl)
    kv = be.new_kv("s")
    with idle_work():
        be.extend(kv, [], [1, 2])
    assert cl.replicas["a"].requests[-1]["priority"] == 5
    cl.replicas["a"].priority_ok = False  # restarted without priority scheduling
    with idle_work():
        be.extend(kv, [], [1, 2, 3])  # refused with priority: resent without it
        list(be.stream_answer(kv, [1, 2, 3], SamplingParams(), 2, frozenset()))
    assert "priority" not in cl.replicas["a"].requests[-1]
    assert be.metrics()["replicas"]["http://a"]["priority"] is False
    assert be.metrics()["replicas"]["http://a"]["background"] == 3
    be.extend(kv, [], [1, 2, 3, 4])  # foreground never carries one
    assert "priority" not in cl.replicas["a"].requests[-1]
    be.close()


@pytest.mark.parametrize("kind", KINDS)
def test_context_length_comes_from_the_engine(kind):
    cl = FakeCluster(kind, hash_logits(), ["a", "b"], max_context=300)
    be = backend(cl)
    assert be.max_context == 300  # not a config file's
    assert backend(cl, max_context=200).max_context == 200  # a cap, where given
    with pytest.raises(RemoteError, match="exceeds the context"):
        list(be.stream_answer(be.new_kv(), list(range(1, 302)), SamplingParams(), 1,
                              frozenset()))
    for r in cl.replicas.values():
        r.up = False
    with pytest.raises(BackendUnavailable, match="context length"):
        backend(cl)
    be.close()


@pytest.mark.parametrize("kind", KINDS)
def test_cached_tokens_reported_by_the_stream(kind):
    cl = FakeCluster(kind, hash_logits(), ["a"])
    be = backend(cl)
    kv = be.new_kv("s")
    toks = [t for t, _ in be.stream_answer(kv, PROMPT, SamplingParams(), 3, frozenset())]
    list(be.stream_answer(kv, PROMPT + toks, SamplingParams(), 3, frozenset()))
    assert kv.last.cached_tokens == len(PROMPT) + 2  # the last token is run again
    assert be.metrics()["replicas"]["http://a"]["cached_tokens"] == len(PROMPT) + 2
    be.close()


def test_llamacpp_withheld_token_is_an_error():
    parser = LlamaCppAdapter().stream_parser()
    probs = [{"id": 7, "logprob": -0.1, "top_logprobs": [{"id": 7, "logprob": -0.1},
                                                        {"id": 3, "logprob": -2.0}]}]
    assert parser.feed({"tokens": [7], "tokens_predicted": 1,
                        "completion_probabilities": probs})[0][0] == 7
    with pytest.raises(RemoteError, match="incomplete UTF-8"):
        parser.feed({"tokens": [7], "tokens_predicted": 3, "completion_probabilities": probs})


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_cache_report_is_read_before_the_last_token(kind):
    """A reader that closes the stream at its last token (as the engine does) still gets the
    engine's cached-token report: it is read before that token is handed on."""
    cl = FakeCluster(kind, hash_logits(), ["a"])
    be = backend(cl)
    kv = be.new_kv("s")
    list(be.stream_answer(kv, PROMPT, SamplingParams(), 3, frozenset()))
    events = be.stream_answer(kv, PROMPT + [9, 9], SamplingParams(), 2, frozenset())
    next(events)
    next(events)
    events.close()  # at the last token
    assert kv.last.cached_tokens == len(PROMPT)
    be.close()


def test_a_replica_added_later_with_a_smaller_context_lowers_it():
    small = FakeCluster("vllm", hash_logits(), ["a"], max_context=300)
    big = FakeCluster("vllm", hash_logits(), ["b"], max_context=900)
    both = httpx.MockTransport(lambda r: (small if r.url.host == "a" else big).handle(r))
    be = RemoteBackend(make_adapter("vllm"), ["http://b"], 50, top_k=4, transport=both,
                       health_interval=None)
    assert be.max_context == 900
    be.add_replica("http://a")
    assert be.max_context == 300
    be.close()


def test_a_foreground_request_preempts_background_streams_without_priorities():
    """On an engine with no priority scheduling (llama.cpp), a foreground request in flight
    preempts a background stream at its next token, a new background stream gives way while
    one is in flight, and runs once none is; with priorities nothing is preempted."""
    from prepos.backends.base import Preempted

    cl = FakeCluster("llama.cpp", hash_logits(), ["a"])
    be = RemoteBackend(make_adapter("llama.cpp"), cl.urls, vocab_size=50, top_k=4,
                       transport=cl.transport, health_interval=None)
    bg_kv = be.new_kv("bg")
    with idle_work():
        bg = be.stream_answer(bg_kv, PROMPT, SamplingParams(), 20, frozenset())
        next(bg)
    fg = be.stream_answer(be.new_kv("fg"), PROMPT, SamplingParams(), 20, frozenset())
    next(fg)  # in flight
    with idle_work(), pytest.raises(Preempted):
        next(bg)
    late = be.stream_answer(be.new_kv("late"), PROMPT, SamplingParams(), 5, frozenset())
    with idle_work(), pytest.raises(Preempted):
        next(late)
    fg.close()  # no foreground request in flight any more
    with idle_work():
        again = be.stream_answer(bg_kv, PROMPT, SamplingParams(), 5, frozenset())
        assert len(list(again)) == 5
    be.close()

    ranked = backend(FakeCluster("vllm", hash_logits(), ["a"]))  # priority scheduling
    with idle_work():
        bg = ranked.stream_answer(ranked.new_kv("bg"), PROMPT, SamplingParams(), 6,
                                  frozenset())
        next(bg)
    fg = ranked.stream_answer(ranked.new_kv("fg"), PROMPT, SamplingParams(), 6, frozenset())
    next(fg)
    with idle_work():
        assert len(list(bg)) == 5
    fg.close()
    ranked.close()


def test_background_streams_give_way_on_a_ranked_engine_when_told():
    """`give_way`: on an engine with priority scheduling too, a foreground request in flight
    preempts a background stream at its next token (as on llama-server)."""
    from prepos.backends.base import Preempted

    be = backend(FakeCluster("vllm", hash_logits(), ["a"]), give_way=True)
    assert be.replicas[0].priority and not be.replicas[0].shares_steps
    with idle_work():
        bg = be.stream_answer(be.new_kv("bg"), PROMPT, SamplingParams(), 6, frozenset())
        next(bg)
    fg = be.stream_answer(be.new_kv("fg"), PROMPT, SamplingParams(), 6, frozenset())
    next(fg)
    with idle_work(), pytest.raises(Preempted):
        next(bg)
    fg.close()
    be.close()


def test_a_streamed_answer_is_admitted_like_a_batch():
    """An answer a remote engine streams runs no batch, but its room is made where a batch's
    is (`KVPool.admit`): other sessions' speculative cells dropped to what they keep, and a
    refusal where the engine's budget cannot hold it even so."""
    from prepos.errors import OverBudget
    from prepos.worker.kv import KVPool
    from prepos.worker.sequence import Forward

    cl = FakeCluster("llama.cpp", hash_logits(), ["a"])
    pool = KVPool(backend(cl), engine_cells=20)
    kept = {"A": 5}
    pool.keeps = (lambda sid: kept.get(sid, len(pool.find(sid))),)
    a = pool.get("A")
    list(a.stream(list(range(1, 11)), SamplingParams(), 3, frozenset()))
    assert len(a) == 12 and pool.used == 12
    b = pool.get("B")
    plan = pool.admit([Forward(b, list(range(20, 32)))], None, True)[0]
    assert plan == (0, 0, 12)
    assert len(a) == 5  # dropped to what it keeps: 5 + the 12 B's answer needs fit in 20
    assert len(list(b.stream(list(range(20, 32)), SamplingParams(), 2, frozenset()))) == 2
    assert pool.used == 5 + 13  # A cannot drop below 5, B's 13 are committed
    c = pool.get("C")
    refused = pool.admit([Forward(c, list(range(40, 50)))], None, True)[0]
    assert isinstance(refused, OverBudget)
    assert len(a) == 5 and len(c) == 0  # nothing changed
