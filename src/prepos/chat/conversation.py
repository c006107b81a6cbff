"""Conversations as a session holds them, and where a client's conversation meets one.

An OpenAI-style client sends its whole conversation with every request; an agentic session
holds the committed one. This module puts the client's messages in the session's form
(`session_messages`), finds how much of them the session already holds (`resume`, which may look
through the versions kept for rollback), and checks the order rules a session applies to
each new message (`check_order`) before any is committed, so a refusal changes nothing.

No HTTP here: a refusal is a `ConversationError` carrying the code, status and field
(`param`) a server reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from prepos.chat.format import normalize_tool_call
from prepos.errors import InvalidInput, PreposError

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(PreposError):
    """A conversation a session cannot take as sent."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request",
                 status: int = 400):
        super().__init__(message)
        self.code = code
        self.status = status
        self.param = param


class Message(Protocol):
    """A message as a client sends it (OpenAI's shape)."""

    role: str
    content: str | list[dict] | None
    tool_calls: list | None


def awaits_tool(messages: Sequence[dict]) -> bool:
    """Whether a conversation awaits a tool result: it ends in an assistant tool call."""
    return (bool(messages) and messages[-1]["role"] == "assistant"
            and bool(messages[-1].get("tool_calls")))


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
        return normalize_tool_call(call)
    except InvalidInput as exc:
        raise ConversationError(f"{where}: {exc}", where) from None


# -- order --------------------------------------------------------------------------------
def check_order(base: Sequence[dict], delta: Sequence[dict], offset: int,
                continue_final: bool = False) -> None:
    """The rules the session applies to each message of `delta` (messages[offset:] of the
    request) after `base`, checked before any is committed. System messages go where the
    chat template allows them (it refuses the others when the conversation is rendered).
    The conversation must end with a user or tool message, or be a system message alone;
    with `continue_final`, an assistant message may end it (its content is continued)."""
    msgs = list(base)
    for k, m in enumerate(delta):
        i = offset + k
        if m["role"] == "assistant" and awaits_tool(msgs):
            raise ConversationError(f"messages[{i}] is an assistant message, but a tool call "
                                    "awaits its result first", f"messages[{i}]",
                                    "tool_result_awaited", 409)
        if m["role"] == "tool" and not awaits_tool(msgs):
            raise ConversationError(f"messages[{i}] is a tool result, but no tool call is "
                                    "awaiting one", f"messages[{i}]", "no_tool_result_awaited",
                                    409)
        if m["role"] == "user" and awaits_tool(msgs):
            raise ConversationError(f"messages[{i}] is a user message, but a tool call awaits "
                                    "its result first", f"messages[{i}]", "tool_result_awaited",
                                    409)
        msgs.append(m)
    last = msgs[-1]["role"] if msgs else None
    if last in ("user", "tool") or (last == "system" and len(msgs) == 1):
        return
    if last == "assistant" and continue_final and not msgs[-1].get("tool_calls"):
        return
    raise ConversationError("the conversation must end with a user or tool message for the "
                            "model to answer (a stateless request may also end with an "
                            "assistant message, which is continued)", "messages")


# -- where a conversation meets a session -------------------------------------------------
def same(a: dict, b: dict) -> bool:
    if a["role"] != b["role"]:
        return False
    ca, cb = a.get("content") or "", b.get("content") or ""
    if a["role"] == "assistant":  # whitespace around generated text is not the client's
        ca, cb = ca.strip(), cb.strip()
    return ca == cb and (a.get("tool_calls") or []) == (b.get("tool_calls") or [])


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
    (`messages[len(held):]` of the request)."""

    rollback_to: int | None
    held: list[dict]
    delta: list[dict]


def resume(sid: str, version: int, held: Sequence[dict], msgs: list[dict],
           kept: Callable[[], Mapping[int, Sequence[dict]]] | None = None) -> Resume:
    """Match `msgs` against session `sid`, which holds `held` at `version`. A conversation
    that does not extend it is refused (409 `conversation_diverged`) unless `kept` is given
    (the versions kept for rollback, by version): then the newest one it extends is the
    rollback target."""
    held = list(held)
    if held and held[0]["role"] == "system" and msgs[0]["role"] != "system":
        msgs = [held[0], *msgs]  # the session's system prompt is implied
    n = extends(held, msgs)
    if n >= 0:
        return Resume(None, held, msgs[n:])
    if kept is None:
        i = first_difference(held, msgs)
        raise ConversationError(f"the conversation diverges from session {sid} at message {i} "
                                f"(the session holds {len(held)} messages at version "
                                f"{version}); send the conversation as the session has it, or "
                                "set on_divergence to 'rollback'", f"messages[{i}]",
                                "conversation_diverged", 409)
    versions = kept()
    for v in sorted(versions, reverse=True):
        old = list(versions[v])
        k = extends(old, msgs)
        if k >= 0:
            return Resume(v, old, msgs[k:])
    raise ConversationError(f"the conversation extends none of the versions session {sid} "
                            "keeps", "messages", "conversation_diverged", 409)
