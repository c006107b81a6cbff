"""OpenAI response bodies: chat completions and text completions, whole or as streamed
chunks, each with the `prepos` extension field (path, match, gate gap, timing); logprobs in
each API's format; tool calls parsed out of the generated text, and withheld from a streamed
answer while they may be a tool call's markup."""

from __future__ import annotations

import copy
import json
import time
import uuid

from starlette.responses import Response

from prepos.chat import cut_calls, tool_formats
from prepos.chat.format import ChatFormat
from prepos.chat.tool_formats import PREPOS, ToolFormat
from prepos.core import Result
from prepos.decode.stream import Stream
from prepos.server.http import results, streaming
from prepos.server.http.request_bodies import ChatCompletion, Completion
from prepos.server.http.results import json_bytes
from prepos.server.http.sse import HEADERS as SSE_HEADERS
from prepos.server.http.sse import EventStream, event

DONE = b"data: [DONE]\n\n"


def finish_reason(res: Result) -> str:
    return "length" if res.finish_reason == "length" else "stop"


def _token_lp(chat_format: ChatFormat, token: int, logprob: float) -> dict:
    text = chat_format.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def message(res: Result, agentic: bool, prefix: str = "",
            forced: dict[str, str] | None = None, parallel: bool = True,
            fmt: ToolFormat = PREPOS) -> tuple[dict, str]:
    """The assistant message of a chat answer, and its finish reason ("length" when cut by
    max_tokens, a call or not, as OpenAI's). `prefix`: the text the answer continued (a
    tool call's opening); `forced`: the openings of the functions it must call, by name:
    the answer is its calls alone (`forced_calls`), content null beside them; `fmt`: the
    tool-call markup of the model's family. A turn cut inside a call returns that call as
    far as it was written, its arguments the raw text so far (`cut_calls.cut_call`),
    and none of its markup in the content."""
    text = prefix + res.text
    cut = res.finish_reason == "length"
    last = None  # the call the answer was cut in
    if agentic and (cut or forced):
        text, last = cut_calls.cut_call(text, fmt, forced)
    if forced:
        calls = forced_calls(text, forced)
        content = ""
    else:
        content, calls = fmt.parse(text) if agentic else (res.text, [])
    if last is not None:  # the text beside it trimmed, as the parsers trim it beside calls
        content, calls = content.strip(), [*calls, last]
    if not parallel:
        calls = calls[:1]
    msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        msg["tool_calls"] = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"]["arguments"])}}
                             for c in calls]
    return msg, finish_reason(res) if cut or not calls else "tool_calls"


def forced_calls(text: str, forced: dict[str, str]) -> list[dict]:
    """The whole calls of a forced answer: each where a function's opening (as the answer
    shows it) starts, its arguments the JSON object after it (the call it was cut in is
    read by `cut_calls.cut_call`). What lies between calls (a closing, a separator) is
    markup."""
    calls: list[dict] = []
    at = 0
    dec = json.JSONDecoder()
    while True:
        found = [(i, name, op) for name, op in forced.items()
                 if (i := text.find(op.lstrip(), at)) >= 0]
        if not found:
            return calls
        i, name, opening = min(found)
        at = i + len(opening.lstrip())
        try:
            args, end = dec.raw_decode(text, at)
        except (ValueError, RecursionError):
            return calls
        if not isinstance(args, dict):
            return calls
        calls.append({"function": {"name": name, "arguments": args}})
        at = end


def _arguments(args) -> str:
    return args if isinstance(args, str) else json.dumps(args)


