"""OpenAI conformance, driven by the real `openai` SDK against a real `prepos serve`: the
items of the conformance issue, each as a client would use it. Plus the README's snippets
as written (the OpenAI one on a new agentic session, the Python one on the engine)."""

from __future__ import annotations

import httpx
import openai
import pytest

from prepos.config import EngineConfig, GateConfig
from prepos.core import Request, SamplingParams
from prepos.engine import Engine
from tests.support.server_harness import ServerProc

SYSTEM = "Live price feed. Answer in one word."
Q = "Which way is ACME moving?"
TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_news", "parameters": {}}}]
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-conformance"),
                    "--max-session-tokens", "256", "--allowed-origins", ORIGIN) as srv:
        yield srv


def user(text="Hello?"):
    return [{"role": "user", "content": text}]


def test_context_overflow_is_context_length_exceeded(oai, model, tok):
    text = "AAPL 101.2 zq " * 40
    assert len(tok(text)["input_ids"]) > 256
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=user(text), max_tokens=4)
    assert err.value.code == "context_length_exceeded" and "eph-" not in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=text, max_tokens=4)
    assert err.value.code == "context_length_exceeded"


def test_models_retrieve(oai, model):
    m = oai.models.retrieve(model)
    assert m.id == model and m.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("nope")
    assert err.value.code == "model_not_found"
    assert err.value.body["type"] == "invalid_request_error"


def test_first_streamed_chunk_is_the_role_alone(oai, model):
    chunks = list(oai.chat.completions.create(model=model, messages=user(), max_tokens=4,
                                              stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[1:])


def test_tool_choice_none_required_named_and_parallel(oai, model):
    none = oai.chat.completions.create(model=model, messages=user(), tools=TOOLS,
                                       tool_choice="none", max_tokens=6)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason != \
        "tool_calls"
    named = oai.chat.completions.create(
        model=model, messages=user(), tools=TOOLS, max_tokens=19,
        tool_choice={"type": "function", "function": {"name": "get_news"}})
    calls = named.choices[0].message.tool_calls
    # cut by max_tokens inside the call's markup past its name (17 tokens): that
    # function's call, and "length"
    assert named.choices[0].finish_reason == "length"
    assert [c.function.name for c in calls] == ["get_news"]
    one = [TOOLS[0]]  # required with one tool: that tool is called
    req = oai.chat.completions.create(model=model, messages=user(), tools=one,
                                      tool_choice="required", max_tokens=24,
                                      parallel_tool_calls=False)
    assert [c.function.name for c in req.choices[0].message.tool_calls] == ["get_price"]
    streamed = list(oai.chat.completions.create(
        model=model, messages=user(), tools=one, tool_choice="required", max_tokens=24,
        stream=True))
    deltas = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_price"]


def test_completions_token_ids_prompt_lists_echo_best_of(oai, model, tok):
    ids = tok("AAPL 101.2")["input_ids"]
    by_ids = oai.completions.create(model=model, prompt=ids, max_tokens=3)
    by_text = oai.completions.create(model=model, prompt="AAPL 101.2", max_tokens=3)
    assert by_ids.choices[0].text == by_text.choices[0].text  # greedy: the same prompt
    # ids that are not the tokenizer's encoding of their text are continued as they are
    pieces = [i for ch in "AAPL 101.2" for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert pieces != ids
    raw = oai.completions.create(model=model, prompt=pieces, max_tokens=3, echo=True)
    assert raw.usage.prompt_tokens == len(pieces)
    assert raw.choices[0].text.startswith("AAPL 101.2")
    many = oai.completions.create(model=model, prompt=["AAPL", "MSFT 310"], max_tokens=2,
                                  echo=True)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text.startswith("AAPL")
    assert many.choices[1].text.startswith("MSFT 310")
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="AAPL", best_of=3, max_tokens=2)
    assert err.value.param == "best_of"


def test_messages_system_anywhere_continuation_and_system_only(oai, model, tok):
    mid = [*user(), {"role": "assistant", "content": "Hi."},
           {"role": "system", "content": "Be brief."}, *user("And now?")]
    assert oai.chat.completions.create(model=model, messages=mid, max_tokens=2).choices
    head = "The trend is"
    cont = oai.chat.completions.create(
        model=model, max_tokens=3, logprobs=True,
        messages=[*user(), {"role": "assistant", "content": head}])
    # the prompt is the conversation, the assistant header and the head, left open
    prompt = tok.apply_chat_template(user(), add_generation_prompt=True, tokenize=False)
    assert cont.usage.prompt_tokens == len(tok(prompt + head, add_special_tokens=False)
                                           ["input_ids"])
    ref = oai.completions.create(model=model, prompt=prompt + head, max_tokens=3)
    assert cont.choices[0].message.content == ref.choices[0].text  # what follows the head
    alone = oai.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Say up."}], max_tokens=2)
    assert alone.usage.completion_tokens >= 1


def test_penalties_and_logit_bias(oai, model, tok):
    target = tok("up", add_special_tokens=False)["input_ids"][0]
    r = oai.chat.completions.create(model=model, messages=user(), max_tokens=4,
                                    logit_bias={str(target): 100}, logprobs=True)
    got = [lp.token for lp in r.choices[0].logprobs.content]
    assert got == [tok.decode([target])] * len(got) and got
    # a frequency penalty of 2 over a bias of 100 cannot undo it; a ban removes the token
    r = oai.chat.completions.create(model=model, messages=user(), max_tokens=4,
                                    frequency_penalty=2, presence_penalty=-2,
                                    logit_bias={str(target): 100})
    assert r.choices[0].message.content == "up" * 4
    other = tok("down", add_special_tokens=False)["input_ids"][0]
    banned = oai.chat.completions.create(model=model, messages=user(), max_tokens=2,
                                         logit_bias={str(target): -100, str(other): 30})
    assert banned.choices[0].message.content == tok.decode([other]) * 2
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
               {"logit_bias": {"5": 101}}, {"logit_bias": {"up": 1}}):
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model=model, messages=user(), max_tokens=1, **kw)


