"""The remote back end against in-process stand-ins for the engines (see remote_fakes.py):
pinning, failover, rejoin, slot affinity, counters, background work, and the Engine's three
paths on top of it, whose greedy answers must equal the in-process back end's."""

from __future__ import annotations

import threading

import pytest
import torch

from prepos.backends.base import idle_work as background_work
from prepos.backends.remote import (
    Abandoned,
    BackendUnavailable,
    RemoteBackend,
    RemoteError,
    make_adapter,
)
from prepos.config import EngineConfig, GateConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.engine import Engine
from prepos.worker.sequence import KVSequence
from tests.support.remote_fakes import FakeCluster, hash_logits, torch_logits

KINDS = ["llama.cpp", "vllm", "sglang"]


def backend(cluster: FakeCluster, **kw) -> RemoteBackend:
    kw.setdefault("health_interval", None)
    return RemoteBackend(make_adapter(cluster.kind, background_priority=5), cluster.urls,
                         vocab_size=50, max_context=512, top_k=4, transport=cluster.transport,
                         **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_extend_returns_the_fresh_topk_and_reads_cached_tokens(kind):
    fn = hash_logits()
    cl = FakeCluster(kind, fn, ["a"])
    be = backend(cl)
    kv = KVSequence(be)
    step = kv.advance([1, 2, 3, 4])
    want = torch.topk(torch.log_softmax(fn([1, 2, 3, 4]), -1), 4)
    assert step.logits.logits is None and step.logits.top_ids == tuple(want.indices.tolist())
    assert step.logits.top_logprobs == pytest.approx(tuple(want.values.tolist()), abs=1e-5)
    kv.advance([1, 2, 3, 4, 5, 6])  # a growing prompt: the engine's cache holds the prefix
    assert kv.handle.last.cached_tokens == 4
    kv.crop(2)  # free: nothing is sent
    assert len(cl.replicas["a"].requests) == 2
    m = be.metrics()["replicas"]["http://a"]
    assert m["requests"] == 2 and m["cached_tokens"] == 4 and m["failures"] == 0
    be.close()


def test_rendezvous_pinning_is_stable_when_a_replica_is_added():
    cl = FakeCluster("vllm", hash_logits(), ["a", "b", "c", "d"])
    be = RemoteBackend(make_adapter("vllm"), cl.urls[:3], 50, 512, health_interval=None,
                       transport=cl.transport)
    keys = [f"s{i}" for i in range(400)]
    before = {k: be.replica_for(k).url for k in keys}
    assert len(set(before.values())) == 3
    be.add_replica(cl.urls[3])
    after = {k: be.replica_for(k).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "http://d" for k in moved)  # only to the new replica
    assert 0.15 < len(moved) / len(keys) < 0.35  # about a quarter, not a reshuffle
    be.close()


@pytest.mark.parametrize("kind", KINDS)
def test_failover_rebuilds_elsewhere_and_rejoin_moves_back(kind):
    fn = hash_logits()
    cl = FakeCluster(kind, fn, ["a", "b"])
    be = backend(cl)
    kv = KVSequence(be)
    home = be.replica_for(kv.handle.key)
    kv.advance([1, 2, 3])
    home_host = home.url.removeprefix("http://")
    other = "b" if home_host == "a" else "a"
    cl.replicas[home_host].up = False  # killed: the next request fails over, full prompt
    step = kv.advance([1, 2, 3, 4])
    assert step.logits.top_ids[0] == int(torch.argmax(fn([1, 2, 3, 4])))
    assert cl.replicas[other].requests[-1].get("prompt",
                                               cl.replicas[other].requests[-1].get("input_ids"))\
        == [1, 2, 3, 4]
    assert kv.handle.replica.url == f"http://{other}" and be.moves == 1
    m = be.metrics()["replicas"]
    assert m[home.url]["failures"] == 1 and not m[home.url]["healthy"]
    cl.replicas[home_host].up = True  # back: a health round lets it rejoin
    assert be.check_health()[home.url] is True
    kv.advance([1, 2, 3, 4, 5])
    assert kv.handle.replica is home and be.metrics()["replicas"][home.url]["rejoins"] == 1
    be.close()


def test_all_replicas_down_raises_and_a_4xx_is_not_a_replica_failure():
    cl = FakeCluster("llama.cpp", hash_logits(), ["a", "b"])
    be = backend(cl)
    kv = be.new_kv()
    for r in cl.replicas.values():
        r.up = False
    with pytest.raises(BackendUnavailable):
        be.extend(kv, [], [1, 2])
    for r in cl.replicas.values():
        r.up = True
    be.check_health()
    with pytest.raises(RemoteError):
        be.extend(kv, [], list(range(600)))  # over max_context: refused before sending
    be.close()


def test_health_thread_notices_down_and_up():
    cl = FakeCluster("sglang", hash_logits(), ["a", "b"])
    be = backend(cl, health_interval=0.02)
    cl.replicas["a"].up = False
    ev = threading.Event()
    for _ in range(200):
        if not be.metrics()["replicas"]["http://a"]["healthy"]:
            break
        ev.wait(0.01)
    assert not be.metrics()["replicas"]["http://a"]["healthy"]
    assert be.replica_for("x").url == "http://b"
    cl.replicas["a"].up = True
    for _ in range(200):
        if be.metrics()["replicas"]["http://a"]["healthy"]:
            break
        ev.wait(0.01)
    assert be.metrics()["replicas"]["http://a"]["healthy"]
    be.close()


def test_llamacpp_slot_affinity_is_lru_per_replica():
    cl = FakeCluster("llama.cpp", hash_logits(), ["a"], slots=2)
    be = backend(cl)
    k1, k2, k3 = be.new_kv("s1"), be.new_kv("s2"), be.new_kv("s3")
    slot = lambda: cl.replicas["a"].requests[-1]["id_slot"]  # noqa: E731
    be.extend(k1, [], [1])
    s1 = slot()
    be.extend(k2, [], [2])
    s2 = slot()
    assert s1 != s2
    be.extend(k1, [1], [3])
    assert slot() == s1  # kept
    be.extend(k3, [], [4])
    assert slot() == s2  # took the least recently used session's slot
    be.close()


def test_background_priority_cancel_and_abort():
    cl = FakeCluster("sglang", hash_logits(), ["a"])
    be = backend(cl)
    kv = be.new_kv("s")
    with background_work():
        be.extend(kv, [], [1, 2])
    assert cl.replicas["a"].requests[-1]["priority"] == 5
    be.extend(kv, [], [1, 2, 3])
    assert "priority" not in cl.replicas["a"].requests[-1]
    be.cancel(kv)  # nothing in flight: nothing to abandon, later requests unaffected
    with background_work():
        be.extend(kv, [], [1, 2, 3, 4])
    assert be.metrics()["replicas"]["http://a"]["background"] == 2

    # cancel while a request is in flight: aborted at the engine, answer discarded
    inner = cl.handle

    def handle(request):
        if request.url.path == "/generate":
            be.cancel(kv)  # from "another thread", while the request is in flight
        return inner(request)

    cl.transport.handler = handle
    with background_work(), pytest.raises(Abandoned):
        be.extend(kv, [], [1, 2, 3, 4, 5])
    assert cl.replicas["a"].aborts and cl.replicas["a"].aborts[-1].startswith("prepos-s-")
    assert be.metrics()["replicas"]["http://a"]["healthy"]  # not the replica's fault
    cl.transport.handler = inner
    with background_work():
        be.extend(kv, [], [1, 2, 3, 4, 5])  # the next request is not affected

    # a foreground request is never cancelled: a mutation cancels the session's idle work
    # (a pre-position that gave way to this request is not done), not the request
    aborts = len(cl.replicas["a"].aborts)
    cl.transport.handler = handle
    assert be.extend(kv, [], [1, 2, 3, 4, 5, 6]) is not None
    assert len(cl.replicas["a"].aborts) == aborts
    be.close()


# -- the Engine on a remote back end --------------------------------------------------------
@pytest.fixture(scope="module")
def torch_model(model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dirs["chatml"]),
                                                local_files_only=True).eval()


