"""The Responses API's request, checked and put in the chat route's terms, before any engine
call: options prepos cannot honour refused by name, options a coding agent sends that change
nothing here accepted (`reasoning` and `include`: the model has no reasoning channel, so
there is no reasoning to configure, summarize or return; tools the server cannot run, hosted
ones such as `web_search` and tool namespaces, left out of the prompt and named in the
response's `metadata`, as `prepos_tools_omitted`); function tools, `tool_choice` and
`text.format` as chat's `tools`, `tool_choice` and `response_format`; `input` items as the
messages a session holds; errors the chat checks raise renamed to the Responses fields.

Input items: messages (`{role, content}`, content a string or `input_text` / `output_text`
parts; `developer` is `system`), `function_call` items (an assistant message's tool calls:
consecutive calls, and a call right after an assistant message, are one message, as a
session commits an answer) and `function_call_output` items (tool results; their `call_id`
must name a call of the previous response, of the conversation or of the input before them).
The same items are a conversation's (`conversation_items`: as the Conversations API keeps
and lists them).
"""

from __future__ import annotations

import re

from prepos.chat import tool_formats
from prepos.chat.format import normalize_tool_call
from prepos.errors import InvalidInput
from prepos.server.http.errors import ApiError, as_api_error
from prepos.server.http.request_bodies import CreateResponse
from prepos.server.openai.response_objects import new_id

INCLUDABLE = {"reasoning.encrypted_content"}  # there is no reasoning: nothing to add
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
MAX_METADATA = 16


def bad(message: str, param: str | None, code: str = "invalid_request",
        status: int = 400) -> ApiError:
    return ApiError(status, code, message, param)


def unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, "unsupported", message, param)


# -- options ------------------------------------------------------------------------------
def refuse_unsupported(body: CreateResponse) -> None:
    """Options that would change the answer in a way prepos does not implement: 400 naming
    each, never ignored."""
    if body.background:
        raise unsupported("background responses are not supported: prepos answers in the "
                          "request (stream: true to see it as it is generated)", "background")
    for name in ("prompt", "context_management", "moderation"):
        if getattr(body, name) is not None:
            raise unsupported(f"{name} is not supported by prepos", name)
    if body.conversation is not None and body.previous_response_id is not None:
        raise bad("conversation and previous_response_id cannot be used together: a "
                  "conversation holds its own history", "conversation")
    if body.reasoning is not None and not isinstance(body.reasoning, dict):
        raise bad("reasoning must be an object", "reasoning")
    if body.truncation not in (None, "disabled"):
        raise unsupported(f"truncation {body.truncation!r} is not supported (only "
                          "'disabled': a conversation over the context is an error)", "truncation")
    if body.top_logprobs not in (None, 0):
        raise unsupported("top_logprobs is not supported on /v1/responses (use "
                          "/v1/chat/completions for logprobs)", "top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    check_metadata(body.metadata)


def check_metadata(meta: dict[str, str] | None) -> dict[str, str]:
    """OpenAI's bounds on `metadata` (a 400 naming it beyond them); the pairs."""
    meta = meta or {}
    if len(meta) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise bad(f"metadata holds at most {MAX_METADATA} pairs, keys up to 64 characters and "
                  "values up to 512", "metadata")
    return meta


def function_tools(body: CreateResponse) -> tuple[list[dict], list[dict], list[str]]:
    """The request's tools in chat's form, as the response echoes them, and the names of
    those left out: only function tools are offered to the model; a tool of another type
    (hosted, such as `web_search`, or a namespace) is named by its name, else its type."""
    chat, echo, names, omitted = [], [], set(), []
    for i, tool in enumerate(body.tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where} must be an object", where)
        kind = tool.get("type")
        if not isinstance(kind, str) or not kind:
            raise bad(f"{where}.type must be a tool type", where + ".type")
        if kind != "function":
            name = tool.get("name")
            omitted.append(name if isinstance(name, str) and name else kind)
            continue
        name, params, desc = tool.get("name"), tool.get("parameters"), tool.get("description")
        if not isinstance(name, str) or not name.strip():
            raise bad(f"{where}.name must be a non-empty string", where + ".name")
        if name in names:
            raise bad(f"{where}: function {name!r} is declared twice", where + ".name")
        names.add(name)
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.parameters must be a JSON schema object", where + ".parameters")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{where}.description must be a string", where + ".description")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{where}.strict must be a boolean", where + ".strict")
        fn = {"name": name, **({"description": desc} if desc is not None else {}),
              **({"parameters": params} if params is not None else {})}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": name, "description": desc,
                     "parameters": params, "strict": strict})
    return chat, echo, omitted


