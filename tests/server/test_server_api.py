"""The session API end to end, against a real `prepos serve` process: the three paths,
streaming (SSE) and not, standing-query pushes, agentic turns and tool results, rollback,
shift, close, metrics."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.support.server_harness import ServerProc, listen_events, sse_events, state_of

SYSTEM = "You are a market analyst. Answer with one word."
Q = "What is the trend?"
DATA = ["AAPL 101.2 101.5 101.9 102.4", "AAPL 102.8 103.1 103.0 103.6"]
TOOLS = [{"type": "function", "function": {"name": "get_price", "description": "price",
                                           "parameters": {"type": "object", "properties": {
                                               "ticker": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-api")) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def create(client, **body) -> str:
    r = client.post("/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def feed(client, sid, data=DATA) -> int:
    version = None
    for d in data:
        r = client.post(f"/sessions/{sid}/append", json={"data": d})
        assert r.status_code == 200, r.text
        version = r.json()["version"]
    return version


def settle(client, sid) -> dict:
    for _ in range(8):  # the pre-position, and the pre-decode after it, on a loaded machine
        r = client.get(f"/sessions/{sid}", params={"wait_ready": 30})
        assert r.status_code == 200, r.text
        info = r.json()
        if info["ready"]["done"]:
            break
    assert not info["preposition"] or info["ready"]["done"], info
    return info


def ask(client, sid, question, **kw) -> dict:
    r = client.post(f"/sessions/{sid}/query", json={"question": question, "max_tokens": 1,
                                                     **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-prepos-path"] == body["path"]
    assert "ttft;dur=" in r.headers["server-timing"]
    return body


def test_health_and_session_listing(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    sid = create(client, kind="streaming", system=SYSTEM)
    listed = {s["id"] for s in client.get("/sessions").json()["data"]}
    assert sid in listed
    info = client.get(f"/sessions/{sid}").json()
    assert info["kind"] == "streaming" and info["version"] == 0 and info["tokens"] > 0
    assert client.delete(f"/sessions/{sid}").status_code == 200


def test_three_paths_and_greedy_agreement(client):
    """Cold on a session that never pre-positions (asked before a twin holds its entry: the
    twin's KV would be a prefix it starts from), fast on a standing query's exact match,
    fall-through on an ad-hoc question; greedy answers agree across paths."""
    base = create(client, kind="streaming", system=SYSTEM, preposition=False)
    feed(client, base)
    cold = ask(client, base, Q)
    hot = create(client, kind="streaming", system=SYSTEM, standing_queries=[Q])
    version = feed(client, hot)
    settle(client, hot)
    fast = ask(client, hot, Q)
    assert cold["path"] == "cold" and cold["timing"]["cached_tokens"] == 0
    assert fast["path"] == "fast" and fast["match"] == "exact" and fast["version"] == version
    assert fast["tokens"] == cold["tokens"]
    assert fast["usage"]["cached_prompt_tokens"] == fast["usage"]["prompt_tokens"]
    other = "Is AAPL rising?"
    fall = ask(client, hot, other)
    assert fall["path"] == "fall-through" and fall["timing"]["cached_tokens"] > 0
    assert fall["tokens"] == ask(client, base, other)["tokens"]
    assert state_of(client, hot)[0] == version  # queries commit nothing


def test_sse_streaming_on_every_path(client):
    hot = create(client, kind="streaming", system=SYSTEM, standing_queries=[Q])
    feed(client, hot)
    settle(client, hot)
    for question, path in ((Q, "fast"), ("Is it falling?", "fall-through")):
        r = client.post(f"/sessions/{hot}/query", json={"question": question, "max_tokens": 4,
                                                         "stream": True, "logprobs": True,
                                                         "top_logprobs": 2})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        names = [n for n, _ in events]
        assert names[-1] == "result" and set(names[:-1]) == {"token"}
        result = events[-1][1]
        assert result["path"] == path
        assert "".join(d["text"] for n, d in events[:-1]) == result["text"]
        assert len(result["logprobs"]) == len(result["tokens"])
        tops = [d["top_logprobs"] for n, d in events[:-1] if d["token"] >= 0]
        assert tops == result["top_logprobs"] and all(len(t) == 2 for t in tops)
        assert [t[0][1] for t in tops] == pytest.approx(result["logprobs"])  # greedy: top-1
        plain = client.post(f"/sessions/{hot}/query",
                            json={"question": question, "max_tokens": 4}).json()
        assert plain["tokens"] == result["tokens"]


def test_standing_query_answers_are_pushed_before_anyone_asks(server, client):
    sid = create(client, kind="streaming", system=SYSTEM, standing_queries=[Q, "Up or down?"])
    feed(client, sid, DATA[:1])
    settle(client, sid)
    events, t = listen_events(server.url, sid)
    hello = events.get(timeout=30)
    assert hello[0] == "hello" and hello[1]["version"] == 1
    version = feed(client, sid, DATA[1:])
    answers = {}
    while len(answers) < 2:
        name, data = events.get(timeout=60)
        if name == "answer" and data["version"] == version:
            answers[data["query"]] = data
    for q, pushed in answers.items():
        assert pushed["path"] == "fast" and pushed["match"] == "exact"
        asked = ask(client, sid, q)
        assert asked["path"] == "fast" and asked["tokens"] == pushed["tokens"]
    metrics = client.get("/metrics").text
    assert "prepos:standing_query_pushes_total" in metrics
    client.delete(f"/sessions/{sid}")
    t.join(30)
    assert not t.is_alive()


def test_agentic_turns_tool_results_and_the_exact_turn(client):
    sid = create(client, kind="agentic", system="You call tools.", tools=TOOLS)
    r = client.post(f"/sessions/{sid}/turn", json={"user": "Price of AAPL?", "max_tokens": 3})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["path"] in ("cold", "fall-through") and "content" in first
    v = first["committed_version"]
    assert v == first["version"] + 1 and state_of(client, sid)[0] == v  # answer committed
    # a user message committed ahead of the turn: the next turn is an exact fast path
    r = client.post(f"/sessions/{sid}/messages", json={"role": "user", "content": "And MSFT?"})
    assert r.status_code == 200 and r.json()["version"] == v + 1
    settle(client, sid)
    r = client.post(f"/sessions/{sid}/turn", json={"max_tokens": 1})
    assert r.status_code == 200 and r.json()["path"] == "fast", r.text
    # an assistant tool call the client holds, then its result resumes from the envelope
    call = {"type": "function", "function": {"name": "get_price",
                                             "arguments": {"ticker": "MSFT"}}}
    r = client.post(f"/sessions/{sid}/messages",
                    json={"role": "assistant", "content": "", "tool_calls": [call]})
    assert r.status_code == 200, r.text
    assert client.get(f"/sessions/{sid}").json()["awaiting_tool_result"] is True
    settle(client, sid)
    r = client.post(f"/sessions/{sid}/tool_result", json={"content": "310.5", "max_tokens": 3,
                                                          "stream": True})
    events = sse_events(r.text)
    result = events[-1][1]
    assert events[-1][0] == "result" and result["path"] == "fall-through", events
    assert result["timing"]["cached_tokens"] > 0


def test_rollback_shift_and_close(client):
    sid = create(client, kind="streaming", system=SYSTEM)
    v1 = feed(client, sid, DATA[:1])
    at_v1 = state_of(client, sid)
    feed(client, sid, DATA[1:] + ["AAPL 104.0 104.2"])
    r = client.post(f"/sessions/{sid}/rollback", json={"version": v1})
    assert r.status_code == 200
    now = state_of(client, sid)
    assert now[0] > v1 and now[1:] == at_v1[1:]  # a new version holding v1's sequence
    feed(client, sid, DATA[1:])
    r = client.post(f"/sessions/{sid}/shift", json={"drop": 1})
    assert r.status_code == 200 and r.json()["messages"] == 2  # system + the newest data
    assert client.delete(f"/sessions/{sid}").status_code == 200
    assert client.get(f"/sessions/{sid}").status_code == 404
    assert client.post(f"/sessions/{sid}/append", json={"data": "x"}).status_code == 404
    assert sid not in {s["id"] for s in client.get("/sessions").json()["data"]}


def test_metrics_in_prometheus_text(client):
    sid = create(client, kind="streaming", system=SYSTEM, standing_queries=[Q])
    feed(client, sid)
    settle(client, sid)
    ask(client, sid, Q)
    text = client.get("/metrics").text
    for name in ('prepos:time_to_first_token_seconds_bucket{le="0.001",path="fast"}',
                 "prepos:prepositions_started_total", "prepos:prepositions_recorded_total",
                 "prepos:prepositions_consumed_total", "prepos:prepositions_invalidated_total",
                 "prepos:prepositions_skipped_total", "prepos:preposition_hit_rate",
                 "prepos:gate_fires_total", "prepos:fall_throughs_total",
                 "prepos:kv_cells_used", "prepos:kv_cells_budget",
                 'prepos:queue_length{queue="foreground"}', "prepos:sessions"):
        assert name in text, name
    fast = [ln for ln in text.splitlines()
            if ln.startswith('prepos:time_to_first_token_seconds_count{path="fast"}')]
    assert fast and float(fast[0].split()[-1]) >= 1


def _counter(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _wait_counter(client, name: str, at_least: float) -> float:
    deadline = time.monotonic() + 30
    while (value := _counter(client, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_generation(server, client, stream):
    sid = create(client, kind="streaming", system=SYSTEM, preposition=False)
    feed(client, sid)
    long = {"question": Q, "max_tokens": 1024, "fast_path": "off"}
    # the precondition that makes this test mean something: greedy decoding of this prompt
    # runs to max_tokens (no end of turn), so only a cancellation ends it early
    assert ask(client, sid, Q, max_tokens=1024, fast_path="off")["finish_reason"] == "length"
    cancelled = _counter(client, "prepos:requests_cancelled_total")
    generated = _counter(client, "prepos:generation_tokens_total")
    with httpx.Client(base_url=server.url, timeout=60) as leaving:
        if stream:
            with leaving.stream("POST", f"/sessions/{sid}/query",
                                json={**long, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("event: token"):
                        break  # one token read, then the connection closes
        else:  # the whole request sent, then the connection closed: no answer is read
            body = json.dumps(long).encode()
            host, port = server.url.rsplit("/", 1)[1].split(":")
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(f"POST /sessions/{sid}/query HTTP/1.1\r\nHost: {host}\r\n"
                            f"Content-Type: application/json\r\nContent-Length: "
                            f"{len(body)}\r\n\r\n".encode() + body)
    assert _wait_counter(client, "prepos:requests_cancelled_total", cancelled + 1) \
        == cancelled + 1
    assert _counter(client, "prepos:generation_tokens_total") - generated < 1024
    assert ask(client, sid, Q)["finish_reason"] == "length"  # the session serves on
