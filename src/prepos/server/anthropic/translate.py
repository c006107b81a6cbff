"""A Messages body in the chat route's terms, and a chat answer back as a Message.

The request: `system` (a string or text blocks; a system-role message in `messages` joins it
where it leads the conversation, else it stays where it is) is the system message; a user
message's `tool_result` blocks are tool messages (in their order, `is_error` written as an
`Error: ` before the result), its text blocks one user message after them; an assistant
message's text blocks are its content and its `tool_use` blocks its tool calls (their ids
kept, so results pair with them); text blocks of one message are joined by a blank line.
`thinking` and `redacted_thinking` blocks of past answers are dropped (this model does not
think aloud); `cache_control` and `citations` on any block are ignored. Tools are function
tools (`input_schema` is the parameters); `tool_choice` `auto`, `any` (required), `tool`
(the named function) and `none`, `disable_parallel_tool_use` as `parallel_tool_calls`.

The answer: the chat flow's parse (`openai_format.message`) as content blocks (text, then
`tool_use` blocks with `toolu_` ids and their input objects), its stop reason and usage. A
call cut by max_tokens is a `tool_use` block too, its input read as far as it was written,
and the stop reason `max_tokens`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from prepos.chat import cut_calls
from prepos.core import Result
from prepos.decode.stream import Stream
from prepos.server.http import results
from prepos.server.http.errors import ApiError

# Claude Code's attribution line (its first system block): `cch=` changes every request, so
# it is dropped, or no two requests would share a prompt prefix
BILLING = re.compile(r"^(x-anthropic-billing-header:[^\n]*)$", re.M)
PER_REQUEST = re.compile(r"\s*\bcch=[^;\s]*;?")
DROPPED = ("thinking", "redacted_thinking")  # a past answer's reasoning: not rendered
NOT_TEXT = ("image", "document")  # what a text-only model cannot read
SEP = "\n\n"  # between a message's text blocks


def bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param}: {message}", param)


def normalize_system(text: str) -> str:
    """The system text with Claude Code's per-request attribution value (`cch=...;` on an
    `x-anthropic-billing-header:` line) left out."""
    if "x-anthropic-billing-header:" not in text:
        return text
    return BILLING.sub(lambda m: PER_REQUEST.sub("", m.group(1)), text)


def _text(b: Any, at: str) -> str:
    """A block that must be text: its text."""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind == "text":
        if not isinstance(b.get("text"), str):
            raise bad("a text block's text must be a string", f"{at}.text")
        return b["text"]
    if kind in NOT_TEXT:
        raise bad(f"{kind} blocks are not supported: this model reads text only", at)
    raise bad(f"expected a text block, got {_kind(b)}", at)


def _text_blocks(blocks: list, where: str) -> list[str]:
    """The text of a list of blocks that may only be text."""
    return [_text(b, f"{where}.{j}") for j, b in enumerate(blocks)]


def _kind(b: Any) -> str:
    if isinstance(b, dict) and isinstance(b.get("type"), str):
        return f"a {b['type']!r} block"
    return f"{type(b).__name__} {json.dumps(b, default=str)[:60]}"


def system_text(system: str | list | None) -> str | None:
    if system is None:
        return None
    text = system if isinstance(system, str) else SEP.join(_text_blocks(system, "system"))
    text = normalize_system(text)
    return text if text.strip() else None


def _content(m: dict, where: str) -> list[dict]:
    c = m.get("content")
    if isinstance(c, str):
        return [{"type": "text", "text": c}]
    if not isinstance(c, list):
        raise bad("content must be a string or a list of content blocks", f"{where}.content")
    for j, b in enumerate(c):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"expected a content block with a type, got {_kind(b)}",
                      f"{where}.content.{j}")
    return c


def _tool_result(b: dict, at: str) -> dict:
    tid = b.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise bad("a tool_result names the tool_use it answers (tool_use_id)",
                  f"{at}.tool_use_id")
    c = b.get("content", "")
    if isinstance(c, str):
        text = c
    elif isinstance(c, list):
        text = SEP.join(_text_blocks(c, f"{at}.content"))
    else:
        raise bad("a tool_result's content must be a string or text blocks", f"{at}.content")
    if b.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tid, "content": text if text.strip() else
            "(no content)"}


def _tool_use(b: dict, at: str) -> dict:
    tid, name, args = b.get("id"), b.get("name"), b.get("input", {})
    if not isinstance(name, str) or not name:
        raise bad("a tool_use names its tool", f"{at}.name")
    if not isinstance(args, dict):
        raise bad("a tool_use's input must be an object", f"{at}.input")
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    if isinstance(tid, str) and tid:
        call["id"] = tid
    return call


def conversation(body) -> tuple[list[dict], list[str]]:
    """The chat route's messages of a Messages body, and where each came from (`system`,
    `messages.i`), for errors that name a message."""
    msgs: list[dict] = []
    where: list[str] = []
    system = system_text(body.system)
    if system is not None:
        msgs.append({"role": "system", "content": system})
        where.append("system")
    if not isinstance(body.messages, list) or not body.messages:
        raise bad("at least one message is required", "messages")
    for i, m in enumerate(body.messages):
        at = f"messages.{i}"
        role = m.get("role")
        blocks = _content(m, at)
        if role == "system":
            text = SEP.join(_text_blocks(blocks, f"{at}.content"))
            text = normalize_system(text)
            if not text.strip():
                continue
            if msgs and all(x["role"] == "system" for x in msgs):  # it leads: the system's
                msgs[0]["content"] += SEP + text
            else:
                msgs.append({"role": "system", "content": text})
                where.append(at)
        elif role == "user":
            texts = []
            for j, b in enumerate(blocks):
                if b["type"] == "tool_result":
                    msgs.append(_tool_result(b, f"{at}.content.{j}"))
                    where.append(at)
                else:
                    texts.append(_text(b, f"{at}.content.{j}"))
            text = SEP.join(t for t in texts if t.strip())
            if text:
                msgs.append({"role": "user", "content": text})
                where.append(at)
            elif not any(b["type"] == "tool_result" for b in blocks):
                raise bad("a user message needs text or tool_result blocks", f"{at}.content")
        elif role == "assistant":
            texts, calls = [], []
            for j, b in enumerate(blocks):
                if b["type"] == "tool_use":
                    calls.append(_tool_use(b, f"{at}.content.{j}"))
                elif b["type"] not in DROPPED:
                    texts.append(_text(b, f"{at}.content.{j}"))
            msg: dict = {"role": "assistant", "content": SEP.join(t for t in texts if t.strip())}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
            where.append(at)
        else:
            raise bad(f"role must be 'user' or 'assistant', got {role!r}", f"{at}.role")
    if all(m["role"] == "system" for m in msgs):
        raise bad("at least one user message is required", "messages")
    return msgs, where


def function_tools(tools: list | None) -> list[dict]:
    """Anthropic's client tools as the chat route's function tools."""
    out = []
    for i, t in enumerate(tools or ()):
        at = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad("a tool must be an object", at)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise bad(f"tool type {kind!r} is not supported: only client tools (a name and "
                      "an input_schema) are", f"{at}.type")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad("a tool needs a name", f"{at}.name")
        if not isinstance(schema, dict):
            raise bad("a tool needs an input_schema (a JSON Schema object)",
                      f"{at}.input_schema")
        fn: dict = {"name": name, "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if t.get("strict") is True:
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """The chat route's tool_choice and parallel_tool_calls of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad("a tool choice of type 'tool' names the tool", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad(f"type must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice.type")


