"""Prompt-lookup speculative decoding (`prepos.decode.lookup`): the proposer and the accept rule,
the back ends' logits at every position, and greedy answers with drafts equal to the same
answers without them (on llama.cpp, within its logit tolerance wherever they differ)."""

import pytest
import torch

from prepos.config import EngineConfig
from prepos.core import AnswerPath, Request, SamplingParams
from prepos.decode.lookup import Lookup, NgramIndex, accepted
from prepos.server.http.metrics import Metrics
from prepos.worker.sequence import Forward, KVSequence, run_forwards
from tests.support.helpers import cold_logits, greedy_agrees, tolerance

REPEAT = "the cat sat on the mat " * 3  # a context the tiny models continue by repeating
TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {}}}]
CALL = {"type": "function", "function": {"name": "get_price", "arguments": {"t": "AAPL"}}}


# -- the proposer and the accept rule ------------------------------------------------------
def test_proposes_what_followed_the_latest_occurrence_of_the_longest_ngram():
    idx = NgramIndex([1, 2, 3, 9, 8, 2, 3, 7, 5, 2, 3], max_ngram=3)
    # 3-gram (5, 2, 3) never occurred before; 2-gram (2, 3) last ended at index 7 -> 7, 5, 2
    assert idx.propose(3) == [7, 5, 2]
    idx = NgramIndex([4, 2, 3, 6, 1, 2, 3, 5, 4, 2, 3], max_ngram=3)
    # the 3-gram (4, 2, 3) occurred at the start: its follower wins over (2, 3)'s later one
    assert idx.propose(2) == [6, 1]


def test_no_match_and_no_room_propose_nothing():
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([1, 2, 1]).propose(0) == []
    assert NgramIndex([7]).propose(3) == []
    assert NgramIndex([]).propose(3) == []


