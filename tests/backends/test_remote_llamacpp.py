"""Integration: the remote back end against two real `llama-server` replicas on loopback,
serving the bundled kind of model converted to GGUF by `prepos.backends.gguf_export`.

Skipped, with the reason, only when no llama-server binary is found
(`scripts/build_llama_server.sh` builds and caches one; `.ci/run` calls it)."""

from __future__ import annotations

import threading

import pytest
import torch

from prepos.backends.llama_server import LlamaServer, find_binary
from prepos.backends.remote import RemoteBackend
from prepos.chat.format import ChatFormat
from prepos.config import EngineConfig, GateConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.engine import Engine
from tests.support.helpers import race_appends_with_queries

pytestmark = pytest.mark.slow

BINARY = find_binary()
if BINARY is None:
    pytest.skip("no llama-server binary: run scripts/build_llama_server.sh (or set "
                "PREPOS_LLAMA_SERVER)", allow_module_level=True)

NEAR_TIE = 1e-3  # logprob gap below which float noise may flip a greedy choice


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prepos.backends.gguf_export import export
    from prepos.lab.tiny import build_model

    root = tmp_path_factory.mktemp("remote-model")
    d = build_model(root / "model", "chatml", "llama", seed=1)
    gguf = export(d, root / "model.gguf")
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True).eval()
    return d, gguf, tok, lm


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    _, gguf, _, _ = model
    logs = tmp_path_factory.mktemp("llama-logs")
    reps = [LlamaServer(BINARY, gguf, slots=4, log=logs / f"r{i}.log") for i in range(2)]
    try:
        for r in reps:
            r.start()
        yield reps
    finally:
        for r in reps:
            r.stop()


@pytest.fixture
def live(servers):
    """Every replica up (a test may have killed one)."""
    for r in servers:
        if r.proc is None or r.proc.poll() is not None:
            r.start()
    return servers


def make_engine(model, urls, **cfg) -> Engine:
    d, _, tok, _ = model
    be = RemoteBackend.from_urls("llama.cpp", urls, len(tok), 2048, top_k=8,
                                 health_interval=0.2)
    config = EngineConfig(gate=GateConfig(tau=0.0, answers=()), workers=4, idle_workers=2,
                          **cfg)
    return Engine(be, ChatFormat(tok), config)


def assert_slots_idle(url: str) -> None:
    """No slot of the llama-server at `url` is processing a task (waited for up to 60 s)."""
    import httpx

    for _ in range(600):
        slots = httpx.get(url + "/slots", timeout=10).json()
        if not any(x.get("is_processing") for x in slots):
            return
        threading.Event().wait(0.1)
    assert not any(x.get("is_processing") for x in slots)


@torch.inference_mode()
def torch_logprobs(lm, tokens) -> torch.Tensor:
    return torch.log_softmax(lm(input_ids=torch.tensor([list(tokens)])).logits[0, -1], -1)


def assert_greedy_equal(lm, prompt, answer_tokens):
    """The remote greedy answer equals the in-process one, token by token, unless the
    in-process choice is a near-tie (float noise between llama.cpp and PyTorch)."""
    seq = list(prompt)
    for tok in answer_tokens:
        lp = torch_logprobs(lm, seq)
        top2 = torch.topk(lp, 2)
        if int(top2.indices[0]) != tok:
            gap = float(top2.values[0] - top2.values[1])
            assert gap < NEAR_TIE and tok == int(top2.indices[1]), (seq, tok, gap)
            return  # past a near-tie the continuations may legitimately differ
        seq.append(tok)


def test_gguf_distribution_matches_torch(model, live):
    """The converted model: llama-server's top-k logprobs equal PyTorch's (q/k permutation
    and every tensor name right), at several prompt lengths."""
    _, _, tok, lm = model
    be = RemoteBackend.from_urls("llama.cpp", [live[0].url], len(tok), 2048, top_k=8,
                                 health_interval=None)
    try:
        ids = tok("AAPL 101.2 101.5 101.9 102.4 What is the trend? up down flat",
                  add_special_tokens=False)["input_ids"]
        kv = be.new_kv()
        for n in (1, 5, len(ids)):
            d = be.extend(kv, [], ids[:n])
            want = torch.topk(torch_logprobs(lm, ids[:n]), 8)
            assert d.top_ids[0] == int(want.indices[0])
            assert d.top_logprobs == pytest.approx(tuple(want.values.tolist()), abs=2e-3)
    finally:
        be.close()


