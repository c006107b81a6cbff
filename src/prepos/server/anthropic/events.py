"""A Message answered whole, or as Anthropic's event stream.

The stream is Anthropic's, event for event (`event: NAME` and `data: JSON`, each data with
its `type`): `message_start` (the message, its content empty), `ping`, then each content
block as `content_block_start`, its deltas (`text_delta`; a `tool_use` block's input as
`input_json_delta` `partial_json`) and `content_block_stop`, then `message_delta` (the stop
reason and stop sequence, and the usage) and `message_stop`. A failure after the stream has
begun is an `error` event in Anthropic's error shape.

Streamed text that may be a tool call's markup is withheld until it is known not to be (as
the chat route's chunks are); the calls are sent whole at the end, each as one block, its
input as one `input_json_delta` (a call cut by max_tokens: its input as far as it was
read, so the SDK's accumulator rebuilds the input a create returns).
`message_start` goes out with the first token, once the prompt is placed, its usage the
prompt's (input and cache read tokens); `message_delta` carries the whole usage (input,
cache read and output tokens), and the SDK's accumulator takes it from there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from starlette.responses import Response

from prepos.chat import tool_formats
from prepos.core import Result
from prepos.decode.stream import Stream
from prepos.server.http import results, streaming
from prepos.server.http.errors import as_api_error
from prepos.server.http.sse import event
from prepos.server.openai.chat_reply import message

from . import translate as T
from .errors import error_body


@dataclass
class MessageReply:
    """One message being answered: its id and model, the stop sequences it was asked to
    stop at, and (set by the flow) how its text is parsed for tool calls."""

    state: object
    model: str
    stream: bool
    stops: tuple[str, ...] = ()
    id: str = field(default_factory=lambda: T.new_id("msg_"))
    rename: object = None  # an error as the client names its fields (routes.Renamer)
    # the answer's parse, set by the flow: agentic (calls parsed), tools (withheld while they
    # may be a call), the call opening it continued, the functions it must call, parallel
    agentic: bool = False
    tools: bool = False
    prefix: str = ""
    forced: dict | None = None
    parallel: bool = True
    sid: str | None = None

    # -- the message ---------------------------------------------------------------------
    def body(self, content: list[dict], reason: str | None, stopped: str | None,
             res: Result | None) -> dict:
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": content, "stop_reason": reason, "stop_sequence": stopped,
               "usage": T.usage(res)}
        if res is not None:
            out["prepos"] = results.extension(res, self.sid)
        return out

    def parts(self, res: Result) -> tuple[str, list[dict], str, str | None]:
        """The answer's text, tool_use blocks, stop reason and stop sequence."""
        fmt = self.state.engine.fmt
        msg, finish = message(res, self.agentic, self.prefix, self.forced, self.parallel,
                              fmt.tool_format)
        uses = T.tool_uses(msg.get("tool_calls") or [])
        stopped = None if uses else T.stop_sequence(fmt, res, self.stops)
        return msg.get("content") or "", uses, T.stop_reason(finish, uses, stopped), stopped

    def whole(self, res: Result) -> dict:
        text, uses, reason, stopped = self.parts(res)
        content = ([{"type": "text", "text": text}] if text else []) + uses
        return self.body(content, reason, stopped, res)

    # -- the HTTP answer -----------------------------------------------------------------
    async def respond(self, receive, streams: list[Stream], cleanup=None) -> Response:
        state, (stream,) = self.state, streams  # one choice
        if not self.stream:
            res = await streaming.result(state, stream, receive, cleanup)
            return results.JSONBody(self.whole(res), headers=results.headers(res, self.sid))
        return await streaming.stream_response(stream, self._guarded(stream, cleanup),
                                               self.sid, state.metrics.token_stages)

    def _guarded(self, stream: Stream, cleanup) -> streaming.Chunks:
        async def run(source):
            try:
                async for chunk in self._events(stream)(source):
                    yield chunk
            except Exception as exc:
                err = as_api_error(exc)
                if self.rename is not None:
                    err = self.rename(err)
                yield emit("error", error=error_body(err)[1]["error"])
            finally:
                if cleanup is not None:
                    cleanup()

        return run

    def _events(self, stream: Stream) -> streaming.Chunks:
        def start() -> bytes:
            msg = self.body([], None, None, None)
            msg["usage"] = T.placed_usage(stream)
            return emit("message_start", message=msg) + emit("ping")

        async def run(source):
            out = tool_formats.Withheld(self.state.engine.fmt.tool_format, self.tools,
                                        self.prefix)
            started = opened = False
            async for token in source:
                if not started:  # the prompt is placed by the first token
                    started = True
                    yield start()
                text = out.feed(token.text)
                if not text:
                    continue
                if not opened:
                    opened = True
                    yield _text_start(0)
                yield _text_delta(0, text)
            if not started:
                yield start()
            sent = out.sent
            res = stream.result()
            text, uses, reason, stopped = self.parts(res)
            index = 0
            if text or opened:
                if not opened:
                    yield _text_start(0)
                if text.startswith(sent) and len(text) > len(sent):
                    yield _text_delta(0, text[len(sent):])
                yield emit("content_block_stop", index=0)
                index = 1
            for use in uses:
                yield emit("content_block_start", index=index,
                           content_block={**use, "input": {}})
                yield emit("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": json.dumps(use["input"])})
                yield emit("content_block_stop", index=index)
                index += 1
            yield emit("message_delta", delta={"stop_reason": reason, "stop_sequence": stopped},
                       usage=T.usage(res), prepos=results.extension(res, self.sid))
            yield emit("message_stop")

        return run


def emit(kind: str, **fields) -> bytes:
    """One event: `event: kind`, its data carrying `type: kind`."""
    return event({"type": kind, **fields}, kind)


def _text_start(index: int) -> bytes:
    return emit("content_block_start", index=index, content_block={"type": "text", "text": ""})


def _text_delta(index: int, text: str) -> bytes:
    return emit("content_block_delta", index=index, delta={"type": "text_delta", "text": text})