class Reply:
    """What every response of one request shares: its id, creation time and model; `index`
    is the choice a copy of it writes."""

    def __init__(self, state, request: ChatCompletion | Completion, sid: str | None,
                 prefix: str, obj: str, chunk_obj: str):
        self.state = state
        self.request = request
        self.sid = sid
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = state.model_name
        self.object = obj
        self.chunk_object = chunk_obj
        self.chat_format: ChatFormat = state.engine.fmt
        self.index = 0
        self.per_prompt = 1  # choices per prompt (completions: n)

    async def respond(self, receive, streams: list[Stream], cleanup=None) -> Response:
        """The answer: one JSON body, or chunks (`stream: true`) ending in `[DONE]`; one choice
        per stream."""
        if not self.request.stream:
            try:
                done = [await self.state.result(s, receive) for s in streams]
            except BaseException:
                for s in streams:
                    s.cancel()
                raise
            finally:
                if cleanup is not None:
                    cleanup()
            return self.whole(done)
        if len(streams) == 1:
            chunks = streaming.guarded(self.chunks(streams[0]), cleanup, last=DONE)
            return await streaming.stream_response(streams[0], chunks, self.sid,
                                                   self.state.metrics.token_stages, direct=True)

        async def each(_source):  # the choices one after the other, each with its index
            for i, stream in enumerate(streams):
                one = self.at(i)
                one.include_usage = False  # once, for all the choices, at the end
                async for c in one.chunks(stream)(stream.aiter()):
                    yield c
            if self.include_usage:
                yield self.usage_chunk([s.result() for s in streams])

        def cancel_all():
            for s in streams:
                s.cancel()

        chunks = streaming.guarded(each, cleanup, last=DONE)
        return EventStream(chunks(None), headers={**results.pending_headers(self.sid),
                                                  **SSE_HEADERS}, on_disconnect=cancel_all)

    def at(self, index: int) -> Reply:
        other = copy.copy(self)
        other.index = index
        return other

    def body(self, chunk: bool = False, **fields) -> dict:
        return {"id": self.id, "object": self.chunk_object if chunk else self.object,
                "created": self.created, "model": self.model, **fields}

    def usage(self, results_: list[Result]) -> dict:
        """Usage of all choices: each prompt counted once, every choice's completion."""
        prompts = results_[::self.per_prompt]
        out = {"prompt_tokens": sum(r.prompt_tokens for r in prompts),
               "completion_tokens": sum(len(r.tokens) for r in results_)}
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        cached = sum(results.cached_prompt_tokens(r) for r in prompts)
        out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    def usage_chunk(self, results_: list[Result]) -> bytes:
        return event(self.body(True, choices=[], usage=self.usage(results_)))

    def choice(self, res: Result) -> dict:
        raise NotImplementedError

    def chunks(self, stream: Stream) -> streaming.Chunks:
        raise NotImplementedError

    def whole(self, results_: list[Result]) -> Response:
        first = results_[0]
        out = self.body(choices=[self.at(i).choice(r) for i, r in enumerate(results_)],
                        usage=self.usage(results_), prepos=results.extension(first, self.sid))
        if self.object == "chat.completion":
            out["system_fingerprint"] = None
        if len(results_) > 1:
            out["prepos"]["choices"] = [results.extension(r, self.sid) for r in results_]
        return results.JSONBody(out, headers=results.headers(first, self.sid))


# -- chat ---------------------------------------------------------------------------------
class ChatReply(Reply):
    """A chat completion's reply. The flow (`flow.ChatCall`) tells it how the answer is
    parsed (`sid`, `agentic`, `tools`, `prefix`, `forced`, `parallel`), then asks it to
    `respond`."""

    def __init__(self, state, body: ChatCompletion, sid: str | None = None,
                 agentic: bool = False, tools: bool = False, prefix: str = "",
                 forced: dict[str, str] | None = None, parallel: bool = True):
        super().__init__(state, body, sid, "chatcmpl-", "chat.completion",
                         "chat.completion.chunk")
        self.agentic = agentic
        self.tools = tools
        self.prefix = prefix  # the tool call's opening the answer continues
        self.forced = forced
        self.parallel = parallel
        self.logprobs = bool(body.logprobs)
        self.top = body.top_logprobs or 0

    def message(self, res: Result) -> tuple[dict, str]:
        return message(res, self.agentic, self.prefix, self.forced, self.parallel,
                       self.chat_format.tool_format)

    def choice(self, res: Result) -> dict:
        msg, finish = self.message(res)
        return {"index": self.index, "message": msg, "finish_reason": finish,
                "logprobs": {"content": self._logprobs(res)} if self.logprobs else None}

    def _chunk(self, delta: dict, finish=None, logprobs=None, **extra) -> bytes:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish}
        return event(self.body(True, system_fingerprint=None, choices=[choice], **extra))

    def _content_frame(self) -> tuple[bytes, bytes]:
        """A text delta's chunk, `_chunk({"content": text})`, as what comes before the text's
        JSON string and what comes after it: the same for every token of the answer."""
        key = b'{"content":'
        whole = self._chunk({"content": ""})
        i = whole.rindex(key + b'""}') + len(key)  # a string's quotes are escaped: found once
        return whole[:i], whole[i + 2:]

    def chunks(self, stream: Stream) -> streaming.Chunks:
        async def run(source):
            # the first chunk carries the role only, as OpenAI's does; then the content
            yield self._chunk({"role": "assistant", "content": ""})
            head, tail = self._content_frame()
            held = self.prefix  # text withheld while it may be a tool call's markup
            sent = ""
            async for ev in source:
                text = ev.text
                if self.tools:
                    held += text
                    safe = tool_formats.safe_prefix(sent + held,
                                                    self.chat_format.tool_format) - len(sent)
                    text, held = held[:max(safe, 0)], held[max(safe, 0):]
                lp = None
                if self.logprobs and ev.token >= 0 and ev.logprob is not None:
                    lp = {"content": [self._entry(ev.token, ev.logprob, ev.top)]}
                if not text and lp is None:
                    continue
                sent += text
                yield (head + json_bytes(text) + tail if lp is None
                       else self._chunk({"content": text}, logprobs=lp))
            res = stream.result()
            msg, finish = self.message(res)
            final: dict = {}
            content = msg.get("content") or ""
            if content.startswith(sent) and len(content) > len(sent):
                final["content"] = content[len(sent):]
            if msg.get("tool_calls"):
                final["tool_calls"] = [{"index": i, **c}
                                       for i, c in enumerate(msg["tool_calls"])]
            yield self._chunk(final, finish, prepos=results.extension(res, self.sid))
            if self.include_usage:
                yield self.usage_chunk([res])

        return run

    def _entry(self, token: int, logprob: float, top) -> dict:
        fmt = self.chat_format
        entry = _token_lp(fmt, token, logprob)
        entry["top_logprobs"] = ([_token_lp(fmt, t, lp) for t, lp in top] if top
                                 else [dict(entry)] if self.top else [])
        return entry

    def _logprobs(self, res: Result) -> list[dict]:
        tops = res.top_logprobs or [None] * len(res.tokens)
        return [self._entry(t, lp, top) for t, lp, top in zip(res.tokens, res.logprobs, tops)]