def remote_engine_on(cluster: FakeCluster, model_dir, **cfg) -> Engine:
    from transformers import AutoTokenizer

    from prepos.chat.format import ChatFormat

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    be = RemoteBackend(make_adapter(cluster.kind), cluster.urls, len(tok), 2048, top_k=8,
                       health_interval=None, transport=cluster.transport)
    config = EngineConfig(gate=GateConfig(tau=0.0, answers=()), workers=2, idle_workers=1,
                          **cfg)
    return Engine(be, ChatFormat(tok), config)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_paths_and_greedy_equality(kind, model_dirs, make_engine, torch_model):
    cl = FakeCluster(kind, torch_logits(torch_model), ["a", "b"])
    remote = remote_engine_on(cl, model_dirs["chatml"])
    local = make_engine("chatml")
    try:
        answers = {}
        for name, eng in (("remote", remote), ("local", local)):
            sid = eng.create_session("streaming", system="You are a market analyst.",
                                     standing=["Is it rising?"])
            eng.append(sid, "AAPL 101.2 101.5 101.9")
            eng.wait_idle()
            sp = SamplingParams(max_tokens=6)
            fast = eng.query(sid, "Is it rising?", Request(sp)).result()
            fall = eng.query(sid, "What is the trend?", Request(sp)).result()
            eng.append(sid, "MSFT 310.0 309.2", wait=False)
            answers[name] = (fast, fall)
        (rf, rl), (lf, ll) = answers["remote"], answers["local"]
        assert rf.path == AnswerPath.FAST and rl.path == AnswerPath.FALL
        assert rf.tokens == lf.tokens and rl.tokens == ll.tokens
        # sampling is the engine's own over the full vocabulary, seeded: reproducible
        sid = remote.sessions.all()[0].id
        hot = SamplingParams(temperature=1.0, seed=3, max_tokens=5)
        a, b = (remote.query(sid, "Is it up?", Request(hot)).result() for _ in range(2))
        assert a.tokens == b.tokens and len(a.tokens) >= 1
    finally:
        remote.close()
        remote.backend.close()


