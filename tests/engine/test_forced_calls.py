"""Forced tool calls (`tool_choice` "required" or a function) on any tokenizer and template:
the grammar is written over the model's own vocabulary, so the template's own encoding of
a call is accepted token by token and no sampled token is refused, whatever the markup
(an added `<tool_call>` token that is not special, as the bundled model's and Qwen's; markup
the tokenizer splits into characters; byte fallback for characters outside the vocabulary).
A forced answer is its calls alone: content null beside them, a call whose opening was cut
before its name is none (but forced to one function, that function's), a turn cut inside a
call says `length` with the call so far and no markup in the content. End to end
on the bundled model: named, required, streamed, cut and replayed."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from prepos.chat.format import ChatFormat
from prepos.core import Result, SamplingParams
from prepos.decode.structured import Grammars
from prepos.server.openai.chat_reply import message
from prepos.server.openai.checks import forced_call
from tests.support.helpers import loaded_app

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "trend-reader"
PRICE = {"type": "function", "function": {"name": "get_price", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string", "enum": ["ACME", "MSFT"]}},
    "required": ["ticker"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 12}},
    "required": ["text"], "additionalProperties": False}}}
TOOLS = [PRICE, NOTE]
USER = {"role": "user", "content": "What is ACME doing?"}
NAMED = {"type": "function", "function": {"name": "get_price"}}


def byte_fallback_tokenizer(out: Path, byte_tokens: bool = True):
    """A SentencePiece-style BPE (Metaspace, byte fallback) whose vocabulary lacks the
    newline, the braces and the quote: the call's markup and JSON go through byte tokens
    (without them, `byte_tokens` False, it cannot write those at all)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from prepos.lab.tiny import CHATML_TEMPLATE

    vocab = {"<unk>": 0}
    for b in range(256 if byte_tokens else 0):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyz_ACEMST:,<>/[]0123456789":
        vocab.setdefault(ch, len(vocab))
    merges = [("t", "o"), ("to", "o"), ("too", "l"), ("c", "a"), ("ca", "l"), ("cal", "l")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=byte_tokens))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """A chat format per kind of markup and vocabulary."""
    from transformers import AutoTokenizer

    from prepos.lab.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    out = {fam: ChatFormat(build_tokenizer(root / fam, fam))
           for fam in ("chatml", "qwen", "llama3", "plain")}
    out["byte-fallback"] = ChatFormat(byte_fallback_tokenizer(root / "bf"))
    out["bundled"] = ChatFormat(AutoTokenizer.from_pretrained(str(BUNDLED)))
    return out


KINDS = ["chatml", "qwen", "llama3", "plain", "byte-fallback", "bundled"]


def grammar_of(fmt, choice, parallel=False):
    return forced_call(SimpleNamespace(fmt=fmt), [USER], TOOLS, choice, parallel=parallel)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("choice", ["required", "get_price"])
