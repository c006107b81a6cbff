"""Pre-decoded answers (prepos.engine.predecode): decoded at idle after an exact entry's
record, served whole (or as far as decoded, the rest live) to a greedy request, gone with
their version, within the cell budget; and over HTTP (JSON, SSE pushes, OpenAI)."""


import httpx
import pytest

from prepos.core import AnswerPath, Request, SamplingParams
from prepos.engine.session import TURN, query_key
from tests.support.helpers import during_idle_forwards, greedy_agrees, query_entry
from tests.support.server_harness import ServerProc, listen_events, sse_events

Q = "What is the trend?"
KEY = query_key(Q)


def settled(make_engine, answer_tokens=8, **kw):
    eng = make_engine(**{"predecode_min_hit": 0.0, **kw})  # pre-decode every version
    sid = eng.create_session("streaming", system="Market.", standing=[Q],
                             answer_tokens=answer_tokens)
    eng.append(sid, "AAPL 101.5 up 3")
    assert eng.wait_idle(300)
    return eng, sid


def agrees(eng, seq, tokens):
    seq = list(seq)
    for tok in tokens:
        assert greedy_agrees(eng, seq, tok)
        seq.append(tok)


def greedy(n, **kw):
    return Request(SamplingParams(max_tokens=n, **kw))


def test_the_whole_answer_is_served_at_once_and_is_the_greedy_answer(make_engine):
    eng, sid = settled(make_engine)
    s = eng.session(sid)
    answer = eng.predecoding(sid, KEY)[1]
    assert answer.done and answer.finish in ("length", "end")
    n = len(answer.tokens) - (answer.finish == "end")
    res = eng.query(sid, Q, greedy(8)).result()
    assert res.path is AnswerPath.FAST and res.predecoded == len(res.tokens) == n
    assert res.tokens == list(answer.tokens[:n])
    agrees(eng, s.snap.tokens + query_entry(eng, sid, Q), res.tokens)
    cold = eng.query(sid, Q, Request(SamplingParams(max_tokens=8), fast_path="off")).result()
    assert cold.predecoded == 0 and cold.path is not AnswerPath.FAST
    if eng.backend.name == "torch":  # bitwise: the same tokens as a cold decode
        assert cold.tokens == res.tokens
    c = eng.prepositioner.counters
    assert c.predecoded_tokens == len(answer.tokens) and c.predecode_served == len(answer.tokens)


def test_a_prefix_is_served_and_more_decodes_live_from_where_it_stopped(make_engine):
    eng, sid = settled(make_engine, answer_tokens=6)
    s = eng.session(sid)
    seq = s.snap.tokens + query_entry(eng, sid, Q)
    short = eng.query(sid, Q, greedy(3)).result()
    assert short.predecoded == 3 and short.finish_reason == "length"
    long = eng.query(sid, Q, greedy(14)).result()
    assert long.path is AnswerPath.FAST and long.predecoded == 6
    assert long.tokens[:3] == short.tokens
    agrees(eng, seq, long.tokens)
    assert KEY in s.current()[1].taken  # a request decoded on: its pre-decode stops


