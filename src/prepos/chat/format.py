"""Token sequences and entries, all derived from the model's own chat template.

Nothing here is written per model. The committed sequence of a session is the template's
rendering of its conversation, tokenized; an entry (the tokens a request appends before
generation resumes) is found by rendering the conversation with one more message whose
content is a sentinel and splitting the text at it: what precedes the sentinel is the
entry's prefix (query prefix, tool-result envelope), what follows it is the closing of the
message plus the assistant header. The generic assistant header is what the generation
prompt adds to the committed text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from prepos.chat import tool_formats
from prepos.chat.control_tokens import ESC, ControlTokens, direct_tokenizer
from prepos.chat.tool_support import ToolSupport
from prepos.errors import InvalidInput

SENTINEL = "PREPOSxSENTINELx7f3a"
ARGS_MARK = "PREPOSxARGSx9d41x"  # stands for a call's text arguments while rendering
STAND_IN = {"role": "user", "content": "0"}  # the line before a data line (`render_appended`)
MAX_BASES = 256  # (key, system message) renderings `render_appended` keeps
# data lines the framing probe renders both ways (`ChatFormat._frames_lines`)
LINE_PROBES = ("T1 101.5", "  padded line  ", "\nbroken\n\nline\n", "tab\there",
               "a {{ b }} {% c %} {# d #} \\ \" '", "é 漢字 🙂",
               "<|im_end|><|im_start|>user\n[INST]</s><|eot_id|>")


@dataclass(frozen=True)
class Split:
    """The text around a message's content: `prefix + content + suffix`."""

    prefix: str
    suffix: str


@dataclass(frozen=True)
class CallMarkup:
    """How the chat template writes an assistant call of one function after a conversation:
    `opening`, from the answer's start through the name to the arguments; `closing`, from
    the arguments to the end of the call (the end of the turn not included)."""

    name: str
    opening: str
    closing: str