def test_a_repeating_pattern_repeats_past_the_sequence_end():
    assert NgramIndex([1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]
    assert NgramIndex([5, 5]).propose(3) == [5, 5, 5]


def test_extend_makes_new_tokens_matchable():
    idx = NgramIndex([1, 2, 3], max_ngram=2)
    assert idx.propose(2) == []
    idx.extend([4, 2, 3])
    assert idx.propose(2) == [4, 2]
    idx.extend([9])  # (3, 9) is new, 9 never occurred: nothing
    assert idx.propose(2) == []


def test_min_ngram_leaves_shorter_matches_undrafted():
    idx = NgramIndex([1, 2, 9, 8, 2], max_ngram=3)
    assert idx.propose(2) == [9, 8]  # the 1-gram (2,) occurred before
    assert idx.propose(2, min_ngram=2) == []  # (8, 2) never did
    idx.extend([9])
    assert idx.propose(2, min_ngram=2) == [8, 2]  # (2, 9) did


def test_the_accept_rule_takes_the_longest_agreeing_prefix():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted([], [3]) == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Lookup(-1)
    with pytest.raises(ValueError):
        NgramIndex([1], max_ngram=0)
    for bad in ({"min_ngram": 0}, {"min_ngram": 4}, {"max_batch": 0}):
        with pytest.raises(ValueError):
            Lookup(4, **bad)


# -- the back ends: logits at every position ---------------------------------------------
def _call(eng, fn):
    got = {}

    def task():
        got["v"] = yield from fn()

    eng._call(task())
    return got["v"]


def test_every_position_s_logits_equal_cold_forwards(make_engine):
    eng = make_engine()
    assert eng.backend.verifies_drafts
    toks = tuple(eng.fmt.encode(REPEAT))
    kv = KVSequence(eng.backend)

    def run():
        yield Forward(kv, toks[:5])  # resident prefix, then the rest with every logit
        adv = yield Forward(kv, toks, logits_from=3)
        again = yield Forward(kv, toks, logits_from=len(toks) - 2)  # fully resident: re-run
        return adv, again

    try:
        adv, again = _call(eng, run)
    finally:
        kv.release()
    assert adv.logits.shape == (len(toks) - 3, eng.backend.vocab_size)
    assert again.logits.shape == (2, eng.backend.vocab_size)
    for i, row in enumerate(adv.logits):
        cold = cold_logits(eng, toks[:3 + i + 1])
        assert float((row - cold).abs().max()) <= tolerance(eng) * 4
    assert float((again.logits[-1] - adv.logits[-1]).abs().max()) <= tolerance(eng) * 4


def test_logits_from_needs_one_whole_forward(make_engine):
    eng = make_engine()
    kv = KVSequence(eng.backend)
    try:
        with pytest.raises(ValueError):
            Forward(kv, (1, 2, 3), max_tokens=1, logits_from=0).plan()
        with pytest.raises(ValueError):
            Forward(kv, (1, 2, 3), logits_from=3).plan()
        assert Forward(kv, (1, 2, 3), logits_from=1).plan() == (0, 0, 3)
    finally:
        kv.release()


def test_batched_step_mixes_all_logits_and_last_logits(make_engine):
    eng = make_engine()
    a, b = KVSequence(eng.backend), KVSequence(eng.backend)
    toks = tuple(eng.fmt.encode(REPEAT))
    try:
        def run():
            return (yield from _batch())

        def _batch():
            yield Forward(a, toks[:4])
            return run_forwards(eng.backend, [Forward(a, toks[:8], logits_from=3),
                                              Forward(b, toks[:6])])

        adv_a, adv_b = _call(eng, run)
    finally:
        a.release()
        b.release()
    assert adv_a.logits.shape == (5, eng.backend.vocab_size) and adv_b.logits.dim() == 1
    assert float((adv_b.logits - cold_logits(eng, toks[:6])).abs().max()) <= tolerance(eng) * 4


# -- answers: drafts change nothing but the number of forwards ------------------------------
def _engines(make_engine, k=4):
    """Without and with drafts; no pre-decoding, so an exact turn's answer decodes live."""
    return (make_engine(lookup_tokens=0, predecode_tokens=0),
            make_engine(lookup_tokens=k, predecode_tokens=0))


def _same_answer(eng, prefix, plain, spec):
    """`spec` equals `plain` token for token, or, on a back end whose logits move with the
    batch, first differs where both tokens are the cold greedy choice within the tolerance."""
    for i, (p, s) in enumerate(zip(plain, spec)):
        if p != s:
            ctx = tuple(prefix) + tuple(plain[:i])
            assert greedy_agrees(eng, ctx, p) and greedy_agrees(eng, ctx, s), (i, plain, spec)
            return
    assert len(plain) == len(spec), (plain, spec)


def _turn(eng, user, sampling):
    sid = eng.create_session("agentic", system="You repeat.")
    res = eng.turn(sid, user, Request(sampling)).result()
    return sid, res


def test_a_repeating_turn_equals_the_plain_decode_and_accepts_drafts(make_engine):
    plain_eng, spec_eng = _engines(make_engine)
    sampling = SamplingParams(max_tokens=40)
    _, plain = _turn(plain_eng, REPEAT, sampling)
    sid, spec = _turn(spec_eng, REPEAT, sampling)
    prompt = spec_eng.session(sid).snap.tokens[:spec.prompt_tokens]
    _same_answer(spec_eng, prompt, plain.tokens, spec.tokens)
    if plain.tokens == spec.tokens:
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    stats = spec_eng.metrics()["lookup"]
    assert stats["proposed"] > 0 and stats["accepted"] > 0
    # fewer forwards than tokens: each verifying forward gave 1 + accepted tokens
    assert stats["verify_steps"] < len(spec.tokens)
    assert plain_eng.metrics()["lookup"]["proposed"] == 0


def test_tool_result_fall_through_and_exact_turn_equal_the_plain_decode(make_engine):
    plain_eng, spec_eng = _engines(make_engine)
    sampling = SamplingParams(max_tokens=30)
    answers = {}
    for name, eng in (("plain", plain_eng), ("spec", spec_eng)):
        sid = eng.create_session("agentic", system="You call tools.", tools=TOOLS)
        eng.add_message(sid, "user", REPEAT)
        eng.add_message(sid, "assistant", "", tool_calls=[CALL])
        eng.wait_idle()
        fall = eng.tool_result(sid, "AAPL 187.3 AAPL 187.3", Request(sampling)).result()
        eng.wait_idle()
        eng.add_message(sid, "user", REPEAT)
        eng.wait_idle()
        exact = eng.turn(sid, None, Request(sampling)).result()
        answers[name] = (fall, exact, eng.session(sid).snap.tokens)
    (pf, pe, _), (sf, se, toks) = answers["plain"], answers["spec"]
    assert sf.path is AnswerPath.FALL and se.path is AnswerPath.FAST
    _same_answer(spec_eng, toks[:sf.prompt_tokens], pf.tokens, sf.tokens)
    if pf.tokens == sf.tokens:  # the same state: the exact turn's prompt is the same too
        _same_answer(spec_eng, toks[:se.prompt_tokens], pe.tokens, se.tokens)
    assert spec_eng.metrics()["lookup"]["proposed"] > 0


def test_max_tokens_and_stop_cut_where_the_plain_decode_does(make_engine):
    plain_eng, spec_eng = _engines(make_engine)
    _, full = _turn(plain_eng, REPEAT, SamplingParams(max_tokens=40))
    assert len(full.tokens) == 40  # the tiny model repeats on to the cap
    for n in (1, 2, 3, 6, 11):
        _, a = _turn(plain_eng, REPEAT, SamplingParams(max_tokens=n))
        sid, b = _turn(spec_eng, REPEAT, SamplingParams(max_tokens=n))
        assert a.tokens == full.tokens[:n] and a.finish_reason == "length"
        _same_answer(spec_eng, spec_eng.session(sid).snap.tokens[:b.prompt_tokens],
                     a.tokens, b.tokens)
        assert len(b.tokens) == n and b.finish_reason == "length"
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a string from the answer's middle
    assert stop.strip()
    sampling = SamplingParams(max_tokens=40, stop=(stop,))
    _, a = _turn(plain_eng, REPEAT, sampling)
    sid, b = _turn(spec_eng, REPEAT, sampling)
    assert a.finish_reason == "stop" and a.text == text[:text.find(stop)]
    _same_answer(spec_eng, spec_eng.session(sid).snap.tokens[:b.prompt_tokens], a.tokens,
                 b.tokens)
    if b.tokens == a.tokens:
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason)


