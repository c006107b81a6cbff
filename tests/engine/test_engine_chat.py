"""`Engine.plan_chat` and `Engine.chat`: a conversation sent whole to an agentic session, the
delta committed and answered, a diverging or oversized one refused with nothing changed, or
rolled back when asked."""

import pytest

from prepos.chat.conversation import ConversationError
from prepos.core import Request, SamplingParams
from tests.support.helpers import state

SYSTEM = "You are a market analyst. Answer with one word."
ONE = Request(SamplingParams(max_tokens=1))


def test_the_delta_is_committed_and_answered(make_engine):
    eng = make_engine("chatml")
    sid = eng.create_session("agentic", system=SYSTEM)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Trend?"}]
    plan = eng.plan_chat(sid, msgs)
    assert plan.delta == (msgs[1],) and plan.rollback_to is None and not plan.commits_nothing
    eng.chat(plan, ONE).result()
    held = eng.snapshot(sid).messages
    assert held[:2] == tuple(msgs) and held[2]["role"] == "assistant"
    # the conversation as the session now has it, plus two messages: one committed, one asked
    more = [*held, {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "up"},
            {"role": "user", "content": "Sure?"}]
    eng.chat(eng.plan_chat(sid, more), ONE).result()
    assert eng.snapshot(sid).messages[:len(more)] == tuple(more)
    # a user message committed alone, then the session's own conversation: nothing to commit,
    # the turn after it is the exact entry
    eng.add_message(sid, "user", "Why?")
    plan = eng.plan_chat(sid, list(eng.snapshot(sid).messages))
    assert plan.commits_nothing and plan.delta == ()


def test_a_diverging_conversation_is_refused_or_rolled_back(make_engine):
    eng = make_engine("chatml")
    sid = eng.create_session("agentic", system=SYSTEM)
    first = [{"role": "user", "content": "Trend?"}]
    eng.chat(eng.plan_chat(sid, first), ONE).result()
    v = eng.snapshot(sid).version
    edited = [{"role": "user", "content": "Trend, please?"}]
    before = state(eng, sid)
    with pytest.raises(ConversationError) as err:
        eng.plan_chat(sid, edited)
    assert err.value.code == "conversation_diverged" and state(eng, sid) == before
    plan = eng.plan_chat(sid, edited, rollback=True)
    assert plan.rollback_to is not None and plan.rollback_to < v
    eng.chat(plan, ONE).result()
    assert eng.snapshot(sid).messages[1] == {"role": "user", "content": "Trend, please?"}


def test_a_delta_that_does_not_fit_changes_nothing(make_engine):
    eng = make_engine("chatml")
    sid = eng.create_session("agentic", system=SYSTEM)
    long = " ".join(["word"] * (eng.max_context + 10))
    msgs = [{"role": "user", "content": "Trend?"}, {"role": "assistant", "content": long},
            {"role": "user", "content": "Sure?"}]
    before = state(eng, sid)
    with pytest.raises(ConversationError) as err:
        eng.chat(eng.plan_chat(sid, msgs), ONE)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert state(eng, sid) == before


def test_a_stock_clients_conversation_is_kept_by_the_engine(make_engine):
    """`Engine.converse`: the first request keeps a new session; the next, resending the
    conversation with one new message, continues it and commits the delta only; the session
    is free again before its reader sees the answer's end; another key starts its own."""
    eng = make_engine("chatml")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Trend?"}]
    stream = eng.converse("a", first, (), ONE)
    answer = stream.result().text
    assert eng.metrics()["implicit"] == {"continued": 0, "started": 1, "evicted": 0}
    (kept,) = [s for s in eng.all_sessions() if s.spec.implicit]
    assert eng.snapshot(kept.id).messages[:2] == tuple(first)
    nxt = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    assert eng.holds_conversation("a", (), nxt) and not eng.holds_conversation("b", (), nxt)
    commits = []
    eng.subscribe(lambda event, s, payload: commits.append(s.id) if event == "commit" else None)
    eng.converse("a", nxt, (), ONE).result()
    assert eng.metrics()["implicit"]["continued"] == 1
    assert eng.snapshot(kept.id).messages[:4] == tuple(nxt)
    assert set(commits) == {kept.id} and len(commits) == 2  # the user message, the answer
    eng.converse("b", nxt, (), ONE).result()  # never another key's conversation
    assert eng.metrics()["implicit"] == {"continued": 1, "started": 2, "evicted": 0}
    assert eng.evict_conversation() and eng.metrics()["implicit"]["evicted"] == 1


