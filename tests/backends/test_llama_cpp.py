"""The in-process llama.cpp back end, in both layouts of its KV cache (one pool, a stream per
sequence): crop, batched decode across sessions, the abort callback, and how far logits move
with the batch they ran in."""

import threading

import pytest
import torch

from prepos.backends import llama_cpp
from prepos.backends.base import Preempted, idle_work
from prepos.config import EngineConfig, GateConfig
from prepos.core import Request, SamplingParams
from prepos.engine import Engine
from prepos.engine.loading import exported_gguf
from prepos.errors import OverBudget, TooManySessions
from tests.support.helpers import greedy_agrees, query_entry
from tests.support.models import NO_LLAMA_CPP

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason=NO_LLAMA_CPP)

Q = "What is the trend?"
TOKENS = [(7 * i + 3) % 400 + 10 for i in range(90)]


@pytest.fixture(scope="module", params=llama_cpp.LAYOUTS)
def backend(model_dirs, request):
    """Each layout of the cache: one pool, or a stream of 4096 / 8 = 512 cells a sequence."""
    be = llama_cpp.LlamaCppBackend(exported_gguf(model_dirs["chatml"]), n_ctx=4096, threads=2,
                                   max_sequences=8, kv_layout=request.param)
    yield be
    be.close()


def test_crop_and_rerun_is_bitwise_identical(backend):
    kv = backend.new_kv()
    try:
        backend.extend(kv, [], TOKENS[:60])
        first = backend.extend(kv, TOKENS[:60], TOKENS[60:70])
        backend.crop(kv, 60)
        again = backend.extend(kv, TOKENS[:60], TOKENS[60:70])
        assert torch.equal(first, again)
    finally:
        backend.release(kv)


def test_a_greedy_step_gives_the_argmax_of_the_logits_it_does_not_copy(backend):
    """A step flagged greedy in a batch gives its token id, the first index of the largest
    of the logits the same batch gives unflagged (the crop and rerun are bitwise equal)."""
    kvs = [backend.new_kv() for _ in range(3)]
    try:
        prompts = [TOKENS[i * 9:i * 9 + 30 + i * 5] for i in range(3)]
        steps = [(kv, [], p) for kv, p in zip(kvs, prompts)]
        rows = backend.extend_batch(steps)
        for kv in kvs:
            backend.crop(kv, 0)
        got = backend.extend_batch(steps, None, [True, False, True])
        assert isinstance(got[0], int) and isinstance(got[2], int)
        assert got[0] == int(torch.argmax(rows[0])) and got[2] == int(torch.argmax(rows[2]))
        assert torch.equal(got[1], rows[1])
    finally:
        for kv in kvs:
            backend.release(kv)


def test_a_batch_of_sessions_matches_each_alone_within_the_tolerance(backend):
    """Each sequence of a batched decode sees only its own cache: its logits equal a decode
    of it alone to within the stated tolerance, and so does its argmax wherever the top-2
    gap exceeds it."""
    kvs = [backend.new_kv() for _ in range(4)]
    try:
        prompts = [TOKENS[i * 5:i * 5 + 40 + i * 7] for i in range(4)]
        alone = []
        for kv, p in zip(kvs, prompts):
            alone.append(backend.extend(kv, [], p))
            backend.crop(kv, 0)
        together = backend.extend_batch([(kv, [], p) for kv, p in zip(kvs, prompts)])
        for a, b in zip(alone, together):
            assert float((a - b).abs().max()) <= backend.logit_tolerance
            top2 = torch.topk(a, 2).values
            if float(top2[0] - top2[1]) > backend.logit_tolerance:
                assert int(a.argmax()) == int(b.argmax())
    finally:
        for kv in kvs:
            backend.release(kv)