def test_streamed_tokens_arrive_one_by_one_and_add_up_to_the_answer(make_engine):
    eng = make_engine(lookup_tokens=4)
    sid = eng.create_session("agentic", system="You repeat.")
    stream = eng.turn(sid, REPEAT, Request(SamplingParams(max_tokens=30)))
    events = list(stream)
    res = stream.result()
    assert "".join(ev.text for ev in events) == res.text
    assert [ev.token for ev in events if ev.token >= 0] == res.tokens


def test_sampled_and_shaped_answers_draft_nothing(make_engine):
    eng = make_engine(lookup_tokens=4)
    _turn(eng, REPEAT, SamplingParams(max_tokens=12, temperature=0.8, seed=3))
    _turn(eng, REPEAT, SamplingParams(max_tokens=12, frequency_penalty=0.5))
    assert eng.metrics()["lookup"]["proposed"] == 0


def test_logprobs_of_drafted_tokens_are_their_positions_own(make_engine):
    eng = make_engine(lookup_tokens=4)
    s2 = eng.create_session("agentic", system="You repeat.")
    res = eng.turn(s2, REPEAT, Request(SamplingParams(max_tokens=40), logprobs=True)).result()
    assert eng.metrics()["lookup"]["accepted"] > 0
    prompt = eng.session(s2).snap.tokens[:res.prompt_tokens]
    assert len(res.logprobs) == len(res.tokens)
    for i, (tok, lp) in enumerate(zip(res.tokens, res.logprobs)):
        cold = torch.log_softmax(cold_logits(eng, tuple(prompt) + tuple(res.tokens[:i])), -1)
        assert abs(float(cold[tok]) - lp) <= tolerance(eng) * 4


def test_lookup_is_off_by_zero_and_on_by_default(make_engine):
    eng = make_engine(lookup_tokens=0)
    _turn(eng, REPEAT, SamplingParams(max_tokens=20))
    assert eng.metrics()["lookup"] == {"proposed": 0, "accepted": 0, "verify_steps": 0}
    eng = make_engine()
    _turn(eng, REPEAT, SamplingParams(max_tokens=60))
    assert EngineConfig().lookup_tokens > 0 and eng.metrics()["lookup"]["proposed"] > 0


def test_the_draft_width_grows_while_drafts_are_accepted_whole(make_engine):
    eng = make_engine(lookup_tokens=8)
    _, res = _turn(eng, REPEAT, SamplingParams(max_tokens=60))
    stats = eng.metrics()["lookup"]
    # the tiny model ends in a repeating token: there the widths go 2, 4, 8, so the verifying
    # forwards drafted more than Lookup.START tokens on average
    assert stats["accepted"] > 0
    assert stats["proposed"] > Lookup.START * stats["verify_steps"]
    assert len(res.tokens) == 60


