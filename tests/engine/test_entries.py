"""Session sequences built incrementally equal the chat template's rendering of the whole
conversation; entries are derived from the template."""

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepos.chat.format import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string"}}}}}]
TEXT = st.text(alphabet=string.ascii_letters + string.digits + " .,:;?!-+()\n", min_size=1,
               max_size=40).filter(lambda t: t.strip())


def rendered_tokens(eng, sid, extra=(), generation_prompt=False):
    s = eng.session(sid)
    text = eng.fmt.render([*s.snap.messages, *extra], s.spec.tools, generation_prompt)
    return tuple(eng.fmt.encode(text))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(TEXT, min_size=1, max_size=6), question=TEXT)
def test_streaming_sequence_and_query_entry_match_the_template(make_engine, family, data,
                                                              question):
    eng = make_engine(family, preposition=False)
    sid = eng.create_session("streaming", system="You are a market analyst.")
    for d in data:
        eng.append(sid, d, wait=False)
    s = eng.session(sid)
    assert s.snap.tokens == rendered_tokens(eng, sid)
    entry = eng.fmt.encode(eng.fmt.frame(s.entries().user, question))
    full = rendered_tokens(eng, sid, [{"role": "user", "content": question}], True)
    assert s.snap.tokens + tuple(entry) == full
    header = s.entries().header
    assert s.snap.tokens + header == rendered_tokens(eng, sid, (), True)


def test_agentic_tool_flow_matches_the_template(make_engine, family):
    eng = make_engine(family, preposition=False)
    sid = eng.create_session("agentic", system="You call tools.", tools=TOOLS)
    eng.add_message(sid, "user", "What is the weather in Paris?", wait=False)
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}
    eng.add_message(sid, "assistant", "", tool_calls=[call], wait=False)
    s = eng.session(sid)
    assert s.awaiting_tool
    env = s.entries().tool
    payload = "sunny, 21 C"
    realized = tuple(eng.fmt.encode(eng.fmt.frame(env, payload)))
    full = rendered_tokens(eng, sid, [{"role": "tool", "content": payload}], True)
    assert s.snap.tokens + realized == full
    prefix = tuple(eng.fmt.encode(env.prefix))
    assert realized[: len(prefix)] == prefix  # the envelope is pre-payable
    eng.add_message(sid, "tool", payload, wait=False)
    assert s.snap.tokens == rendered_tokens(eng, sid)
    assert not s.awaiting_tool


def test_end_of_turn_comes_from_the_template(make_engine, family):
    eng = make_engine(family)
    eot = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}[family]
    assert eng.fmt.tokenizer.convert_tokens_to_ids(eot) in eng.fmt.end_of_turn


def test_parse_tool_calls_both_markups():
    content, calls = parse_tool_calls(
        'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content == "Let me look."
    assert calls == [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    content, calls = parse_tool_calls('{"name": "g", "parameters": {"y": "z"}}')
    assert content == "" and calls[0]["function"] == {"name": "g", "arguments": {"y": "z"}}
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    assert parse_tool_calls('{"name": 3}') == ('{"name": 3}', [])


def test_bundled_model_sequences_match_its_template():
    from prepos.config import EngineConfig
    from prepos.engine import Engine
    from prepos.paths import DEFAULT_MODEL

    eng = Engine.from_pretrained(DEFAULT_MODEL, EngineConfig(preposition=False))
    try:
        sid = eng.create_session("streaming", system="Live price feed. Answer in one word.")
        for msg in ("ACME 41 43 44 47 48 50", "ACME 51 52 52 54 55 57"):
            eng.append(sid, msg, wait=False)
        s = eng.session(sid)
        assert s.snap.tokens == rendered_tokens(eng, sid)
        q = "Which way is ACME moving?"
        full = rendered_tokens(eng, sid, [{"role": "user", "content": q}], True)
        assert s.snap.tokens + tuple(eng.fmt.encode(eng.fmt.frame(s.entries().user, q))) == full
        a = eng.create_session("agentic", system="You call tools.", tools=TOOLS)
        eng.add_message(a, "user", "Weather in Paris?", wait=False)
        call = {"type": "function", "function": {"name": "get_weather",
                                                 "arguments": {"city": "Paris"}}}
        eng.add_message(a, "assistant", "", tool_calls=[call], wait=False)
        eng.add_message(a, "tool", "sunny", wait=False)
        assert eng.session(a).snap.tokens == rendered_tokens(eng, a)
    finally:
        eng.close()