def test_the_templates_own_encoding_of_a_call_is_accepted(formats, kind, choice):
    fmt = formats[kind]
    (grammar, _), grammars = grammar_of(fmt, choice), Grammars(fmt)
    base = fmt.render([USER], TOOLS, generation_prompt=True)
    call = {"type": "function", "function": {"name": "get_price",
                                             "arguments": {"ticker": "ACME"}}}
    text = fmt.render([USER, {"role": "assistant", "content": "", "tool_calls": [call]}],
                      TOOLS)[len(base):]
    ids = fmt.encode(text)
    c = grammars.constraint(SamplingParams(grammar=grammar))
    taken = 0
    for t in ids:
        if c.finished or t in fmt.end_of_turn:
            break
        assert c.allowed()[t], (kind, fmt.tokenizer.decode(ids[:taken + 1]))
        c.accept(t)
        taken += 1
    assert c.finished  # one call, parallel calls off: nothing may follow
    content, calls = fmt.parse_tool_calls(fmt.decode(ids[:taken]))
    assert [x["function"] for x in calls] == [call["function"]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("parallel", [False, True])
def test_no_token_the_mask_allows_is_refused_and_finished_walks_are_calls(formats, kind,
                                                                          parallel):
    """Seeded random walks through the mask: every allowed token is accepted, the mask is
    never empty, and a walk that ends is one or more calls of the request's tools."""
    fmt = formats[kind]
    grammar, _ = grammar_of(fmt, "required", parallel)
    grammars = Grammars(fmt)
    rng = random.Random(7)
    ended = 0
    for _ in range(12):
        c = grammars.constraint(SamplingParams(grammar=grammar))
        ids: list[int] = []
        for _ in range(300):
            allowed = c.allowed().nonzero()[0].tolist()
            assert allowed, (kind, fmt.decode(ids))
            ends = [t for t in allowed if t in fmt.end_of_turn]
            t = ends[0] if ends and rng.random() < 0.5 else rng.choice(allowed)
            if t in fmt.end_of_turn:
                break
            c.accept(t)
            ids.append(t)
            if c.finished:
                break
        else:
            continue
        ended += 1
        _, calls = fmt.parse_tool_calls(fmt.decode(ids))
        assert calls and {x["function"]["name"] for x in calls} <= {"get_price", "note"}
        assert parallel or len(calls) == 1
    assert ended  # bounded strings and enums: some walks close their calls


def _result(text: str, reason: str) -> Result:
    return SimpleNamespace(text=text, finish_reason=reason)  # what a message reads of one


def test_a_forced_answer_is_its_calls_alone():
    opening = '<tool_call>\n{"name": "get_price", "arguments": '
    forced = {"get_price": opening, "note": opening.replace("get_price", "note")}
    one = opening + '{"ticker": "ACME"}}\n</tool_call>'
    msg, finish = message(_result(one, "stop"), True, forced=forced)
    assert finish == "tool_calls" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"ticker": "ACME"}
    # a second call cut before its name is written: none, and no markup in the content
    msg, finish = message(_result(one + '\n<tool_call>\n{"name":', "length"), True,
                          forced=forced)
    assert finish == "length" and msg["content"] is None and len(msg["tool_calls"]) == 1
    # cut inside the second call's arguments: that call, its arguments as they are
    msg, _ = message(_result(one + "\n" + forced["note"] + '{"text": "ab', "length"), True,
                     forced=forced)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_price", "note"]
    assert msg["tool_calls"][1]["function"]["arguments"] == '{"text": "ab'
    msg, _ = message(_result(one + "\n" + forced["note"] + "{}}", "stop"), True,
                     forced=forced, parallel=False)
    assert len(msg["tool_calls"]) == 1
    # cut in the opening before the name is whole: no call, nothing in the content
    for cut in ("<tool_call>", opening[:opening.index("get_pr") + 6]):
        msg, finish = message(_result(cut, "length"), True, forced=forced)
        assert finish == "length" and msg == {"role": "assistant", "content": ""}
    # past the name: that function's call, its arguments (none yet) as they are
    for cut in (opening[:opening.index("get_price") + 9], opening[:-3]):
        msg, finish = message(_result(cut, "length"), True, forced=forced)
        assert finish == "length" and msg["content"] is None
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in msg["tool_calls"]] == [("get_price", "")]


def test_an_answer_forced_to_one_function_cut_anywhere_is_its_call():
    opening = '<tool_call>\n{"name": "get_price", "arguments": '
    forced = {"get_price": opening}
    for cut in ("", "<tool_", "<tool_call>", opening[:opening.index("get_pr") + 6], opening):
        msg, finish = message(_result(cut, "length"), True, forced=forced)
        assert finish == "length" and msg["content"] is None, cut
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in msg["tool_calls"]] == [("get_price", "")], cut
    msg, _ = message(_result(opening + '{"ticker": "AC', "length"), True, forced=forced)
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"ticker": "AC'


