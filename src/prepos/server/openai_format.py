"""OpenAI response bodies: chat completions and text completions, whole or as streamed
chunks, each with the `prepos` extension field (path, match, gate gap, timing); logprobs in
each API's format; tool calls parsed out of the generated text, and withheld from a streamed
answer while they may be a tool call's markup."""

from __future__ import annotations

import json
import time
import uuid

from starlette.responses import Response

from prepos.core import Result
from prepos.entries import ChatFormat, parse_tool_calls
from prepos.server import results, streaming
from prepos.server.schemas import ChatCompletion, Completion
from prepos.server.sse import event
from prepos.stream import Stream

TOOL_MARKS = ("<tool_call>",)
DONE = b"data: [DONE]\n\n"


def finish_reason(res: Result) -> str:
    return "length" if res.finish_reason == "length" else "stop"


def _token_lp(chat_format: ChatFormat, token: int, logprob: float) -> dict:
    text = chat_format.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def message(res: Result, agentic: bool) -> tuple[dict, str]:
    """The assistant message of a chat answer, and its finish reason."""
    content, calls = parse_tool_calls(res.text) if agentic else (res.text, [])
    msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        msg["tool_calls"] = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"]["arguments"])}}
                             for c in calls]
        return msg, "tool_calls"
    return msg, finish_reason(res)


def safe_prefix(text: str) -> int:
    """How much of `text` cannot be part of a tool call's markup: everything before the
    first mark (or a partial one at the end); nothing if it opens like a JSON call."""
    if text.lstrip().startswith("{"):
        return 0
    cut = len(text)
    for mark in TOOL_MARKS:
        i = text.find(mark)
        if i >= 0:
            cut = min(cut, i)
        for k in range(min(len(mark) - 1, len(text)), 0, -1):
            if text.endswith(mark[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class Reply:
    """What every response of one request shares: its id, creation time and model."""

    def __init__(self, state, request: ChatCompletion | Completion, sid: str | None,
                 prefix: str, obj: str, chunk_obj: str):
        self.request = request
        self.sid = sid
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = state.model_name
        self.object = obj
        self.chunk_object = chunk_obj
        self.chat_format: ChatFormat = state.engine.fmt

    def body(self, chunk: bool = False, **fields) -> dict:
        return {"id": self.id, "object": self.chunk_object if chunk else self.object,
                "created": self.created, "model": self.model, **fields}

    def usage_chunk(self, res: Result) -> bytes:
        return event(self.body(True, choices=[], usage=results.usage(res)))

    def whole(self, res: Result) -> Response:
        raise NotImplementedError

    def chunks(self, stream: Stream) -> streaming.Chunks:
        raise NotImplementedError


async def respond(reply: Reply, state, receive, stream: Stream, cleanup=None,
) -> Response:
    """The answer: one JSON body, or chunks (`stream: true`) ending in `[DONE]`."""
    if not reply.request.stream:
        return reply.whole(await streaming.result(state, stream, receive, cleanup))
    chunks = streaming.guarded(reply.chunks(stream), cleanup, last=DONE)
    return await streaming.stream_response(stream, chunks, reply.sid)


# -- chat ---------------------------------------------------------------------------------
class ChatReply(Reply):
    def __init__(self, state, body: ChatCompletion, sid: str | None, agentic: bool,
                 tools: bool):
        super().__init__(state, body, sid, "chatcmpl-", "chat.completion",
                         "chat.completion.chunk")
        self.agentic = agentic
        self.tools = tools
        self.logprobs = bool(body.logprobs)
        self.top = body.top_logprobs or 0

    def whole(self, res: Result) -> Response:
        msg, finish = message(res, self.agentic)
        choice = {"index": 0, "message": msg, "finish_reason": finish,
                  "logprobs": {"content": self._logprobs(res)} if self.logprobs else None}
        out = self.body(choices=[choice], usage=results.usage(res), system_fingerprint=None,
                        prepos=results.extension(res, self.sid))
        return results.json_response(out, headers=results.headers(res, self.sid))

    def _chunk(self, delta: dict, finish=None, logprobs=None, **extra) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return event(self.body(True, system_fingerprint=None, choices=[choice], **extra))

    def chunks(self, stream: Stream) -> streaming.Chunks:
        async def run(source):
            first = True
            held = ""  # text withheld while it may be a tool call's markup
            sent = ""
            async for ev in source:
                delta: dict = {"role": "assistant"} if first else {}
                text = ev.text
                if self.tools:
                    held += text
                    safe = safe_prefix(sent + held) - len(sent)
                    text, held = held[:max(safe, 0)], held[max(safe, 0):]
                lp = None
                if self.logprobs and ev.token >= 0 and ev.logprob is not None:
                    lp = {"content": [self._entry(ev.token, ev.logprob, ev.top)]}
                if not text and lp is None and not first:
                    continue
                delta["content"] = text
                sent += text
                first = False
                yield self._chunk(delta, logprobs=lp)
            res = stream.result()
            msg, finish = message(res, self.agentic)
            final: dict = {"role": "assistant"} if first else {}
            content = msg.get("content") or ""
            if content.startswith(sent) and len(content) > len(sent):
                final["content"] = content[len(sent):]
            if msg.get("tool_calls"):
                final["tool_calls"] = [{"index": i, **c}
                                       for i, c in enumerate(msg["tool_calls"])]
            yield self._chunk(final, finish, prepos=results.extension(res, self.sid))
            if self.include_usage:
                yield self.usage_chunk(res)

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
    def __init__(self, state, body: Completion, sid: str | None):
        super().__init__(state, body, sid, "cmpl-", "text_completion", "text_completion")
        self.want_lp = body.logprobs is not None
        self.top = body.logprobs or 0

    def _lp_block(self, tokens, lps, tops, offset0: int) -> dict:
        fmt = self.chat_format
        texts = [fmt.decode([t]) for t in tokens]
        offsets, at = [], offset0
        for t in texts:
            offsets.append(at)
            at += len(t)
        listed = None
        if self.top:  # keyed by text (the legacy format): of equal texts the likeliest stays
            listed = []
            for t, lp, alt in zip(texts, lps, tops or [None] * len(texts)):
                step: dict[str, float] = {}
                for i, alt_lp in alt or [(None, lp)]:
                    step.setdefault(t if i is None else fmt.decode([i]), alt_lp)
                listed.append(step)
        return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": listed,
                "text_offset": offsets}

    def whole(self, res: Result) -> Response:
        choice = {"index": 0, "text": res.text, "finish_reason": finish_reason(res),
                  "logprobs": self._lp_block(res.tokens, res.logprobs, res.top_logprobs, 0)
                  if self.want_lp else None}
        out = self.body(choices=[choice], usage=results.usage(res),
                        prepos=results.extension(res, self.sid))
        return results.json_response(out, headers=results.headers(res, self.sid))

    def _chunk(self, text: str, finish=None, logprobs=None, **extra) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return event(self.body(True, choices=[choice], **extra))

    def chunks(self, stream: Stream) -> streaming.Chunks:
        async def run(source):
            at = 0
            async for ev in source:
                lp = None
                if self.want_lp and ev.token >= 0 and ev.logprob is not None:
                    lp = self._lp_block([ev.token], [ev.logprob], [ev.top], at)
                if not ev.text and lp is None:
                    continue
                at += len(ev.text)
                yield self._chunk(ev.text, logprobs=lp)
            res = stream.result()
            yield self._chunk("", finish_reason(res), prepos=results.extension(res, self.sid))
            if self.include_usage:
                yield self.usage_chunk(res)

        return run
