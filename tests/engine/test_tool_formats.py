"""Tool calls by family: the family detected from the chat template, one parser per family
(well-formed calls, several calls, malformed markup kept as text), the streamed answer's
withholding of each family's opening marker, and prepos's fallback on a template that
renders no tools (tools in a system block, calls written as text the parser reads back;
through the server: rendered, never dropped); a call cut by max_tokens at every character,
in every family's markup and in a forced answer's, read as far as it was written
(`cut_calls`), and its arguments read leniently."""

from __future__ import annotations

import json
import time

import pytest
from starlette.testclient import TestClient

from prepos.chat import cut_calls as cc
from prepos.chat import tool_formats as tf
from prepos.chat.format import ChatFormat, normalize_tool_call
from prepos.lab.tiny import build_model, build_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = tf.call("get_weather", {"city": "Paris"})
EXPECTED = {"chatml": "hermes", "qwen": "hermes", "llama3": "llama3", "mistral": "mistral",
            "plain": "prepos"}


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-formats")
    return {fam: ChatFormat(build_tokenizer(root / fam, fam)) for fam in EXPECTED}


def _generated_call(fmt: ChatFormat, calls: list[dict]) -> str:
    """A tool call as the model would emit it: the template's own rendering of it after the
    generation prompt, tokenized and detokenized as an answer is (special tokens dropped),
    up to the end of the turn."""
    msgs = [{"role": "user", "content": "weather?"}]
    base = fmt.render(msgs, [WEATHER], generation_prompt=True)
    text = fmt.render([*msgs, {"role": "assistant", "content": "", "tool_calls": calls}],
                      [WEATHER])
    assert text.startswith(base)
    ids = fmt.encode(text[len(base):])
    cut = next(i for i, t in enumerate(ids) if t in fmt.end_of_turn)
    return fmt.decode(ids[:cut])


def test_the_family_is_detected_from_the_template(formats):
    for fam, name in EXPECTED.items():
        assert formats[fam].tool_format.name == name, fam
    assert formats["chatml"].tool_support.complete
    plain = formats["plain"].tool_support
    assert not plain.tools and not plain.tool_calls and plain.rendered_call is None


def test_source_markers_decide_where_the_rendering_says_nothing():
    assert tf.detect("{{ '[TOOL_CALLS]' }}", "call: x").name == "mistral"
    assert tf.detect("... <tool_call> ...", "x").name == "hermes"
    assert tf.detect("<|python_tag|>", "x").name == "llama3"
    assert tf.detect("anything", '{"name": "f", "parameters": {}}').name == "llama3"
    assert tf.detect("anything", "f(x)").name == "prepos"
    assert tf.detect("<tool_call>", None).name == "prepos"  # renders no calls: the fallback


@pytest.mark.parametrize("fam", list(EXPECTED))
def test_each_family_reads_back_the_calls_its_template_writes(formats, fam):
    fmt = formats[fam]
    two = [CALL, tf.call("get_time", {"zone": "CET", "n": [1, 2]})]
    for calls in ([CALL], two):
        generated = _generated_call(fmt, calls)
        content, parsed = fmt.parse_tool_calls(generated)
        assert parsed == calls, (fam, generated)
        assert content == ""


def test_hermes_blocks_with_text_around_and_malformed_ones():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' \
           '\n</tool_call>'
    assert tf.parse_hermes(text) == ("Let me look.", [CALL])
    for bad in ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                '<tool_call>{"name": "get_weather"',  # cut off
                "no call here"):
        assert tf.parse_hermes(bad) == (bad, []), bad
    # one good block beside a malformed one: the call, and the malformed text kept
    mixed = '<tool_call>{"name": 1}</tool_call> and <tool_call>{"name": "get_weather", ' \
            '"arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    content, calls = tf.parse_hermes(mixed)
    assert calls == [CALL] and content == '<tool_call>{"name": 1}</tool_call> and'


def test_llama3_json_with_and_without_the_python_tag():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert tf.parse_llama3(one) == ("", [CALL])
    assert tf.parse_llama3("<|python_tag|>" + one) == ("", [CALL])
    assert tf.parse_llama3(f"{one}; {one}") == ("", [CALL, CALL])
    for bad in ('{"name": "get_weather", "parameters": {"city": "Par',
                '{"city": "Paris"}', f"{one} and then some words", "It is sunny."):
        assert tf.parse_llama3(bad) == (bad, []), bad


