"""The OpenAI-compatible endpoints end to end, with the real `openai` client against a real
`prepos serve` process: models, chat and completions (streaming and not), logprobs, usage
with cached tokens, the `session_id` extension (delta-only turns, divergence refused or
rolled back, the exact-turn fast path), and the path reported in headers and body."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.support.server_harness import ServerProc, state_of

SYSTEM = "You are a market analyst. Answer with one word."
Q = "What is the trend?"


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-openai")) as srv:
        yield srv


@pytest.fixture(scope="module")
def model_name(model_dirs):
    return model_dirs["chatml"].name


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_models(oai, model_name):
    models = oai.models.list().data
    assert [m.id for m in models] == [model_name]


def test_stateless_chat_streaming_and_not(oai, model_name):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    raw = oai.chat.completions.with_raw_response.create(
        model=model_name, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=1)
    r = raw.parse()
    # a new implicit session: cold, or fall-through where its system prompt was prefilled
    # at idle priority between its creation and the turn
    assert raw.headers["x-prepos-path"] == r.model_extra["prepos"]["path"]
    assert r.model_extra["prepos"]["path"] in ("cold", "fall-through")
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content) <= 4
    assert r.usage.prompt_tokens > 0
    assert all(e.top_logprobs[0].token == e.token for e in r.choices[0].logprobs.content)
    chunks = list(oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=4,
                                              stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.model_extra["prepos"]["path"] in ("cold", "fall-through")


def test_session_turns_are_delta_only(oai, http, model_name):
    sid = http.post("/sessions", json={"kind": "agentic", "system": SYSTEM}).json()["id"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "AAPL?"}]
    r = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=3,
                                    extra_body={"session_id": sid})
    assert r.model_extra["prepos"]["session_id"] == sid
    msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    # the session holds the conversation so far: system, user, the committed answer
    assert http.get(f"/sessions/{sid}").json()["messages"] == 3
    http.get(f"/sessions/{sid}", params={"wait_ready": 30})
    msgs.append({"role": "user", "content": "And MSFT?"})
    raw = oai.chat.completions.with_raw_response.create(
        model=model_name, messages=msgs, max_tokens=3, extra_body={"session_id": sid})
    r2 = raw.parse()
    # the next user message's prefix was pre-paid: only the delta was prefilled
    assert raw.headers["x-prepos-path"] == "fall-through"
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    v = state_of(http, sid)[0]
    # the same conversation sent without the system message: it is implied
    msgs.append({"role": "assistant", "content": r2.choices[0].message.content + "  "})
    msgs.append({"role": "user", "content": "Thanks."})
    r3 = oai.chat.completions.create(model=model_name, messages=msgs[1:], max_tokens=2,
                                     extra_body={"session_id": sid})
    assert r3.model_extra["prepos"]["version"] == v + 1


def test_committed_user_message_gets_the_exact_fast_path(oai, http, model_name):
    sid = http.post("/sessions", json={"kind": "agentic", "system": SYSTEM}).json()["id"]
    http.post(f"/sessions/{sid}/messages", json={"role": "user", "content": "Trend?"})
    http.get(f"/sessions/{sid}", params={"wait_ready": 30})
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Trend?"}]
    raw = oai.chat.completions.with_raw_response.create(
        model=model_name, messages=msgs, max_tokens=1, extra_body={"session_id": sid})
    r = raw.parse()
    assert raw.headers["x-prepos-path"] == "fast"
    assert r.model_extra["prepos"]["match"] == "exact"
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens


def test_divergence_is_refused_or_rolled_back(oai, http, model_name):
    sid = http.post("/sessions", json={"kind": "agentic", "system": SYSTEM}).json()["id"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "One?"}]
    r = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=2,
                                    extra_body={"session_id": sid})
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "Two?"}]
    oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=2,
                                extra_body={"session_id": sid})
    before = state_of(http, sid)
    edited = [msgs[0], msgs[1], {"role": "assistant", "content": "something else"},
              {"role": "user", "content": "Three?"}]
    with pytest.raises(openai.ConflictError) as err:
        oai.chat.completions.create(model=model_name, messages=edited, max_tokens=2,
                                    extra_body={"session_id": sid})
    assert err.value.body["code"] == "conversation_diverged"
    assert "message 2" in err.value.body["message"]
    assert state_of(http, sid) == before
    r = oai.chat.completions.create(model=model_name, messages=edited, max_tokens=2,
                                    extra_body={"session_id": sid,
                                                "on_divergence": "rollback"})
    held = http.get(f"/sessions/{sid}", params={"include": "messages"}).json()["message_list"]
    assert [m["content"] for m in held[:4]] == [m["content"] for m in edited]
    assert held[4]["role"] == "assistant" and r.model_extra["prepos"]["version"] > before[0]


def test_streaming_session_via_completions_and_chat(oai, http, model_name):
    sid = http.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                       "standing_queries": [Q]}).json()["id"]
    http.post(f"/sessions/{sid}/append", json={"data": "AAPL 101.2 101.5 101.9"})
    http.get(f"/sessions/{sid}", params={"wait_ready": 30})
    raw = oai.completions.with_raw_response.create(model=model_name, prompt=Q, max_tokens=1,
                                                   logprobs=1, extra_body={"session_id": sid})
    c = raw.parse()
    assert raw.headers["x-prepos-path"] == "fast"
    assert c.choices[0].logprobs.token_logprobs[0] <= 0
    chat = oai.chat.completions.create(model=model_name, max_tokens=1,
                                       messages=[{"role": "user", "content": Q}],
                                       extra_body={"session_id": sid})
    assert chat.choices[0].message.content == c.choices[0].text
    assert chat.model_extra["prepos"]["path"] == "fast"
    streamed = list(oai.completions.create(model=model_name, prompt=Q, max_tokens=3,
                                           stream=True, extra_body={"session_id": sid}))
    assert streamed[-1].model_extra["prepos"]["path"] == "fast"  # decodes on after the first
    plain = oai.completions.create(model=model_name, prompt=Q, max_tokens=3,
                                   extra_body={"session_id": sid})
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    chunks = list(oai.completions.create(model=model_name, prompt="Is it up?", max_tokens=3,
                                         stream=True, extra_body={"session_id": sid}))
    assert chunks[-1].model_extra["prepos"]["path"] == "fall-through"
    stateless = oai.completions.create(model=model_name, prompt=Q, max_tokens=2)
    assert stateless.model_extra["prepos"]["path"] == "cold"
    assert stateless.model_extra["prepos"]["session_id"] is None


def test_unsupported_or_out_of_range_options_are_refused_by_name(oai, model_name):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [({"n": 17}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
             ({"logit_bias": {"x": 2.0}}, "logit_bias"), ({"top_logprobs": 3}, "top_logprobs"),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": ["not", "an", "object"]}}}, "response_format")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=model_name, messages=msgs, **extra)
        assert err.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=msgs)


def test_top_logprobs_list_the_most_likely_tokens(oai, http, model_name):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    r = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=4,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    for e in content:
        lps = [a.logprob for a in e.top_logprobs]
        assert len(lps) == 3 and lps == sorted(lps, reverse=True)
        assert e.top_logprobs[0].token == e.token and lps[0] == pytest.approx(e.logprob)
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-6
    streamed = [c.choices[0].logprobs.content[0] for c in oai.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=3,
        stream=True) if c.choices and c.choices[0].logprobs]
    # the same tokens; their logprobs within llama.cpp's stated tolerance (the second request
    # starts from the first's prefix, computed in other batches)
    assert [[a.token for a in e.top_logprobs] for e in streamed] == \
        [[a.token for a in e.top_logprobs] for e in content]
    assert [a.logprob for e in streamed for a in e.top_logprobs] == pytest.approx(
        [a.logprob for e in content for a in e.top_logprobs], abs=0.05)
    # the fast path lists them from the cached distribution
    sid = http.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                       "standing_queries": [Q]}).json()["id"]
    http.post(f"/sessions/{sid}/append", json={"data": "AAPL 101.2 101.5 101.9"})
    http.get(f"/sessions/{sid}", params={"wait_ready": 30})
    fast = oai.chat.completions.create(model=model_name, max_tokens=1, logprobs=True,
                                       top_logprobs=3, messages=[{"role": "user", "content": Q}],
                                       extra_body={"session_id": sid})
    assert fast.model_extra["prepos"]["path"] == "fast"
    e = fast.choices[0].logprobs.content[0]
    assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    # completions key the alternatives by text (the legacy format): at most 3 distinct texts
    c = oai.completions.create(model=model_name, prompt=Q, max_tokens=1, logprobs=3,
                               extra_body={"session_id": sid})
    top = c.choices[0].logprobs.top_logprobs[0]
    assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(e.logprob)


def test_stateless_completions_continue_the_raw_prompt(oai, model_name, model_dirs):
    """Without session_id, /v1/completions continues the prompt as given, with no chat
    template: the greedy continuation transformers itself produces."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "AAPL 101.2 101.5 101.9 102.4 MSFT"
    c = oai.completions.create(model=model_name, prompt=prompt, max_tokens=6, logprobs=1)
    assert c.model_extra["prepos"]["path"] == "cold"
    n = len(c.choices[0].logprobs.tokens)
    tok = AutoTokenizer.from_pretrained(str(model_dirs["chatml"]))
    lm = AutoModelForCausalLM.from_pretrained(str(model_dirs["chatml"])).eval()
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        out = lm.generate(torch.tensor([ids]), max_new_tokens=max(n, 1), do_sample=False,
                          pad_token_id=tok.pad_token_id)
    assert c.choices[0].text == tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert c.usage.prompt_tokens == len(ids)
