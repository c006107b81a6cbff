"""Responses API bodies: the response object (`openai.types.responses.Response`) of a
finished answer, whole or as the Responses event stream (`response.created`, ...,
`response.completed`), each event with its `type` and `sequence_number`.

An answer's text is a `message` item with one `output_text` part; its tool calls, parsed in
the model's family as the chat route parses them (`openai_format.message`), are
`function_call` items with the `call_id` a `function_call_output` answers. Streamed text
that may be a tool call's markup is withheld until it is known not to be (as chat's chunks
are); the calls are sent whole at the end (`response.function_call_arguments.delta` and
`.done`). A response cut at `max_output_tokens` is `incomplete`, its reason
`max_output_tokens`; a call it was cut in is a `function_call` item `incomplete` too, its
`arguments` the raw text written so far (`cut_calls.cut_call`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.responses import Response

from prepos.chat import tool_formats
from prepos.core import Result
from prepos.decode.stream import Stream
from prepos.server.http import results, streaming
from prepos.server.http.errors import as_api_error
from prepos.server.http.sse import event
from prepos.server.openai.chat_reply import message


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class Reply:
    """One response being made: its id, the request's settings it echoes, and what happens
    to the finished object (`save`: stored, where the request asked)."""

    state: object
    echo: dict  # the request's settings as the response object carries them
    stream: bool
    save: Callable[[dict, Result], Awaitable[None]] | None = None  # stored off the loop
    kept: bool = True  # the prompt stays in a kept session's KV (cache_write_tokens)
    id: str = field(default_factory=lambda: new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    msg_id: str = field(default_factory=lambda: new_id("msg_"))
    # the answer's parse (set by the flow): agentic (calls parsed), the tool-call opening it
    # continued, the function it must call, whether several calls are allowed
    agentic: bool = False
    tools: bool = False
    prefix: str = ""
    forced: str | None = None
    parallel: bool = True
    sid: str | None = None

    # -- the object --------------------------------------------------------------------
    def body(self, status: str, output: list[dict], res: Result | None = None) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created_at,
               "status": status, "background": False, "error": None,
               "incomplete_details": None, "completed_at": None, "output": output,
               "usage": None, **self.echo}
        if res is not None:
            out["completed_at"] = int(time.time())
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["usage"] = self.usage(res)
            out["prepos"] = results.extension(res, self.sid)
        return out

    def usage(self, res: Result) -> dict:
        cached = results.cached_prompt_tokens(res)
        written = res.prompt_tokens - cached if self.kept else 0
        return {"input_tokens": res.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached,
                                         "cache_write_tokens": written},
                "output_tokens": len(res.tokens),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": res.prompt_tokens + len(res.tokens)}

    def output(self, res: Result) -> tuple[str, str | None, list[dict]]:
        """The answer's status, text (None where it is only calls) and function calls."""
        fmt = self.state.engine.fmt.tool_format
        msg, _ = message(res, self.agentic, self.prefix, self.forced, self.parallel, fmt)
        status = "incomplete" if res.finish_reason == "length" else "completed"
        calls = [self.call_item(c, status) for c in msg.get("tool_calls") or ()]
        content = msg.get("content")
        return status, content if content or not calls else None, calls

    def message_item(self, text: str, status: str) -> dict:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "status": status,
                "content": [self.part(text)] if status != "in_progress" else []}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def call_item(call: dict, status: str) -> dict:
        return {"id": new_id("fc_"), "type": "function_call", "status": status,
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"]}

    async def finished(self, res: Result) -> dict:
        status, text, calls = self.output(res)
        items = ([self.message_item(text, status)] if text is not None else []) + calls
        obj = self.body(status, items, res)
        if self.save is not None:
            await self.save(obj, res)
        return obj

    # -- the HTTP answer -----------------------------------------------------------------
    async def respond(self, receive, streams: list[Stream], cleanup=None) -> Response:
        state, (stream,) = self.state, streams  # one choice
        if not self.stream:
            res = await streaming.result(state, stream, receive, cleanup)
            return results.JSONBody(await self.finished(res),
                                         headers=results.headers(res, self.sid))
        return await streaming.stream_response(stream, self._guarded(stream, cleanup),
                                               self.sid, state.metrics.token_stages)

    def _guarded(self, stream: Stream, cleanup) -> streaming.Chunks:
        async def run(source):
            events = Events()
            try:
                async for chunk in self._events(stream, events)(source):
                    yield chunk
            except Exception as exc:
                err = as_api_error(exc)
                yield events.emit("error", code=err.code, message=err.message,
                                  param=err.param)
                failed = self.body("failed", [])
                failed["error"] = {"code": "rate_limit_exceeded" if err.status == 429
                                   else "server_error", "message": err.message}
                yield events.emit("response.failed", response=failed)
            finally:
                if cleanup is not None:
                    cleanup()

        return run

    def _events(self, stream: Stream, ev: Events) -> streaming.Chunks:
        async def run(source):
            started = self.body("in_progress", [])
            yield ev.emit("response.created", response=started)
            yield ev.emit("response.in_progress", response=started)
            where = {"item_id": self.msg_id, "output_index": 0}
            out = tool_formats.Withheld(self.state.engine.fmt.tool_format, self.tools,
                                        self.prefix)
            opened = False
            async for token in source:
                text = out.feed(token.text)
                if not text:
                    continue
                if not opened:
                    opened = True
                    for chunk in self._open(ev, where):
                        yield chunk
                yield ev.emit("response.output_text.delta", **where, content_index=0,
                              delta=text, logprobs=[])
            sent = out.sent
            res = stream.result()
            status, content, calls = self.output(res)
            items = []
            if content is not None or opened:
                if not opened:
                    opened = True
                    for chunk in self._open(ev, where):
                        yield chunk
                if content is not None and content.startswith(sent) and len(content) > len(sent):
                    yield ev.emit("response.output_text.delta", **where, content_index=0,
                                  delta=content[len(sent):], logprobs=[])
                    sent = content
                item = self.message_item(sent, status)
                yield ev.emit("response.output_text.done", **where, content_index=0,
                              text=sent, logprobs=[])
                yield ev.emit("response.content_part.done", **where, content_index=0,
                              part=self.part(sent))
                yield ev.emit("response.output_item.done", output_index=0, item=item)
                items.append(item)
            for call in calls:
                at = {"item_id": call["id"], "output_index": len(items)}
                yield ev.emit("response.output_item.added", output_index=len(items),
                              item={**call, "arguments": "", "status": "in_progress"})
                yield ev.emit("response.function_call_arguments.delta", **at,
                              delta=call["arguments"])
                yield ev.emit("response.function_call_arguments.done", **at,
                              name=call["name"], arguments=call["arguments"])
                yield ev.emit("response.output_item.done", output_index=len(items), item=call)
                items.append(call)
            obj = self.body(status, items, res)
            if self.save is not None:
                await self.save(obj, res)
            yield ev.emit("response.completed" if status == "completed"
                          else "response.incomplete", response=obj)

        return run

    def _open(self, ev: Events, where: dict):
        yield ev.emit("response.output_item.added", output_index=0,
                      item=self.message_item("", "in_progress"))
        yield ev.emit("response.content_part.added", **where, content_index=0,
                      part=self.part(""))


class Events:
    """The stream's events, numbered in order."""

    def __init__(self):
        self.n = 0

    def emit(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return event(data, kind)
