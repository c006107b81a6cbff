"""Tool calls in generated text, by the markup of the model's family.

A chat template that renders assistant tool calls writes them in its family's markup; the
model emits the same markup, so the parser is chosen from the template (`detect`):

- `hermes` (Hermes, Qwen, ChatML tool templates): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, one block per call;
- `llama3` (Llama 3.1 and later, JSON tool calling): the whole message one JSON object
  `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or not; several joined by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (or
  `name[ARGS]{...}`, newer models);
- `prepos` (a template that renders no tool calls: prepos's own fallback): `<tool_call>`
  blocks as for `hermes`, or a whole message that is one JSON call object.

Each parser returns `(content, calls)`: the text outside the markup and the calls in the
normalized form a session holds (`{"type": "function", "function": {"name", "arguments"}}`,
arguments a JSON object). Markup that does not hold a well-formed call is not a call: it
stays in the content, and the text is returned as it was. (A call a client sends may carry
any text as its arguments, a call cut off included: it is held and rendered as sent.)

The special-token markers (`<|python_tag|>`, `[TOOL_CALLS]`) are usually removed when the
answer is detokenized; the parsers take the text with or without them.

An answer cut by max_tokens inside a call (`cut_call`) returns that call as far as it was
written, as OpenAI returns one: its name once written whole (a forced answer's function
where it was forced to one) and its arguments' raw text so far, a JSON prefix; each family
has its reader of a cut call beside its parser. `lenient_arguments` reads such arguments as
an object (Anthropic's `tool_use` input).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

Parsed = tuple[str, list[dict]]


def call(name: str, arguments: dict) -> dict:
    """A tool call in the one form a session holds and the chat template renders."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def loads(text: str) -> object:
    """`json.loads`, refusing with ValueError whatever it cannot decode, nesting deeper
    than the decoder recurses included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def arguments(args: object) -> dict:
    """A call's arguments as a JSON object: the object itself, or a JSON text of one (empty
    text: none). ValueError for anything else."""
    if isinstance(args, str):
        args = loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError(f"got {type(args).__name__}")
    return args


def sent_arguments(args: object) -> dict | str:
    """A client's call arguments as a session holds them: a JSON object, or the JSON text
    of one (empty text: none), as the object; any other text as sent (a call cut off, text
    that is not JSON), rendered as it is. ValueError for anything but an object or text."""
    if isinstance(args, dict):
        return args
    if not isinstance(args, str):
        raise ValueError(f"got {type(args).__name__}")
    try:
        return arguments(args)
    except ValueError:
        return args


def as_call(obj: object, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> dict | None:
    """A decoded JSON object as a call: a string "name" and a JSON-object argument field
    (a JSON text of one is taken too); None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = next((obj[key] for key in arg_keys if key in obj), {})
    try:
        return call(obj["name"], arguments(raw))
    except ValueError:
        return None


def _json_call(raw: str) -> dict | None:
    try:
        return as_call(loads(raw))
    except ValueError:
        return None


# -- a cut call's pieces ------------------------------------------------------------------
Cut = tuple[str, "dict | None"]  # (the text before a cut call's markup, the call so far)
ARG_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


def _skip(text: str, at: int, chars: str = _WS) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _partial_mark(text: str, marks: tuple[str, ...]) -> int:
    """Where a mark begun but not finished ends `text` (its length where none does)."""
    for mark in marks:
        for k in range(min(len(mark) - 1, len(text)), 0, -1):
            if text.endswith(mark[:k]):
                return len(text) - k
    return len(text)


def _so_far(name: str, args: str) -> dict:
    """A cut call: its arguments the raw text written (a JSON prefix), not an object."""
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _call_so_far(text: str, at: int) -> tuple[str | None, str | None]:
    """The name and the arguments' raw text of a JSON call object that starts at `text[at]`
    (`{`) and may be cut anywhere: the name once its string is whole, the arguments from
    their first character to their end or the text's ("" once their key is whole, None
    before)."""
    dec = json.JSONDecoder()
    name = args = None
    i = at + 1
    while True:
        i = _skip(text, i, _WS + ",")
        if i >= len(text) or text[i] != '"':
            return name, args
        try:
            key, i = json.decoder.scanstring(text, i + 1)
        except ValueError:  # cut inside a key
            return name, args
        if key in ARG_KEYS:
            args = ""
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            return name, args
        i = _skip(text, i + 1)
        try:
            value, end = dec.raw_decode(text, i)
        except (ValueError, RecursionError):  # cut inside this value
            if key in ARG_KEYS:
                args = text[i:]
            return name, args
        if key == "name" and isinstance(value, str) and value:
            name = value
        elif key in ARG_KEYS:
            args = text[i:end]
        i = end


