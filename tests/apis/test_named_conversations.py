"""Conversations the client names: an `x-session-id` header, a body `session_id` or a
`prompt_cache_key` that names no session of the caller's key is the client's name for its
conversation. It is accepted (never a 404), answered exactly as a stateless server answers
the messages sent, and the conversation is kept and continued from its KV; an edited or
regenerated history branches; names are per key; a session made by `POST /sessions` keeps
its stricter rules. Through the real server with the OpenAI SDK, greedy, on the chatml tiny
model, each answer compared with a server that keeps nothing."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.server_harness import ServerProc

SYSTEM = "You are a terse market assistant. Answer in one word. " * 3
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    keys = [a for k in KEYS for a in ("--api-key", k)]
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-named"), *keys) as kept, \
            ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-cold"),
                       "--implicit-memory", "0", *keys) as cold:
        yield kept, cold


@pytest.fixture(scope="module")
def model(model_dirs):
    return model_dirs["chatml"].name


def client(server, key: str = KEYS[0], name: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-ID": name} if name else None
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                         default_headers=headers)


def ask(c, model, msgs, **kw):
    return c.chat.completions.with_raw_response.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, **kw)


def answer(raw) -> str:
    return raw.parse().choices[0].message.content


def cached(raw) -> int:
    return raw.parse().usage.prompt_tokens_details.cached_tokens


def continued(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('prepos:implicit_sessions_total{outcome="continued"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_header_names_a_conversation_made_on_first_use_continued_branched(servers, model):
    kept, cold = servers
    c, ref = client(kept, name="conv-header-1"), client(cold)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "ACME 40 41 43: up or down?"}]
    first = ask(c, model, msgs)  # no session has that name: made, not refused
    assert first.status_code == 200
    assert first.headers["x-session-id"] == "conv-header-1"  # named back, for a router
    assert answer(first) == answer(ask(ref, model, msgs))
    msgs += [{"role": "assistant", "content": answer(first)},
             {"role": "user", "content": "And BOLT 9 9 8?"}]
    before = continued(kept)
    second = ask(c, model, msgs)
    assert continued(kept) == before + 1
    assert cached(second) >= first.parse().usage.prompt_tokens  # only the delta prefilled
    assert answer(second) == answer(ask(ref, model, msgs))
    regenerated = ask(c, model, msgs)  # a client's retry: the same messages again
    assert answer(regenerated) == answer(second)
    edited = [msgs[0], {"role": "user", "content": "CRUX 5 6 7: up or down?"}]  # a UI's edit
    assert answer(ask(c, model, edited)) == answer(ask(ref, model, edited))
    msgs += [{"role": "assistant", "content": answer(second)},
             {"role": "user", "content": "And DYNA?"}]
    third = ask(c, model, msgs)  # the branch it came from is still there
    assert answer(third) == answer(ask(ref, model, msgs))
    assert cached(third) >= second.parse().usage.prompt_tokens


def test_a_body_session_id_and_a_prompt_cache_key_name_conversations(servers, model):
    kept, cold = servers
    c, ref = client(kept), client(cold)
    for extra in ({"extra_body": {"session_id": "conv-body-1"}},
                  {"extra_body": {"prompt_cache_key": "desk-7"}}):
        msgs = [{"role": "system", "content": SYSTEM + str(extra)},
                {"role": "user", "content": "FLUX 3 2 1?"}]
        first = ask(c, model, msgs, **extra)
        assert first.status_code == 200
        msgs += [{"role": "assistant", "content": answer(first)},
                 {"role": "user", "content": "Why?"}]
        second = ask(c, model, msgs, **extra)
        assert cached(second) >= first.parse().usage.prompt_tokens
        assert answer(second) == answer(ask(ref, model, msgs))


@pytest.mark.parametrize("extra, param", [
    ({"session_id": "no spaces allowed"}, "session_id"),
    ({"session_id": "x" * 129}, "session_id"),
    ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
])
def test_an_invalid_name_is_a_400_naming_it_and_changes_nothing(servers, model, extra, param):
    kept, _ = servers
    msgs = [{"role": "user", "content": "EQTY?"}]
    before = continued(kept)
    r = httpx.post(kept.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {KEYS[0]}"},
                   json={"model": model, "messages": msgs, "max_tokens": 2, **extra})
    assert r.status_code == 400
    assert param in r.text
    assert continued(kept) == before


def test_an_invalid_header_name_is_a_400_naming_the_rule(servers, model):
    kept, _ = servers
    r = httpx.post(kept.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {KEYS[0]}", "X-Session-ID": "a b"},
                   json={"model": model, "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"


def test_two_keys_one_name_stay_apart(servers, model):
    kept, _ = servers
    msgs = [{"role": "system", "content": SYSTEM + "Apart."},
            {"role": "user", "content": "ACME?"}]
    a = client(kept, KEYS[0], "shared-name")
    first = ask(a, model, msgs)
    msgs += [{"role": "assistant", "content": answer(first)},
             {"role": "user", "content": "BOLT?"}]
    before = continued(kept)
    other = ask(client(kept, KEYS[1], "shared-name"), model, msgs)  # key A's very messages
    assert other.status_code == 200
    assert continued(kept) == before  # key B found nothing of key A's
    assert cached(other) < first.parse().usage.prompt_tokens
    mine = ask(a, model, msgs)
    assert continued(kept) == before + 1
    assert cached(mine) >= first.parse().usage.prompt_tokens


def test_a_session_made_by_post_sessions_keeps_its_rules(servers, model):
    kept, _ = servers
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    r = httpx.post(kept.url + "/sessions", headers={**auth, "X-Session-ID": "made-1"},
                   json={"kind": "agentic", "system": SYSTEM})
    assert r.status_code in (200, 201), r.text
    c = client(kept, KEYS[0], "made-1")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "ACME?"}]
    first = ask(c, model, msgs)
    assert first.parse().model_extra["prepos"]["session_id"] == "made-1"
    diverged = [msgs[0], {"role": "user", "content": "Something else?"}]
    with pytest.raises(openai.ConflictError):  # 409 conversation_diverged, as before
        ask(c, model, diverged)
    # another key naming it has a conversation of its own, and learns nothing of the session
    theirs = ask(client(kept, KEYS[1], "made-1"), model, diverged)
    assert theirs.status_code == 200
    assert theirs.parse().model_extra["prepos"]["session_id"] is None
    state = httpx.get(kept.url + "/sessions/made-1", headers=auth).json()
    assert state["messages"] == 3  # system, user, assistant: untouched by key B