def tool_choice(body: CreateResponse) -> tuple[str | dict, str | dict]:
    """`tool_choice` in chat's form, and as the response echoes it."""
    choice = body.tool_choice
    if choice is None:
        return "auto", "auto"
    if choice in ("auto", "none", "required"):
        return choice, choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice {'type': 'function'} needs a name", "tool_choice")
        return {"type": "function", "function": {"name": name}}, {"type": "function",
                                                                   "name": name}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise unsupported(f"tool_choice {kind!r} is not supported: 'auto', 'none', 'required' or "
                      "{'type': 'function', 'name': ...}", "tool_choice")


def text_format(body: CreateResponse) -> tuple[dict | None, dict]:
    """`text.format` as chat's `response_format` (None for plain text), and the `text` the
    response echoes."""
    text = body.text or {}
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise unsupported(f"text.verbosity {verbosity!r} is not supported", "text.verbosity")
    fmt = text.get("format")
    echo = {"format": {"type": "text"}, "verbosity": verbosity or "medium"}
    if fmt is None:
        return None, echo
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                             "json_schema"):
        raise bad("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                  "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text.format")
    echo["format"] = fmt
    if fmt["type"] == "text":
        return None, echo
    if fmt["type"] == "json_object":
        return {"type": "json_object"}, echo
    inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}, echo


# -- input items --------------------------------------------------------------------------
def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise unsupported(f"{where}[{j}]: content part {kind!r} is not supported: prepos "
                              "takes text (input_text, output_text) only", f"{where}[{j}]")
        out.append(part["text"])
    return "".join(out)


def call_of(name: str, arguments, where: str | None) -> dict:
    """A function call in the session's form. `where` None: the model's own output, whose
    arguments are kept as {} where they are not a JSON object (a client resends them as it
    got them, so both sides agree)."""
    try:
        return normalize_tool_call({"function": {"name": name, "arguments": arguments}})
    except InvalidInput as exc:
        if where is None:
            return tool_formats.call(name, {})
        raise bad(f"{where}: {exc}", where + ".arguments") from None


def _assistant_call(out: list[dict], call: dict) -> None:
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def input_messages(raw: str | list[dict], calls: set[str],
                   name: str = "input") -> tuple[list[dict], list[str]]:
    """`input` (or a list of items the field `name` holds) as session messages, and the item
    each message starts at. `calls`: the call ids a function_call_output may answer (those
    before it: the previous response's, the conversation's); the items' own function_call
    items are added to it."""
    if isinstance(raw, str):
        if not raw.strip():
            raise bad(f"{name} must not be empty", name)
        return [{"role": "user", "content": raw}], [name]
    if not raw:
        raise bad(f"{name} must not be empty", name)
    out: list[dict] = []
    where: list[str] = []
    for i, item in enumerate(raw):
        at = f"{name}[{i}]"
        kind = item.get("type", "message")
        n = len(out)
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None  # a list: unhashable
            if role is None:
                raise bad(f"{at}.role must be user, assistant, system or developer, got "
                          f"{item.get('role')!r}", at + ".role")
            content = _text(item.get("content"), at + ".content")
            if role != "assistant" and not content.strip():
                raise bad(f"{at}.content must not be empty", at + ".content")
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            fn, cid = item.get("name"), item.get("call_id")
            if not isinstance(fn, str) or not fn:
                raise bad(f"{at}.name must be a non-empty string", at + ".name")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{at}.call_id must be a non-empty string", at + ".call_id")
            args = item.get("arguments", "")
            if not isinstance(args, str):
                raise bad(f"{at}.arguments must be a JSON text", at + ".arguments")
            calls.add(cid)
            _assistant_call(out, call_of(fn, args, at))
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or cid not in calls:
                raise bad(f"{at}: no function call with call_id {cid!r} before it (in the "
                          f"previous response, the conversation or the {name})", at + ".call_id")
            out.append({"role": "tool", "content": _text(item.get("output"), at + ".output")})
        else:
            raise unsupported(f"{at}: item type {kind!r} is not supported (message, "
                              "function_call and function_call_output items are)", at + ".type")
        where += [at] * (len(out) - n)
    return out, where