def test_logprobs_and_stop_sequences_are_the_requests_own(make_engine):
    eng, sid = settled(make_engine)
    ref = eng.query(sid, Q, Request(SamplingParams(max_tokens=8, top_logprobs=3),
                                    logprobs=True, fast_path="off")).result()
    res = eng.query(sid, Q, Request(SamplingParams(max_tokens=8, top_logprobs=3),
                                    logprobs=True)).result()
    assert res.predecoded == len(res.tokens) and len(res.logprobs) == len(res.tokens)
    tol = eng.backend.logit_tolerance
    for a, b in zip(res.logprobs, ref.logprobs):
        assert abs(a - b) <= tol
    assert [t for t, _ in res.top_logprobs[0]] == [t for t, _ in ref.top_logprobs[0]]
    text = res.text
    if len(text) > 2:  # a stop sequence inside the answer ends it there, as decoded live
        stop = text[len(text) // 2:len(text) // 2 + 2]
        cut = eng.query(sid, Q, greedy(8, stop=(stop,))).result()
        live = eng.query(sid, Q, Request(SamplingParams(max_tokens=8, stop=(stop,)),
                                         fast_path="off")).result()
        assert cut.text == live.text == text[:text.find(stop)] and cut.finish_reason == "stop"


def test_other_sampling_gets_the_first_token_from_the_record_only(make_engine):
    eng, sid = settled(make_engine)
    res = eng.query(sid, Q, greedy(4, temperature=0.8, seed=3)).result()
    assert res.path is AnswerPath.FAST and res.predecoded == 0 and len(res.tokens) >= 1


def test_a_mutation_drops_the_answer_with_its_record_and_counts_its_waste(make_engine):
    eng, sid = settled(make_engine)
    old = eng.session(sid).current()[1]
    n = len(old.answer(KEY).tokens)
    eng.query(sid, Q, greedy(2)).result()
    eng.append(sid, "MSFT 99", wait=False)
    assert old.answer(KEY) is None and not old.valid
    assert eng.prepositioner.counters.predecode_wasted == n - 2
    assert eng.wait_idle(300)
    snap, ready = eng.session(sid).current()
    assert ready.version == snap.version and ready.answer(KEY) is not None


def test_a_predecode_whose_session_moved_on_is_discarded(make_engine):
    eng, sid = settled(make_engine, answer_tokens=12)
    seen = []

    def mutate_mid_predecode():  # on the worker, as an idle forward starts
        s = eng.session(sid)
        ready = s.current()[1]
        if not seen and ready.answer(KEY) is not None and not ready.answer(KEY).done:
            seen.append(ready)
            eng.append(sid, "NVDA 7", wait=False)

    stop = during_idle_forwards(eng, mutate_mid_predecode)
    try:
        eng.append(sid, "AAPL 102")
        assert eng.wait_idle(300)
    finally:
        stop()
    assert seen and seen[0].answer(KEY) is None
    assert len(seen[0].answers[KEY].tokens) < 12  # it stopped part way
    snap, ready = eng.session(sid).current()
    answer = ready.answer(KEY)
    assert ready.version == snap.version and answer.done
    agrees(eng, snap.tokens + ready.records[KEY].entry, answer.tokens)
    assert eng.prepositioner.counters.predecode_wasted > 0


def test_an_agentic_turn_is_served_whole_and_committed(make_engine):
    eng = make_engine(predecode_tokens=7, predecode_min_hit=0.0)
    sid = eng.create_session("agentic", system="Tools.")
    eng.add_message(sid, "user", "What now?")
    assert eng.wait_idle(300)
    s = eng.session(sid)
    seq = s.snap.tokens + s.entries().header
    version = s.version
    res = eng.turn(sid, None, greedy(7)).result()
    assert res.path is AnswerPath.FAST and res.predecoded == len(res.tokens) > 0
    agrees(eng, seq, res.tokens)
    assert s.version == version + 1 and s.snap.messages[-1]["role"] == "assistant"
    assert eng.prepositioner.counters.predecode_wasted == 0


def test_a_predecode_stays_within_the_session_budget(make_engine):
    eng = make_engine(predecode_min_hit=0.0)
    sid = eng.create_session("streaming", system="Market.", standing=[Q], budget_cells=50,
                             answer_tokens=64)  # the entry ends at 43: room for 8 tokens
    eng.append(sid, "up 3")
    assert eng.wait_idle(300)
    ready = eng.session(sid).current()[1]
    answer, rec = ready.answer(KEY), ready.records[KEY]
    assert answer.finish in ("room", "end") and rec.p + len(answer.tokens) - 1 <= 50
    assert len(eng.pool.get(sid).tokens) <= 50


def test_the_policy_pre_decodes_only_where_requests_come(make_engine):
    """h(rho) = rho / (1 + rho) against predecode_min_hit (0.2), rho the session's exact
    requests per update: updates nobody asks about turn it off, requests turn it back on."""
    eng = make_engine(predecode_min_hit=0.2)
    sid = eng.create_session("streaming", system="Market.", standing=[Q], answer_tokens=5)
    s = eng.session(sid)
    for i in range(7):
        eng.append(sid, f"AAPL {100 + i}")
        assert eng.wait_idle(300)
    rate = eng.prepositioner.predecoder.rate
    assert rate.rho(s, KEY) < 0.25 and eng.predecoding(sid, KEY) == (None, None)
    assert eng.query(sid, Q, greedy(5)).result().predecoded == 0  # the record alone
    for _ in range(3):
        eng.query(sid, Q, greedy(1)).result()
    eng.append(sid, "AAPL 120")
    assert eng.wait_idle(300)
    assert rate.rho(s, KEY) > 0.25 and eng.predecoding(sid, KEY)[1] is not None
    assert eng.query(sid, Q, greedy(5)).result().predecoded > 0


def test_off_and_budgets(make_engine):
    eng = make_engine(predecode_tokens=0)
    sid = eng.create_session("streaming", system="Market.", standing=[Q])
    eng.append(sid, "up 3")
    assert eng.wait_idle(300)
    assert eng.predecoding(sid, KEY) == (None, None)
    assert eng.query(sid, Q, greedy(4)).result().predecoded == 0
    eng2 = make_engine(predecode_min_hit=0.0)
    a = eng2.create_session("agentic", answer_tokens=1)  # the record holds one token
    assert eng2.predecoding(a, TURN)[0] is None


# -- over HTTP --------------------------------------------------------------------------
def settle(c, sid):
    """Until the current version's pre-position and pre-decode are done."""
    for _ in range(20):
        info = c.get(f"/sessions/{sid}", params={"wait_ready": 30}).json()
        if info["ready"]["done"] and info["ready"]["version"] == info["version"]:
            return
    raise TimeoutError(f"session {sid} did not settle")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-predecode"),
                    "--predecode-tokens", "6", "--predecode-min-hit", "0") as srv:
        yield srv