# -- completions --------------------------------------------------------------------------
class CompletionReply(Reply):
    def __init__(self, state, body: Completion, sid: str | None,
                 echo: list[str] | None = None, per_prompt: int = 1):
        super().__init__(state, body, sid, "cmpl-", "text_completion", "text_completion")
        self.want_lp = body.logprobs is not None  # logprobs: 0 too (the sampled token's)
        self.echo = echo  # the prompts, when they are echoed before each completion
        self.per_prompt = per_prompt

    def _echoed(self) -> str:
        return self.echo[self.index // self.per_prompt] if self.echo else ""

    def _lp_block(self, tokens, lps, tops, offset0: int) -> dict:
        fmt = self.chat_format
        texts = [fmt.decode([t]) for t in tokens]
        offsets, at = [], offset0
        for t in texts:
            offsets.append(at)
            at += len(t)
        # keyed by text (the legacy format): the `logprobs` likeliest, of equal texts the
        # likeliest, then the sampled token if it is not among them (OpenAI: up to
        # logprobs + 1 entries, so `logprobs: 0` lists the sampled token alone)
        listed = []
        for t, lp, alt in zip(texts, lps, tops or [None] * len(texts)):
            step: dict[str, float] = {}
            for i, alt_lp in alt or ():
                step.setdefault(fmt.decode([i]), alt_lp)
            step.setdefault(t, lp)
            listed.append(step)
        return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": listed,
                "text_offset": offsets}

    def _prompt_block(self, prompt: list | None) -> dict:
        """The echoed prompt's logprobs, as OpenAI's legacy API lists them: the first
        token's logprob and top_logprobs null."""
        prompt = prompt or []
        block = self._lp_block([t for t, _, _ in prompt], [lp for _, lp, _ in prompt],
                               [top for _, _, top in prompt], 0)
        if prompt:
            block["top_logprobs"][0] = None
        return block

    def choice(self, res: Result) -> dict:
        lp = None
        if self.want_lp:
            lp = self._lp_block(res.tokens, res.logprobs, res.top_logprobs, 0)
            if self.echo:  # the prompt's tokens first, then the answer's after its text
                head = self._prompt_block(res.prompt_logprobs)
                shift = len(self._echoed())
                lp = {k: head[k] + ([o + shift for o in lp[k]] if k == "text_offset"
                                    else lp[k]) for k in lp}
        return {"index": self.index, "text": self._echoed() + res.text,
                "finish_reason": finish_reason(res), "logprobs": lp}

    def _chunk(self, text: str, finish=None, logprobs=None, **extra) -> bytes:
        choice = {"index": self.index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish}
        return event(self.body(True, choices=[choice], **extra))

    def chunks(self, stream: Stream) -> streaming.Chunks:
        async def run(source):
            at = 0
            # the echo with the prompt's logprobs waits for them (they come before the first
            # token); without logprobs it goes at once
            echo = bool(self.echo)
            if echo and not self.want_lp:
                yield self._chunk(self._echoed())
                echo = False
            async for ev in source:
                if echo:
                    yield self._chunk(self._echoed(),
                                      logprobs=self._prompt_block(stream.prompt_logprobs))
                    at, echo = len(self._echoed()), False
                lp = None
                if self.want_lp and ev.token >= 0 and ev.logprob is not None:
                    lp = self._lp_block([ev.token], [ev.logprob], [ev.top], at)
                if not ev.text and lp is None:
                    continue
                at += len(ev.text)
                yield self._chunk(ev.text, logprobs=lp)
            res = stream.result()
            if echo:  # no token came: the prompt's logprobs are in the result
                yield self._chunk(self._echoed(),
                                  logprobs=self._prompt_block(res.prompt_logprobs))
            yield self._chunk("", finish_reason(res), prepos=results.extension(res, self.sid))
            if self.include_usage:
                yield self.usage_chunk([res])

        return run
