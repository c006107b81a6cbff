"""A data line's text rendered without the conversation before it (`ChatFormat.
render_appended`): for any lines, after a system message or not, on every template family
prepos's tiny models carry (and the bundled model's, where it is installed), the text is the
template's rendering of the whole conversation; a template whose lines depend on where they
stand is found out by the probe and rendered whole; one that frames a line's content as it
is frames it without rendering, one that rewrites content is found out and rendered; a
streaming session's tokens after many appends are the whole conversation's tokens, and its
appends stay quick however long it grows."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from prepos.chat.format import ChatFormat
from prepos.engine.session import QUICK_RENDER, Session
from prepos.engine.session_spec import STREAMING, SessionSpec
from prepos.lab.tiny import build_tokenizer

FAMILIES = ("chatml", "qwen", "llama3", "mistral", "plain")
NUMBERED = ("{% for m in messages %}<|im_start|>{{ m.role }} #{{ loop.index }}\n"
            "{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# lines rendered where they stand, their content rewritten (line breaks made spaces)
REWORDED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{{ m.content | replace('\\n', ' ') }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    root = tmp_path_factory.mktemp("appended")
    out = {fam: ChatFormat(build_tokenizer(root / fam, fam)) for fam in FAMILIES}
    numbered = build_tokenizer(root / "numbered", "chatml")
    numbered.chat_template = NUMBERED
    out["numbered"] = ChatFormat(numbered)
    reworded = build_tokenizer(root / "reworded", "chatml")
    reworded.chat_template = REWORDED
    out["reworded"] = ChatFormat(reworded)
    try:
        from prepos.engine.loading import load_tokenizer, resolve_model
        out["smollm2"] = ChatFormat(load_tokenizer(resolve_model("smollm2")))
    except Exception:  # not installed: the tiny families stand
        pass
    return out


lines = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                max_size=40).filter(str.strip)
# data lines as dashboards send them, and lines holding the templates' own markup
markup = st.sampled_from(["<|im_end|>", "<|im_start|>user\n", "<|eot_id|>", "[INST]", "</s>"])
line = st.one_of(lines, st.tuples(lines, markup, lines).map("".join))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from([*FAMILIES, "numbered", "reworded", "smollm2"]),
       system=st.one_of(st.none(), lines), data=st.lists(line, min_size=2, max_size=8))
def test_a_line_rendered_alone_is_the_whole_conversation_s_text(formats, name, system, data):
    fmt = formats.get(name)
    assume(fmt is not None)  # the bundled model, where it is installed
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": text} for text in data]
    for n in range(2, len(msgs) + 1):
        part = msgs[:n]
        assert fmt.render_appended(part, fmt.render(part[:-1])) == fmt.render(part)


def test_the_tiny_families_render_lines_alone_and_a_numbering_template_does_not(formats):
    assert all(formats[fam].appends_locally for fam in FAMILIES)
    assert "smollm2" not in formats or formats["smollm2"].appends_locally
    fmt = formats["numbered"]
    assert not fmt.appends_locally
    msgs = [{"role": "user", "content": f"line {i}"} for i in range(9)]
    text = fmt.render_appended(msgs, fmt.render(msgs[:-1]))
    assert text == fmt.render(msgs) and "user #9\nline 8" in text


def test_a_message_other_than_a_data_line_renders_the_whole_conversation(formats):
    fmt = formats["chatml"]
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    assert fmt.render_appended(msgs, "not the text before") == fmt.render(msgs)


@pytest.mark.parametrize("name", ["chatml", "numbered"])
def test_a_long_stream_s_tokens_are_its_whole_conversation_s(formats, name):
    fmt = formats[name]
    s = Session("s-0", SessionSpec(STREAMING, "You watch a feed."), fmt, max_context=100_000,
                max_versions=8, shift_keep=0.5, reserve=64)
    for i in range(120):
        line_ = f"T{i % 8} {100 + i % 17}.{i % 10}"
        short = len(s.snap.text) + len(line_) <= QUICK_RENDER
        assert s.quick_append(line_) == (fmt.appends_locally or short)
        s.append(line_)
    snap = s.snap
    assert len(snap.text) > QUICK_RENDER
    assert snap.text == fmt.render(snap.messages)
    assert list(snap.tokens) == fmt.encode(snap.text)


def test_the_kept_rendering_of_a_system_message_is_one_key_s(formats):
    """Two keys' sessions with one system message each keep their own rendering of it: one
    key's prompt is never found faster for another."""
    fmt = formats["chatml"]
    msgs = [{"role": "system", "content": "A prompt two keys share."},
            *({"role": "user", "content": f"line {i}"} for i in range(3))]
    for owner in ("key-a", "key-b"):
        assert fmt.render_appended(msgs, fmt.render(msgs[:-1]), owner=owner) == fmt.render(msgs)
    assert {k for k in fmt._bases if k[1] == "A prompt two keys share."} == \
        {("key-a", "A prompt two keys share."), ("key-b", "A prompt two keys share.")}


def test_a_template_that_frames_lines_as_they_are_renders_nothing_for_one(formats):
    """Where the template frames a line's content as it is, a line after the kept system
    message and stand-in is that framing: the template is not called; one that rewrites
    content (line breaks made spaces) is found out by the probe and rendered each line."""
    assert all(formats[fam].frames_lines for fam in FAMILIES)
    assert "smollm2" not in formats or formats["smollm2"].frames_lines
    assert formats["reworded"].appends_locally and not formats["reworded"].frames_lines
    assert not formats["numbered"].frames_lines
    for name, renders in (("chatml", 0), ("llama3", 0), ("reworded", 1)):
        fmt = formats[name]
        msgs = [{"role": "system", "content": "Lines follow."},
                *({"role": "user", "content": f" line\n{i} "} for i in range(4))]
        fmt.render_appended(msgs[:-1], fmt.render(msgs[:-2]))  # keeps the system message's
        template, calls = fmt.tokenizer.apply_chat_template, []
        fmt.tokenizer.apply_chat_template = lambda *a, **k: calls.append(1) or template(*a, **k)
        try:
            text = fmt.render_appended(msgs, fmt.render(msgs[:-1]))
            n = len(calls) - 1  # the whole rendering passed in as the text before
        finally:
            del fmt.tokenizer.apply_chat_template
        assert n == renders
        assert text == fmt.render(msgs)
