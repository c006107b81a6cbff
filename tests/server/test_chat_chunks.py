"""A streamed chat answer's text chunks are made from a frame (the bytes before and after the
text's JSON string, the same for every token): they must be the bytes the whole chunk's
JSON encoding gives, for any text, model name and choice."""

from __future__ import annotations

import json
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.server.http.request_bodies import ChatCompletion
from prepos.server.http.results import json_bytes
from prepos.server.openai.chat_reply import ChatReply


def reply(model: str, index: int) -> ChatReply:
    state = types.SimpleNamespace(model_name=model, engine=types.SimpleNamespace(fmt=None))
    body = ChatCompletion(model=model, messages=[{"role": "user", "content": "hi"}],
                          stream=True)
    return ChatReply(state, body, None, agentic=False, tools=False).at(index)


@settings(max_examples=200, deadline=None)
@given(text=st.text(), model=st.text(min_size=1), index=st.integers(0, 8))
def test_a_framed_text_chunk_is_the_whole_chunks_encoding(text, model, index):
    r = reply(model, index)
    head, tail = r._content_frame()
    framed = head + json_bytes(text) + tail
    assert framed == r._chunk({"content": text})
    data = json.loads(framed.removeprefix(b"data: "))
    assert data["choices"] == [{"index": index, "delta": {"content": text}, "logprobs": None,
                                "finish_reason": None}]
    assert data["model"] == model