def _named_call(name: str | None, args: str | None, marked: bool) -> dict | None:
    """A cut call object as a call: once its name is whole, after its family's mark; bare
    JSON (no mark) once its arguments' key is written too, before which it may be any JSON
    answer."""
    if name is None or (args is None and not marked):
        return None
    return _so_far(name, args or "")


# -- hermes -------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_hermes(text: str) -> Parsed:
    calls, kept, at = [], [], 0
    for m in _HERMES.finditer(text):
        c = _json_call(m.group(1))
        if c is None:
            continue  # not a call: its text stays
        calls.append(c)
        kept.append(text[at:m.start()])
        at = m.end()
    if not calls:
        return text, []
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def cut_hermes(text: str) -> Cut:
    """The last `<tool_call>` block, where it has no closing (or a mark begun at the end)."""
    i = text.rfind("<tool_call>")
    if i >= 0 and "</tool_call>" not in text[i:]:
        j = _skip(text, i + len("<tool_call>"))
        found = _call_so_far(text, j) if text.startswith("{", j) else (None, None)
        return text[:i], _named_call(*found, marked=True)
    return text[:_partial_mark(text, ("<tool_call>",))], None


# -- llama 3.1 ----------------------------------------------------------------------------
PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> Parsed:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls, dec, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = dec.raw_decode(body, at)
        except (ValueError, RecursionError):
            return text, []
        c = as_call(obj)
        if c is None:
            return text, []
        calls.append(c)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return "", calls


def cut_llama3(text: str) -> Cut:
    """The JSON call the message was cut in, after any whole ones (joined by `;`); the
    message opened by `<|python_tag|>` or not. A mark elsewhere ends the content."""
    head = _skip(text, 0)
    tagged = text.startswith(PYTHON_TAG, head)
    if not tagged and not text.startswith("{", head):
        i = text.find(PYTHON_TAG)
        return text[:i if i >= 0 else _partial_mark(text, (PYTHON_TAG,))], None
    dec, at, whole = json.JSONDecoder(), head + len(PYTHON_TAG) * tagged, False
    while True:
        at = _skip(text, at, _WS + ";")
        if at >= len(text):  # whole calls, or the mark alone
            return (text if whole or not tagged else text[:head]), None
        if text[at] != "{":
            return text, None  # not calls
        try:
            obj, end = dec.raw_decode(text, at)
        except (ValueError, RecursionError):
            c = _named_call(*_call_so_far(text, at), marked=tagged or whole)
            if c is None and not (tagged or whole):
                return text, None  # a JSON answer, not yet a call: content
            return (text[:at] if whole else text[:head]), c
        if as_call(obj) is None:
            return text, None
        whole, at = True, end


# -- mistral ------------------------------------------------------------------------------
TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


def parse_mistral(text: str) -> Parsed:
    at = text.find(TOOL_CALLS)
    if at >= 0:
        before, body = text[:at], text[at + len(TOOL_CALLS):]
    elif text.lstrip().startswith("[{"):  # the marker was a special token, detokenized away
        before, body = "", text.lstrip()
    else:
        return text, []
    calls = _mistral_array(body) if body.lstrip().startswith("[") else _mistral_named(body)
    if not calls:
        return text, []
    return before.strip(), calls


def _mistral_array(body: str) -> list[dict]:
    try:
        obj, end = json.JSONDecoder().raw_decode(body.lstrip())
    except (ValueError, RecursionError):
        return []
    if not isinstance(obj, list) or not obj or body.lstrip()[end:].strip():
        return []
    calls = [as_call(o) for o in obj]
    return [] if any(c is None for c in calls) else calls  # type: ignore[misc]


def _mistral_named(body: str) -> list[dict]:
    """`name[ARGS]{...}` calls, each after its own `[TOOL_CALLS]` (newer Mistral models)."""
    calls = []
    for part in body.split(TOOL_CALLS):
        name, sep, args = part.partition(_ARGS)
        if not sep:
            return []
        try:
            obj = loads(args)
        except ValueError:
            return []
        c = as_call({"name": name.strip(), "arguments": obj})
        if c is None:
            return []
        calls.append(c)
    return calls