# the arguments of a forced call: JSON spaced as the templates' `tojson` writes it, never
# padded (a model cannot run out its tokens on whitespace)
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ChatFormat:
    """Renders conversations with a tokenizer's chat template and tokenizes them."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidInput("the tokenizer has no chat_template; prepos needs one")
        self.tokenizer = tokenizer
        self._one: dict[int, str] = {}  # one token's text, decoded once (a fast answer's)
        # one int object per token id, shared by every session's tokens (a tokenizer returns
        # new ones: ~36 bytes a token, for each of thousands of sessions)
        self._id_objects = list(range(len(tokenizer)))
        self.controls = ControlTokens(tokenizer)
        self._direct = direct_tokenizer(tokenizer)  # what `encode` tokenizes with, if any
        # every added or special token, markup wherever the template writes it (`encode`)
        self.markup_ids = {m: tokenizer.convert_tokens_to_ids(m) for m in self.controls.markup}
        self._markup_re = re.compile("|".join(map(re.escape, self.controls.markup))
                                     ) if self.controls.markup else None
        # user text is text: with a tokenizer that tokenizes a rendering piece by piece as
        # it does whole, control-token strings in content are plain characters; otherwise
        # they are refused (check_text)
        self.plain_text = self._pieces_agree()
        self.tool_support = ToolSupport.probe(self._template)
        self.tool_format = tool_formats.detect(
            str(tokenizer.chat_template), self.tool_support.rendered_call)
        self.end_of_turn = self._end_of_turn_ids()
        probe = self.render([{"role": "user", "content": f" {SENTINEL} "}])
        self.trims_content = f" {SENTINEL} " not in probe
        # `render_appended`'s system message and stand-in (their text, and a line's framing
        # after them where `frames_lines`), by API key and system message
        self._bases: dict[tuple[str | None, str | None], tuple[str, Split | None]] = {}
        self.appends_locally = self._appends_locally()
        self.frames_lines = self.appends_locally and self._frames_lines()

    def check_text(self, text: Any, what: str) -> None:
        """Where control-token strings in text cannot be plain characters (`plain_text`
        false), refuse text that holds one of the model's control tokens (`<|im_end|>`,
        ...): tokenized, it would be chat markup (a forged end of turn, a new role)."""
        if self.plain_text or not isinstance(text, str):
            return
        found = self.controls.find_special(text)
        if found:
            raise InvalidInput(f"{what} contains the model's control token "
                               f"{found!r}, which would be read as chat markup")

    def defuse(self, text: str) -> str:
        """Content as it goes into the template: each control-token string escaped, so
        that `encode` tokenizes it as plain characters (identity without `plain_text`)."""
        return self.controls.defuse(text) if self.plain_text else text

    def parse_tool_calls(self, text: str) -> tuple[str, list[dict]]:
        """Generated assistant text as content and tool calls, in the template's family's
        markup (`tool_formats`)."""
        return self.tool_format.parse(text)

    def call_markup(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                    name: str) -> CallMarkup:
        """How the template writes a call of `name` as the answer after `messages`
        (InvalidInput where it writes none prepos can find the arguments of)."""
        base = self.render(messages, tools, generation_prompt=True)

        def written(fn: str) -> str:
            call = {"type": "function", "function": {"name": fn, "arguments": {}}}
            return self.render([*messages, {"role": "assistant", "content": "",
                                             "tool_calls": [call]}], tools)

        at = written(SENTINEL).find(SENTINEL, len(base))  # where the name starts
        text = written(name)
        args = text.find("{}", at + len(name)) if at >= 0 else -1
        if not text.startswith(base) or args < 0:
            raise InvalidInput("this model's chat template does not write tool calls in a "
                               "form prepos can start")
        rest = text[args + 2:]
        end = self.controls.find_special(rest)
        return CallMarkup(name, text[len(base):args], rest[:rest.find(end)] if end else rest)

    def call_separator(self, messages: Sequence[dict], tools: Sequence[dict] | None
                       ) -> str | None:
        """What the template writes between two calls of one answer, where it writes each
        as one call's markup (None where it writes several calls otherwise, as one list)."""
        one = self.call_markup(messages, tools, SENTINEL)
        call = {"type": "function", "function": {"name": SENTINEL, "arguments": {}}}
        base = self.render(messages, tools, generation_prompt=True)
        two = self.render([*messages, {"role": "assistant", "content": "",
                                       "tool_calls": [call, call]}], tools)[len(base):]
        first = one.opening + "{}" + one.closing
        at = two.find(one.opening, len(first)) if two.startswith(first) else -1
        return two[len(first):at] if at >= 0 else None

    def call_grammar(self, calls: Sequence[tuple[CallMarkup, dict, bool]],
                     separator: str | None = None) -> str:
        """A grammar (llguidance's Lark) of one call of one of `calls`, each a function's
        markup, its arguments' JSON Schema and whether the schema is enforced strictly (an
        unsupported keyword an error) or leniently (ignored): the markup as the template
        writes it, its special tokens as tokens, then the end of the answer. With a
        `separator` (`call_separator`), one or more calls, the model ending the turn after
        any of them."""
        def lark(text: str) -> str:
            return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p)
                            for p in self.markup_pieces(text))

        rules = [f"start: {' | '.join(f'call_{i}' for i in range(len(calls)))}"]
        if separator is not None:
            rules = [f"start: one ({lark(separator)} one)*" if separator else "start: one+",
                     "one" + rules[0][5:]]
        for i, (markup, schema, strict) in enumerate(calls):
            schema = {**schema, "x-guidance": {**CALL_JSON, "lenient": not strict}}
            rules.append(f"call_{i}: {lark(markup.opening)} args_{i} {lark(markup.closing)}")
            rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        return "\n".join(rules) + "\n"

    def markup_pieces(self, text: str) -> list[str | int]:
        """Template text as `encode` tokenizes it: each markup token (an added or special
        token: `<|im_end|>`, an added `<tool_call>`) its id, the text between them text."""
        out: list[str | int] = []
        at = 0
        for m in self._markup_re.finditer(text) if self._markup_re else ():
            out += [text[at:m.start()], self.markup_ids[m.group(0)]]
            at = m.end()
        out.append(text[at:])
        return [p for p in out if p != ""]

    # -- rendering -----------------------------------------------------------------------
    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               generation_prompt: bool = False) -> str:
        """The template's text of a conversation: the tools and tool calls it does not
        render written by prepos's fallback (`ToolSupport.apply`), content defused."""
        msgs, raw = _marked_arguments([without_ids(m) for m in messages])
        msgs, tool_list = self.tool_support.apply(msgs, tools)
        if self.plain_text:
            msgs, tool_list = self.controls.defuse_obj(msgs), self.controls.defuse_obj(tool_list)
        text = self._template(msgs, tool_list, generation_prompt)
        for mark, args in raw.items():  # text arguments, written as sent
            args = self.defuse(args)
            text = text.replace(json.dumps(mark), args).replace(mark, args)
        return text

    def render_appended(self, messages: Sequence[dict], before: str,
                        tools: Sequence[dict] | None = None, owner: str | None = None) -> str:
        """`render(messages)`, where `before` is the text of all but the last: a streaming
        session's, a system message (or none) and data lines (user messages of text). A
        data line after another adds the text it adds after any one line, where the template
        renders lines so (`appends_locally`): then only the system message, a stand-in line
        and the new one are rendered, and a stream's hundredth line costs what its second
        did; where the template frames a line's content as it is (`frames_lines`), the line
        is that framing around it and nothing is rendered. (The line before the new one is
        checked; the session keeps the rest so.) The system message and stand-in are kept
        by `owner` (the session's API key) and the system message: one key's prompt is
        never found faster for another."""
        if not (self.appends_locally and not tools and len(messages) >= 3
                and _line(messages[-1]) and _line(messages[-2])):
            return self.render(messages, tools)
        head = messages[:1] if messages[0]["role"] == "system" else ()
        key = (owner, head[0]["content"] if head else None)
        base = self._bases.get(key)
        if base is None:
            if len(self._bases) >= MAX_BASES:
                self._bases.clear()
            base = self._bases[key] = self._base(head)
        was, framing = base
        if framing is not None:
            return before + self.frame(framing, messages[-1]["content"])
        added = self._added(was, head, messages[-1])
        return self.render(messages, tools) if added is None else before + added

    def _base(self, head: Sequence[dict]) -> tuple[str, Split | None]:
        """The text of `head` (a system message, or none) and a stand-in line, and where
        the template frames lines (`frames_lines`), a line's framing after them."""
        was = self.render([*head, STAND_IN])
        return was, self._framing(head, was) if self.frames_lines else None

    def _framing(self, head: Sequence[dict], was: str) -> Split | None:
        """A line's framing after `head` and a stand-in line, whose text is `was` (None:
        the template does not render one as an extension of them)."""
        try:
            return self.split([*head, STAND_IN], None, "user", was, False)
        except InvalidInput:
            return None

    def _added(self, was: str, head: Sequence[dict], line: dict) -> str | None:
        """The text `line` adds after `head` (a system message, or none) and a stand-in line,
        whose text is `was` (None: not an extension of it)."""
        now = self.render([*head, STAND_IN, line])
        return now[len(was):] if now.startswith(was) else None

    def _appends_locally(self) -> bool:
        """Whether data lines of different lengths, after a system message or not, each add
        after the whole conversation the text they add after a stand-in line alone."""
        lines = [{"role": "user", "content": c} for c in
                 ("T1 101.5", "price 99.25 at 12:00, volume 1,200", "x", "a\nb 7", "last one")]
        for head in ([], [{"role": "system", "content": "You watch a price feed."}]):
            for n in range(2, len(lines) + 1):
                msgs = [*head, *lines[:n]]
                try:
                    added = self._added(self.render([*head, STAND_IN]), head, msgs[-1])
                    if added is None or self.render(msgs[:-1]) + added != self.render(msgs):
                        return False
                except InvalidInput:
                    return False
        return True

    def _frames_lines(self) -> bool:
        """Whether a data line's text is its content framed as it is (`frame`, the way a
        question's entry is made), after a system message or not: on lines padded, broken,
        quoting, holding template syntax, other scripts and markup."""
        for head in ([], [{"role": "system", "content": "You watch a price feed."}]):
            was = self.render([*head, STAND_IN])
            framing = self._framing(head, was)
            if framing is None:
                return False
            for content in LINE_PROBES:
                try:
                    added = self._added(was, head, {"role": "user", "content": content})
                except InvalidInput:
                    return False
                if added != self.frame(framing, content):
                    return False
        return True

    def _template(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                  generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as exc:  # jinja raises for conversations a template refuses
            raise InvalidInput(f"the chat template refused the conversation: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Rendered text's tokens: its control tokens are markup, its defused content plain
        characters."""
        if ESC in text:
            ids = self.controls.encode_pieces(text)
        elif self._direct is not None:
            ids = self._direct.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        objs = self._id_objects
        return [objs[t] if t < len(objs) else t for t in ids]

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt as the tokenizer takes it on its own: its special tokens (a BOS)
        added, no chat template."""
        if ESC in text:
            before, after = self.controls.prompt_frame
            return [*before, *self.controls.encode_pieces(text), *after]
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if len(ids) == 1:  # the first token of every answer: at most a vocabulary's strings
            text = self._one.get(ids[0])
            if text is None:
                text = self._one[ids[0]] = self.tokenizer.decode([ids[0]],
                                                                  skip_special_tokens=True)
            return text
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _pieces_agree(self) -> bool:
        """Whether tokenizing a rendering piece by piece (between its control tokens) gives
        the tokens of tokenizing it whole, on a probe conversation."""
        msgs = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello there, 12 apples?"},
                {"role": "assistant", "content": " Yes: 12.\n"},
                {"role": "user", "content": "ok"}]
        try:
            text = self._template(msgs, None, generation_prompt=True)
        except InvalidInput:
            return False
        return self.encode(text) == self.controls.encode_pieces(text)

    def split(self, messages: Sequence[dict], tools: Sequence[dict] | None, role: str,
              base_text: str, generation_prompt: bool = True) -> Split:
        """The text a new `role` message adds after `messages` (whose rendering is
        `base_text`), split at its content."""
        mark = SENTINEL
        while mark in base_text:  # never a string the conversation already holds
            mark += "x"
        text = self.render([*messages, {"role": role, "content": mark}], tools,
                           generation_prompt)
        added = text[len(base_text):]
        if not text.startswith(base_text) or added.count(mark) != 1:
            raise InvalidInput(f"the chat template does not render a {role!r} message "
                               "after the conversation as an extension of it")
        before, after = added.split(mark)
        return Split(before, after)

    def frame(self, split: Split, content: str) -> str:
        """The text of a message with this framing, as the template would render it."""
        content = content.strip() if self.trims_content else content
        return split.prefix + self.defuse(content) + split.suffix

    def header(self, messages: Sequence[dict], tools: Sequence[dict] | None,
               base_text: str) -> str:
        if not messages:  # templates refuse an empty conversation: take it after a probe
            probe = [{"role": "user", "content": SENTINEL}]
            base_text = self.render(probe, tools)
            messages = probe
        text = self.render(messages, tools, generation_prompt=True)
        if not text.startswith(base_text):
            raise InvalidInput("the chat template's generation prompt is not an extension")
        return text[len(base_text):]

    def _end_of_turn_ids(self) -> frozenset[int]:
        """Token ids that end an assistant turn: eos, and the first token the template puts
        after an assistant message's content."""
        ids: set[int] = set()
        self.closing_tokens = 0  # the tokens the template writes after an assistant message
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        try:
            msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}]
            after = self.render(msgs).split(SENTINEL, 1)[1]
            toks = self.encode(after)
            self.closing_tokens = len(toks)
            special = set(self.tokenizer.all_special_ids)
            if toks and toks[0] in special:
                ids.add(toks[0])
        except InvalidInput:
            pass
        return frozenset(ids)


