"""Assembling a request's output: cancellation by the reader; the stream's hand-off from the
producer's thread to an async reader."""

import functools

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


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_text_a_token_at_a_time_equals_the_whole_decode(model_dirs, data):
    """An answer's text kept a token at a time (`Detokenizer`) is the text of decoding its
    tokens whole after every token, but for a character whose bytes are not all in yet,
    which `whole()` shows as the whole decode does; its stop strings are found where a
    whole decode finds them (tiny tokenizers of two families, any token ids, specials
    and broken byte sequences included)."""
    from prepos.chat.detokenize import Detokenizer

    family = data.draw(st.sampled_from(sorted(model_dirs)))
    fmt = _format(str(model_dirs[family]))
    ids = data.draw(st.lists(st.integers(0, len(fmt.tokenizer) - 1), max_size=40))
    taken: list[int] = []
    detok = Detokenizer(fmt, taken)
    assert detok._stream is not None  # the tiny tokenizers concatenate: one token at a time
    for i, tok in enumerate(ids):
        taken.append(tok)
        detok.add()
        whole = fmt.decode(ids[:i + 1])
        assert whole.startswith(detok.text) and detok.whole() == whole
        assert detok.fixed <= len(detok.text)
    stop = data.draw(st.text(min_size=1, max_size=3))
    stream, res = Stream(), Result(AnswerPath.COLD, Match.NONE)
    gen = Generation(fmt, SamplingParams(max_tokens=1000, stop=(stop,)), stream, res, 0.0)
    expected = _first_stop(fmt, [t for t in ids if t not in fmt.end_of_turn], stop)
    for tok in ids:
        if tok not in fmt.end_of_turn and gen.add(tok):
            break
    else:
        gen.finish("length")
    assert res.text == expected and "".join(ev.text for ev in stream) == expected


@functools.cache
def _format(model_dir: str):
    """A tiny model's ChatFormat, made once a test session."""
    from transformers import AutoTokenizer

    from prepos.chat.format import ChatFormat

    return ChatFormat(AutoTokenizer.from_pretrained(model_dir))


def _first_stop(fmt, ids: list[int], stop: str) -> str:
    """The text a whole decode after every token gives: cut before the first stop string
    at the first token whose text holds it."""
    for i in range(len(ids)):
        text = fmt.decode(ids[:i + 1])
        if stop in text:
            return text[:text.index(stop)]
    return fmt.decode(ids)