def test_a_batch_in_any_order_with_gaps_between_its_sequences_matches_each_alone(backend):
    """Steps given out of sequence order, of unequal lengths, skipping held sequences (which
    the streams layout runs as several ubatches): each step's logits are those of it alone,
    returned in the order the steps were given."""
    kvs = [backend.new_kv() for _ in range(6)]
    try:
        for kv in kvs:
            backend.extend(kv, [], TOKENS[:30])
        picked = [kvs[4], kvs[0], kvs[2], kvs[5]]  # 1 and 3 stay out: gaps in the ids
        news = [TOKENS[30:31], TOKENS[40:47], TOKENS[50:51], TOKENS[60:63]]
        together = backend.extend_batch([(kv, TOKENS[:30], t) for kv, t in zip(picked, news)])
        for kv, t, got in zip(picked, news, together):
            backend.crop(kv, 30)
            alone = backend.extend(kv, TOKENS[:30], t)
            assert float((alone - got).abs().max()) <= backend.logit_tolerance
    finally:
        for kv in kvs:
            backend.release(kv)


def test_a_decode_batch_with_gaps_leaves_the_sequences_between_as_they_were(backend,
                                                                           monkeypatch):
    """One token each for sequences 0, 2, 4 and 6 (the streams layout fills the gaps between
    with throwaway rows so that the batch runs as one ubatch): each step's logits are those
    of it alone, and the sequences in the gaps (1 and 3 holding tokens, 5 empty) hold
    exactly what they held."""
    filled = []
    fillers = backend._fillers
    monkeypatch.setattr(backend, "_fillers", lambda rows: filled.append(fillers(rows))
                        or filled[-1])
    kvs = [backend.new_kv() for _ in range(7)]
    try:
        pasts = [TOKENS[:20 + k] for k in range(5)] + [[], TOKENS[:9]]
        for kv, past in zip(kvs, pasts):
            if past:
                backend.extend(kv, [], past)
        gap_before = backend.extend(kvs[1], pasts[1], [TOKENS[50]])
        backend.crop(kvs[1], len(pasts[1]))
        picked = [0, 2, 4, 6]
        together = backend.extend_batch([(kvs[k], pasts[k], [TOKENS[40 + k]]) for k in picked])
        if backend.kv_layout == "streams":
            assert sorted(r[0] for r in filled[-1]) == [1, 3, 5]
        for k, got in zip(picked, together):
            backend.crop(kvs[k], len(pasts[k]))
            alone = backend.extend(kvs[k], pasts[k], [TOKENS[40 + k]])
            assert float((alone - got).abs().max()) <= backend.logit_tolerance
        pos_max = llama_cpp._ll.llama_memory_seq_pos_max
        assert [pos_max(backend.mem, kvs[k].seq) for k in (1, 3, 5)] == [20, 22, -1]
        assert torch.equal(backend.extend(kvs[1], pasts[1], [TOKENS[50]]), gap_before)
    finally:
        for kv in kvs:
            backend.release(kv)


def test_sequences_are_handed_out_lowest_first(backend):
    """Sessions held together get neighbouring ids, which the streams layout batches as one."""
    a, b, c = backend.new_kv(), backend.new_kv(), backend.new_kv()
    backend.release(b)
    d = backend.new_kv()
    try:
        assert (a.seq, d.seq, c.seq) == (0, 1, 2)
    finally:
        for kv in (a, c, d):
            backend.release(kv)


def test_a_stream_caps_the_context_the_pool_does_not(backend):
    trained = int(llama_cpp._ll.llama_model_n_ctx_train(backend.model))
    assert backend.kv_cells == 4096
    stream = 512 if backend.kv_layout == "streams" else 4096
    assert backend.max_context == min(stream, trained) and trained > 512


def test_a_stream_too_small_to_hold_a_session_is_refused(model_dirs):
    with pytest.raises(ValueError, match="at least 256"):
        llama_cpp.LlamaCppBackend(exported_gguf(model_dirs["chatml"]), n_ctx=4096,
                                  max_sequences=32, kv_layout="streams")
    with pytest.raises(ValueError, match="kv_layout"):
        llama_cpp.LlamaCppBackend(exported_gguf(model_dirs["chatml"]), kv_layout="paged")