def test_mistral_array_named_form_and_malformed():
    arr = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert tf.parse_mistral("[TOOL_CALLS]" + arr) == ("", [CALL])
    assert tf.parse_mistral(arr) == ("", [CALL])  # the marker detokenized away
    assert tf.parse_mistral('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == \
        ("Sure.", [CALL])
    for bad in ("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {",
                "[TOOL_CALLS][]", '[TOOL_CALLS][{"name": "f"}] trailing', "[1, 2] is a list",
                "[TOOL_CALLS]get_weather{}"):
        assert tf.parse_mistral(bad) == (bad, []), bad


def test_prepos_format_takes_blocks_or_one_bare_json_call():
    assert tf.parse_prepos(tf.render_prepos_call(CALL)) == ("", [CALL])
    assert tf.parse_prepos('{"name": "get_weather", "arguments": {"city": "Paris"}}') == \
        ("", [CALL])
    assert tf.parse_prepos("plain answer") == ("plain answer", [])


@pytest.mark.parametrize("fmt,opening", [(tf.HERMES, "<tool_call>"), (tf.PREPOS, "<tool_call>"),
                                         (tf.LLAMA3, "<|python_tag|>"),
                                         (tf.MISTRAL, "[TOOL_CALLS]")])
def test_streaming_withholds_each_family_s_opening(fmt, opening):
    lead = "Let me check. "
    assert tf.safe_prefix(lead, fmt) == len(lead)
    assert tf.safe_prefix(lead + opening + "{", fmt) == len(lead)
    for k in range(1, len(opening)):  # a marker cut at the end of what has come so far
        assert tf.safe_prefix(lead + opening[:k], fmt) == len(lead), opening[:k]
    for start in fmt.starts:  # a message that opens like a bare call: all of it withheld
        assert tf.safe_prefix(f" {start}\"name\"", fmt) == 0
    if not fmt.starts:
        assert tf.safe_prefix('{"name": "f"', fmt) == len('{"name": "f"')


def test_fallback_writes_tools_and_calls_the_template_does_not(formats):
    fmt = formats["plain"]
    user = {"role": "user", "content": "weather in Paris?"}
    bare = fmt.render([user], None, generation_prompt=True)
    with_tools = fmt.render([user], [WEATHER], generation_prompt=True)
    assert "get_weather" not in bare and '"get_weather"' in with_tools
    assert with_tools.startswith("<|im_start|>system\nYou can call these tools")
    # a system message of the client's keeps its text, the block after it
    sys_msg = {"role": "system", "content": "Be brief."}
    text = fmt.render([sys_msg, user], [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools")
    # the assistant's call is written as the text the parser reads back
    called = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    generated = _generated_call(fmt, [CALL])
    assert fmt.parse_tool_calls(generated) == ("", [CALL])
    turn = fmt.render([user, called, {"role": "tool", "content": "sunny"}], [WEATHER], True)
    assert tf.render_prepos_call(CALL) in turn and "<|im_start|>tool\nsunny" in turn


@pytest.fixture(scope="module")
def plain_app(tmp_path_factory):
    from prepos.config import EngineConfig
    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    model = build_model(tmp_path_factory.mktemp("plain-model") / "plain-llama", "plain",
                        "llama", seed=1)
    app = create_app(ServerConfig(model=model, engine=EngineConfig(backend="torch",
                                                                   threads=2)))
    with TestClient(app, base_url="http://localhost") as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:  # the model loads in the background
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        yield client, app.state.prepos, model.name


def test_the_server_renders_tools_on_a_template_without_tool_support(plain_app):
    client, state, name = plain_app
    msgs = [{"role": "user", "content": "weather in Paris?"}]

    def prompt_tokens(**extra) -> int:
        r = client.post("/v1/chat/completions", json={"model": name, "messages": msgs,
                                                      "max_tokens": 1, "temperature": 0,
                                                      **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    fmt = state.engine.fmt
    with_tools = prompt_tokens(tools=[WEATHER])
    assert with_tools == len(fmt.encode(fmt.render(msgs, [WEATHER], generation_prompt=True)))
    assert with_tools > prompt_tokens() + len(fmt.encode(json.dumps(WEATHER)))  # not dropped
    # a conversation with a call and its result: the call is in what the model reads
    history = [*msgs, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.post("/v1/chat/completions", json={"model": name, "messages": history,
                                                  "tools": [WEATHER], "max_tokens": 1})
    assert r.status_code == 200, r.text
    norm = [msgs[0], {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny"}]
    want = fmt.encode(fmt.render(norm, [WEATHER], generation_prompt=True))
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    # tool_choice "required" opens the fallback's call markup and reads back the call
    r = client.post("/v1/chat/completions", json={"model": name, "messages": msgs,
                                                  "tools": [WEATHER], "max_tokens": 60,
                                                  "tool_choice": "required"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == \
        "get_weather"


def test_json_nested_deeper_than_the_decoder_recurses_is_no_call():
    deep = "[" * 5000 + "]" * 5000
    text = '<tool_call>{"name": "f", "arguments": ' + deep + '}</tool_call>'
    assert tf.parse_prepos(text) == (text, [])
    assert tf.parse_hermes(text) == (text, [])
    assert tf.parse_llama3('{"name": "f", "parameters": ' + deep + '}')[1] == []
    assert tf.parse_mistral("[TOOL_CALLS]" + deep)[1] == []
    assert tf.parse_mistral("[TOOL_CALLS]f[ARGS]" + deep)[1] == []
    # a client's call with such arguments is held as the text it sent
    assert normalize_tool_call({"function": {"name": "f", "arguments": deep}})[
        "function"]["arguments"] == deep


# -- a call cut by max_tokens -------------------------------------------------------------
ARGS = '{"city": "Paris"}'
# each family's call markup, with its marker and without it (detokenized away), and the
# text before it: (format, text, lead, whether the markup is a mark (else bare JSON))
CUT_FORMS = [
    (tf.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + '}\n</tool_call>',
     "Let me look.\n", True),
    (tf.PREPOS, '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + '}\n</tool_call>',
     "Let me look.\n", True),
    (tf.PREPOS, '{"name": "get_weather", "arguments": ' + ARGS + "}", "", False),
    (tf.LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS + "}", "", True),
    (tf.LLAMA3, '{"name": "get_weather", "parameters": ' + ARGS + "}", "", False),
    (tf.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS + "}]", "Sure. ",
     True),
    (tf.MISTRAL, '[{"name": "get_weather", "arguments": ' + ARGS + "}]", "", False),
    (tf.MISTRAL, "[TOOL_CALLS]get_weather[ARGS]" + ARGS, "Sure. ", True),
]


def _whole(fmt, before: str, c) -> tuple[str, list[dict]]:
    """What the reply writers make of a cut answer: the text before the cut call parsed
    for content and whole calls, then the cut call."""
    content, calls = fmt.parse(before)
    return content, calls + ([c] if c else [])


@pytest.mark.parametrize("fmt,markup,lead,marked", CUT_FORMS,
                         ids=[f"{f.name}-{i}" for i, (f, *_) in enumerate(CUT_FORMS)])
def test_a_call_cut_anywhere_is_its_name_and_arguments_so_far(fmt, markup, lead, marked):
    text = lead + markup
    start = text.index(ARGS)
    # a call from the character after its name (a closing quote, or `[ARGS]`'s `[`), or
    # for bare JSON after the arguments' key
    named = text.index("get_weather") + 12 if marked else text.index(ARGS) - 2
    for k in range(len(text) + 1):
        cut = text[:k]
        before, c = cc.cut_call(cut, fmt)
        content, calls = _whole(fmt, before, c)
        if k < len(lead):  # before the markup: the text as it is, no call
            assert (before, c) == (cut, None), cut
            continue
        if k < named:  # cut before the name: no call, and no mark's text in the content
            assert c is None and not calls, cut
            assert content == (lead if marked else cut), cut
            continue
        assert content.strip() == lead.strip(), cut
        (got,) = calls
        assert got["function"]["name"] == "get_weather", cut
        args = got["function"]["arguments"]
        if isinstance(args, dict):  # read whole by the parser (the call complete)
            assert args == {"city": "Paris"} and k >= start + len(ARGS), cut
            continue
        # the raw text so far: a prefix of the arguments as written (or all of them)
        assert args == text[start:min(k, start + len(ARGS))], cut
        read = cc.lenient_arguments(args)  # as far as it goes: the city so far, or none
        assert read == {} or "Paris".startswith(read["city"]) and set(read) == {"city"}, cut
        assert read == {"city": "Paris"} or k < start + len(ARGS), cut


def test_whole_calls_before_the_cut_one_are_kept():
    one = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
    before, c = cc.cut_call("Hi. " + one + '<tool_call>\n{"name": "b", "arguments": {"x', tf.HERMES)
    assert _whole(tf.HERMES, before, c) == ("Hi.", [tf.call("a", {}),
                                                   {"type": "function", "function": {
                                                       "name": "b", "arguments": '{"x'}}])
    before, c = cc.cut_call('{"name": "a", "parameters": {}}; {"name": "b', tf.LLAMA3)
    assert _whole(tf.LLAMA3, before, c) == ("", [tf.call("a", {})])  # b's name not whole
    for mistral in ('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": ',
                    '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '):
        before, c = cc.cut_call(mistral, tf.MISTRAL)
        content, calls = _whole(tf.MISTRAL, before, c)
        assert content == "" and [x["function"]["name"] for x in calls] == ["a", "b"]
        assert calls[1]["function"]["arguments"] == ""
    before, c = cc.cut_call("[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[AR", tf.MISTRAL)
    assert _whole(tf.MISTRAL, before, c)[1] == [tf.call("a", {}), {
        "type": "function", "function": {"name": "b", "arguments": ""}}]


def test_an_answer_not_cut_in_a_call_is_as_it_was():
    for fmt in (tf.HERMES, tf.PREPOS, tf.LLAMA3, tf.MISTRAL):
        for text in ("It is sunny in Paris.", "[1, 2] is a list", '{"answer": "sun',
                     "a <tool_call> b </tool_call> c", ""):
            before, c = cc.cut_call(text, fmt)
            assert c is None and (before == text or not before.strip()), (fmt.name, text)
    # a JSON answer with a "name" but no arguments yet is content, not a call
    assert cc.cut_call('{"name": "Ada", "age": 3', tf.LLAMA3) == ('{"name": "Ada", "age": 3',
                                                                   None)


def _forced(fmt: ChatFormat, names: list[str]) -> dict[str, str]:
    msgs = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in names]
    shown = {}
    for n in names:
        opening = fmt.call_markup(msgs, tools, n).opening
        shown[n] = "".join(p for p in fmt.controls.split_special(opening) if isinstance(p, str))
    return shown


@pytest.mark.parametrize("fam", list(EXPECTED))
def test_a_forced_call_cut_anywhere_is_the_forced_function_s(formats, fam):
    """A forced answer is calls alone, read from the openings the grammar writes: forced to
    one function, a cut call is that function's from its first character; forced to one of
    several, from where its name is written."""
    fmt = formats[fam]
    one = _forced(fmt, ["get_weather"])
    two = _forced(fmt, ["get_weather", "get_time"])
    opening = one["get_weather"]
    text = opening + ARGS
    named = opening.index("get_weather") + len("get_weather")
    for k in range(len(text)):
        cut = text[:k]
        before, c = cc.cut_call(cut, fmt, one)
        assert before == "" and c["function"]["name"] == "get_weather", cut
        assert c["function"]["arguments"] == text[len(opening):max(k, len(opening))], cut
        before, c = cc.cut_call(cut, fmt, two)
        assert before == "" or not before.strip(), cut
        assert (c is None) == (k < named), cut
    # whole: no call left over for the cut reader
    assert cc.cut_call(text + "}", fmt, one) == (text + "}", None)


def test_lenient_arguments_close_what_was_cut():
    cases = {
        '{"city": "Paris"}': {"city": "Paris"},
        '{"city": "Par': {"city": "Par"},
        '{"city": "Paris", "days": [1, 2': {"city": "Paris", "days": [1, 2]},
        '{"city": "Paris", "da': {"city": "Paris"},
        '{"city": "Paris", "days": ': {"city": "Paris"},
        '{"a": {"b": "c\\': {"a": {"b": "c"}},
        '{"a": tr': {},
        '{"n": 12': {"n": 12},
        "": {}, "{": {}, "[1, 2]": {}, "not json": {}, "{'a': 1}": {},
        '{"a": "x\x13y"': {"a": "x\x13y"},  # a control character, as a small model writes
    }
    for text, want in cases.items():
        assert cc.lenient_arguments(text) == want, text
    deep = '{"a": ' + "[" * 5000
    assert cc.lenient_arguments(deep) == {}  # nested deeper than the decoder recurses