def cut_mistral(text: str) -> Cut:
    """The call the message was cut in: in the array after `[TOOL_CALLS]` (or an array of
    calls whose marker was detokenized away), the whole calls before it kept in the array,
    closed; or a `name[ARGS]{...` call, after its own `[TOOL_CALLS]`."""
    at = text.find(TOOL_CALLS)
    head = _skip(text, 0)
    marked = at >= 0
    if not marked:
        if not (text.startswith("[{", head) or text[head:].rstrip() == "["):
            return text[:_partial_mark(text, (TOOL_CALLS,))], None
        at = head
    body = _skip(text, at + len(TOOL_CALLS) * marked)
    if not text.startswith("[", body):
        return _cut_mistral_named(text, at) if marked else (text, None)
    dec, i, last, cut = json.JSONDecoder(), body + 1, 0, -1
    while cut < 0:
        i = _skip(text, i, _WS + ",")
        if i >= len(text):
            break
        if text[i] != "{":  # the array closed, or no array of calls
            return text, None
        try:
            obj, end = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            cut = i
            break
        if as_call(obj) is None:
            return text, None
        last = i = end
    c = _named_call(*_call_so_far(text, cut), marked=marked or last > 0) if cut >= 0 \
        else None
    if c is None and not (marked or last):
        return text, None  # a JSON answer, not yet a call: content
    return (text[:last] + "]" if last else text[:at]), c


def _cut_mistral_named(text: str, first: int) -> Cut:
    j = text.rfind(TOOL_CALLS)
    name, sep, args = text[j + len(TOOL_CALLS):].partition(_ARGS)
    if not sep:  # the name whole where `[ARGS]` has begun
        k = _partial_mark(name, (_ARGS,))
        name = name[:k] if k < len(name) else ""
    name = name.strip()
    return (text[:j] if j > first else text[:first]), (_so_far(name, args.lstrip()) if name
                                                       else None)


# -- prepos's own (a template that renders no tool calls) ---------------------------------
def parse_prepos(text: str) -> Parsed:
    content, calls = parse_hermes(text)
    if calls:
        return content, calls
    c = _json_call(text.strip())
    return ("", [c]) if c else (text, [])


def cut_prepos(text: str) -> Cut:
    """A `<tool_call>` block cut, or a message that is one bare JSON call cut."""
    before, c = cut_hermes(text)
    head = _skip(text, 0)
    if before != text or not text.startswith("{", head):
        return before, c
    c = _named_call(*_call_so_far(text, head), marked=False)
    return ("", c) if c else (text, None)


def render_prepos_call(c: dict) -> str:
    """A call as prepos writes it into an assistant message's text: the markup
    `parse_prepos` reads back."""
    fn, args = c["function"], c["function"]["arguments"]
    if isinstance(args, str):  # text as sent, not a JSON object: written as it is
        body = f'{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": {args}}}'
    else:
        body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return "<tool_call>\n" + body + "\n</tool_call>"


