"""How an engine `Stream` becomes a response, for the session API and the OpenAI endpoints.

Not streamed: the result as one JSON body, once it is there (a client that leaves first
cancels it). Streamed: a finished stream (the fast path) is written as one response with its
path in the headers; an unfinished one as server-sent events while the model worker produces
them, with `X-Prepos-Path: pending` (the path comes in the last event), and a client that
leaves cancels it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

from prepos.core import Result
from prepos.decode.stream import Stream, TokenEvent
from prepos.errors import PreposError
from prepos.server.http import results
from prepos.server.http.direct import StageClock, Stages
from prepos.server.http.errors import as_api_error, error_body
from prepos.server.http.sse import HEADERS as SSE_HEADERS
from prepos.server.http.sse import EventStream, event

Chunks = Callable[[AsyncIterator], AsyncIterator[bytes]]  # stream events -> response bytes


async def result(state, stream: Stream, receive,
                 cleanup: Callable[[], None] | None = None) -> Result:
    """The stream's result, for a response that is not streamed (the stream cancelled if the
    wait fails); `cleanup` either way."""
    try:
        return await state.result(stream, receive)
    except BaseException:
        stream.cancel()
        raise
    finally:
        if cleanup is not None:
            cleanup()


def guarded(chunks: Chunks, cleanup: Callable[[], None] | None = None,
            error_event: str | None = None, last: bytes = b"") -> Chunks:
    """SSE framing around a chunk generator: an error event (named `error_event`) if it
    fails, `cleanup` either way, then `last`."""

    async def run(source):
        try:
            async for c in chunks(source):
                yield c
        except Exception as exc:
            err = as_api_error(exc)
            yield event(error_body(err.status, err.code, err.message, err.param), error_event)
        finally:
            if cleanup is not None:
                cleanup()
        if last:
            yield last

    return run


async def timed(events: AsyncIterator[TokenEvent], stages: Stages
                ) -> AsyncIterator[TokenEvent]:
    """A stream's events, each one's time through the server observed by stage
    (`metrics.TOKEN_STAGES`: engine, handoff, respond)."""
    clock = StageClock(stages)
    async for ev in events:
        since = clock.taken(ev)
        yield ev
        clock.answered(since)


async def stream_response(stream: Stream, chunks: Chunks, sid: str | None,
                          stages: Stages, direct: bool = False) -> Response:
    """A finished stream (the fast path) is written as one response with its path in the
    headers; otherwise the chunks are streamed as the model worker produces them, each
    token's stages observed (`stages`: `Metrics.token_stages`). `direct`: `chunks` awaits
    nothing but its events, so the stream's producer may write them (`direct.py`, which
    observes the stages itself)."""
    if stream.done:
        async def done_source():
            for ev in stream:
                yield ev

        body = b"".join([c async for c in chunks(done_source())])
        try:
            headers = results.headers(stream.result(), sid)
        except PreposError:
            headers = {}
        return Response(body, headers={**headers, **SSE_HEADERS},
                        media_type="text/event-stream")
    return EventStream(chunks(timed(stream.aiter(), stages)),
                       headers={**results.pending_headers(sid), **SSE_HEADERS},
                       on_disconnect=stream.cancel, on_write=stages["write"],
                       direct=(stream, chunks, stages) if direct else None)
