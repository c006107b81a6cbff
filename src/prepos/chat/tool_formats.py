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

An answer cut by max_tokens inside a call is read by `cut_calls`, a reader per family that
follows these parsers' rules.
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


# -- mistral ------------------------------------------------------------------------------
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


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
        name, sep, args = part.partition(ARGS)
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


# -- prepos's own (a template that renders no tool calls) ---------------------------------
def parse_prepos(text: str) -> Parsed:
    content, calls = parse_hermes(text)
    if calls:
        return content, calls
    c = _json_call(text.strip())
    return ("", [c]) if c else (text, [])


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
    streamed answer while they may be one), and the characters a message that is one bare
    JSON call starts with."""

    name: str
    parse: Callable[[str], Parsed]
    marks: tuple[str, ...]
    starts: tuple[str, ...]


HERMES = ToolFormat("hermes", parse_hermes, ("<tool_call>",), ())
LLAMA3 = ToolFormat("llama3", parse_llama3, (PYTHON_TAG,), ("{",))
MISTRAL = ToolFormat("mistral", parse_mistral, (TOOL_CALLS,), ("[",))
PREPOS = ToolFormat("prepos", parse_prepos, ("<tool_call>",), ("{",))


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


class Withheld:
    """A streamed answer's text as it may be sent: with `tools`, what may still be a tool
    call's opening markup (`safe_prefix`, after `prefix`, text the answer continues) held
    back; `sent`, all the text given out so far."""

    def __init__(self, fmt: ToolFormat, tools: bool, prefix: str = ""):
        self.fmt, self.tools, self.held, self.sent = fmt, tools, prefix, ""

    def feed(self, text: str) -> str:
        """The part of the text so far, with `text` added, that may be sent now."""
        if self.tools:
            self.held += text
            safe = max(safe_prefix(self.sent + self.held, self.fmt) - len(self.sent), 0)
            text, self.held = self.held[:safe], self.held[safe:]
        self.sent += text
        return text

