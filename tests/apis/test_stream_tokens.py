"""A streamed answer's chunks carry every token once, in order: the tokens (their logprob
entries) and the text of a streamed chat completion equal those of the same request answered
whole, through a real `prepos serve`, with pre-positioning on and off. No timing."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.server_harness import ServerProc

MESSAGES = [{"role": "system", "content": "You are a market analyst."},
            {"role": "user", "content": "AAPL 101.2 101.5 101.9 102.4. What is the trend?"}]


@pytest.fixture(scope="module", params=["preposition", "no-preposition"])
def server(request, model_dirs, tmp_path_factory):
    args = ["--no-preposition"] if request.param == "no-preposition" else []
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-stream"),
                    *args) as srv:
        yield srv


def streamed(c: httpx.Client, body: dict) -> tuple[list[str], str]:
    tokens, text = [], ""
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
                tokens += [t["token"] for t in (choice.get("logprobs") or {}).get("content")
                           or []]
    return tokens, text


def test_every_token_once_in_order(server, model_dirs):
    body = {"model": model_dirs["chatml"].name, "messages": MESSAGES, "max_tokens": 24,
            "temperature": 0, "logprobs": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for _ in range(3):  # cold, then the kept conversation (its answer pre-decoded, if on)
            whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
            tokens, text = streamed(c, body)
            assert tokens == [t["token"] for t in whole["logprobs"]["content"]]
            assert text == whole["message"]["content"] and len(tokens) > 1


def stage_counts(c: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["stage"]: s.value
            for f in text_string_to_metric_families(c.get("/metrics").text)
            if f.name == "prepos:token_stage_seconds" for s in f.samples
            if s.name.endswith("_count")}


def test_a_text_answer_streamed_and_each_tokens_stages_counted(server, model_dirs):
    body = {"model": model_dirs["chatml"].name, "max_tokens": 24, "temperature": 0,
            "messages": [*MESSAGES[:1], {"role": "user", "content": "MSFT 40.1 40.0 39.7?"}]}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        before = stage_counts(c)
        _, text = streamed(c, body)  # a new conversation: streamed as the model makes it
        after = {k: v - before.get(k, 0.0) for k, v in stage_counts(c).items()}
        whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert text == whole["message"]["content"] and text
    events = after["handoff"]  # every event the model made, once
    assert events >= 2 and after["respond"] == events and after["engine"] == events - 1
    assert after["write"] >= 3  # the role's chunk, the text's, the last