def test_an_answer_without_logprobs_asks_the_engine_for_no_distributions(model_dirs,
                                                                            torch_model):
    """A streamed answer that keeps no logprobs asks llama-server for none (`n_probs` 0: the
    engine's top-k over the vocabulary each token is not paid); one that keeps them asks for
    them, and gets each token's; the tokens are the same greedy answer either way."""
    cl = FakeCluster("llama.cpp", torch_logits(torch_model), ["a"])
    eng = remote_engine_on(cl, model_dirs["chatml"], preposition=False)
    try:
        sid = eng.create_session("streaming", system="You are a market analyst.")
        eng.append(sid, "AAPL 101.2 101.5 101.9")
        plain = eng.query(sid, "What is the trend?", Request(SamplingParams(max_tokens=5)))
        plain = plain.result()
        asked = [r for r in cl.replicas["a"].requests if r.get("stream")]
        assert asked and asked[-1]["n_probs"] == 0
        kept = eng.query(sid, "What is the trend?",
                         Request(SamplingParams(max_tokens=5, top_logprobs=2), logprobs=True))
        kept = kept.result()
        asked = [r for r in cl.replicas["a"].requests if r.get("stream")]
        assert asked[-1]["n_probs"] >= 2
        assert kept.tokens == plain.tokens and len(kept.logprobs) == len(kept.tokens)
        assert all(len(top) == 2 for top in kept.top_logprobs)
    finally:
        eng.close()
        eng.backend.close()


def test_engine_cold_path_and_prefix_cache_on_remote(model_dirs, torch_model):
    cl = FakeCluster("llama.cpp", torch_logits(torch_model), ["a"])
    eng = remote_engine_on(cl, model_dirs["chatml"], preposition=False)
    try:
        sid = eng.create_session("streaming", system="You are a market analyst.")
        eng.append(sid, "AAPL 101.2 101.5 101.9")
        res = eng.query(sid, "What is the trend?", Request(SamplingParams(max_tokens=3))).result()
        assert res.path == AnswerPath.FALL or res.path == AnswerPath.COLD
        assert eng.backend.metrics()["replicas"]["http://a"]["cached_tokens"] > 0
    finally:
        eng.close()
        eng.backend.close()


def test_engine_marks_prepositions_as_background_work(model_dirs, torch_model):
    """With the scheduler's idle-work hook (base.idle_work), pre-positions reach the engine
    as background work, at its background priority."""
    import prepos.backends.base as base

    if not hasattr(base, "idle_work"):
        pytest.skip("the scheduler does not mark idle steps yet (base.idle_work missing)")
    cl = FakeCluster("vllm", torch_logits(torch_model), ["a"])
    eng = remote_engine_on(cl, model_dirs["chatml"])
    eng.backend.adapter.background_priority = 7
    try:
        sid = eng.create_session("streaming", system="You are a market analyst.",
                                 standing=["Is it rising?"])
        eng.append(sid, "AAPL 101.2 101.5")
        eng.wait_idle()
        assert eng.backend.metrics()["replicas"]["http://a"]["background"] > 0
        assert any(r.get("priority") == 7 for r in cl.replicas["a"].requests)
        eng.query(sid, "What is the trend?", Request(SamplingParams(max_tokens=1))).result()
        assert "priority" not in cl.replicas["a"].requests[-1]  # foreground
    finally:
        eng.close()
        eng.backend.close()