def test_an_answer_cut_inside_a_call_leaves_no_markup_in_the_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_pr'
    msg, finish = message(_result(text, "length"), True)
    assert finish == "length" and msg == {"role": "assistant", "content": "Let me look.\n"}
    # past the name: the call so far beside the text (an unforced answer: LangChain's loop)
    msg, finish = message(_result(text + 'ice", "arguments": {"ticker": "AC', "length"), True)
    assert finish == "length" and msg["content"] == "Let me look."
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in msg["tool_calls"]] == [("get_price", '{"ticker": "AC')]
    # a whole answer keeps what is not a call, malformed markup included
    msg, _ = message(_result("a <tool_call> b", "stop"), True)
    assert msg["content"] == "a <tool_call> b"


# -- end to end on the bundled model ------------------------------------------------------
@pytest.fixture(scope="module")
def client():

    from prepos.config import EngineConfig
    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    app = create_app(ServerConfig(model=BUNDLED, engine=EngineConfig(threads=2)))
    with loaded_app(app) as c:
        yield c


def chat(client, **kw):
    body = {"model": BUNDLED.name, "messages": [USER], "tools": TOOLS, **kw}
    return client.post("/v1/chat/completions", json=body)


def streamed(client, **kw) -> tuple[list[dict], dict]:
    r = chat(client, stream=True, **kw)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    return [c["choices"][0] for c in chunks if c["choices"]], chunks[-1]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_the_bundled_model_makes_a_forced_call(client, choice):
    r = chat(client, tool_choice=choice, max_tokens=200, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_price", "note")
    if choice == NAMED:
        assert json.loads(call["function"]["arguments"])["ticker"] in ("ACME", "MSFT")
    # streamed: no chunk carries markup as content, the last one carries the call
    choices, _ = streamed(client, tool_choice=choice, max_tokens=200,
                          parallel_tool_calls=False)
    assert all(not ch["delta"].get("content") for ch in choices)
    assert choices[-1]["finish_reason"] == "tool_calls"
    (again,) = choices[-1]["delta"]["tool_calls"]
    assert again["function"]["name"] == call["function"]["name"]


def test_the_bundled_model_with_parallel_calls_ends_with_calls(client):
    r = chat(client, tool_choice="required", max_tokens=300)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["message"]["content"] is None and c["message"]["tool_calls"]
    assert c["finish_reason"] in ("tool_calls", "length")


@pytest.mark.parametrize("max_tokens", [1, 3, 12, 20])
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_cut_forced_call_says_length_and_is_replayed(client, choice, max_tokens):
    r = chat(client, tool_choice=choice, max_tokens=max_tokens)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    msg = c["message"]
    assert c["finish_reason"] == "length"
    assert "<tool_call>" not in (msg["content"] or "")
    assert msg["content"] == ("" if not msg.get("tool_calls") else None)
    choices, _ = streamed(client, tool_choice=choice, max_tokens=max_tokens)
    assert all(not ch["delta"].get("content") for ch in choices)
    assert choices[-1]["finish_reason"] == "length"
    # sent back with an error as the tool's result (instructor, the Agents SDK)
    history = [USER, msg] + [{"role": "tool", "tool_call_id": t["id"], "content": "cut off"}
                             for t in msg.get("tool_calls") or ()]
    if not msg.get("tool_calls"):
        history = [USER, {"role": "assistant", "content": ""},
                   {"role": "user", "content": "again"}]
    again = chat(client, messages=history, tool_choice=choice, max_tokens=4)
    assert again.status_code == 200, again.text


def test_a_call_the_vocabulary_cannot_write_is_refused_before_it_starts(tmp_path):
    """Without byte fallback, a vocabulary lacking the newline and braces cannot write the
    call's markup: refused when compiled (before anything changes), never a token refused
    mid-answer."""
    from prepos.errors import InvalidResponseFormat

    fmt = ChatFormat(byte_fallback_tokenizer(tmp_path, byte_tokens=False))
    grammar, _ = grammar_of(fmt, "get_price")
    with pytest.raises(InvalidResponseFormat, match="vocabulary"):
        Grammars(fmt).constraint(SamplingParams(grammar=grammar))
