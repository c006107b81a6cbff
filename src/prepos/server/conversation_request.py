"""A conversation sent whole, in no API's terms: what chat completions, the Messages API and
the Responses API each translate their body into before the one flow answers it
(`server/openai/flow.py`). Its checks are made once, here or where it is made: the tools'
shape by the translation, the tool choice against the tools it ends up with (a named
session's own, where none are sent), the sampling by `Limits.sampling`, each message's size
by the flow."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from prepos.core import SamplingParams
from prepos.server.http.errors import ApiError


@dataclass
class ConversationRequest:
    messages: list[dict]  # role, content (tool_calls): the whole conversation, in chat terms
    sampling: SamplingParams
    tools: list[dict]  # function tools in chat terms, checked
    tools_sent: bool = False  # none sent: a named session's own are used
    tool_choice: Any = None  # chat terms: None, "auto", "none", "required", {"function": ...}
    parallel: bool = True  # several calls in one answer
    name: str | None = None  # the session it names (a key's session, or the client's name)
    n: int = 1  # choices
    logprobs: bool = False
    fast_path: str | None = None  # overrides a session's
    rollback: bool = False  # a conversation that diverged from its session rolls it back
    stream: bool = False

    @cached_property
    def choice(self) -> str:
        """The tool choice, "auto", "none", "required" or the function it must call, checked
        against the tools once they are settled."""
        return tool_choice(self.tool_choice, self.tools)

    def use_session_tools(self, name: str, tools: tuple[dict, ...]) -> None:
        """Session `name`'s tools: 409 where others are sent; sent or not, its own are the
        request's (its tool choice names them)."""
        if self.tools_sent and self.tools != list(tools):
            raise ApiError(409, "tools_differ", f"the request's tools differ from those "
                           f"session {name} was created with; send the same tools or none",
                           "tools")
        self.tools = list(tools)


def tool_choice(choice, tools: list[dict]) -> str:
    """A chat tool choice checked against `tools`: "auto", "none", "required", or the name
    of the function it must call."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        if not names:
            raise ApiError(400, "invalid_request", "tool_choice 'required' needs tools",
                           "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise ApiError(400, "invalid_request", "tool_choice must be 'auto', 'none', "
                       "'required' or {'type': 'function', 'function': {'name': ...}}",
                       "tool_choice")
    if name not in names:
        raise ApiError(400, "invalid_request", f"tool_choice names function {name!r}, which "
                       f"is not among the request's tools {names}", "tool_choice")
    return name
