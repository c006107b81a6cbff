"""benchmarks/agent_jobs.py without timing: its synthetic requests have each client's captured
shape (and no timing is asserted), a next turn resends the conversation with the answer and
the tool's result in the API's form, the draws are seeded; and the engine's counter of the
tool waits whose next entry was pre-positioned before the result arrived."""

from __future__ import annotations

import json

import pytest

# under a name of its own: `agents` is the OpenAI Agents SDK's package
from benchmarks import agent_jobs as agents
from prepos.core import Request, SamplingParams
from tests.support.helpers import hold_worker


def first_jobs(scale: float = 1.0, seed: int = 0, agent: int = 0) -> dict:
    statics = {c: agents.Statics(c, seed, scale) for c in agents.CLIENTS}
    return {c: agents.Job(statics[c], seed, agent, 0, scale) for c in agents.CLIENTS}


def test_claude_code_shape():
    path, headers, body = first_jobs()["claude_code"].request("m")
    assert path == "/v1/messages?beta=true" and headers["X-Claude-Code-Session-Id"]
    assert body["stream"] is True and body["max_tokens"] == 128000
    system = [b["text"] for b in body["system"]]
    assert [b["type"] for b in body["system"]] == ["text"] * 3
    assert len(system[0]) == 74 and system[0].startswith("x-anthropic-billing-header: ")
    assert "cc_version=" in system[0] and "cc_entrypoint=" in system[0]
    assert len(system[1]) == 62 and 5700 <= len(system[2]) <= 5900
    context, sys_msg, task = body["messages"]
    assert context["role"] == "user" and 3000 <= len(context["content"][0]["text"]) <= 4000
    assert sys_msg["role"] == "system" and task["role"] == "user"
    assert 12 <= len(body["tools"]) <= 22
    assert all(t["input_schema"]["type"] == "object" and t["name"] for t in body["tools"])


def test_codex_shape():
    path, headers, body = first_jobs()["codex"].request("m")
    assert path == "/v1/responses" and headers["session-id"] and headers["thread-id"]
    assert body["stream"] is True and body["store"] is False and "instructions" not in body
    assert body["reasoning"] == {"summary": "auto"}
    assert body["include"] == ["reasoning.encrypted_content"] and body["prompt_cache_key"]
    roles = [i["role"] for i in body["input"]]
    assert roles == ["developer", "developer", "user", "user"]
    assert [len(i["content"][0]["text"]) for i in body["input"][:2]] == [19000, 3000]
    kinds = [t["type"] for t in body["tools"]]
    assert kinds.count("function") == 10 and "web_search" in kinds and "namespace" in kinds


def test_opencode_shape():
    path, headers, body = first_jobs()["opencode"].request("m")
    assert path == "/v1/chat/completions" and headers["x-session-id"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 32000 and len(body["tools"]) == 10
    system, user = body["messages"]
    assert system["role"] == "system" and 9600 <= len(system["content"]) <= 9800
    assert user["role"] == "user"


def test_the_next_turn_resends_everything_with_the_answer_and_the_result():
    prose = agents.Answer(status=200, text="I will look.")
    for client, job in first_jobs(0.05).items():
        _, _, before = job.request("m")
        before = json.loads(json.dumps(before))
        job.absorb(prose, ["out.txt"])
        _, _, after = job.request("m")
        key = "input" if client == "codex" else "messages"
        assert after[key][:len(before[key])] == before[key]
        added = after[key][len(before[key]):]
        assert len(added) == 2 and added[0]["role"] == "assistant"
        assert added[1]["role"] == "user" and "out.txt" in json.dumps(added[1])
    call = agents.Answer(status=200, text="", calls=[{"id": "c1", "name": "ls",
                                                      "arguments": "{}"}])
    jobs = first_jobs(0.05)
    for job in jobs.values():
        job.absorb(call, ["a.py"])
    assert jobs["claude_code"].messages[-1]["content"][0] == {
        "type": "tool_result", "tool_use_id": "c1", "content": "a.py"}
    assert jobs["claude_code"].messages[-2]["content"][0]["type"] == "tool_use"
    assert jobs["codex"].input[-2]["type"] == "function_call"
    assert jobs["codex"].input[-1] == {"type": "function_call_output", "call_id": "c1",
                                       "output": "a.py"}
    assert jobs["opencode"].messages[-1] == {"role": "tool", "tool_call_id": "c1",
                                             "content": "a.py"}


def test_draws_are_seeded_and_a_clients_prompt_is_shared():
    a, b = first_jobs(seed=3), first_jobs(seed=3)
    other = first_jobs(seed=3, agent=5)
    for c in agents.CLIENTS:
        assert a[c].request("m") == b[c].request("m")
        assert a[c].request("m")[1] != other[c].request("m")[1]  # its own session
    assert a["codex"].request("m")[2]["input"][:2] == other["codex"].request("m")[2]["input"][:2]


def test_codex_as_chat_for_a_server_without_its_route():
    job = first_jobs(0.05)["codex"]
    job.absorb(agents.Answer(status=200, text="x", calls=[{"id": "c1", "name": "ls",
                                                            "arguments": "{}"}]), ["a.py"])
    path, body = agents.for_llama("/v1/responses", job.request("m")[2], 16, "chat")
    assert path == "/v1/chat/completions" and body["max_tokens"] == 16
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "system", "user", "user", "assistant", "tool"]
    assert body["messages"][-2]["tool_calls"][0]["id"] == "c1"
    assert all(t["type"] == "function" for t in body["tools"]) and len(body["tools"]) == 10


def test_the_next_turns_found_prepositioned_are_counted(make_engine):
    eng = make_engine("chatml")
    sid = eng.create_session("agentic", system="You call tools.")
    req = Request(SamplingParams(max_tokens=2))
    eng.turn(sid, "List the files.", req).result()
    eng.wait_idle()  # the tool's run: the entry after the answer is pre-positioned
    eng.turn(sid, "a.py b.py", req).result()
    c = eng.prepositioner.counters
    assert (c.next_turns, c.next_turns_ready) == (1, 1)
    eng.wait_idle()
    gate = hold_worker(eng)  # no idle time: the next message comes before the pre-position
    try:
        eng.add_message(sid, "user", "Read a.py.", wait=False)
        eng.add_message(sid, "assistant", "Reading it.", wait=False)  # a client's answer
        stream = eng.turn(sid, "print(1)", req)
    finally:
        gate.set()
    stream.result()
    assert (c.next_turns, c.next_turns_ready) == (2, 1)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_no_preposition_counts_none_ready(make_engine):
    eng = make_engine("chatml", preposition=False)
    sid = eng.create_session("agentic", system="You call tools.")
    req = Request(SamplingParams(max_tokens=2))
    eng.turn(sid, "List the files.", req).result()
    eng.wait_idle()
    eng.turn(sid, "a.py", req).result()
    assert (eng.prepositioner.counters.next_turns,
            eng.prepositioner.counters.next_turns_ready) == (1, 0)