def test_on_streams_a_request_longer_than_its_stream_is_refused_clearly(model_dirs):
    cfg = EngineConfig(backend="llama.cpp", threads=2, kv_layout="streams", kv_cells=2048,
                       max_sequences=8, gate=GateConfig(tau=0.0, answers=()))
    with Engine.from_pretrained(model_dirs["chatml"], cfg) as eng:
        assert eng.max_context == 256
        sid = eng.create_session("streaming", system="You read market data.")
        with pytest.raises(OverBudget, match="256"):
            eng.query(sid, Q, Request(SamplingParams(max_tokens=400))).result(timeout=60)
        for i in range(40):  # the data window shifts within the stream
            eng.append(sid, f"AAPL {100 + i} {101 + i} {99 + 2 * i}")
        assert len(eng.session(sid).snap.tokens) <= 256
        assert len(eng.query(sid, Q, Request(SamplingParams(max_tokens=4)))
                   .result(timeout=60).tokens) >= 1


def test_context_length_extends_the_context_with_yarn(model_dirs):
    """Past the training context, the context is YaRN-scaled RoPE: a session may hold that
    many tokens, the resident cells hold one such session whatever --kv-cells says, and a
    session runs past the trained length; within it, the context is capped as asked."""
    gguf = exported_gguf(model_dirs["chatml"])
    plain = llama_cpp.LlamaCppBackend(gguf, n_ctx=512, threads=2, max_sequences=2)
    trained = int(llama_cpp._ll.llama_model_n_ctx_train(plain.model))
    plain.close()
    cfg = EngineConfig(backend="llama.cpp", threads=2, kv_cells=256, max_sequences=2,
                       context_length=2 * trained, gate=GateConfig(tau=0.0, answers=()))
    with Engine.from_pretrained(model_dirs["chatml"], cfg) as eng:
        assert eng.max_context == 2 * trained and eng.backend.kv_cells >= 2 * trained
        assert eng.config.budget.session_cells == 2 * trained  # one session: all of it
        sid = eng.create_session("streaming", system="You read market data.")
        line = "AAPL " + " ".join(str(100 + i % 50) for i in range(40))
        while len(eng.session(sid).snap.tokens) < trained + 64:
            eng.append(sid, line)
        res = eng.query(sid, Q, Request(SamplingParams(max_tokens=2))).result(timeout=120)
        assert res.prompt_tokens > trained and len(res.tokens) >= 1
    cut = EngineConfig(backend="llama.cpp", threads=2, kv_cells=1024, context_length=300,
                       gate=GateConfig(tau=0.0, answers=()))
    with Engine.from_pretrained(model_dirs["chatml"], cut) as eng:
        assert eng.max_context == 300


def test_crop_removes_the_positions_it_drops(backend):
    """After a crop the sequence attends to its kept prefix only: re-running the dropped
    positions gives a fresh run's logits (stale cells would change them)."""
    a, b = backend.new_kv(), backend.new_kv()
    try:
        backend.extend(a, [], TOKENS)
        backend.crop(a, 5)
        out = backend.extend(a, TOKENS[:5], TOKENS[40:45])
        ref = backend.extend(b, [], TOKENS[:5] + TOKENS[40:45])
        assert float((out - ref).abs().max()) <= backend.logit_tolerance
    finally:
        backend.release(a)
        backend.release(b)


def test_idle_forward_aborts_for_a_waiting_request_and_leaves_the_cache_as_it_was(backend):
    kv = backend.new_kv()
    try:
        backend.extend(kv, [], TOKENS[:20])
        with idle_work(True, should_yield=lambda: True), pytest.raises(Preempted):
            backend.extend(kv, TOKENS[:20], TOKENS[20:80])
        # the aborted chunk's cells were removed: the sequence holds its 20 positions only,
        # so extending from 20 gives what it gave before
        ref = backend.extend(kv, TOKENS[:20], TOKENS[20:30])
        backend.crop(kv, 20)
        assert torch.equal(ref, backend.extend(kv, TOKENS[:20], TOKENS[20:30]))
    finally:
        backend.release(kv)


