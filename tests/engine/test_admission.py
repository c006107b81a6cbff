"""Admission by load (`Engine.admit`, `engine/admission.py`'s `Backpressure`): a request that
needs model work is refused while the foreground queue is full; one the engine answers from
a ready record with no model work is not. Nothing changes either way."""

import pytest

from prepos.core import Request, SamplingParams
from prepos.engine.session import query_key
from prepos.errors import Overloaded

Q = "What is the trend?"


def test_a_full_queue_refuses_model_work_only(make_engine):
    eng = make_engine(max_queue=0, predecode_min_hit=0.0)  # every queue is full
    sid = eng.create_session("streaming", system="Market.", standing=[Q], answer_tokens=4)
    eng.append(sid, "AAPL 101.5 up 3")
    assert eng.wait_idle(300)
    version = eng.snapshot(sid).version
    with pytest.raises(Overloaded) as refused:
        eng.admit()  # a request whose work is not known to be fast
    assert refused.value.retry_after >= 1 and "queued (limit 0)" in str(refused.value)
    one = Request(SamplingParams(max_tokens=1))
    eng.admit(sid, query_key(Q), one)  # the ready record answers it: admitted
    sampled = Request(SamplingParams(max_tokens=4, temperature=1.0, seed=1))
    with pytest.raises(Overloaded):  # its later tokens need the model
        eng.admit(sid, query_key(Q), sampled)
    with pytest.raises(Overloaded):  # no record for this entry
        eng.admit(sid, query_key("Something else?"), one)
    assert eng.snapshot(sid).version == version


def test_the_wait_told_follows_the_answers_times(make_engine):
    eng = make_engine(max_queue=0)
    eng.backpressure.answer_seconds = 2.5  # as if answers with model work took 2.5 s
    eng.backpressure.queued = lambda: 3
    with pytest.raises(Overloaded) as refused:
        eng.admit()
    assert refused.value.retry_after == 8  # ceil(3 x 2.5)