def test_paths_and_greedy_equality(model, live):
    _, _, _, lm = model
    eng = make_engine(model, [r.url for r in live])
    try:
        sid = eng.create_session("streaming", system="You are a market analyst.",
                                 standing=["Is it rising?"])
        eng.append(sid, "AAPL 101.2 101.5 101.9 102.4")
        eng.wait_idle()
        sp = SamplingParams(max_tokens=8)
        s = eng.session(sid)
        fast = eng.query(sid, "Is it rising?", Request(sp)).result()
        assert fast.path == AnswerPath.FAST
        fall = eng.query(sid, "What is the trend?", Request(sp)).result()
        assert fall.path == AnswerPath.FALL and fall.cached_prompt_tokens > 0
        cold_sid = eng.create_session("streaming", system="You are a market analyst.",
                                      preposition=False)
        cold = eng.query(cold_sid, "What is the trend?", Request(sp)).result()
        assert cold.path == AnswerPath.COLD
        for res, question in ((fast, "Is it rising?"), (fall, "What is the trend?")):
            snap = s.at(res.version)
            ent = s.entries(snap)
            prompt = snap.tokens + tuple(eng.fmt.encode(eng.fmt.frame(ent.user, question)))
            assert_greedy_equal(lm, prompt, res.tokens)
        m = eng.backend.metrics()["replicas"]
        assert sum(r["requests"] for r in m.values()) > 0
        assert sum(r["cached_tokens"] for r in m.values()) > 0  # the prefix cache was used
    finally:
        eng.close()
        eng.backend.close()


def test_pinning_spreads_sessions_and_keeps_each_on_one_replica(model, live):
    eng = make_engine(model, [r.url for r in live])
    try:
        sids: list[str] = []
        homes: dict[str, str] = {}
        while len(set(homes.values())) < 2 and len(sids) < 64:  # session ids are random
            batch = [eng.create_session("streaming", system=f"Session {i}.") for i in range(8)]
            for sid in batch:
                eng.append(sid, "AAPL 101.2 101.5")
            eng.wait_idle()
            sids += batch
            homes = {sid: eng.pool.get(sid).handle.replica.url for sid in sids}
        assert len(set(homes.values())) == 2  # both replicas serve sessions
        for sid in sids:
            eng.query(sid, "What is the trend?", Request(SamplingParams(max_tokens=2))).result()
            eng.append(sid, "MSFT 310.0")
        eng.wait_idle()
        assert {sid: eng.pool.get(sid).handle.replica.url for sid in sids} == homes
        assert eng.backend.moves == 0
    finally:
        eng.close()
        eng.backend.close()


def test_failover_when_a_replica_is_killed_then_rejoin(model, live):
    _, _, _, lm = model
    eng = make_engine(model, [r.url for r in live])
    try:
        victim = live[0]
        sids: list[str] = []
        on_victim: list[str] = []
        while not on_victim and len(sids) < 64:  # session ids are random: place some there
            batch = [eng.create_session("streaming", system=f"Analyst {i}.") for i in range(6)]
            for sid in batch:
                eng.append(sid, "AAPL 101.2 101.5 101.9")
            eng.wait_idle()
            sids += batch
            on_victim = [sid for sid in sids
                         if eng.pool.get(sid).handle.replica.url == victim.url]
        assert on_victim, "rendezvous put none of 66 sessions on the first replica"
        victim.kill()
        sp = SamplingParams(max_tokens=4)
        for sid in on_victim:  # no request lost: each moves and rebuilds from the full prompt
            res = eng.query(sid, "What is the trend?", Request(sp)).result()
            s = eng.session(sid)
            snap = s.at(res.version)
            prompt = snap.tokens + tuple(eng.fmt.encode(eng.fmt.frame(s.entries(snap).user,
                                                                      "What is the trend?")))
            assert_greedy_equal(lm, prompt, res.tokens)
            assert eng.pool.get(sid).handle.replica.url == live[1].url
        m = eng.backend.metrics()
        assert m["replicas"][victim.url]["failures"] >= 1
        assert not m["replicas"][victim.url]["healthy"]
        assert m["moves"] >= len(on_victim)
        victim.start()  # back on the same port: the health checker lets it rejoin
        for _ in range(100):
            if eng.backend.metrics()["replicas"][victim.url]["healthy"]:
                break
            threading.Event().wait(0.1)
        assert eng.backend.metrics()["replicas"][victim.url]["healthy"]
        res = eng.query(on_victim[0], "Is it rising?", Request(sp)).result()
        assert res.tokens
        assert eng.pool.get(on_victim[0]).handle.replica.url == victim.url
    finally:
        eng.close()
        eng.backend.close()