def test_n_choices_chat_completions_and_one_cache(oai, server, model):
    r = oai.chat.completions.create(model=model, messages=user(), max_tokens=3, n=3,
                                    temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = oai.chat.completions.create(model=model, messages=user(), max_tokens=3, n=3,
                                        temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content
                                                          for c in r.choices]
    c = oai.completions.create(model=model, prompt="AAPL", max_tokens=2, n=2, logprobs=0)
    one = oai.completions.create(model=model, prompt="AAPL", max_tokens=2)
    assert [x.index for x in c.choices] == [0, 1]
    # usage: the prompt once, every choice's tokens
    assert c.usage.prompt_tokens == one.usage.prompt_tokens
    assert c.usage.completion_tokens == sum(len(x.logprobs.tokens) for x in c.choices)
    streamed = list(oai.chat.completions.create(model=model, messages=user(), max_tokens=2,
                                                n=2, stream=True))
    assert {ch.choices[0].index for ch in streamed if ch.choices} == {0, 1}
    with httpx.Client(base_url=server.url, timeout=60) as h:
        sid = h.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                        "standing_queries": [Q]}).json()["id"]
        h.post(f"/sessions/{sid}/append", json={"data": "ACME 41 43 44 47 48 50"})
        assert h.get(f"/sessions/{sid}", params={"wait_ready": 30}).json()["ready"]["done"]
    r = oai.chat.completions.create(model=model, messages=user(Q), max_tokens=1, n=4,
                                    temperature=1.0, extra_body={"session_id": sid})
    paths = [x["path"] for x in r.model_extra["prepos"]["choices"]]
    assert len(r.choices) == 4 and paths == ["fast"] * 4  # n answers, one cache


def test_cors_preflight_and_headers(server, model):
    pre = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_readme_openai_snippet_on_a_new_agentic_session(oai, server, model):
    sid = httpx.post(server.url + "/sessions", json={"kind": "agentic"}).json()["id"]
    r = oai.chat.completions.create(
        model=model, max_tokens=1,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "ACME 41 43 44 47 48 50"}],
        extra_body={"session_id": sid})
    assert r.choices[0].message.content is not None and r.model_extra["prepos"]["path"]
    held = httpx.get(f"{server.url}/sessions/{sid}", params={"include": "messages"}).json()
    assert held["message_list"][0] == {"role": "system", "content": SYSTEM}


def test_readme_python_snippet_is_served_from_the_cache(model_dirs):
    cfg = EngineConfig(gate=GateConfig(tau=0.0, answers=()), threads=2)
    with Engine.from_pretrained(model_dirs["chatml"], cfg) as eng:
        sid = eng.create_session("streaming", system=SYSTEM, standing=[Q],
                                 fast_path="relaxed")
        eng.append(sid, "ACME 41 43 44 47 48 50")
        eng.wait_idle()
        res = eng.query(sid, Q, Request(SamplingParams(max_tokens=1))).result()
        assert res.path.value == "fast" and res.match.value == "exact"


def test_completions_logprobs_zero_is_the_sampled_tokens_logprobs(oai, model):
    """OpenAI's legacy `logprobs: 0`: the logprobs object with every token, its logprob
    and offset, and `top_logprobs` holding the sampled token alone (up to logprobs + 1
    entries, the sampled token always among them), whole and streamed."""
    c = oai.completions.create(model=model, prompt="ACME 101 102", max_tokens=4, logprobs=0)
    lp = c.choices[0].logprobs
    n = c.usage.completion_tokens
    assert lp is not None and n >= 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and all(
        b == a + len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]
    # logprobs: 2, sampled: at most three entries, the sampled token's among them
    c = oai.completions.create(model=model, prompt="ACME 101 102", max_tokens=4, logprobs=2,
                               temperature=1.5, seed=7)
    lp = c.choices[0].logprobs
    for t, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and t in top and top[t] >= x - 1e-6
    # streamed: each token's chunk carries its own logprobs object
    chunks = [ch.choices[0] for ch in oai.completions.create(
        model=model, prompt="ACME 101 102", max_tokens=4, logprobs=0, stream=True)]
    steps = [ch.logprobs for ch in chunks if ch.logprobs is not None]
    assert steps and all(s.top_logprobs == [{s.tokens[0]: s.token_logprobs[0]}]
                         for s in steps)
    assert "".join(ch.text for ch in chunks) == "".join(s.tokens[0] for s in steps)