def essay(topic: str) -> list[dict]:
    """A stock client's conversation; two topics share the system part and the request's
    opening words."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Write a long, detailed essay about the weather in the "
                                        "mountains and " + topic}]


def shared_prefix(eng, a: str, b: str) -> int:
    """The prompt tokens the essays on `a` and `b` share."""
    one, two = (eng.fmt.encode(eng.fmt.render(essay(t), generation_prompt=True)) for t in (a, b))
    return next(i for i, (x, y) in enumerate(zip(one, two)) if x != y)


def test_a_new_kept_conversation_starts_from_the_longest_prefix_another_holds(make_engine,
                                                                           monkeypatch):
    """A conversation a stock client sends whole starts on a new kept session with no
    pre-position of its own (its turn follows at once): an entry pre-positioned first would
    hold the session's system part alone, and its turn would then reuse that much of another
    conversation's prefix, not all that the two share."""
    eng = make_engine("chatml")
    submitted = []  # (session, idle) of every task, in order
    submit = eng.scheduler.submit

    def recorded(gen, idle=False, key=None, *args, **kw):
        submitted.append((key, idle))
        return submit(gen, idle, key, *args, **kw)

    monkeypatch.setattr(eng.scheduler, "submit", recorded)
    eng.converse("a", essay("the sea"), (), ONE).result()
    assert eng.wait_idle(120)
    submitted.clear()
    res = eng.converse("a", essay("the rivers"), (), ONE).result()
    assert submitted[0][1] is False  # the new session's first task is its turn
    shared = shared_prefix(eng, "the sea", "the rivers")
    system = len(eng.fmt.encode(eng.fmt.render(essay("x")[:1])))
    assert shared > system + 4  # the two share more than the system part
    assert res.cached_prompt_tokens >= shared - 1


def test_a_shared_prefix_in_a_lower_tier_is_reused_with_every_sequence_held(make_engine):
    """With as many KV sequences as clients (here one), a new conversation's own sequence is
    the only one: the prefix it shares with a conversation moved down a tier is loaded into
    that sequence, not refused for want of a free one; and the scheduler's step counts say
    the prefill ran the prompt less that prefix."""
    eng = make_engine("chatml", max_sequences=1)
    eng.converse("a", essay("the sea"), (), ONE).result()
    assert eng.wait_idle(120)
    before = eng.scheduler.steps.tokens["prefill"]
    res = eng.converse("a", essay("the rivers"), (), ONE).result()
    shared = shared_prefix(eng, "the sea", "the rivers")
    assert shared >= 32  # two whole blocks at least
    assert res.cached_prompt_tokens >= shared - shared % 16
    # the steps count what they ran: the prompt less the prefix it reused
    assert (eng.scheduler.steps.tokens["prefill"] - before
            == res.prompt_tokens - res.cached_prompt_tokens)


def test_a_streams_end_callbacks_run_before_its_reader_sees_the_end():
    from prepos.core import AnswerPath, Match, Result
    from prepos.decode.stream import Stream

    stream, seen = Stream(), []
    stream.on_end(lambda: seen.append(stream.done))
    stream.on_end(lambda: 1 / 0)  # a failing callback is logged; the stream still ends
    stream.finish(Result(AnswerPath.COLD, Match.NONE))
    assert seen == [False] and stream.done and stream.result().path is AnswerPath.COLD
    stream.on_end(lambda: seen.append("late"))  # once it has ended: at once
    assert seen == [False, "late"]


class WriteAhead:
    """A write-ahead log that keeps what each write was handed: (event, version, origin)."""

    def __init__(self):
        self.writes: list[tuple[str, int | None, object]] = []

    def created(self, s, snap, origin=None):
        self.writes.append(("create", snap.version, origin))

    def committed(self, s, snap, origin=None):
        self.writes.append(("commit", snap.version, origin))

    def closing(self, s, origin=None):
        self.writes.append(("close", None, origin))


def test_every_commit_hands_its_requests_origin_to_the_write_ahead_log(make_engine):
    """The origin a caller passes (the server's Idempotency-Key attempt) reaches the log with
    each write the call makes, on its own thread or the worker's: the session's creation, a
    rollback and a delta's messages, the turn's user message and the answer committed when
    the stream ends, a message and the close; a call without one hands None."""
    eng = make_engine("chatml")
    log = WriteAhead()
    eng.write_ahead(log)
    created, chat, more, closed = object(), object(), object(), object()
    sid = eng.create_session("agentic", system=SYSTEM, origin=created)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Trend?"},
            {"role": "assistant", "content": "up"}, {"role": "user", "content": "Sure?"}]
    eng.chat(eng.plan_chat(sid, msgs), Request(ONE.sampling, origin=chat)).result()
    eng.wait_idle()
    eng.add_message(sid, "user", "Why?", origin=more)
    eng.rollback(sid, 1)
    eng.close_session(sid, origin=closed)
    assert log.writes == [("create", 0, created), ("commit", 1, chat), ("commit", 2, chat),
                          ("commit", 3, chat), ("commit", 4, chat), ("commit", 5, more),
                          ("commit", 6, None), ("close", None, closed)]
