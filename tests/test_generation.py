"""Assembling a request's output: cancellation by the reader; the stream's hand-off from the
producer's thread to an async reader."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.core import AnswerPath, Match, Result, SamplingParams
from prepos.decode.generation import Generation
from prepos.decode.stream import Stream


def test_generation_stops_at_the_next_token_once_cancelled():
    class Fmt:
        end_of_turn = frozenset({0})

        def decode(self, tokens):
            return "".join(chr(ord("a") + t) for t in tokens)

    stream = Stream()
    res = Result(AnswerPath.COLD, Match.NONE)
    gen = Generation(Fmt(), SamplingParams(max_tokens=10), stream, res, 0.0)
    assert gen.add(1) is False and gen.add(2) is False
    stream.cancel()
    assert gen.add(3) is True  # dropped: nobody reads it
    assert res.finish_reason == "cancelled" and res.tokens == [1, 2] and res.text == "bc"
    assert "".join(ev.text for ev in stream) == "bc"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50_000), st.sampled_from([0.0, 0.0, 1e-4, 1e-3])),
                max_size=60),
       st.booleans())
def test_an_async_reader_gets_every_event_once_in_order(pushes, fails):
    """The producer thread and the event loop race on every event (pushed while the reader
    waits, before it waits, in bursts): each event arrives once, in order, then the end."""
    import asyncio
    import threading
    import time

    from prepos.decode.stream import TokenEvent

    stream = Stream()

    def produce():
        for token, pause in pushes:
            if pause:
                time.sleep(pause)
            stream.push(TokenEvent(token, str(token)))
        if fails:
            stream.fail(RuntimeError("the worker failed"))
        else:
            stream.finish(Result(AnswerPath.COLD, Match.NONE))

    async def read():
        got = []
        try:
            async for ev in stream.aiter():
                got.append(ev.token)
        except RuntimeError:
            assert fails
        else:
            assert not fails
        return got

    async def run():
        producer = threading.Thread(target=produce)
        producer.start()
        got = await asyncio.wait_for(read(), 30)
        producer.join()
        return got

    assert asyncio.run(run()) == [t for t, _ in pushes]