def test_never_stale_under_concurrent_updates(model, live):
    """Appends race with standing-query requests (fast path when the ready record is
    current, fall-through otherwise): every answer equals the greedy answer of the exact
    version it reports."""
    _, _, _, lm = model
    eng = make_engine(model, [r.url for r in live])
    q = "Is it rising?"
    try:
        sid = eng.create_session("streaming", system="You are a market analyst.",
                                 standing=[q])
        eng.append(sid, "AAPL 101.2")
        eng.wait_idle()
        results = race_appends_with_queries(eng, sid, q, 12, SamplingParams(max_tokens=2))
        eng.wait_idle()
        results.append(eng.query(sid, q, Request(SamplingParams(max_tokens=2))).result())
        assert results[-1].path == AnswerPath.FAST
        s = eng.session(sid)
        for res in results:
            snap = s.at(res.version)
            prompt = snap.tokens + tuple(eng.fmt.encode(eng.fmt.frame(s.entries(snap).user, q)))
            assert_greedy_equal(lm, prompt, res.tokens)
        assert len(results) >= 3
    finally:
        eng.close()
        eng.backend.close()


def test_streamed_answers_on_llama_server(model, live):
    """One streamed request per answer: greedy equal to PyTorch, a stop id that is not an
    end-of-generation token ends it (prepos closes the stream), the engine's own seeded
    sampling is reproducible, closing the stream aborts the task, and the context length
    is the server's per-slot n_ctx."""

    _, _, tok, lm = model
    be = RemoteBackend.from_urls("llama.cpp", [live[0].url], len(tok), top_k=8,
                                 health_interval=None)
    rep = be.replicas[0]
    try:
        assert be.max_context == 2048 and rep.n_slots == 4  # from /props
        prompt = tok("MSFT 310.0 309.2 308.7 Is it falling?",
                     add_special_tokens=False)["input_ids"]
        got = list(be.stream_answer(be.new_kv("s"), prompt, SamplingParams(top_logprobs=3),
                                    10, frozenset()))
        toks = [t for t, _ in got]
        assert len(toks) == 10 and rep.counters["streams"] == 1
        assert rep.counters["requests"] == 0
        assert_greedy_equal(lm, prompt, toks)
        want = torch.topk(torch_logprobs(lm, prompt), 3)
        assert got[0][1].top_logprobs[:3] == pytest.approx(tuple(want.values.tolist()),
                                                           abs=2e-3)
        if toks[3] not in toks[:3]:
            stopped = [t for t, _ in be.stream_answer(be.new_kv("t"), prompt,
                                                      SamplingParams(), 10,
                                                      frozenset({toks[3]}))]
            assert stopped == toks[:4]
        hot = SamplingParams(temperature=1.0, seed=7)
        a, b = ([t for t, _ in be.stream_answer(be.new_kv(f"h{i}"), prompt, hot, 10,
                                                frozenset())] for i in range(2))
        assert a == b and len(a) == 10
        events = be.stream_answer(be.new_kv("long"), prompt, SamplingParams(),
                                  2000 - len(prompt), frozenset())
        next(events)
        events.close()
        assert_slots_idle(live[0].url)
        # the aborted task stopped far short of its 2000 tokens (the server's log says)
        import re

        lengths = re.findall(r"stop processing: n_tokens = (\d+)", live[0].log.read_text())
        assert lengths and int(lengths[-1]) < 1000
    finally:
        be.close()


def test_whole_answers_are_predecoded_on_llama_server(model, live):
    """A standing query's whole answer is pre-decoded at idle as one streamed request to the
    engine and served at once, equal to the greedy answer; with appends racing queries (each
    append cancels a pre-decode in flight), every answer still equals the greedy answer of the
    version it reports, and the engine is left with no request running."""

    _, _, _, lm = model
    eng = make_engine(model, [r.url for r in live], predecode_tokens=12, predecode_min_hit=0.0)
    q = "Is it rising?"
    try:
        sid = eng.create_session("streaming", system="You are a market analyst.",
                                 standing=[q])
        eng.append(sid, "AAPL 101.2 101.5 101.9 102.4")
        eng.wait_idle()
        s = eng.session(sid)

        def greedy_equal(res):
            snap = s.at(res.version)
            prompt = snap.tokens + tuple(eng.fmt.encode(eng.fmt.frame(s.entries(snap).user, q)))
            assert_greedy_equal(lm, prompt, res.tokens)

        whole = eng.query(sid, q, Request(SamplingParams(max_tokens=12))).result()
        assert whole.path == AnswerPath.FAST and whole.predecoded == len(whole.tokens) > 1
        greedy_equal(whole)
        longer = eng.query(sid, q, Request(SamplingParams(max_tokens=20))).result()
        assert longer.predecoded == len(whole.tokens) and longer.tokens[:12] == whole.tokens
        greedy_equal(longer)  # the rest decoded live, the pre-decoded tokens in its prompt
        results = race_appends_with_queries(eng, sid, q, 10, SamplingParams(max_tokens=12))
        for res in results:
            greedy_equal(res)
        assert eng.prepositioner.counters.predecoded_tokens > 0
        eng.wait_idle()
        for r in live:
            assert_slots_idle(r.url)
    finally:
        eng.close()
        eng.backend.close()