CONVERSATION_ID = re.compile(r"conv_[A-Za-z0-9_-]{1,100}")


def conversation_id(value, param: str) -> str:
    """A conversation's id as it was given (`conv_...`); else a 400 naming `param`."""
    if isinstance(value, str) and CONVERSATION_ID.fullmatch(value):
        return value
    raise bad(f"{param} must be a conversation id (conv_...), got {value!r:.80}", param)


def conversation_ref(value) -> str:
    """A response's `conversation`: an id, or an object {"id": ...}."""
    if isinstance(value, dict):
        return conversation_id(value.get("id"), "conversation.id")
    return conversation_id(value, "conversation")


def _parts(content, kind: str) -> list[dict]:
    """A message's content (checked by `_text`) as the parts a conversation item holds."""
    if isinstance(content, str):
        content = [{"type": kind, "text": content}]
    return [{"type": p["type"], "text": p["text"], "annotations": [], "logprobs": []}
            if p["type"] == "output_text" else {"type": p["type"], "text": p["text"]}
            for p in content]


def conversation_items(raw: str | list[dict]) -> list[dict]:
    """Input items (checked by `input_messages`) as a conversation keeps them, each with a
    new id and `status`: a message's content as parts (`input_text`, or `output_text` for
    the assistant's), a function call's output as it was sent."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    out = []
    for item in raw:
        kind = item.get("type", "message")
        if kind == "message":
            text = "output_text" if item["role"] == "assistant" else "input_text"
            out.append({"id": new_id("msg_"), "type": "message", "role": item["role"],
                        "content": _parts(item["content"], text), "status": "completed"})
        elif kind == "function_call":
            out.append({"id": new_id("fc_"), "type": "function_call",
                        "call_id": item["call_id"], "name": item["name"],
                        "arguments": item.get("arguments", ""), "status": "completed"})
        else:
            output = item["output"]
            out.append({"id": new_id("fco_"), "type": "function_call_output",
                        "call_id": item["call_id"], "status": "completed",
                        "output": output if isinstance(output, str) else _parts(output, "")})
    return out


def output_message(output: list[dict]) -> dict | None:
    """A response's output items as the assistant message its conversation continues with
    (None for none)."""
    out: list[dict] = []
    for item in output:
        if item["type"] == "message":
            out.append({"role": "assistant",
                        "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            _assistant_call(out, call_of(item["name"], item["arguments"], None))
    return out[0] if out else None


def output_calls(output: list[dict]) -> set[str]:
    return {item["call_id"] for item in output if item["type"] == "function_call"}


# -- errors in the Responses API's terms --------------------------------------------------
RENAMES = {"max_completion_tokens": "max_output_tokens",
           "response_format.json_schema": "text.format", "response_format": "text.format"}
TYPE_TAGS = {"str", "int", "float", "bool"}  # pydantic's union members in an error's loc
MESSAGE = re.compile(r"messages\[(\d+)\]")


class Renamer:
    """Errors of the chat checks and of the conversation named in the Responses fields:
    `messages[i]` is the input item (or `instructions`, or `previous_response_id` for the
    stored conversation) message i came from."""

    def __init__(self, where: list[str] | None = None):
        self.where = where or []

    def _sub(self, text: str) -> str:
        def one(m: re.Match) -> str:
            i = int(m.group(1))
            return self.where[i] if i < len(self.where) else "input"

        text = MESSAGE.sub(one, text)
        for old, new in RENAMES.items():
            text = text.replace(old, new)
        text = re.sub(r"\bmax_tokens\b", "max_output_tokens", text)
        return re.sub(r"\bmessages\b", "input", text)

    @staticmethod
    def _loc(param: str) -> str:
        """A pydantic loc as a field path: `input.list[...].0` is `input[0]`."""
        out = ""
        for seg in param.split("."):
            if seg in TYPE_TAGS or seg.startswith(("list[", "dict[")):
                continue
            out += f"[{seg}]" if seg.isdigit() else (f".{seg}" if out else seg)
        return out

    def __call__(self, exc: BaseException) -> ApiError:
        err = as_api_error(exc)
        param = self._sub(self._loc(err.param)) if err.param else err.param
        if err.code in ("over_budget", "context_length_exceeded"):
            return ApiError(400, "context_length_exceeded", self._sub(err.message),
                            param or "input")
        return ApiError(err.status, err.code, self._sub(err.message), param, err.headers)
