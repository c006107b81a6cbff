"""A tool call cut by max_tokens, read as far as it was written, as OpenAI returns one.

`cut_call` splits an answer cut by max_tokens into the text before the call it was cut in
(what the family's parser, `tool_formats`, reads for the whole calls and content before it)
and that call so far: its name once written whole (a forced answer's one function before
that) and its arguments' raw text, a JSON prefix, as OpenAI sends a cut call's `arguments`.
Each family's reader follows its parser's rules (a mark opens a call; bare JSON is a call
once its arguments' key is written, content before). `lenient_arguments` reads such
arguments as an object (Anthropic's `tool_use` input). Every reply writer (chat
completions, Responses, Messages) takes the call through `openai/format.message`.
"""

from __future__ import annotations

import json

from prepos.chat.tool_formats import ARGS, PYTHON_TAG, TOOL_CALLS, ToolFormat, as_call

Cut = tuple[str, dict | None]  # (the text before a cut call's markup, the call so far)
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


# -- each family's reader -----------------------------------------------------------------
def cut_hermes(text: str) -> Cut:
    """The last `<tool_call>` block, where it has no closing (or a mark begun at the end)."""
    i = text.rfind("<tool_call>")
    if i >= 0 and "</tool_call>" not in text[i:]:
        j = _skip(text, i + len("<tool_call>"))
        found = _call_so_far(text, j) if text.startswith("{", j) else (None, None)
        return text[:i], _named_call(*found, marked=True)
    return text[:_partial_mark(text, ("<tool_call>",))], None


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
    name, sep, args = text[j + len(TOOL_CALLS):].partition(ARGS)
    if not sep:  # the name whole where `[ARGS]` has begun
        k = _partial_mark(name, (ARGS,))
        name = name[:k] if k < len(name) else ""
    name = name.strip()
    return (text[:j] if j > first else text[:first]), (_so_far(name, args.lstrip()) if name
                                                       else None)


def cut_prepos(text: str) -> Cut:
    """A `<tool_call>` block cut, or a message that is one bare JSON call cut."""
    before, c = cut_hermes(text)
    head = _skip(text, 0)
    if before != text or not text.startswith("{", head):
        return before, c
    c = _named_call(*_call_so_far(text, head), marked=False)
    return ("", c) if c else (text, None)


READERS = {"hermes": cut_hermes, "llama3": cut_llama3, "mistral": cut_mistral,
           "prepos": cut_prepos}


# -- the answer's call --------------------------------------------------------------------
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
    return READERS[fmt.name](text)


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
