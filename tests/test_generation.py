"""Assembling a request's output: cancellation by the reader."""

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
