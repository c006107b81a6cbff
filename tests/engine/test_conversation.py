"""Conversation matching for the OpenAI `session_id` extension: client messages in the
session's form, where they extend a session's history, and the rules checked before any
commit."""

from __future__ import annotations

import pytest

from prepos.chat.conversation import (
    ConversationError,
    check_order,
    extends,
    pending_calls,
    resume,
    same,
    session_messages,
)
from prepos.chat.format import normalize_tool_call, without_ids
from prepos.server.http.errors import status_of
from prepos.server.http.request_bodies import ChatMessage


def test_conversation_matching():
    held = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]
    sent = session_messages([ChatMessage(role="system", content="s"),
                      ChatMessage(role="user", content=[{"type": "text", "text": "u"}]),
                      ChatMessage(role="assistant", content=" a\n", tool_calls=[
                          {"id": "c1", "type": "function",
                           "function": {"name": "f", "arguments": "{\"x\": 1}"}}]),
                      ChatMessage(role="tool", content="42", tool_call_id="c1")])
    # the ids that pair calls with results are kept, and compared and rendered without
    assert extends(held, sent) == 3
    assert sent[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert sent[2]["tool_calls"][0]["id"] == "c1" and without_ids(sent[2]) == {
        "role": "assistant", "content": " a\n", "tool_calls": held[2]["tool_calls"]}
    assert not same({"role": "user", "content": " u"}, {"role": "user", "content": "u"})
    assert extends(held, sent[:2]) == -1
    # a system message after the first is the template's to allow or refuse, not session_messages'
    assert session_messages([ChatMessage(role="user", content="u"),
                      ChatMessage(role="system", content="s")])[1]["role"] == "system"
    with pytest.raises(ConversationError) as err:
        session_messages([ChatMessage(role="robot", content="u")])
    assert err.value.param == "messages[0].role"


def test_resume_finds_the_delta_or_the_version_to_roll_back_to():
    held = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    sent = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "v"}]
    r = resume("s-1", 2, held, sent)  # the session's system prompt is implied
    assert r.rollback_to is None and r.delta == sent[1:] and len(r.held) == 2
    other = [{"role": "user", "content": "w"}]
    with pytest.raises(ConversationError) as err:
        resume("s-1", 2, held, other)
    assert err.value.code == "conversation_diverged" and err.value.param == "messages[1]"
    kept = {1: held[:1], 2: held}
    r = resume("s-1", 2, held, other, lambda: kept)
    assert r.rollback_to == 1 and r.delta == [{"role": "user", "content": "w"}]


def test_order_rules_before_any_commit():
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]}
    check_order([call], [{"role": "tool", "content": "42"}], 1)
    with pytest.raises(ConversationError) as err:
        check_order([call], [{"role": "user", "content": "u"}], 1)
    assert (err.value.code, status_of(err.value)) == ("tool_result_awaited", 409)
    with pytest.raises(ConversationError) as err:
        check_order([], [{"role": "tool", "content": "42"}], 0)
    assert err.value.code == "no_tool_result_awaited"
    with pytest.raises(ConversationError) as err:  # an assistant message would orphan it
        check_order([call], [{"role": "assistant", "content": "a"}], 1)
    assert (err.value.code, status_of(err.value), err.value.param) == ("tool_result_awaited", 409,
                                                                   "messages[1]")


def test_what_a_conversation_may_end_with():
    sys_msg = {"role": "system", "content": "s"}
    user = {"role": "user", "content": "u"}
    answer = {"role": "assistant", "content": "The tr"}
    check_order([], [sys_msg], 0)  # a system message alone: the model answers it
    check_order([], [sys_msg, user, answer], 0, continue_final=True)  # continued
    for msgs, kw in (([sys_msg, user, answer], {}), ([sys_msg, sys_msg], {})):
        with pytest.raises(ConversationError) as err:
            check_order([], msgs, 0, **kw)
        assert err.value.param == "messages" and "end with" in str(err.value)


def _calls(*ids):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": f"f{k}", "arguments": {}}}
        if i else {"type": "function", "function": {"name": f"f{k}", "arguments": {}}}
        for k, i in enumerate(ids)]}


def _result(cid=None):
    m = {"role": "tool", "content": "r"}
    return {**m, "tool_call_id": cid} if cid else m


def test_several_calls_await_one_result_each_matched_by_id_or_in_order():
    user = {"role": "user", "content": "u"}
    two = _calls("a", "b")
    assert pending_calls([user, two]) == ["a", "b"]
    assert pending_calls([user, two, _result("b")]) == ["a"]  # by id
    assert pending_calls([user, two, _result()]) == ["b"]  # no id: the next in order
    assert pending_calls([user, two, _result("b"), _result("a")]) == []
    assert pending_calls([user, _calls(None, None), _result("x")]) == [None]  # ids unknown
    # every result in a row, in any order, by id or without one
    for results in ([_result("a"), _result("b")], [_result("b"), _result("a")],
                    [_result(), _result()], [_result("b"), _result()]):
        check_order([user, two], results, 2)
    check_order([], [user, two, _result("a"), _result("b")], 0)  # stateless: the whole of it
    # a result naming a call that is not awaiting one: 400 naming it
    for results in ([_result("c")], [_result("a"), _result("a")]):
        with pytest.raises(ConversationError) as err:
            check_order([user, two], results, 2)
        assert (err.value.code, status_of(err.value)) == ("unknown_tool_call_id", 400)
        assert "'a'" in str(err.value) or "'c'" in str(err.value)
        assert err.value.param.endswith(".tool_call_id")
    # a third result for two calls; a user message or an end while one still awaits
    with pytest.raises(ConversationError) as err:
        check_order([user, two], [_result(), _result(), _result()], 2)
    assert (err.value.code, err.value.param) == ("no_tool_result_awaited", "messages[4]")
    with pytest.raises(ConversationError) as err:
        check_order([user, two], [_result("a"), user], 2)
    assert (err.value.code, status_of(err.value)) == ("tool_result_awaited", 409)
    assert "'b'" in str(err.value)
    with pytest.raises(ConversationError) as err:
        check_order([user, two], [_result("a")], 2)
    assert (err.value.code, status_of(err.value)) == ("tool_result_awaited", 409)


def test_call_arguments_that_are_not_a_json_object_are_held_as_sent():
    for text in ('{"city": "Par', "not json", "[1, 2]", '"x"'):
        c = normalize_tool_call({"function": {"name": "f", "arguments": text}})
        assert c["function"]["arguments"] == text
    assert normalize_tool_call({"function": {"name": "f", "arguments": '{"a": 1}'}})[
        "function"]["arguments"] == {"a": 1}
    assert normalize_tool_call({"function": {"name": "f", "arguments": ""}})[
        "function"]["arguments"] == {}
    for bad in (7, [1], None, True):
        with pytest.raises(Exception, match="must be a string"):
            normalize_tool_call({"function": {"name": "f", "arguments": bad}})


def test_a_conversation_may_end_with_system_messages_after_a_user_message():
    """Claude Code sends its environment as a system message after the user's: answered as
    the user's turn; after an assistant message (continued) or alone it is as before."""
    user, sys_msg = {"role": "user", "content": "u"}, {"role": "system", "content": "env"}
    check_order([], [user, sys_msg, dict(sys_msg)], 0)
    with pytest.raises(ConversationError):
        check_order([], [user, {"role": "assistant", "content": "a"}, sys_msg], 0,
                    continue_final=True)