def test_more_sessions_than_sequences_is_refused_not_evicted(backend):
    held = [backend.new_kv() for _ in range(backend.n_seq)]
    try:
        with pytest.raises(TooManySessions, match="at most"):
            backend.new_kv()
    finally:
        for kv in held:
            backend.release(kv)
    backend.release(backend.new_kv())  # released sequences are reused


def test_the_server_serves_more_sessions_than_the_back_end_holds(model_dirs):
    """A back end that holds 8 sessions' KV at once: the server admits its own limit of 20
    persistent sessions (429 after, nothing changed), answers a query on every one (their
    KV moving down a tier and back), and still answers stateless requests."""
    from fastapi.testclient import TestClient

    from prepos.server.http.app import create_app
    from prepos.server.http.limits import Limits
    from prepos.server.http.state import ServerConfig

    cfg = EngineConfig(backend="llama.cpp", max_sequences=8, threads=2,
                       gate=GateConfig(tau=0.0, answers=()))
    app = create_app(ServerConfig(model=model_dirs["chatml"], engine=cfg,
                                  limits=Limits(max_sessions=20)))
    with TestClient(app, base_url="http://localhost") as client:
        for _ in range(600):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.1)
        made = [client.post("/sessions", json={"kind": "streaming"}) for _ in range(21)]
        assert [r.status_code for r in made] == [201] * 20 + [429]
        assert made[-1].json()["error"]["code"] == "too_many_sessions"
        sids = [r.json()["id"] for r in made[:20]]
        for i, sid in enumerate(sids):
            assert client.post(f"/sessions/{sid}/append",
                               json={"data": f"ACME {i} {i + 1}"}).status_code == 200
        for sid in sids:
            r = client.post(f"/sessions/{sid}/query", json={"question": "Up?", "max_tokens": 2})
            assert r.status_code == 200, r.text
        tiers = [client.get(f"/sessions/{sid}").json()["kv"] for sid in sids]
        assert tiers.count("resident") <= 8 and set(tiers) <= {"resident", "ram", "disk"}
        assert len(client.get("/sessions").json()["data"]) == 20
        model = client.get("/v1/models").json()["data"][0]["id"]
        r = client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text


def test_concurrent_answers_are_batched_and_each_is_its_greedy_answer(model_dirs):
    """Six sessions answering at once share quanta (their steps run as one forward),
    and every token of every answer is the greedy choice of a cold forward of that session's
    own sequence (to within the back end's tolerance)."""
    cfg = EngineConfig(backend="llama.cpp", threads=2, preposition=False,
                       gate=GateConfig(tau=0.0, answers=()))
    with Engine.from_pretrained(model_dirs["chatml"], cfg) as eng:
        sids = []
        for i in range(6):
            sid = eng.create_session("streaming", system="You read market data.")
            eng.append(sid, f"AAPL {100 + i} {101 + i} {99 + 2 * i}")
            sids.append(sid)
        before = eng.scheduler.steps.total, eng.scheduler.steps.sequences
        gate = threading.Event()

        def blocker():  # holds the one model worker until every request is queued
            gate.wait(30)
            yield

        eng.scheduler.submit(blocker())
        streams = {sid: eng.query(sid, Q, Request(SamplingParams(max_tokens=8), fast_path="off"))
                   for sid in sids}
        gate.set()
        answers = {sid: st.result(timeout=60).tokens for sid, st in streams.items()}
        batches = eng.scheduler.steps.total - before[0]
        forwards = eng.scheduler.steps.sequences - before[1]
        assert forwards > batches  # some quanta ran several sessions' steps in one forward
        for sid in sids:
            seq = list(eng.session(sid).snap.tokens) + list(query_entry(eng, sid, Q))
            for tok in answers[sid]:
                assert greedy_agrees(eng, seq, tok), sid
                seq.append(tok)
