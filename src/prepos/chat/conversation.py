"""Conversations as a session holds them, and where a client's conversation meets one.

An OpenAI-style client sends its whole conversation with every request; an agentic session
holds the committed one. This module puts the client's messages in the session's form
(`session_messages`), finds how much of them the session already holds (`resume`, which may look
through the versions kept for rollback), and checks the order rules a session applies to
each new message (`check_order`) before any is committed, so a refusal changes nothing.

No HTTP here: a refusal is a `ConversationError` carrying the code and field (`param`) a
server reports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from prepos.chat.format import normalize_tool_call, without_ids
from prepos.errors import InvalidInput, PreposError

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(PreposError):
    """A conversation a session cannot take as sent."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code
        self.param = param


class Message(Protocol):
    """A message as a client sends it (OpenAI's shape)."""

    role: str
    content: str | list[dict] | None
    tool_calls: list | None


def pending_calls(messages: Sequence[dict]) -> list[str | None]:
    """The tool calls a conversation awaits results for, in order, each by its id (None
    where the call has none): those of its last assistant message with calls, less the
    tool messages after it, each answering the call its `tool_call_id` names, else the
    next one in order."""
    k = len(messages)
    while k and messages[k - 1]["role"] == "tool":
        k -= 1
    if not k or messages[k - 1]["role"] != "assistant":
        return []
    pending = [c.get("id") for c in messages[k - 1].get("tool_calls") or ()]
    for m in messages[k:]:
        if not pending:
            break
        cid = m.get("tool_call_id")
        pending.pop(pending.index(cid) if cid is not None and cid in pending else 0)
    return pending


def awaits_tool(messages: Sequence[dict]) -> bool:
    """Whether a conversation awaits a tool result: a call of its last assistant message
    has none yet."""
    return bool(pending_calls(messages))


