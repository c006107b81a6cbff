"""What a chat template does with tools, and prepos's fallback where it does nothing.

At load, sentinel tools, tool calls and tool results are rendered through the template and
looked for in its text (`ToolSupport.probe`). What the template does not render, prepos
writes itself before the template runs (`ToolSupport.apply`), never dropping it:

- tools: a system-message block listing them (`tool_formats.render_prepos_tools`), added to
  the first system message or as one of its own;
- an assistant message's tool calls: appended to its text, each as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the markup prepos's own
  parser reads back (`tool_formats.parse_prepos`);
- a tool message: a user message `<tool_response>\\n...\\n</tool_response>`.

So a model whose template renders only role and content (SmolLM2-135M-Instruct's) sees its
tools and its own earlier calls, and can run a tool loop in the format it is shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from prepos.chat.tool_formats import render_prepos_call, render_prepos_tools
from prepos.errors import InvalidInput

_TOOL = "PREPOSxTOOLx51c2"
_ARG = "PREPOSxARGx51c2"
_VALUE = "PREPOSxVALUEx51c2"
_RESULT = "PREPOSxRESULTx51c2"

Render = Callable[[Sequence[dict], Sequence[dict] | None, bool], str]


def _probe_tools() -> list[dict]:
    return [{"type": "function", "function": {
        "name": _TOOL, "description": "a probe",
        "parameters": {"type": "object", "properties": {_ARG: {"type": "string"}}}}}]


def _probe_call() -> dict:
    return {"type": "function", "function": {"name": _TOOL, "arguments": {_ARG: _VALUE}}}


@dataclass(frozen=True)
class ToolSupport:
    """Whether the template renders tools, assistant tool calls and tool messages; the text
    it writes for a call (None where it writes none)."""

    tools: bool
    tool_calls: bool
    tool_results: bool
    rendered_call: str | None

    @property
    def complete(self) -> bool:
        return self.tools and self.tool_calls and self.tool_results

    @classmethod
    def probe(cls, render: Render) -> ToolSupport:
        tools = _probe_tools()
        user = {"role": "user", "content": "x"}
        called = {"role": "assistant", "content": "", "tool_calls": [_probe_call()]}
        has_tools = _TOOL in _try(render, [user], tools, False)
        base = _try(render, [user], tools, True)
        text = _try(render, [user, called], tools, False)
        added = text[len(base):] if base and text.startswith(base) else text
        has_calls = _VALUE in added  # the call's argument value: nowhere but in a call
        rendered = added if has_calls else None
        result = _try(render, [user, called, {"role": "tool", "content": _RESULT}], tools,
                      False)
        return cls(has_tools, has_calls, _RESULT in result, rendered)

    def apply(self, messages: Sequence[dict], tools: Sequence[dict] | None
              ) -> tuple[list[dict], list[dict] | None]:
        """The conversation and tools as the template is given them: what it does not
        render written into messages by prepos."""
        msgs = list(messages)
        tool_list = list(tools) if tools else None
        if tool_list and not self.tools:
            msgs = _with_block(msgs, render_prepos_tools(tool_list))
            tool_list = None
        if not (self.tool_calls and self.tool_results):
            msgs = [self._message(m) for m in msgs]
        return msgs, tool_list

    def _message(self, m: dict) -> dict:
        if m.get("role") == "assistant" and m.get("tool_calls") and not self.tool_calls:
            content = m.get("content") or ""
            calls = "\n".join(render_prepos_call(c) for c in m["tool_calls"])
            out = {k: v for k, v in m.items() if k != "tool_calls"}
            out["content"] = f"{content}\n{calls}" if content.strip() else calls
            return out
        if m.get("role") == "tool" and not self.tool_results:
            return {"role": "user",
                    "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        return m


def _with_block(msgs: list[dict], block: str) -> list[dict]:
    if msgs and msgs[0].get("role") == "system":
        first = dict(msgs[0])
        first["content"] = f"{first.get('content') or ''}\n\n{block}".lstrip("\n")
        return [first, *msgs[1:]]
    return [{"role": "system", "content": block}, *msgs]


def _try(render: Render, msgs: list[dict], tools: list[dict], prompt: bool) -> str:
    try:
        return render(msgs, tools, prompt)
    except InvalidInput:
        return ""