def test_no_drafts_while_more_answers_run_than_max_batch(make_engine):
    eng = make_engine(lookup_tokens=8, lookup_max_batch=2)
    assert eng.lookup.running() == 0  # the scheduler's count of foreground tasks
    eng.lookup.running = lambda: 3  # as if two more answers shared each forward
    _turn(eng, REPEAT, SamplingParams(max_tokens=30))
    assert eng.metrics()["lookup"]["proposed"] == 0


def test_draft_counters_reach_prometheus(make_engine):
    eng = make_engine(lookup_tokens=4)
    _turn(eng, REPEAT, SamplingParams(max_tokens=40))
    stats = eng.metrics()["lookup"]
    metrics = Metrics()
    metrics.engine = eng
    text = metrics.render().decode()
    assert f'prepos:lookup_drafts_total{{outcome="proposed"}} {float(stats["proposed"])}' in text
    assert f'prepos:lookup_drafts_total{{outcome="accepted"}} {float(stats["accepted"])}' in text
    assert f'prepos:lookup_verify_steps_total {float(stats["verify_steps"])}' in text


# -- drafts from the session's earlier answers ----------------------------------------------
def test_a_prior_corpus_drafts_and_the_sequence_s_own_occurrence_wins():
    idx = NgramIndex([7, 1, 2], max_ngram=2, prior=[1, 2, 5, 6])
    assert idx.tokens == [7, 1, 2] and len(idx) == 3
    assert idx.propose(2) == [5, 6]  # (1, 2) occurred in the prior only
    idx.extend([9, 1, 2])
    assert idx.tokens == [7, 1, 2, 9, 1, 2]
    assert idx.propose(2) == [9, 1]  # and now in the sequence too, later
    assert NgramIndex([3], prior=[3, 4]).propose(1) == []  # the sequence's last n are its own


def test_a_session_keeps_the_last_tokens_of_its_answers(make_engine):
    eng = make_engine(lookup_said_tokens=5)
    s = eng.session(eng.create_session("streaming"))
    s.remember_answer([1, 2, 3])
    s.remember_answer([])
    s.remember_answer([4, 5, 6])
    assert s.said() == (2, 3, 4, 5, 6)
    off = make_engine(lookup_said_tokens=0)
    s = off.session(off.create_session("streaming"))
    s.remember_answer([1, 2])
    assert s.said() == ()


def _query_twice(eng, question, sampling):
    """A streaming session asked `question` twice on the same data: the answer never enters
    the context, so only the first answer, kept by the session, can draft the second."""
    sid = eng.create_session("streaming", system="You read sensor values.")
    eng.append(sid, "t=1 temp=21.5 hum=40 t=2 temp=21.7 hum=41")
    first = eng.query(sid, question, Request(sampling)).result()
    before = dict(eng.metrics()["lookup"])
    second = eng.query(sid, question, Request(sampling)).result()
    after = eng.metrics()["lookup"]
    return sid, first, second, {k: after[k] - before[k] for k in after}


def test_a_query_asked_again_drafts_from_the_earlier_answer(make_engine):
    sampling = SamplingParams(max_tokens=32)
    question = "What changed between the two readings?"
    said_eng = make_engine(lookup_tokens=8)
    ctx_eng = make_engine(lookup_tokens=8, lookup_said_tokens=0)
    plain_eng = make_engine(lookup_tokens=0)
    sid, first, second, said = _query_twice(said_eng, question, sampling)
    _, _, ctx_second, ctx = _query_twice(ctx_eng, question, sampling)
    _, _, plain, _ = _query_twice(plain_eng, question, sampling)
    prompt = tuple(said_eng.session(sid).snap.tokens)  # + the query's entry: same on each
    assert len(plain.tokens) > 8, plain.tokens
    for spec in (second, ctx_second):
        _same_answer(said_eng, prompt, plain.tokens, spec.tokens)
    assert said_eng.session(sid).said()[-len(second.tokens):] == tuple(second.tokens)
    # the same state, the same greedy answer (where logits move with the batch, it may not)
    assert second.tokens == first.tokens or tolerance(said_eng) > 0
    if second.tokens == first.tokens:  # the same answer again: most of it drafted
        decoded = len(second.tokens) - 1  # the entry's forward gave the first token
        # forwards = decoded - accepted (each verifying forward gives 1 + its accepted)
        assert said["accepted"] >= decoded // 2, (said, ctx, second.tokens)
        assert said["accepted"] > ctx["accepted"] or ctx["accepted"] >= decoded // 2