def test_http_json_sse_and_openai_routes_serve_it(server, model):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/sessions", json={"kind": "streaming", "standing_queries": [Q],
                                      "answer_max_tokens": 5})
        assert r.status_code == 201 and r.json()["answer_max_tokens"] == 5
        sid = r.json()["id"]
        c.post(f"/sessions/{sid}/append", json={"data": "AAPL 101"}).raise_for_status()
        settle(c, sid)
        r = c.post(f"/sessions/{sid}/query", json={"question": Q, "max_tokens": 5})
        body = r.json()
        assert r.headers["x-prepos-path"] == "fast" and body["predecoded"] == len(body["tokens"])
        r = c.post(f"/sessions/{sid}/query", json={"question": Q, "max_tokens": 5,
                                                   "stream": True})
        events = sse_events(r.text)
        assert r.headers["x-prepos-path"] == "fast" and events[-1][0] == "result"
        assert events[-1][1]["predecoded"] == body["predecoded"]
        assert events[-1][1]["tokens"] == body["tokens"]
        # the OpenAI route on an agentic session: the next turn, pre-decoded (6 tokens)
        a = c.post("/sessions", json={"kind": "agentic"}).json()["id"]
        c.post(f"/sessions/{a}/messages", json={"role": "user", "content": "Hi"})
        settle(c, a)
        r = c.post("/v1/chat/completions", json={
            "model": model, "session_id": a, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        ext = r.json()["prepos"]
        assert ext["path"] == "fast" and ext["predecoded"] == r.json()["usage"][
            "completion_tokens"] > 0
        r = c.post("/sessions", json={"kind": "streaming", "answer_max_tokens": -1})
        assert r.status_code == 400 and "answer_max_tokens" in r.text


def test_sse_pushes_the_whole_standing_answer_once_pre_decoded(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/sessions", json={"kind": "streaming", "standing_queries": [Q],
                                      "push_max_tokens": 6})
        sid = r.json()["id"]
        assert r.json()["answer_max_tokens"] == 6
        events, _ = listen_events(server.url, sid)
        assert events.get(timeout=30)[0] == "hello"
        version = c.post(f"/sessions/{sid}/append", json={"data": "AAPL 102"}).json()["version"]
        while True:
            name, data = events.get(timeout=60)
            if name == "answer" and data["version"] == version:
                break
        assert data["path"] == "fast" and data["predecoded"] == len(data["tokens"]) > 0
        asked = c.post(f"/sessions/{sid}/query", json={"question": Q, "max_tokens": 6}).json()
        assert asked["tokens"] == data["tokens"]
        metrics = c.get("/metrics").text
        assert "prepos:prepositions_predecoded_tokens" in metrics
        assert "prepos:prepositions_predecode_served" in metrics
        c.delete(f"/sessions/{sid}")