# -- tool calls in generated text ---------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split generated assistant text into content and tool calls in prepos's own markup:
    `<tool_call>{json}</tool_call>` blocks, or a whole message that is one JSON object with
    "name" and "arguments"/"parameters". A chat format parses its template's family
    (`ChatFormat.parse_tool_calls`)."""
    return tool_formats.parse_prepos(text)


# -- tool calls a client sends ------------------------------------------------------------
def normalize_tool_call(call: object) -> dict:
    """A client's tool call (`{"function": {"name": ..., "arguments": ...}}`, the arguments
    a JSON object or its text, empty text for none) in the one form a session holds and the
    chat template renders. Arguments that are other text (a call cut off, not JSON) are kept
    as sent and rendered as they are. Refuses (InvalidInput) a call without a name, or whose
    arguments are neither text nor an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidInput("a tool call needs function.name")
    try:
        args = tool_formats.sent_arguments(fn.get("arguments", {}))
    except ValueError as exc:
        raise InvalidInput(f"tool call arguments must be a string (or a JSON object): "
                           f"{exc}") from None
    return tool_formats.call(fn["name"], args)


def _line(m: dict) -> bool:
    """Whether a message is a data line: a user message of text, nothing else."""
    return m["role"] == "user" and isinstance(m.get("content"), str) and len(m) == 2


def without_ids(m: dict) -> dict:
    """A message without the ids that pair tool calls with results (the session's form
    compares and renders without them)."""
    if "tool_call_id" not in m and not any("id" in c for c in m.get("tool_calls") or ()):
        return m
    out = {k: v for k, v in m.items() if k != "tool_call_id"}
    if m.get("tool_calls"):
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"}
                             for c in m["tool_calls"]]
    return out


def _marked_arguments(messages: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """The messages with each call's text arguments (not a JSON object) replaced by a mark
    the template writes as a string, and the text each mark stands for."""
    if not any(isinstance(c["function"].get("arguments"), str)
               for m in messages for c in m.get("tool_calls") or ()):
        return messages, {}
    base, blob = ARGS_MARK, json.dumps(messages)
    while base in blob:  # never a string the conversation holds
        base += "x"
    raw: dict[str, str] = {}
    out = []
    for m in messages:
        calls = []
        for c in m.get("tool_calls") or ():
            args = c["function"].get("arguments")
            if isinstance(args, str):
                mark = f"{base}{len(raw)}x"
                raw[mark] = args
                c = {**c, "function": {**c["function"], "arguments": mark}}
            calls.append(c)
        out.append({**m, "tool_calls": calls} if calls else m)
    return out, raw
