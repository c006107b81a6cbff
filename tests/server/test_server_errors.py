"""Every bad input gets a 4xx JSON error that names the problem and leaves every session
exactly as it was (version, tokens and messages compared before and after). Against a real
server with API keys and tight limits."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.helpers import fill_ids
from tests.support.server_harness import ServerProc, state_of

SYSTEM = "You are a market analyst. Answer with one word."
Q = "What is the trend?"
KEY, OTHER = "key-a", "key-b"
LIMITS = ["--api-key", KEY, "--api-key", OTHER, "--max-body-bytes", "20000",
          "--max-tokens", "16", "--max-input-tokens", "200", "--max-session-tokens", "256"]
TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {}}}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-errors"),
                    *LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def texts(model_dirs):
    """Inputs of known token length: over the per-request limit, and one that fits a
    request but not the session."""
    tok = AutoTokenizer.from_pretrained(str(model_dirs["chatml"]))
    unit = "AAPL 101.2 zq "

    def of(lo: int, hi: int) -> str:
        text = unit
        while len(tok(text, add_special_tokens=False)["input_ids"]) < lo:
            text += unit
        assert len(tok(text, add_special_tokens=False)["input_ids"]) <= hi
        return text

    return {"big": of(260, 400), "medium": of(185, 200)}


@pytest.fixture(scope="module")
def sessions(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        s = c.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                      "standing_queries": [Q]}).json()["id"]
        for d in ("AAPL 101.2 101.5 101.9", "AAPL 102.8 103.1 103.0"):
            assert c.post(f"/sessions/{s}/append", json={"data": d}).status_code == 200
        a = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM,
                                      "tools": TOOLS}).json()["id"]
        r = c.post(f"/sessions/{a}/turn", json={"user": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        t = c.post("/sessions", json={"kind": "agentic", "system": SYSTEM}).json()["id"]
        c.post(f"/sessions/{t}/messages", json={"role": "user", "content": "Price?"})
        call = {"function": {"name": "get_price", "arguments": "{\"ticker\": \"AAPL\"}"}}
        r = c.post(f"/sessions/{t}/messages", json={"role": "assistant", "content": "",
                                                    "tool_calls": [call]})
        assert r.status_code == 200, r.text
        held = c.get(f"/sessions/{a}", params={"include": "messages"}).json()["message_list"]
        yield {"S": s, "A": a, "T": t, "held": held}


def chat(messages, **kw):
    return {"model": "chatml-llama", "messages": messages, "max_tokens": 2, **kw}


def cases(t):
    big, medium = t["big"], t["medium"]
    user = {"role": "user", "content": "different"}
    sys_msg = {"role": "system", "content": SYSTEM}
    return [
        # bodies
        ("malformed-json", "POST", "/sessions/{S}/append", {"content": b'{"data": '}, 400,
         "malformed_json", "JSON"),
        ("not-an-object", "POST", "/sessions/{S}/append", {"content": b"[1, 2]"}, 400,
         "invalid_request", "object"),
        ("empty-body", "POST", "/sessions/{S}/append", {"content": b""}, 400,
         "missing_body", "body"),
        ("missing-field", "POST", "/sessions/{S}/append", {"json": {}}, 400,
         "invalid_request", "data"),
        ("unknown-field", "POST", "/sessions/{S}/append", {"json": {"data": "x", "datta": 1}},
         400, "invalid_request", "datta"),
        ("wrong-type", "POST", "/sessions/{S}/append", {"json": {"data": 5}}, 400,
         "invalid_request", "data"),
        ("empty-data", "POST", "/sessions/{S}/append", {"json": {"data": "   "}}, 400,
         "invalid_input", "empty"),
        # control-token strings in text are plain characters, not errors (test_special_tokens)
        # sessions and keys
        ("unknown-session", "POST", "/sessions/s-0-nope/append", {"json": {"data": "x"}},
         404, "session_not_found", "s-0-nope"),
        ("other-key-append", "POST", "/sessions/{S}/append",
         {"json": {"data": "x"}, "key": OTHER}, 404, "session_not_found", "no session"),
        ("other-key-read", "GET", "/sessions/{S}", {"key": OTHER}, 404, "session_not_found",
         "no session"),
        ("other-key-close", "DELETE", "/sessions/{A}", {"key": OTHER}, 404,
         "session_not_found", "no session"),
        ("other-key-events", "GET", "/sessions/{S}/events", {"key": OTHER}, 404,
         "session_not_found", "no session"),
        ("no-key", "POST", "/sessions/{S}/append", {"json": {"data": "x"}, "key": None}, 401,
         "missing_api_key", "Bearer"),
        ("bad-key", "POST", "/sessions/{S}/append", {"json": {"data": "x"}, "key": "nope"},
         401, "invalid_api_key", "not valid"),
        # kinds
        ("query-agentic", "POST", "/sessions/{A}/query", {"json": {"question": "q"}}, 409,
         "wrong_session_kind", "agentic"),
        ("turn-streaming", "POST", "/sessions/{S}/turn", {"json": {"user": "u"}}, 409,
         "wrong_session_kind", "streaming"),
        ("append-agentic", "POST", "/sessions/{A}/append", {"json": {"data": "d"}}, 409,
         "wrong_session_kind", "agentic"),
        ("message-streaming", "POST", "/sessions/{S}/messages",
         {"json": {"role": "user", "content": "c"}}, 409, "wrong_session_kind", "streaming"),
        ("shift-agentic", "POST", "/sessions/{A}/shift", {"json": {}}, 409,
         "wrong_session_kind", "agentic"),
        # versions
        ("rollback-missing", "POST", "/sessions/{S}/rollback", {"json": {"version": 999}},
         404, "version_not_found", "999"),
        ("rollback-negative", "POST", "/sessions/{S}/rollback", {"json": {"version": -1}},
         404, "version_not_found", "-1"),
        ("rollback-string", "POST", "/sessions/{S}/rollback", {"json": {"version": "1"}},
         400, "invalid_request", "version"),
        ("shift-too-many", "POST", "/sessions/{S}/shift", {"json": {"drop": 99}}, 400,
         "invalid_input", "drop"),
        # sizes
        ("body-too-large", "POST", "/sessions/{S}/append", {"json": {"data": "x" * 30000}},
         413, "body_too_large", "20000"),
        ("body-too-large-chunked", "POST", "/sessions/{S}/append",
         {"chunked": b'{"data": "' + b"x" * 30000 + b'"}'}, 413, "body_too_large", "20000"),
        ("input-too-large", "POST", "/sessions/{S}/append", {"json": {"data": big}}, 413,
         "input_too_large", "200"),
        ("question-too-large", "POST", "/sessions/{S}/query", {"json": {"question": big}},
         413, "input_too_large", "200"),
        ("over-session-budget", "POST", "/sessions/{A}/messages",
         {"json": {"role": "user", "content": medium}}, 413, "over_budget", "256"),
        ("turn-over-context", "POST", "/sessions/{A}/turn",
         {"json": {"user": medium, "max_tokens": 16}}, 413, "over_budget", "256"),
        # sampling
        ("temperature", "POST", "/sessions/{S}/query",
         {"json": {"question": Q, "temperature": -1}}, 400, "invalid_sampling", "temperature"),
        ("top-p", "POST", "/sessions/{S}/query", {"json": {"question": Q, "top_p": 0}}, 400,
         "invalid_sampling", "top_p"),
        ("top-k", "POST", "/sessions/{S}/query", {"json": {"question": Q, "top_k": -2}}, 400,
         "invalid_sampling", "top_k"),
        ("max-tokens-zero", "POST", "/sessions/{S}/query",
         {"json": {"question": Q, "max_tokens": 0}}, 400, "invalid_sampling", "max_tokens"),
        ("max-tokens-over-limit", "POST", "/sessions/{S}/query",
         {"json": {"question": Q, "max_tokens": 17}}, 400, "max_tokens_limit", "16"),
        ("empty-stop", "POST", "/sessions/{S}/query", {"json": {"question": Q, "stop": [""]}},
         400, "invalid_sampling", "stop"),
        ("fast-path-mode", "POST", "/sessions/{S}/query",
         {"json": {"question": Q, "fast_path": "fastest"}}, 400, "invalid_request",
         "fast_path"),
        ("empty-question", "POST", "/sessions/{S}/query", {"json": {"question": " "}}, 400,
         "invalid_input", "question"),
        ("turn-bad-sampling", "POST", "/sessions/{A}/turn",
         {"json": {"user": "hi", "temperature": -1}}, 400, "invalid_sampling", "temperature"),
        # agentic protocol
        ("tool-result-unawaited", "POST", "/sessions/{A}/tool_result",
         {"json": {"content": "42"}}, 409, "no_tool_result_awaited", "not awaiting"),
        ("tool-message-unawaited", "POST", "/sessions/{A}/messages",
         {"json": {"role": "tool", "content": "42"}}, 409, "no_tool_result_awaited",
         "not awaiting"),
        ("user-while-tool-awaited", "POST", "/sessions/{T}/turn", {"json": {"user": "hi"}},
         409, "tool_result_awaited", "tool result"),
        ("turn-while-tool-awaited", "POST", "/sessions/{T}/turn", {"json": {}}, 400,
         "invalid_input", "tool result"),
        ("bad-tool-call", "POST", "/sessions/{A}/messages",
         {"json": {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}},
         400, "invalid_input", "function.name"),
        ("bad-role", "POST", "/sessions/{A}/messages",
         {"json": {"role": "robot", "content": "x"}}, 400, "invalid_request", "role"),
        # inspection and routes
        ("wait-ready", "GET", "/sessions/{S}?wait_ready=abc", {}, 400, "invalid_request",
         "wait_ready"),
        ("include", "GET", "/sessions/{S}?include=secrets", {}, 400, "invalid_request",
         "include"),
        ("no-route", "GET", "/nope", {}, 404, "not_found", "/nope"),
        ("method", "PUT", "/sessions/{S}", {}, 405, "method_not_allowed", "Method"),
        # OpenAI-compatible
        ("chat-diverged", "POST", "/v1/chat/completions",
         {"json": chat([sys_msg, user], session_id="{A}")}, 409, "conversation_diverged",
         "message 1"),
        ("chat-tool-unawaited", "POST", "/v1/chat/completions",
         {"json": chat([*t["held"], {"role": "tool", "content": "x"}], session_id="{A}")},
         409, "no_tool_result_awaited", "messages[3]"),
        ("chat-multi-delta-over-budget", "POST", "/v1/chat/completions",
         {"json": chat([*t["held"], {"role": "user", "content": medium},
                        {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": "and?"}], session_id="{A}")},
         400, "context_length_exceeded", "conversation"),
        ("chat-tools-differ", "POST", "/v1/chat/completions",
         {"json": chat([*t["held"], {"role": "user", "content": "x"}], session_id="{A}",
                       tools=[{"type": "function", "function": {"name": "other"}}])},
         409, "tools_differ", "tools"),
        ("chat-ends-with-assistant", "POST", "/v1/chat/completions",
         {"json": chat(t["held"], session_id="{A}")}, 400, "invalid_request", "end with"),
        ("chat-model", "POST", "/v1/chat/completions",
         {"json": {**chat([user]), "model": "nope"}}, 404, "model_not_found", "nope"),
        ("chat-bad-role", "POST", "/v1/chat/completions",
         {"json": chat([{"role": "robot", "content": "x"}])}, 400, "invalid_request",
         "messages[0].role"),
        ("chat-empty-messages", "POST", "/v1/chat/completions", {"json": chat([])}, 400,
         "invalid_request", "messages"),
        ("chat-streaming-session", "POST", "/v1/chat/completions",
         {"json": chat([user, {"role": "assistant", "content": "a"}, user],
                       session_id="{S}")}, 400, "invalid_request", "one user message"),
        ("completion-agentic-session", "POST", "/v1/completions",
         {"json": {"model": "chatml-llama", "prompt": "x", "session_id": "{A}"}}, 409,
         "wrong_session_kind", "agentic"),
        # creation
        ("create-kind", "POST", "/sessions", {"json": {"kind": "weird"}}, 400,
         "invalid_request", "kind"),
        ("create-standing-agentic", "POST", "/sessions",
         {"json": {"kind": "agentic", "standing_queries": ["q"]}}, 409, "wrong_session_kind",
         "standing"),
        ("create-budget", "POST", "/sessions", {"json": {"kind": "streaming",
                                                          "budget_cells": 0}}, 400,
         "invalid_input", "budget_cells"),
        ("create-push", "POST", "/sessions", {"json": {"kind": "streaming",
                                                        "push_max_tokens": 0}}, 400,
         "invalid_request", "push_max_tokens"),
        ("create-empty-system", "POST", "/sessions", {"json": {"kind": "streaming",
                                                               "system": " "}}, 400,
         "invalid_input", "system"),
    ]


def test_every_bad_input_is_a_named_4xx_and_changes_nothing(server, sessions, texts):
    ids = {k: sessions[k] for k in ("S", "A", "T")}
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        def states():
            return {k: state_of(c, sid) for k, sid in ids.items()}

        def count():
            return len(c.get("/sessions").json()["data"])

        before, n = states(), count()
        failures = []
        for name, method, path, kw, status, code, mention in cases({**texts, **sessions}):
            kw = dict(kw)
            headers = {}
            if "key" in kw:
                key = kw.pop("key")
                headers["Authorization"] = f"Bearer {key}" if key else ""
            if "json" in kw:
                kw["json"] = fill_ids(kw["json"], ids)
            if "chunked" in kw:
                data = kw.pop("chunked")
                kw["content"] = iter([data[i:i + 4096] for i in range(0, len(data), 4096)])
            if "content" in kw:  # a body as sent, said to be JSON (a client's mistake)
                headers["content-type"] = "application/json"
            r = c.request(method, path.format(**ids), headers=headers, **kw)
            try:
                err = r.json()["error"]
            except (ValueError, KeyError, TypeError):
                err = {"code": None, "message": r.text, "param": None}
            text = f"{err.get('message')} {err.get('param')}"
            if (r.status_code, err.get("code")) != (status, code) or mention not in text:
                failures.append(f"{name}: {r.status_code} {err} (wanted {status} {code} "
                                f"naming {mention!r})")
            after = states()
            if after != before:
                failures.append(f"{name}: changed a session")
                before = after
        assert count() == n, "a refused create made a session"
    assert not failures, "\n".join(failures)


def test_a_max_tokens_past_the_limit_is_answered_to_it(server):
    """A chat request asking more than --max-tokens (16 here) or the context holds is
    answered up to it, `finish_reason: length`, as llama.cpp's server answers it."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": server.model.name, "max_tokens": 10**6,
                         "messages": [{"role": "user", "content": "Count."}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] <= 16
    if out["usage"]["completion_tokens"] == 16:
        assert out["choices"][0]["finish_reason"] == "length"
