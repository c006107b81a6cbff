"""Implicit sessions: a stock OpenAI client that resends its whole conversation and names no
session pays, from its second turn on, only its new messages (the rest is found in the KV
of the implicit session its previous turn left), never across API keys, kept while the KV
tiers hold them and within the bytes given for their bookkeeping, found by hash. Through
the real server with the OpenAI SDK, on the chatml tiny model; API behaviour, not the
model's wording."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.server_harness import ServerProc

SYSTEM = "You are a terse market assistant. " * 4
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    args = ("--implicit-sessions", "2", *(a for k in KEYS for a in ("--api-key", k)))
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-implicit"),
                    *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(model_dirs):
    return model_dirs["chatml"].name


def client(server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def implicit_counts(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("prepos:implicit_sessions_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def turn(c, model, msgs, **kw):
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=6, **kw)
    msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def test_each_turn_after_the_first_finds_the_previous_turns_prompt_cached(server, model):
    c = client(server)
    msgs = [{"role": "system", "content": SYSTEM}]
    prompts, cache = [], []
    for i in range(4):
        msgs.append({"role": "user", "content": f"What about item {i}?"})
        r = turn(c, model, msgs)
        prompts.append(r.usage.prompt_tokens)
        cache.append(cached(r))
        assert r.model_extra["prepos"]["session_id"] is None  # nothing a client could name
    for i in range(1, 4):  # the previous prompt is a prefix of this one, and it was kept
        assert prompts[i - 1] <= cache[i] < prompts[i]
    # streamed, the same: cached_tokens in the final usage chunk
    msgs.append({"role": "user", "content": "And streamed?"})
    chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    assert cached(chunks[-1]) >= prompts[-1]


def test_a_conversation_is_never_continued_for_another_key(server, model):
    msgs = [{"role": "system", "content": SYSTEM + "Keys."},
            {"role": "user", "content": "First question?"}]
    turn(client(server, KEYS[0]), model, msgs)
    msgs.append({"role": "user", "content": "Second question?"})
    before = implicit_counts(server)
    other = client(server, KEYS[1]).chat.completions.create(model=model, messages=msgs,
                                                            max_tokens=4)
    after = implicit_counts(server)
    assert after.get("continued", 0) == before.get("continued", 0)
    assert after["started"] == before["started"] + 1
    mine = client(server, KEYS[0]).chat.completions.create(model=model, messages=msgs,
                                                           max_tokens=4)
    assert cached(mine) > cached(other)  # the key's own conversation, found


def test_a_diverging_conversation_starts_anew_and_is_answered(server, model):
    c = client(server)
    msgs = [{"role": "system", "content": SYSTEM + "Diverge."},
            {"role": "user", "content": "One?"}]
    turn(c, model, msgs)
    edited = [msgs[0], {"role": "user", "content": "Another first question?"},
              {"role": "assistant", "content": "something else"},
              {"role": "user", "content": "Two?"}]
    r = c.chat.completions.create(model=model, messages=edited, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_kept_conversations_are_bounded_least_recently_used_first(server, model):
    c = client(server)
    convs = []
    for i in range(3):  # the server keeps 2
        msgs = [{"role": "system", "content": SYSTEM + f"Bound {i}."},
                {"role": "user", "content": "Hello?"}]
        turn(c, model, msgs)
        convs.append(msgs)
    assert implicit_counts(server)["evicted"] >= 1
    for msgs in convs:
        msgs.append({"role": "user", "content": "Again?"})
    newest = c.chat.completions.create(model=model, messages=convs[2], max_tokens=4)
    oldest = c.chat.completions.create(model=model, messages=convs[0], max_tokens=4)
    assert cached(newest) > 0
    assert cached(oldest) < cached(newest)  # evicted: answered, its prompt prefilled again


def test_a_tool_loop_through_stateless_requests_is_continued(server, model):
    c = client(server)
    tools = [{"type": "function", "function": {
        "name": "price", "description": "a ticker's price",
        "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}},
                       "required": ["ticker"]}}}]
    msgs = [{"role": "system", "content": SYSTEM + "Tools."},
            {"role": "user", "content": "Price of ACME?"}]
    first = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=4)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content or "",
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "price",
                                           "arguments": '{"ticker": "ACME"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "41.5"}]
    second = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=4)
    msgs += [{"role": "assistant", "content": second.choices[0].message.content or ""},
             {"role": "user", "content": "And now?"}]
    third = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=4)
    assert cached(third) >= second.usage.prompt_tokens


def test_without_implicit_sessions_nothing_is_kept(model_dirs, tmp_path):
    with ServerProc(model_dirs["chatml"], tmp_path, "--implicit-sessions", "0") as srv:
        c, model = client(srv), model_dirs["chatml"].name
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}]
        turn(c, model, msgs)
        msgs.append({"role": "user", "content": "Again?"})
        assert cached(c.chat.completions.create(model=model, messages=msgs,
                                                max_tokens=4)) == 0


TOOLS = [{"type": "function", "function": {
    "name": "price", "description": "a ticker's price",
    "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}},
                   "required": ["ticker"]}}}]


def answered(msgs: list[dict], r) -> None:
    """The model's reply appended as a client appends it, with a result for each call."""
    m = r.choices[0].message
    reply = {"role": "assistant", "content": m.content or ""}
    if m.tool_calls:
        reply["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    msgs.append(reply)
    msgs += [{"role": "tool", "tool_call_id": c.id, "content": "0"} for c in m.tool_calls or ()]


def test_a_continued_turn_is_a_fall_through_counting_every_cached_token(server, model):
    """A continued turn resumes from the kept KV, so it is a fall-through whether or not its
    new messages are the envelope pre-positioned after the last answer (a replayed call is
    not), and its own count of cached tokens is usage's: the whole prompt is its entry."""
    c = client(server)
    msgs = [{"role": "system", "content": SYSTEM + "Paths."},
            {"role": "user", "content": "Price of ACME?"}]
    prev = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=4)
    answered(msgs, prev)
    call = {"id": "call_9", "type": "function",
            "function": {"name": "price", "arguments": '{"ticker": "ACME"}'}}
    for new in ([{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_9", "content": "41.5"}],
                [{"role": "user", "content": "And BOLT?"}]):
        msgs += new
        r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=4)
        p = r.model_extra["prepos"]
        assert p["path"] == "fall-through"
        assert p["timing"]["cached_tokens"] == cached(r) >= prev.usage.prompt_tokens
        assert p["timing"]["prefill_tokens"] == r.usage.prompt_tokens - cached(r)
        answered(msgs, r)
        prev = r


def tier_moves(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("prepos:kv_tier_moves_total{"):
            out[line.split('into="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("disk", ["64M", "0"])
def test_kept_conversations_are_the_tiers_to_keep(model_dirs, tmp_path, disk):
    """No count bounds the kept conversations: a conversation whose KV moved down to disk to
    make room for another is continued from there and answers as a cold request; one whose
    KV no tier could keep (no disk) is closed, and its next turn starts anew."""
    model = model_dirs["chatml"].name
    args = ("--max-kv-cells", "300", "--kv-ram", "0", "--kv-disk", disk, "--no-preposition",
            "--api-key", "a", "--api-key", "b")
    with ServerProc(model_dirs["chatml"], tmp_path, *args) as srv:
        a, b = client(srv, "a"), client(srv, "b")
        first = [{"role": "system", "content": SYSTEM + "Disk."},
                 {"role": "user", "content": "First?"}]
        turn(a, model, first)
        for i in range(3):  # other conversations take the resident cells
            turn(a, model, [{"role": "system", "content": SYSTEM + f"Other {i}."},
                            {"role": "user", "content": "Hello?"}])
        moved = tier_moves(srv)
        assert moved.get("disk" if disk != "0" else "dropped", 0) >= 1
        first.append({"role": "user", "content": "Second?"})
        before = implicit_counts(srv)
        again = a.chat.completions.create(model=model, messages=first, max_tokens=6)
        after = implicit_counts(srv)
        cold = b.chat.completions.create(model=model, messages=first, max_tokens=6)
        assert again.choices[0].message.content == cold.choices[0].message.content
        if disk != "0":
            assert after["continued"] == before.get("continued", 0) + 1
            assert cached(again) > 0
        else:
            assert after.get("continued", 0) == before.get("continued", 0)
            assert after["evicted"] >= 1


def test_kept_conversations_are_bounded_by_their_memory(model_dirs, tmp_path):
    model = model_dirs["chatml"].name
    with ServerProc(model_dirs["chatml"], tmp_path, "--implicit-memory", "12K") as srv:
        c = client(srv)
        convs = []
        for i in range(4):
            msgs = [{"role": "system", "content": SYSTEM + f"Memory {i}."},
                    {"role": "user", "content": "Hello?"}]
            turn(c, model, msgs)
            convs.append(msgs)
        counts = implicit_counts(srv)
        assert counts["evicted"] >= 1
        # the newest is continued, the least recently used was evicted and starts again
        # (read from the counts, not from cached tokens: a KV copy saved into a tier at idle
        # may still give the new session its prefix)
        for i, outcome in ((3, "continued"), (0, "started")):
            convs[i].append({"role": "user", "content": "Again?"})
            c.chat.completions.create(model=model, messages=convs[i], max_tokens=4)
            now = implicit_counts(srv)
            assert now[outcome] == counts[outcome] + 1, (i, counts, now)
            counts = now


def test_a_conversation_is_found_by_its_hash_not_by_a_scan(make_engine, monkeypatch):
    """Finding a conversation checks one kept session, however many the key has, and never
    one of another key's."""
    import prepos.engine.implicit as implicit
    from prepos.engine.session_spec import SessionSpec

    eng = make_engine(preposition=False)
    kept = implicit.ImplicitSessions(lambda: eng, eng.close_session, memory=None)
    convs = []
    for i in range(40):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Q{i}?"},
                {"role": "assistant", "content": f"A{i}."}]
        sid = f"imp-{i}"
        eng.restore_session(sid, SessionSpec("agentic", SYSTEM, implicit=True, owner="a"),
                            [(0, msgs)])
        kept.keep(sid, "a")
        kept.release(sid)
        convs.append(msgs)
    checked = []
    real = implicit.resume
    monkeypatch.setattr(implicit, "resume",
                        lambda *a, **kw: checked.append(a[0]) or real(*a, **kw))
    ask = [*convs[7], {"role": "user", "content": "More?"}]
    assert kept.find(eng, "b", [], ask) is None  # another key's: not even looked at
    assert kept.find(eng, "a", [{"type": "function", "function": {"name": "f"}}], ask) is None
    assert checked == []
    assert kept.find(eng, "a", [], ask) == "imp-7" and checked == ["imp-7"]
    assert kept.find(eng, "a", [], ask) is None  # held by the first request
    kept.release("imp-7")
    edited = [*convs[7][:2], {"role": "assistant", "content": "Something else."},
              {"role": "user", "content": "More?"}]
    assert kept.find(eng, "a", [], edited) is None  # diverges at its answer
    assert kept.find(eng, "a", [], convs[7][:2]) is None  # shorter than any kept one
