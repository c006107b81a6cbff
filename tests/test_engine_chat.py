"""`Engine.plan_chat` and `Engine.chat`: a conversation sent whole to an agentic session, the
delta committed and answered, a diverging or oversized one refused with nothing changed, or
rolled back when asked."""

import pytest

from helpers import state
from prepos.chat.conversation import ConversationError
from prepos.core import Request, SamplingParams

SYSTEM = "You are a market analyst. Answer with one word."
ONE = Request(SamplingParams(max_tokens=1))


def test_the_delta_is_committed_and_answered(make_engine):
    eng = make_engine("chatml")
    sid = eng.create_session("agentic", system=SYSTEM)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Trend?"}]
    plan = eng.plan_chat(sid, msgs)
    assert plan.delta == (msgs[1],) and plan.rollback_to is None and not plan.commits_nothing
    eng.chat(plan, ONE).result()
    held = eng.snapshot(sid).messages
    assert held[:2] == tuple(msgs) and held[2]["role"] == "assistant"
    # the conversation as the session now has it, plus two messages: one committed, one asked
    more = [*held, {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "up"},
            {"role": "user", "content": "Sure?"}]
    eng.chat(eng.plan_chat(sid, more), ONE).result()
    assert eng.snapshot(sid).messages[:len(more)] == tuple(more)
    # a user message committed alone, then the session's own conversation: nothing to commit,
    # the turn after it is the exact entry
    eng.add_message(sid, "user", "Why?")
    plan = eng.plan_chat(sid, list(eng.snapshot(sid).messages))
    assert plan.commits_nothing and plan.delta == ()


def test_a_diverging_conversation_is_refused_or_rolled_back(make_engine):
    eng = make_engine("chatml")
    sid = eng.create_session("agentic", system=SYSTEM)
    first = [{"role": "user", "content": "Trend?"}]
    eng.chat(eng.plan_chat(sid, first), ONE).result()
    v = eng.snapshot(sid).version
    edited = [{"role": "user", "content": "Trend, please?"}]
    before = state(eng, sid)
    with pytest.raises(ConversationError) as err:
        eng.plan_chat(sid, edited)
    assert err.value.code == "conversation_diverged" and state(eng, sid) == before
    plan = eng.plan_chat(sid, edited, rollback=True)
    assert plan.rollback_to is not None and plan.rollback_to < v
    eng.chat(plan, ONE).result()
    assert eng.snapshot(sid).messages[1] == {"role": "user", "content": "Trend, please?"}


def test_a_delta_that_does_not_fit_changes_nothing(make_engine):
    eng = make_engine("chatml")
    sid = eng.create_session("agentic", system=SYSTEM)
    long = " ".join(["word"] * (eng.max_context + 10))
    msgs = [{"role": "user", "content": "Trend?"}, {"role": "assistant", "content": long},
            {"role": "user", "content": "Sure?"}]
    before = state(eng, sid)
    with pytest.raises(ConversationError) as err:
        eng.chat(eng.plan_chat(sid, msgs), ONE)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert state(eng, sid) == before