# -- the session's form -------------------------------------------------------------------
def session_messages(messages: Sequence[Message]) -> list[dict]:
    """Client messages as the session holds them: role, content, tool_calls."""
    if not messages:
        raise ConversationError("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ROLES:
            raise ConversationError(f"messages[{i}].role must be system, user, assistant or "
                                    f"tool, got {m.role!r}", f"messages[{i}].role")
        content = _content(m, i)
        msg: dict = {"role": role, "content": content}
        if role == "tool" and getattr(m, "tool_call_id", None) is not None:
            msg["tool_call_id"] = m.tool_call_id  # matched to a call, never rendered
        if m.tool_calls:
            if role != "assistant":
                raise ConversationError(f"messages[{i}]: only assistant messages carry "
                                        "tool_calls", f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(m.tool_calls)]
        elif role != "assistant" and not content.strip():
            raise ConversationError(f"messages[{i}].content must not be empty",
                                    f"messages[{i}].content")
        out.append(msg)
    return out


def _content(m: Message, i: int) -> str:
    c = m.content
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    parts = []
    for j, part in enumerate(c):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ConversationError(f"messages[{i}].content[{j}]: only text content parts "
                                    "are supported", f"messages[{i}].content", "unsupported")
        parts.append(part["text"])
    return "".join(parts)


def _tool_call(call: object, where: str) -> dict:
    try:
        out = normalize_tool_call(call)
    except InvalidInput as exc:
        raise ConversationError(f"{where}: {exc}", where) from None
    cid = call.get("id") if isinstance(call, dict) else None
    return {**out, "id": cid} if isinstance(cid, str) and cid else out


# -- order --------------------------------------------------------------------------------
def check_order(base: Sequence[dict], delta: Sequence[dict], offset: int,
                continue_final: bool = False) -> None:
    """The rules the session applies to each message of `delta` (messages[offset:] of the
    request) after `base`, checked before any is committed. System messages go where the
    chat template allows them (it refuses the others when the conversation is rendered).
    The conversation must end with a user or tool message, followed by none or more system
    messages (Claude Code sends its environment so), or be a system message alone; with
    `continue_final`, an assistant message may end it (its content is continued)."""
    msgs = list(base)
    for k, m in enumerate(delta):
        i = offset + k
        pending = pending_calls(msgs)
        if m["role"] in ("assistant", "user") and pending:
            raise ConversationError(f"messages[{i}] is {'an' if m['role'] == 'assistant' else 'a'}"
                                    f" {m['role']} message, but {_awaited(pending)} first",
                                    f"messages[{i}]", "tool_result_awaited")
        if m["role"] == "tool" and not pending:
            raise ConversationError(f"messages[{i}] is a tool result, but no tool call is "
                                    "awaiting one", f"messages[{i}]", "no_tool_result_awaited")
        cid = m.get("tool_call_id") if m["role"] == "tool" else None
        if cid is not None and cid not in pending and any(pending):
            raise ConversationError(f"messages[{i}] answers tool call {cid!r}, which is not "
                                    f"awaiting a result ({_awaited(pending)})",
                                    f"messages[{i}].tool_call_id", "unknown_tool_call_id")
        msgs.append(m)
    last = msgs[-1]["role"] if msgs else None
    trailing = last == "system"
    if trailing:  # what the trailing system messages follow
        last = next((m["role"] for m in reversed(msgs) if m["role"] != "system"), "system")
        if last == "system" and len(msgs) == 1:
            return  # a system message alone
    if last == "tool" and pending_calls(msgs):
        raise ConversationError(f"the conversation ends while {_awaited(pending_calls(msgs))}:"
                                " send a tool message for each call", "messages",
                                "tool_result_awaited")
    if last in ("user", "tool"):
        return
    if last == "assistant" and continue_final and not trailing and \
            not msgs[-1].get("tool_calls"):
        return
    raise ConversationError("the conversation must end with a user or tool message for the "
                            "model to answer (a stateless request may also end with an "
                            "assistant message, which is continued)", "messages")


def _awaited(pending: list[str | None]) -> str:
    ids = ", ".join(repr(c) for c in pending if c is not None)
    n = len(pending)
    return (f"{n} tool call{'s' if n > 1 else ''} await{'' if n > 1 else 's'} "
            f"{'results' if n > 1 else 'its result'}" + (f" ({ids})" if ids else ""))


# -- where a conversation meets a session -------------------------------------------------
def _canonical(m: dict) -> tuple:
    """A message as the session's form compares it: role, content (an assistant's stripped:
    whitespace around generated text is not the client's) and tool calls, the ids that pair
    calls with results aside."""
    content = m.get("content") or ""
    if m["role"] == "assistant":
        content = content.strip()
    return m["role"], content, without_ids(m).get("tool_calls") or []


def same(a: dict, b: dict) -> bool:
    """Whether two messages are the same in the session's form (`_canonical`)."""
    return _canonical(a) == _canonical(b)


def message_key(m: dict) -> bytes:
    """A message's bytes for hashing: equal exactly where `same` holds."""
    return json.dumps(_canonical(m), sort_keys=True, ensure_ascii=False).encode()


def extends(history: Sequence[dict], msgs: Sequence[dict]) -> int:
    """How many leading messages of `msgs` equal `history`; -1 if it does not extend it."""
    if len(msgs) < len(history):
        return -1
    for i, h in enumerate(history):
        if not same(h, msgs[i]):
            return -1
    return len(history)


def first_difference(history: Sequence[dict], msgs: Sequence[dict]) -> int:
    for i, h in enumerate(history):
        if i >= len(msgs) or not same(h, msgs[i]):
            return i
    return len(history)


@dataclass(frozen=True)
class Resume:
    """Where a client's conversation meets a session: the version to roll back to first
    (None: the current one), the messages that version holds, and the new ones after them
    (`messages[len(held):]` of the request); `sent`, the client's copy of `held` (the
    same messages, with the ids that pair its tool calls with results)."""

    rollback_to: int | None
    held: list[dict]
    delta: list[dict]
    sent: list[dict]


def resume(sid: str, version: int, held: Sequence[dict], msgs: list[dict],
           kept: Callable[[], Mapping[int, Sequence[dict]]] | None = None) -> Resume:
    """Match `msgs` against session `sid`, which holds `held` at `version`. A conversation
    that does not extend it is refused (`conversation_diverged`) unless `kept` is given
    (the versions kept for rollback, by version): then the newest one it extends is the
    rollback target."""
    held = list(held)
    if held and held[0]["role"] == "system" and msgs[0]["role"] != "system":
        msgs = [held[0], *msgs]  # the session's system prompt is implied
    n = extends(held, msgs)
    if n >= 0:
        return Resume(None, held, msgs[n:], msgs[:n])
    if kept is None:
        i = first_difference(held, msgs)
        raise ConversationError(f"the conversation diverges from session {sid} at message {i} "
                                f"(the session holds {len(held)} messages at version "
                                f"{version}); send the conversation as the session has it, or "
                                "set on_divergence to 'rollback'", f"messages[{i}]",
                                "conversation_diverged")
    versions = kept()
    for v in sorted(versions, reverse=True):
        old = list(versions[v])
        k = extends(old, msgs)
        if k >= 0:
            return Resume(v, old, msgs[k:], msgs[:k])
    raise ConversationError(f"the conversation extends none of the versions session {sid} "
                            "keeps", "messages", "conversation_diverged")