def render_prepos_tools(tools: list[dict]) -> str:
    """The tools as a system-message block, for a template that renders none."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call these tools (JSON schemas, one per line):\n<tools>\n" + lines +
            "\n</tools>\nTo call one, answer with only this, one block per call:\n"
            '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n'
            "</tool_call>\nEach result comes back in a tool message.")


# -- the families -------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """One family's markup: its parser, the strings that open a call (withheld from a
    streamed answer while they may be one), the characters a message that is one bare
    JSON call starts with, and its reader of a call cut by max_tokens (`cut_call`)."""

    name: str
    parse: Callable[[str], Parsed]
    marks: tuple[str, ...]
    starts: tuple[str, ...]
    cut: Callable[[str], Cut]


HERMES = ToolFormat("hermes", parse_hermes, ("<tool_call>",), (), cut_hermes)
LLAMA3 = ToolFormat("llama3", parse_llama3, (PYTHON_TAG,), ("{",), cut_llama3)
MISTRAL = ToolFormat("mistral", parse_mistral, (TOOL_CALLS,), ("[",), cut_mistral)
PREPOS = ToolFormat("prepos", parse_prepos, ("<tool_call>",), ("{",), cut_prepos)


def detect(template: str, rendered_call: str | None) -> ToolFormat:
    """The family of a chat template, from its source and from how it renders a tool call
    (`rendered_call`: the text it writes for an assistant tool call; None where it writes
    none, which is prepos's fallback)."""
    if rendered_call is None:
        return PREPOS
    found = _by_marker(rendered_call)
    if found is None and rendered_call.strip().startswith("{"):
        found = LLAMA3  # a bare JSON object, as Llama 3.1 writes its calls
    return found or _by_marker(template) or PREPOS


def _by_marker(text: str) -> ToolFormat | None:
    if TOOL_CALLS in text:
        return MISTRAL
    if "<tool_call>" in text:
        return HERMES
    if PYTHON_TAG in text:
        return LLAMA3
    return None


def safe_prefix(text: str, fmt: ToolFormat = PREPOS) -> int:
    """How much of `text` cannot be part of a tool call's markup in this family: everything
    before the first mark (or a partial one at its end); nothing if it opens like a bare
    JSON call."""
    head = text.lstrip()
    if any(head.startswith(s) for s in fmt.starts):
        return 0
    cut = len(text)
    for mark in fmt.marks:
        i = text.find(mark)
        if i >= 0:
            cut = min(cut, i)
        for k in range(min(len(mark) - 1, len(text)), 0, -1):
            if text.endswith(mark[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


# -- a call cut by max_tokens -------------------------------------------------------------
def cut_call(text: str, fmt: ToolFormat, forced: dict[str, str] | None = None) -> Cut:
    """An answer cut by max_tokens, as the text before the call it was cut in (what the
    family's parser reads for the whole calls and content before it) and that call as far
    as it was written (None where none was begun): its name once written whole, and its
    arguments' raw text so far (a JSON prefix; "" before they begin), as OpenAI returns a
    call cut by max_tokens. Where its name was not reached there is no call: a mark's text
    is no content, a bare JSON answer not yet a call (name and arguments' key unwritten)
    stays content. An answer not cut inside a call comes back as it is, with None.

    `forced`: a forced answer's functions and their openings as the answer shows them (its
    calls are generated under a grammar of them: `forced_call`): the answer is calls alone,
    each from its opening, so the last is read from those, whether or not it was cut; where
    the answer was forced to one function the call is that function's even before its name
    is written."""
    if forced:
        return _cut_forced(text, forced)
    return fmt.cut(text)


def _cut_forced(text: str, forced: dict[str, str]) -> Cut:
    openings = {name: op.lstrip() for name, op in forced.items() if op.strip()}
    last = max(((text.rfind(op), name) for name, op in openings.items()), default=(-1, ""))
    start = 0
    if last[0] >= 0:  # the last call whose opening is whole
        at = last[0] + len(openings[last[1]])
        try:
            args, start = json.JSONDecoder().raw_decode(text, at)
        except (ValueError, RecursionError):  # cut inside its arguments
            return text[:last[0]], _so_far(last[1], text[at:])
        if not isinstance(args, dict):
            return text, None
    # an opening begun after it (past its name, so it is no closing's text) or at the start
    longest = max(map(len, openings.values()), default=0)
    for k in range(max(start, len(text) - longest), len(text) + 1):
        frag = text[k:].lstrip() if start == 0 else text[k:]
        if start and not frag:
            return text, None
        begun = [n for n, op in openings.items() if op.startswith(frag)]
        if start and not begun:
            continue
        if start == 0 and len(forced) == 1:
            return text[:k], _so_far(next(iter(forced)), "")
        if len(begun) == 1 and len(frag) >= _name_end(openings[begun[0]], begun[0]):
            return text[:k], _so_far(begun[0], "")
        return text[:k], None
    return text, None


def _name_end(opening: str, name: str) -> int:
    """Where a function's name ends in its call's opening (the opening's end where the
    template writes it otherwise)."""
    for written in (json.dumps(name)[1:-1], name):
        at = opening.find(written)
        if at >= 0:
            return at + len(written)
    return len(opening)


def lenient_arguments(text: str) -> dict:
    """A call's arguments text as an object, read leniently: a JSON object, or one cut off
    (by max_tokens) closed where it was cut (an open string, then the open arrays and
    objects), a member whose key or value was cut left out; {} where it is neither."""
    try:
        args = json.loads(text, strict=False) if text.strip() else {}
        return args if isinstance(args, dict) else {}
    except (ValueError, RecursionError):
        pass
    if not text.lstrip().startswith("{"):
        return {}
    stack: list[str] = []  # the closings of the open arrays and objects
    safe = (0, "")  # the last point the text closes at whole: its end and the closings
    in_str = esc = key = value = False  # value: a whole value ends the text so far
    expect_key = False  # a string here is a member's key
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str, value = False, not key
                if value:
                    safe = (i + 1, "".join(reversed(stack)))
        elif ch == '"':
            in_str, esc, key, expect_key = True, False, expect_key, False
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            value, expect_key = False, ch == "{"
            safe = (i + 1, "".join(reversed(stack)))
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                break
            value = True
            safe = (i + 1, "".join(reversed(stack)))
        elif ch == ",":
            if value:
                safe = (i, "".join(reversed(stack)))
            value, expect_key = False, stack[-1:] == ["}"]
        elif ch == ":":
            value = False
        elif ch not in _WS:
            value = True  # a number or a literal, whole once something follows it
    closings = "".join(reversed(stack))
    tries = []
    if in_str and not key:
        tries.append(text[:-1] + '"' + closings if esc else text + '"' + closings)
    elif not in_str and value:
        tries.append(text.rstrip() + closings)
    tries.append(text[:safe[0]] + safe[1])
    for attempt in tries:
        try:
            args = json.loads(attempt, strict=False)
        except (ValueError, RecursionError):
            continue
        if isinstance(args, dict):
            return args
    return {}