# -- the answer ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def tool_uses(calls: list[dict]) -> list[dict]:
    """The chat message's tool calls as tool_use blocks; a call cut by max_tokens inside its
    arguments has them read as far as they go (`cut_calls.lenient_arguments`: open
    strings and objects closed, else {}), the message's stop reason saying it was cut."""
    return [{"type": "tool_use", "id": new_id("toolu_"), "name": c["function"]["name"],
             "input": cut_calls.lenient_arguments(c["function"]["arguments"])}
            for c in calls]


def stop_sequence(fmt, res: Result, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the answer (the answer's text is cut before it), if one
    did."""
    if res.finish_reason != "stop" or not stops or not res.tokens:
        return None
    whole = fmt.decode(res.tokens)
    tail = whole[len(res.text):] if whole.startswith(res.text) else whole
    found = [(tail.find(s), -len(s), s) for s in stops if s in tail]
    return min(found)[2] if found else None


def stop_reason(finish: str, uses: list[dict], stopped: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if uses:
        return "tool_use"
    return "stop_sequence" if stopped is not None else "end_turn"


def usage(res: Result | None) -> dict:
    """The prompt split as Anthropic's usage splits it: its tokens found in kept KV (the
    chat flow's cached tokens) are `cache_read_input_tokens`, the rest `input_tokens`."""
    if res is None:  # before the prompt is placed
        return _usage(0, 0, 0)
    return _usage(res.prompt_tokens, results.cached_prompt_tokens(res), len(res.tokens))


def placed_usage(stream: Stream) -> dict:
    """`message_start`'s usage: the prompt's as placed (no output yet)."""
    if stream.done:  # answered whole already (a prepared entry, a failure)
        try:
            return {**usage(stream.result()), "output_tokens": 0}
        except Exception:  # the failure is the stream's error event
            return usage(None)
    prompt, cached = stream.placed or (0, 0)
    return _usage(prompt, cached, 0)


def _usage(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}
