"""The agents people run: N concurrent coding-agent sessions, replayed with the request shapes
Claude Code, Codex CLI and OpenCode send, prepos beside llama-server on the same GGUF.

The workload. An agent runs jobs; a job is one conversation of --turns turns. Each turn sends
the request its client would send (streamed), reads the stream to its end, then "runs the
tool" (sleeps a latency drawn per turn, log-uniform over --tool-seconds, default 0.2-5 s: the
idle window a tool call leaves the server) and sends the next turn: the whole conversation
again with the model's answer and a tool result of a size drawn per turn (log-uniform over
--result-chars, default 200-4,000 characters) appended, as the client would. Agent i's job j
speaks client (i + j) mod 3's shape (claude_code, codex, opencode); each agent runs enough
jobs that every N has at least --min-jobs (3) of them, so one agent alone runs all three
shapes in turn. Every draw (latency, sizes, texts) is seeded by (--seed, agent, job, turn):
both servers get the same workload.

The request shapes, as captured from the real clients; the text is synthetic (seeded words of
the same sizes and structure; the vendors' prompts are not copied):
  claude_code  Claude Code 2.1.328: POST /v1/messages?beta=true, stream, max_tokens 128000,
               `system` as three text blocks (a 74-character attribution line
               `x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;`, a 62-character
               line, ~5,800 characters whose last ~500 are the session's environment), messages
               starting with a user message of ~3-4k characters of context and the task, then a
               `system`-role message and the task's user message (a conversation that
               ended with the system message is a 400 on prepos: the order is a guess to
               check against the capture); 12-22 tools with JSON-schema `input_schema`; header
               X-Claude-Code-Session-Id.
  codex        Codex CLI 0.169: POST /v1/responses, stream, store false, no instructions;
               input: two `developer` messages (~19k and ~3k characters) and two user messages
               (the session's environment, the task); 10 function tools, a web_search and a
               namespace tool; reasoning {summary: auto}, include
               ["reasoning.encrypted_content"], prompt_cache_key; headers session-id and
               thread-id. A next turn resends the whole input with the previous output items
               and the tool results appended.
  opencode     OpenCode 1.18: POST /v1/chat/completions, stream, stream_options include_usage,
               max_tokens 32000, a ~9.7k-character system message (its last ~400 the
               session's environment), 10 tools; header x-session-id. A next turn resends
               every message.
Sizes the captures did not record (tool descriptions and schemas, the task, the `system`-role
message) are drawn (PROFILES, below) and reported in `shapes` (characters per request part).

The tool calls are replayed, honestly: SmolLM2-135M rarely calls a tool. Each next turn
appends the model's own answer as the assistant message, exactly as it came (its text, and
its calls where it made any), then the tool's result in the API's form: where the model made
calls, one result per call (`tool_result` blocks, `function_call_output` items, `tool`
messages); where it answered in prose, a user message carrying the result text (a client
cannot answer a call that was never made). `model_tool_calls` counts the turns with real
calls.

The arms, one server alive at a time (a fresh one per N; which runs first alternates with N):
  prepos        `prepos serve --model smollm2 --context-length 32768 --kv-ram <--ram-mib>M
                --max-tokens <--answer-tokens>`: every request as the client sends it (its
                max_tokens 128000 / 32000 / none are answered up to --max-tokens, as prepos
                answers coding agents; no temperature: prepos's default is greedy).
  llama_server  `llama-server -m <the same GGUF> -c 32768 --rope-scaling yarn --rope-scale 4
                --yarn-orig-ctx 8192 -np N --kv-unified --cache-ram <--ram-mib> --jinja`:
                --kv-unified so each of the N slots may use the whole 32k context (with -np N
                the slots would otherwise split it, 2,048 tokens each at 16), the pool the
                same 32,768 cells prepos keeps resident (--llama-cells sets another -c: N x
                32,768 gives each slot a whole context); --jinja since llama-server takes no
                `tools` without it. Each body gets max_tokens (max_output_tokens) set to
                --answer-tokens and temperature 0 (llama-server's per-request max_tokens
                overrides its -n and its default temperature is 0.8), so both servers decode
                the same greedy budget. The Codex shape goes to its /v1/responses where that
                route answers the Codex request (this llama-server build serves it, converted
                to chat; non-function tools skipped), else as the equivalent
                /v1/chat/completions request (developer messages as system ones): `codex_route`.

What is reported, per N and arm (sample counts beside every figure): turn TTFT P50/P99 (the
client's time from sending a request to its first content or tool-call delta; an answer with
neither, empty, counts its end), over all turns and over next turns (those after a tool
wait); job completion time P50/P99 (first request sent to last stream ended, tool waits
included: the same on both arms); the cached fraction of the ceiling (per next turn, the
prompt tokens the server says it found cached, over the previous turn's prompt plus answer:
what could have been kept; capped at 1 per turn; pooled and its P50 and minimum), from each
API's usage (chat `prompt_tokens_details.cached_tokens`, or llama-server's `timings.cache_n`;
messages `cache_read_input_tokens`; responses `input_tokens_details.cached_tokens`); errors
(failed requests: a non-2xx, an error event, a broken stream; a job stops at its first; a
keep-alive connection the server had closed before answering is opened again once, as the
clients' SDKs do, counted in `reconnects`);
and, for prepos, `tool_waits_prepositioned`: of the tool waits, the fraction in which the
next turn's entry was pre-positioned before the result arrived, from the engine's counters
(`prepos:prepositions_next_turns_ready`, requests that brought the next message after an
answer and found that version's pre-position done as they arrived, over the client's count
of tool waits; `prepos:prepositions_next_turns`, all such requests, should equal that count).
Ratios are prepos over llama-server. Targets at every N: turn_ttft_ratio_vs_llama_server
(P50) <= 1.0, job_time_ratio_vs_llama_server (P50) <= 1.0, cached >= 0.95 of the ceiling,
errors 0, tool_waits_prepositioned >= 0.9 (`targets`).

    python benchmarks/agent_jobs.py [--agents 1,4,16] [--turns 4] [--seed 0] [--quick]
                                [--arms prepos,llama_server]
The last line printed is the JSON summary (also results/agent_jobs.json, every turn in
results/agent_jobs_turns.json, the figure results/agent_jobs.png; --quick: agent_jobs-quick*).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stock_clients import resolve, serve_prepos  # noqa: E402
from token_cadence import stop_pair  # noqa: E402

from common import RESULTS, machine, metric_samples, write  # noqa: E402
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402
from prepos.chat.tool_formats import render_prepos_tools  # noqa: E402

CLIENTS = ("claude_code", "codex", "opencode")
TRAINED_CONTEXT = 8192  # SmolLM2's: YaRN past it
# Sizes in characters at --scale 1 (a range: drawn per session). `shared` text is the same for
# every session of a client (one client version's prompt), `env` the session's own part.
PROFILES = {
    "claude_code": {"attribution": 74, "line": 62, "system_shared": 5300, "system_env": 500,
                    "context": (3000, 4000), "task": (120, 400), "system_message": (300, 600),
                    "tools": (12, 22), "tool_description": (100, 1500), "max_tokens": 128000},
    "codex": {"developer": (19000, 3000), "environment": (900, 1500), "task": (120, 400),
              "tools": 10, "tool_description": (100, 1500)},
    "opencode": {"system_shared": 9300, "system_env": 400, "task": (120, 400), "tools": 10,
                 "tool_description": (100, 1500), "max_tokens": 32000},
}
WORDS = """the a of to and in is for that with on as be this by are from at or it an not you
your when each if then use only file files function value test tests error line lines path
module config return call result build check read write list update change should must
before after always never run command shell output input process thread worker queue store
record table field column row key map set get put post delete patch commit branch merge
diff review lint format import export class method param args default option flag string
integer boolean array object schema json yaml source tree folder project repository user
task tool tools answer question code edit search find match pattern replace create remove
rename move copy open close start stop wait retry limit timeout session cache token model
stream request response handler client server api endpoint status message context step plan
todo note warning info debug trace log print exit code type name size count index offset
range first last next previous current new old same other more less most least all any
some none every many few small large long short fast slow safe clear simple""".split()
CODE = ["def {a}({b}):", "    return {a}({b}) + 1", "class {A}:", "    {a} = {b}.{c}({n})",
        "import {a}", "from {a}.{b} import {c}", "if {a} is None:", "    raise ValueError('{a}')",
        "for {a} in {b}:", "    {a}.append({b})", "}} // {a}", "const {a} = await {b}({c});",
        "let {a} = {b}.{c}();", "# {a} {b} {c}"]
EXTS = ["py", "ts", "js", "md", "json", "toml", "go", "rs", "yaml", "txt"]


# -- synthetic text -----------------------------------------------------------------------
def words(rng: random.Random, lo: int, hi: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]


def sentence(rng: random.Random, lo: int = 6, hi: int = 18, end: str = ".") -> str:
    w = words(rng, lo, hi)
    return " ".join([w[0].capitalize(), *w[1:]]) + end


def fit(text: str, chars: int) -> str:
    return text[:chars]


def prose(rng: random.Random, chars: int) -> str:
    """Markdown-like instructions: headings, bullets, paragraphs; exactly `chars` long."""
    out, n = [], 0
    while n < chars:
        r = rng.random()
        if r < 0.08:
            line = "\n## " + sentence(rng, 2, 5, end="")
        elif r < 0.4:
            line = "- " + sentence(rng, 5, 16)
        else:
            line = " ".join(sentence(rng) for _ in range(rng.randint(2, 5)))
        out.append(line)
        n += len(line) + 1
    return fit("\n".join(out), chars)


def ident(rng: random.Random, k: int = 2, style: str = "snake") -> str:
    w = [rng.choice(WORDS) for _ in range(k)]
    return "".join(x.capitalize() for x in w) if style == "camel" else "_".join(w)


def a_path(rng: random.Random) -> str:
    return "/".join(ident(rng, 1) for _ in range(rng.randint(1, 3))) + \
        f"/{ident(rng)}.{rng.choice(EXTS)}"


def tool_output(rng: random.Random, chars: int) -> str:
    """What a coding tool returns: file listings, code, grep hits, test output."""
    out, n = [], 0
    kind = rng.choice(["listing", "code", "grep", "tests"])
    while n < chars:
        if kind == "listing":
            line = f"{rng.randint(0, 99999):>6}  {a_path(rng)}"
        elif kind == "grep":
            line = f"{a_path(rng)}:{rng.randint(1, 900)}: {' '.join(words(rng, 3, 10))}"
        elif kind == "tests":
            line = (f"{a_path(rng)}::test_{ident(rng)} "
                    f"{rng.choice(['PASSED', 'PASSED', 'PASSED', 'FAILED', 'SKIPPED'])}")
        else:
            line = rng.choice(CODE).format(a=ident(rng), b=ident(rng, 1), c=ident(rng, 1),
                                           A=ident(rng, 2, "camel"), n=rng.randint(0, 64))
        out.append(line)
        n += len(line) + 1
    return fit("\n".join(out), chars)


def environment(rng: random.Random, chars: int, tag: str | None = None) -> str:
    lines = [f"Working directory: /home/{ident(rng, 1)}/{ident(rng)}",
             f"Is directory a git repo: {rng.choice(['yes', 'no'])}", "Platform: linux",
             f"Today's date: 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
             f"Shell: {rng.choice(['bash', 'zsh'])}"]
    body = "\n".join(lines) + "\n" + prose(rng, chars)
    if tag:
        body = f"<{tag}>\n{body}"
        return fit(body, chars - len(tag) - 4) + f"\n</{tag}>"
    return fit(body, chars)


def between(rng: random.Random, span, scale: float) -> int:
    lo, hi = span if isinstance(span, tuple) else (span, span)
    return max(1, round(rng.randint(lo, hi) * scale))


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def schema(rng: random.Random, scale: float = 1.0) -> dict:
    props, required = {}, []
    for _ in range(rng.randint(1, 6)):
        name = ident(rng, rng.randint(1, 2))
        kind = rng.choice(["string", "string", "integer", "boolean", "array"])
        p: dict = {"type": kind, "description": sentence(rng, max(1, round(4 * scale)),
                                                          max(2, round(20 * scale)))}
        if kind == "array":
            p["items"] = {"type": "string"}
        props[name] = p
        if rng.random() < 0.5:
            required.append(name)
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def tool_defs(rng: random.Random, n: int, span, scale: float, style: str) -> list[dict]:
    """n tools: (name, description, JSON schema of the input)."""
    out, names = [], set()
    while len(out) < n:
        name = ident(rng, rng.randint(1, 2), style)
        if name in names:
            continue
        names.add(name)
        out.append({"name": name, "description": prose(rng, between(rng, span, scale)),
                    "schema": schema(rng, scale)})
    return out


# -- the clients' requests ----------------------------------------------------------------
@dataclass
class Answer:
    """One streamed answer as the client read it."""

    status: int = 0
    text: str = ""
    calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments" (JSON text)}
    prompt: int | None = None
    cached: int | None = None
    completion: int | None = None
    ttft_s: float | None = None  # first content or tool-call delta
    total_s: float = 0.0
    error: str | None = None


class Statics:
    """A client version's shared text (system prompts, tools), seeded by (seed, client)."""

    def __init__(self, client: str, seed: int, scale: float):
        rng = random.Random(f"{seed}:{client}")
        prof = PROFILES[client]
        self.client = client
        if client == "claude_code":
            suffix = "".join(rng.choice("0123456789abcdef") for _ in range(7))
            self.attribution = (f"x-anthropic-billing-header: cc_version=2.1.328.{suffix}; "
                                "cc_entrypoint=cli;")
            assert len(self.attribution) == prof["attribution"]
            self.line = fit(sentence(rng, 12, 14) + " " + sentence(rng), prof["line"])
            self.system = prose(rng, round(prof["system_shared"] * scale))
            self.tools = tool_defs(rng, prof["tools"][1], prof["tool_description"], scale,
                                   "camel")
        elif client == "codex":
            big, small = prof["developer"]
            self.developer = (prose(rng, round(big * scale)), prose(rng, round(small * scale)))
            self.tools = tool_defs(rng, prof["tools"], prof["tool_description"], scale,
                                   "snake")
            self.namespace = {"type": "namespace", "name": ident(rng, 2),
                              "description": sentence(rng),
                              "tools": [{"type": "function", "name": t["name"],
                                         "description": t["description"],
                                         "parameters": t["schema"]}
                                        for t in tool_defs(rng, 2, (80, 300), scale, "snake")]}
        else:
            self.system = prose(rng, round(prof["system_shared"] * scale))
            self.tools = tool_defs(rng, prof["tools"], prof["tool_description"], scale,
                                   "snake")


SEP = "\n\n"  # prepos's join of text blocks (and of its tools block to the system text)


def tools_block(functions: list[dict]) -> str:
    """Function tools ({name, description, parameters}) as the text prepos writes into the
    system message for a template that renders no tools."""
    return render_prepos_tools([{"type": "function", "function": f} for f in functions])


class Job:
    """One agent's conversation in its client's own request shape: `request()` is the next
    turn's (path, headers, body); `absorb(answer, outputs)` appends the model's answer and
    the tool's results as the client would.

    `same_prompt`: the request written so that both servers render the same text (see
    `same_prompt_text`): the tools, as prepos's block (`render_prepos_tools`, what prepos
    writes itself for a template that renders none), at the end of the system text (Claude
    Code's, OpenCode's) or of the first developer message (Codex's), no `tools` field; and
    Claude Code's three system blocks sent as one string, joined by a blank line (prepos
    joins blocks with one, llama-server with nothing)."""

    def __init__(self, st: Statics, seed: int, agent: int, job: int, scale: float,
                 same_prompt: bool = False):
        self.st, self.client, self.same_prompt = st, st.client, same_prompt
        rng = random.Random(f"{seed}:{st.client}:{agent}:{job}")
        self.session = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        prof = PROFILES[self.client]
        task = sentence(rng, 8, 20) + " " + prose(rng, between(rng, prof["task"], scale))
        if self.client == "claude_code":
            n_tools = rng.randint(*prof["tools"])
            self.tools = [{"name": t["name"], "description": t["description"],
                           "input_schema": {"$schema": "http://json-schema.org/draft-07/"
                                                       "schema#", **t["schema"]}}
                          for t in st.tools[:n_tools]]
            self.system = [{"type": "text", "text": st.attribution},
                           {"type": "text", "text": st.line},
                           {"type": "text", "text": st.system + "\n\n" + environment(
                               rng, round(prof["system_env"] * scale))}]
            self.messages: list[dict] = [
                {"role": "user", "content": [{"type": "text", "text": environment(
                    rng, between(rng, prof["context"], scale), "system-reminder")}]},
                {"role": "system", "content": prose(
                    rng, between(rng, prof["system_message"], scale))},
                {"role": "user", "content": [{"type": "text", "text": task}]}]
        elif self.client == "codex":
            tools = [{"type": "function", "name": t["name"], "description": t["description"],
                      "strict": False, "parameters": t["schema"]} for t in st.tools]
            self.tools = [*tools, {"type": "web_search"}, st.namespace]
            self.input: list[dict] = [
                *({"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": d}]} for d in st.developer),
                {"type": "message", "role": "user", "content": [{"type": "input_text",
                 "text": environment(rng, between(rng, prof["environment"], scale),
                                     "environment_context")}]},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": task}]}]
        else:
            self.tools = [{"type": "function", "function": {
                "name": t["name"], "description": t["description"], "parameters": t["schema"]}}
                for t in st.tools]
            self.messages = [{"role": "system", "content": st.system + "\n" + environment(
                                 rng, round(prof["system_env"] * scale))},
                             {"role": "user", "content": task}]

        if same_prompt:
            self._same_prompt()

    def _same_prompt(self) -> None:
        """The tools written into the text, no `tools` field (see the class)."""
        if self.client == "claude_code":
            block = tools_block([{"name": t["name"], "description": t["description"],
                                  "parameters": t["input_schema"]} for t in self.tools])
            self.system = SEP.join([*(b["text"] for b in self.system), block])
        elif self.client == "codex":
            block = tools_block([{"name": t["name"], "description": t["description"],
                                  "parameters": t["parameters"]}
                                 for t in self.tools if t["type"] == "function"])
            first = self.input[0]["content"][0]
            first["text"] = first["text"] + SEP + block
        else:
            block = tools_block([t["function"] for t in self.tools])
            self.messages[0]["content"] = self.messages[0]["content"] + SEP + block
        self.tools = []

    def request(self, model: str) -> tuple[str, dict, dict]:
        tools = {"tools": self.tools} if self.tools else {}
        if self.client == "claude_code":
            return "/v1/messages?beta=true", {
                "anthropic-version": "2023-06-01", "x-api-key": "unused",
                "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
                "x-app": "cli", "X-Claude-Code-Session-Id": self.session}, {
                "model": "claude-sonnet-4-5", "max_tokens": PROFILES[self.client]["max_tokens"],
                "stream": True, "system": self.system, "messages": self.messages,
                **tools, "metadata": {"user_id": f"user_{self.session}"}}
        if self.client == "codex":
            return "/v1/responses", {
                "Authorization": "Bearer unused", "session-id": self.session,
                "thread-id": self.session, "originator": "codex_exec"}, {
                "model": model, "input": self.input, **tools,
                **({"tool_choice": "auto"} if tools else {}), "parallel_tool_calls": False,
                "reasoning": {"summary": "auto"}, "store": False, "stream": True,
                "include": ["reasoning.encrypted_content"], "prompt_cache_key": self.session}
        return "/v1/chat/completions", {
            "Authorization": "Bearer unused", "x-session-id": self.session}, {
            "model": model, "messages": self.messages, **tools,
            "max_tokens": PROFILES[self.client]["max_tokens"], "stream": True,
            "stream_options": {"include_usage": True}}

    def absorb(self, ans: Answer, outputs: list[str]) -> None:
        """The answer as the assistant's turn, then the tool results: one per call the model
        made, else the (first) result as a user message. `outputs`: one per call, or one."""
        calls = ans.calls
        if self.client == "claude_code":
            blocks = [{"type": "text", "text": ans.text}] if ans.text or not calls else []
            for c in calls:
                try:
                    args = json.loads(c["arguments"] or "{}")
                except ValueError:
                    args = {}
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["name"],
                               "input": args if isinstance(args, dict) else {}})
            self.messages.append({"role": "assistant", "content": blocks})
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c["id"], "content": out}
                for c, out in zip(calls, outputs)] if calls else [
                {"type": "text", "text": outputs[0]}]})
        elif self.client == "codex":
            if ans.text or not calls:
                self.input.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": ans.text}]})
            for c in calls:
                self.input.append({"type": "function_call", "call_id": c["id"],
                                   "name": c["name"], "arguments": c["arguments"]})
            if calls:
                self.input.extend({"type": "function_call_output", "call_id": c["id"],
                                   "output": out} for c, out in zip(calls, outputs))
            else:
                self.input.append({"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": outputs[0]}]})
        else:
            msg: dict = {"role": "assistant", "content": ans.text}
            if calls:
                msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
            self.messages.append(msg)
            if calls:
                self.messages.extend({"role": "tool", "tool_call_id": c["id"], "content": out}
                                     for c, out in zip(calls, outputs))
            else:
                self.messages.append({"role": "user", "content": outputs[0]})


def shapes(job: Job, model: str) -> dict:
    """Characters per part of a job's first request (what the synthetic text amounts to)."""
    path, _, body = job.request(model)
    n = lambda x: len(json.dumps(x))  # noqa: E731
    out = {"path": path, "request_chars": n(body), "tools": len(body.get("tools", ())),
           "tools_chars": n(body.get("tools", []))}
    if job.client == "claude_code":
        out["system_blocks_chars"] = [len(body["system"])] if isinstance(body["system"], str) \
            else [len(b["text"]) for b in body["system"]]
        out["messages_chars"] = [len(json.dumps(m["content"])) for m in body["messages"]]
    elif job.client == "codex":
        out["input_chars"] = [len(i["content"][0]["text"]) for i in body["input"]]
    else:
        out["messages_chars"] = [len(m["content"]) for m in body["messages"]]
    return out


# -- what each server is sent -------------------------------------------------------------
def responses_as_chat(body: dict, max_tokens: int) -> dict:
    """A Codex request as the equivalent chat completion: developer messages as system
    ones, output items as the assistant's message and calls, function_call_output items as
    tool messages, function tools only."""
    msgs: list[dict] = []
    for item in body["input"]:
        kind = item.get("type")
        if kind == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            role = "system" if item["role"] == "developer" else item["role"]
            msgs.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" not in msgs[-1]:
                msgs[-1]["tool_calls"] = [call]
            elif msgs and msgs[-1]["role"] == "assistant":
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": item["output"]})
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                   "parameters")}}
             for t in body.get("tools", ()) if t.get("type") == "function"]
    return {"model": body["model"], "messages": msgs, **({"tools": tools} if tools else {}),
            "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def for_llama(path: str, body: dict, max_tokens: int, codex_route: str) -> tuple[str, dict]:
    """llama-server's body: the same budget prepos's --max-tokens gives, greedy."""
    if path == "/v1/responses":
        if codex_route == "chat":
            return "/v1/chat/completions", responses_as_chat(body, max_tokens)
        return path, {**body, "max_output_tokens": max_tokens, "temperature": 0}
    return path, {**body, "max_tokens": max_tokens, "temperature": 0}


# -- reading a stream ---------------------------------------------------------------------
def read_stream(r: httpx.Response, path: str, t0: float) -> Answer:
    """The answer as a client reads it: text, calls, usage, the first delta's time."""
    ans = Answer(status=r.status_code)
    if r.status_code != 200:
        ans.error = f"{r.status_code}: {r.read()[:300]!r}"
        ans.total_s = time.perf_counter() - t0
        return ans
    kind = "messages" if path.startswith("/v1/messages") else \
        "responses" if path.startswith("/v1/responses") else "chat"
    calls: dict = {}  # index or id -> call
    usage: dict = {}
    finished = False

    def first() -> None:
        if ans.ttft_s is None:
            ans.ttft_s = time.perf_counter() - t0

    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        raw = line[5:].strip()
        if raw == "[DONE]":
            finished = True
            continue
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue
        typ = ev.get("type", "")
        if "error" in ev and typ in ("", "error") or typ in ("response.failed", "error"):
            ans.error = json.dumps(ev)[:300]
            break
        if kind == "chat":
            for c in ev.get("choices") or ():
                d = c.get("delta") or {}
                if d.get("content"):
                    first()
                    ans.text += d["content"]
                for tc in d.get("tool_calls") or ():
                    first()
                    call = calls.setdefault(tc.get("index", 0), {"id": "", "name": "",
                                                                 "arguments": ""})
                    call["id"] = tc.get("id") or call["id"]
                    fn = tc.get("function") or {}
                    call["name"] += fn.get("name") or ""
                    call["arguments"] += fn.get("arguments") or ""
                if c.get("finish_reason"):
                    finished = True
            if ev.get("usage"):
                u = ev["usage"]
                usage.update(prompt=u.get("prompt_tokens"), completion=u.get(
                    "completion_tokens"), cached=(u.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"))
            if ev.get("timings") and usage.get("cached") is None:
                usage["cached"] = ev["timings"].get("cache_n")
        elif kind == "messages":
            if typ == "content_block_start":
                b = ev.get("content_block") or {}
                if b.get("type") == "tool_use":
                    first()
                    calls[ev.get("index", len(calls))] = {"id": b.get("id", ""),
                                                          "name": b.get("name", ""),
                                                          "arguments": ""}
            elif typ == "content_block_delta":
                d = ev.get("delta") or {}
                if d.get("type") == "text_delta" and d.get("text"):
                    first()
                    ans.text += d["text"]
                elif d.get("type") == "input_json_delta":
                    first()
                    call = calls.setdefault(ev.get("index", 0), {"id": "", "name": "",
                                                                 "arguments": ""})
                    call["arguments"] += d.get("partial_json", "")
            u = (ev.get("message") or {}).get("usage") if typ == "message_start" else \
                ev.get("usage") if typ == "message_delta" else None
            if u:
                if u.get("input_tokens") is not None or u.get("cache_read_input_tokens") \
                        is not None:
                    read = u.get("cache_read_input_tokens") or 0
                    usage.update(prompt=(u.get("input_tokens") or 0) + read + (
                        u.get("cache_creation_input_tokens") or 0), cached=read)
                if u.get("output_tokens"):
                    usage["completion"] = u["output_tokens"]
            if typ == "message_stop":
                finished = True
        else:
            if typ == "response.output_text.delta" and ev.get("delta"):
                first()
                ans.text += ev["delta"]
            elif typ in ("response.function_call_arguments.delta",):
                first()
            elif typ == "response.output_item.added" and \
                    (ev.get("item") or {}).get("type") == "function_call":
                first()
            elif typ == "response.output_item.done":
                item = ev.get("item") or {}
                if item.get("type") == "function_call":
                    calls[len(calls)] = {"id": item.get("call_id", ""),
                                         "name": item.get("name", ""),
                                         "arguments": item.get("arguments", "")}
            elif typ in ("response.completed", "response.incomplete"):
                finished = True
                u = (ev.get("response") or {}).get("usage") or {}
                usage.update(prompt=u.get("input_tokens"), completion=u.get("output_tokens"),
                             cached=(u.get("input_tokens_details") or {}).get("cached_tokens"))
    ans.total_s = time.perf_counter() - t0
    ans.calls = [c for c in calls.values() if c.get("name")]
    for i, c in enumerate(ans.calls):
        c["id"] = c["id"] or f"call_{i}"
    ans.prompt, ans.cached, ans.completion = (usage.get("prompt"), usage.get("cached"),
                                              usage.get("completion"))
    if ans.error is None and not finished:
        ans.error = "the stream ended before the answer did"
    if ans.ttft_s is None:  # no delta: an empty answer, its first token the end
        ans.ttft_s = ans.total_s
    return ans


# -- servers ------------------------------------------------------------------------------
def start_prepos(model: str, log: Path, args, port: int | None = None
                 ) -> tuple[subprocess.Popen, str]:
    return serve_prepos(model, log, [*(["--port", str(port)] if port else []),
        "--threads", str(args.threads), "--context-length", str(args.context),
        "--kv-ram", f"{args.ram_mib}M", "--max-tokens", str(args.answer_tokens),
        *args.server_arg])


class Llama(LlamaServer):
    """llama-server with the whole context for the pool (-c, not per slot), YaRN past the
    trained context, unified KV, the RAM prompt cache."""

    def __init__(self, binary, gguf, agents: int, args, log: Path, port: int | None = None):
        super().__init__(binary, gguf, port=port, slots=agents, threads=args.threads, log=log)
        self.context, self.ram_mib = args.context, args.ram_mib
        self.cells = args.llama_cells or args.context  # the pool: -c

    def args(self) -> list[str]:
        yarn = ["--rope-scaling", "yarn", "--rope-scale", f"{self.context / TRAINED_CONTEXT:g}",
                "--yarn-orig-ctx", str(TRAINED_CONTEXT)] if self.context > TRAINED_CONTEXT \
            else []
        return [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "-c", str(self.cells), "-np", str(self.slots), "--kv-unified",
                "--cache-ram", str(self.ram_mib), *yarn, "-t", str(self.threads),
                "-tb", str(self.threads), "--no-warmup", "--jinja", "--metrics"]


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]


def warm_up(url: str, model: str, llama: bool) -> str | None:
    """One tiny streamed request on each route (first-use costs out of the measurement);
    for llama-server, whether its /v1/responses takes the Codex request's fields (its
    route for the Codex shape: "responses", else "chat")."""
    tiny = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    with httpx.Client(timeout=300) as http:
        http.post(url + "/v1/chat/completions", json={"model": model, "messages": tiny,
                  "max_tokens": 2, "stream": False}).raise_for_status()
        http.post(url + "/v1/messages", headers={"anthropic-version": "2023-06-01"},
                  json={"model": "claude-sonnet-4-5", "max_tokens": 2, "system": "Be brief.",
                        "messages": [{"role": "user", "content": "Hi."}]}).raise_for_status()
        body = {"model": model, "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                                  "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                             "text": "Hi."}]}],
            "tools": [{"type": "function", "name": "noop", "description": "Nothing.",
                       "strict": False, "parameters": {"type": "object", "properties": {}}},
                      {"type": "web_search"}],
            "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "warm-up",
            "max_output_tokens": 2}
        t0 = time.perf_counter()
        with http.stream("POST", url + "/v1/responses", json=body) as r:
            ans = read_stream(r, "/v1/responses", t0)
    if not llama:
        if ans.error:
            raise RuntimeError(f"prepos's /v1/responses refused the Codex shape: {ans.error}")
        return None
    return "responses" if ans.error is None else "chat"


def scrape(url: str) -> dict[str, float]:
    return metric_samples(httpx.get(url + "/metrics", timeout=60).text,
                          keep=("prepos:prepositions_", "prepos:implicit_sessions",
                                "prepos:requests"))


def counter(m: dict[str, float], name: str) -> float:
    return m.get(f"{name}_total", m.get(name, 0.0))


# -- one arm at one N ---------------------------------------------------------------------
def plan(n_agents: int, min_jobs: int) -> list[list[int]]:
    """Each agent's job numbers: together at least `min_jobs`."""
    per = max(1, math.ceil(min_jobs / n_agents))
    return [list(range(per)) for _ in range(n_agents)]


def send(http: httpx.Client, url: str, path: str, body: dict, headers: dict, t0: float
         ) -> tuple[Answer, int]:
    """One request, its stream read; (the answer, reconnects). A keep-alive connection the
    server closed before any byte of an answer came (it had not taken the request) is
    opened again and the request sent once more, as the clients' SDKs do; the time counts
    from the first try."""
    for attempt in (0, 1):
        try:
            r = http.send(http.build_request("POST", url + path, json=body,
                                             headers=headers), stream=True)
        except (httpx.RemoteProtocolError, httpx.ConnectError) as exc:
            if attempt == 0:
                continue
            return Answer(error=f"{type(exc).__name__}: {exc}"[:300],
                          total_s=time.perf_counter() - t0), attempt
        except httpx.HTTPError as exc:
            return Answer(error=f"{type(exc).__name__}: {exc}"[:300],
                          total_s=time.perf_counter() - t0), attempt
        try:
            return read_stream(r, path, t0), attempt
        except httpx.HTTPError as exc:
            return Answer(error=f"{type(exc).__name__}: {exc}"[:300],
                          total_s=time.perf_counter() - t0), attempt
        finally:
            r.close()
    raise AssertionError("unreachable")


def run_agent(url: str, model: str, agent: int, jobs: list[int], args, statics: dict,
              llama_route: str | None, start: threading.Barrier, turns: list, done: list,
              lock: threading.Lock) -> None:
    with httpx.Client(timeout=args.request_timeout) as http:
        start.wait()
        for j in jobs:
            client = CLIENTS[(agent + j) % len(CLIENTS)]
            job = Job(statics[client], args.seed, agent, j, args.scale,
                      same_prompt=args.prompts == "same")
            t_job, ok, prev = time.perf_counter(), True, None
            for t in range(args.turns):
                rng = random.Random(f"{args.seed}:{agent}:{j}:{t}")
                wait_s = log_uniform(rng, *args.tool_seconds)
                result_chars = max(1, round(log_uniform(rng, *args.result_chars) * args.scale))
                path, headers, body = job.request(model)
                if llama_route is not None:
                    path, body = for_llama(path, body, args.answer_tokens, llama_route)
                t0 = time.perf_counter()
                ans, reconnects = send(http, url, path, body, headers, t0)
                rec = {"agent": agent, "job": j, "client": client, "turn": t + 1,
                       "route": path.split("?")[0], "ttft_s": ans.ttft_s,
                       "total_s": ans.total_s, "prompt": ans.prompt, "cached": ans.cached,
                       "completion": ans.completion, "calls": len(ans.calls),
                       "empty": not ans.text and not ans.calls, "error": ans.error,
                       "reconnects": reconnects}
                if prev is not None and prev["prompt"] is not None and \
                        prev["completion"] is not None:
                    rec["ceiling"] = prev["prompt"] + prev["completion"]
                with lock:
                    turns.append(rec)
                if ans.error is not None:
                    ok = False
                    break
                prev = rec
                if t == args.turns - 1:
                    break
                time.sleep(wait_s)  # the tool runs: the server's idle window
                outputs = [tool_output(rng, max(1, result_chars // max(1, len(ans.calls))))
                           for _ in (ans.calls or [None])]
                job.absorb(ans, outputs)
            with lock:
                done.append({"agent": agent, "job": j, "client": client, "ok": ok,
                             "time_s": time.perf_counter() - t_job,
                             "turns": sum(1 for x in turns if x["agent"] == agent
                                          and x["job"] == j and x["error"] is None)})


def run_arm(url: str, model: str, n_agents: int, args, statics: dict,
            llama_route: str | None) -> tuple[list, list, float]:
    turns: list = []
    done: list = []
    lock = threading.Lock()
    start = threading.Barrier(n_agents + 1)
    threads = [threading.Thread(target=run_agent, args=(
        url, model, a, jobs, args, statics, llama_route, start, turns, done, lock))
        for a, jobs in enumerate(plan(n_agents, args.min_jobs))]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    return turns, done, time.perf_counter() - t0


# -- figures ------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile (None for none)."""
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else None


def dist(xs: list[float], unit: float, suffix: str) -> dict:
    return {"n": len(xs), f"p50_{suffix}": _r(pct(xs, 50), unit),
            f"p99_{suffix}": _r(pct(xs, 99), unit),
            f"mean_{suffix}": _r(statistics.fmean(xs) if xs else None, unit)}


def _r(x: float | None, unit: float) -> float | None:
    return None if x is None else round(x * unit, 3)


def summarize(turns: list, jobs: list, wall_s: float, tool_waits: int) -> dict:
    good = [t for t in turns if t["error"] is None]
    later = [t for t in good if t["turn"] > 1]
    fracs, num, den = [], 0, 0
    for t in later:
        if t.get("ceiling") and t["cached"] is not None:
            c = min(t["cached"], t["ceiling"])
            fracs.append(c / t["ceiling"])
            num, den = num + c, den + t["ceiling"]
    last = [t["prompt"] for t in good if t["turn"] == max((x["turn"] for x in good),
                                                          default=0) and t["prompt"]]
    first = [t["prompt"] for t in good if t["turn"] == 1 and t["prompt"]]
    out = {"turn_ttft": dist([t["ttft_s"] for t in good], 1e3, "ms"),
           "next_turn_ttft": dist([t["ttft_s"] for t in later], 1e3, "ms"),
           "turn_ttft_by_client": {c: dist([t["ttft_s"] for t in good if t["client"] == c],
                                           1e3, "ms") for c in CLIENTS
                                   if any(t["client"] == c for t in good)},
           "job_time": dist([j["time_s"] for j in jobs if j["ok"]], 1, "s"),
           "cached_of_ceiling": {"pooled": round(num / den, 4) if den else None,
                                 "p50": _r(pct(fracs, 50), 1), "min": _r(min(fracs, default=None)
                                                                         if fracs else None, 1),
                                 "n": len(fracs)},
           "errors": sum(1 for t in turns if t["error"] is not None),
           "error_samples": sorted({t["error"] for t in turns if t["error"]})[:3],
           "turns": len(good), "jobs": len(jobs), "jobs_ok": sum(1 for j in jobs if j["ok"]),
           "tool_waits": tool_waits, "wall_s": round(wall_s, 2),
           "reconnects": sum(t.get("reconnects", 0) for t in turns),
           "model_tool_calls": sum(1 for t in good if t["calls"]),
           "empty_answers": sum(1 for t in good if t["empty"]),
           "completion_tokens_mean": _r(statistics.fmean(
               [t["completion"] for t in good if t["completion"] is not None]) if any(
               t["completion"] is not None for t in good) else None, 1),
           "prompt_tokens_first_turn_p50": pct(first, 50),
           "prompt_tokens_last_turn_p50": pct(last, 50)}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def figure(out: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ns = sorted(out["by_agents"], key=int)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for arm, color in (("prepos", "tab:blue"), ("llama_server", "tab:orange")):
        rows = [out["by_agents"][n].get(arm) for n in ns]
        if not any(rows):
            continue
        xs = [int(n) for n, r in zip(ns, rows) if r]
        rows = [r for r in rows if r]
        axes[0].plot(xs, [r["turn_ttft"]["p50_ms"] for r in rows], "o-", color=color,
                     label=f"{arm} P50")
        axes[0].plot(xs, [r["turn_ttft"]["p99_ms"] for r in rows], "s--", color=color,
                     label=f"{arm} P99")
        axes[1].plot(xs, [r["job_time"]["p50_s"] for r in rows], "o-", color=color, label=arm)
        axes[2].plot(xs, [r["cached_of_ceiling"]["pooled"] for r in rows], "o-", color=color,
                     label=arm)
    axes[0].set(title="turn TTFT", xlabel="agents", ylabel="ms", xscale="log", yscale="log")
    axes[1].set(title="job completion time (P50)", xlabel="agents", ylabel="s", xscale="log")
    axes[2].set(title="cached / ceiling (pooled)", xlabel="agents", xscale="log",
                ylim=(0, 1.05))
    for ax in axes:
        ax.set_xticks([int(n) for n in ns], labels=ns)
        ax.legend(fontsize=7)
    fig.suptitle(f"coding agents: {out['model']}, {out['turns']} turns a job, "
                 f"{out['context']} context", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default=None, help="Ns, comma-separated (default 1,4,16)")
    ap.add_argument("--turns", type=int, default=None, help="turns a job (default 4)")
    ap.add_argument("--min-jobs", type=int, default=3, help="jobs at least, at every N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke: 1 agent, 2 turns, texts at 5%% of their size, 8-token "
                         "answers")
    ap.add_argument("--arms", default="prepos,llama_server")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--ram-mib", type=int, default=4096,
                    help="prepos's --kv-ram and llama-server's --cache-ram, MiB")
    ap.add_argument("--answer-tokens", type=int, default=None,
                    help="most tokens an answer may take on both servers (default 128)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cells", type=int, default=None,
                    help="llama-server's pool, -c (default --context: the cells prepos keeps "
                         "resident; N x --context gives each slot a whole context)")
    ap.add_argument("--scale", type=float, default=None, help="text sizes' factor (default 1)")
    ap.add_argument("--tool-seconds", default=None, help="LO,HI (default 0.2,5)")
    ap.add_argument("--result-chars", default="200,4000", help="LO,HI of a tool's result")
    ap.add_argument("--codex-route", choices=["auto", "responses", "chat"], default="auto",
                    help="llama-server's route for the Codex shape (auto: /v1/responses where "
                         "it takes the Codex request, else chat)")
    ap.add_argument("--request-timeout", type=float, default=3600)
    ap.add_argument("--server-arg", action="append", default=[], help="one more for prepos")
    ap.add_argument("--prompts", choices=["same", "captured"], default="same",
                    help="same (default): both servers are sent the same text, the tools "
                         "written into the system text (or Codex's first developer message) "
                         "as prepos writes them, no `tools` field; captured: the requests as "
                         "the clients send them (SmolLM2's template renders no tools: prepos "
                         "writes them into the prompt, llama-server leaves them out, so the "
                         "two prefill different prompts)")
    ap.add_argument("--port-base", type=int, default=0,
                    help="the servers' ports: prepos base+2k, llama-server base+2k+1 at the "
                         "k-th N (default 0: free ports)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    q = args.quick
    args.agents = [int(x) for x in (args.agents or ("1" if q else "1,4,16")).split(",")]
    args.turns = args.turns or (2 if q else 4)
    args.answer_tokens = args.answer_tokens or (8 if q else 128)
    args.scale = args.scale if args.scale is not None else (0.05 if q else 1.0)
    args.tool_seconds = tuple(float(x) for x in (args.tool_seconds or "0.2,5").split(","))
    args.result_chars = tuple(float(x) for x in args.result_chars.split(","))
    arms = [a for a in args.arms.split(",") if a]
    name = ("agent_jobs-quick" if q else "agent_jobs") + \
        ("-captured" if args.prompts == "captured" else "")
    out_path = args.out or RESULTS / f"{name}.json"

    binary = find_binary()
    if "llama_server" in arms and binary is None:
        print("no llama-server binary: run scripts/build_llama_server.sh (or --arms prepos)",
              file=sys.stderr)
        return 2
    served, gguf, label = resolve(args.model)
    statics = {c: Statics(c, args.seed, args.scale) for c in CLIENTS}
    out: dict = {
        "benchmark": "agents", "model": label, "machine": machine(), "quick": q,
        "context": args.context, "llama_cells": args.llama_cells or args.context,
        "agents": args.agents, "turns": args.turns,
        "min_jobs": args.min_jobs, "seed": args.seed, "arms": arms,
        "answer_tokens": args.answer_tokens, "ram_mib": args.ram_mib, "threads": args.threads,
        "scale": args.scale, "tool_seconds": list(args.tool_seconds),
        "result_chars": list(args.result_chars),
        "prompts": args.prompts,
        "shapes": {c: shapes(Job(statics[c], args.seed, 0, 0, args.scale,
                                 same_prompt=args.prompts == "same"), "model")
                   for c in CLIENTS},
        "tool_calls_mode": "replayed: the model's answer appended as it came, then the tool's "
                           "result (as a user message where the model made no call)",
        "notes": [
            "prompts=same: both servers are sent the same text (the tools as prepos's block "
            "in the system text or Codex's first developer message, no `tools` field; Claude "
            "Code's system blocks as one string joined by a blank line), so both prefill the "
            "same tokens (`prompt_tokens_agreement`); the model cannot make structured tool "
            "calls (no `tools`), so every tool result goes back as a user message"
            if args.prompts == "same" else
            "prompts=captured: the prompts differ in tokens: SmolLM2's chat template renders "
            "no tools; prepos writes them into the system message, llama-server (--jinja) "
            "leaves them out (prompt_tokens_first_turn_p50 of each arm, "
            "`prompt_tokens_agreement`): the ratios measure that as well as serving",
            "llama-server's bodies: max_tokens (max_output_tokens) set to answer_tokens and "
            "temperature 0, so it decodes the greedy budget prepos's --max-tokens gives the "
            "clients' own values"],
        "by_agents": {}}
    if "llama_server" not in arms:
        out["note"] = "prepos's arm alone (--arms prepos): no ratios"
    log = Path(tempfile.mkdtemp(prefix="agents-"))
    out["server_logs"] = str(log)
    print(f"server logs: {log}", file=sys.stderr, flush=True)
    all_turns: list = []
    for k, n in enumerate(args.agents):
        row: dict = {}
        order = arms if k % 2 == 0 else arms[::-1]
        tool_waits = None
        for arm in order:
            proc = llama = None
            try:
                if arm == "prepos":
                    proc, url = start_prepos(served, log / f"prepos-{n}.log", args,
                                             args.port_base and args.port_base + 2 * k)
                    model = served_model(url)
                    warm_up(url, model, llama=False)
                    route = None
                    before = scrape(url)
                else:
                    llama = Llama(binary, gguf, n, args, log / f"llama-{n}.log",
                                  args.port_base and args.port_base + 2 * k + 1).start(
                        wait=600)
                    url = llama.url
                    model = served_model(url)
                    probed = warm_up(url, model, llama=True)
                    route = probed if args.codex_route == "auto" else args.codex_route
                turns, jobs, wall = run_arm(url, model, n, args, statics, route)
                tool_waits = sum(max(0, j["turns"] - 1) if j["ok"] else max(0, j["turns"])
                                 for j in jobs)
                s = summarize(turns, jobs, wall, tool_waits)
                if arm == "prepos":
                    time.sleep(0.2)
                    after = scrape(url)

                    def delta(metric: str) -> int:
                        return int(counter(after, metric) - counter(before, metric))

                    ready = delta("prepos:prepositions_next_turns_ready")
                    s["next_turns_counted"] = delta("prepos:prepositions_next_turns")
                    s["next_turns_ready"] = ready
                    s["tool_waits_prepositioned"] = round(ready / tool_waits, 4) \
                        if tool_waits else None
                    s["prepositions"] = {m: delta(f"prepos:prepositions_{m}") for m in (
                        "started", "recorded", "consumed", "invalidated", "skipped",
                        "preempted")}
                else:
                    s["codex_route"] = "/v1/responses" if route == "responses" else \
                        "/v1/chat/completions (the equivalent chat request)"
                row[arm] = s
                print(f"{n} agents, {arm}: wall {s['wall_s']} s, turns {s['turns']}, errors "
                      f"{s['errors']}, TTFT P50 {s['turn_ttft']['p50_ms']} ms, job P50 "
                      f"{s['job_time']['p50_s']} s", file=sys.stderr, flush=True)
                all_turns.extend({"agents": n, "arm": arm, **t} for t in turns)
            finally:
                stop_pair(proc, llama)
        p, ls = row.get("prepos"), row.get("llama_server")
        if p and ls:
            row["prompt_tokens_agreement"] = agreement(
                [t for t in all_turns if t["agents"] == n])
            row["turn_ttft_ratio_vs_llama_server"] = ratio(p["turn_ttft"]["p50_ms"],
                                                           ls["turn_ttft"]["p50_ms"])
            row["turn_ttft_p99_ratio_vs_llama_server"] = ratio(p["turn_ttft"]["p99_ms"],
                                                               ls["turn_ttft"]["p99_ms"])
            row["next_turn_ttft_ratio_vs_llama_server"] = ratio(
                p["next_turn_ttft"]["p50_ms"], ls["next_turn_ttft"]["p50_ms"])
            row["job_time_ratio_vs_llama_server"] = ratio(p["job_time"]["p50_s"],
                                                          ls["job_time"]["p50_s"])
            row["job_time_p99_ratio_vs_llama_server"] = ratio(p["job_time"]["p99_s"],
                                                              ls["job_time"]["p99_s"])
        if p:
            cached = p["cached_of_ceiling"]["pooled"]
            row["targets"] = {
                "turn_ttft_ratio_le_1": _met(row.get("turn_ttft_ratio_vs_llama_server"),
                                             lambda r: r <= 1.0),
                "job_time_ratio_le_1": _met(row.get("job_time_ratio_vs_llama_server"),
                                            lambda r: r <= 1.0),
                "cached_ge_0.95": _met(cached, lambda c: c >= 0.95),
                "errors_0": p["errors"] == 0,
                "tool_waits_prepositioned_ge_0.9": _met(p.get("tool_waits_prepositioned"),
                                                        lambda f: f >= 0.9)}
        out["by_agents"][str(n)] = row
    out["targets_met"] = all(v is True for r in out["by_agents"].values()
                             for v in r.get("targets", {}).values())
    write(out_path, out)
    write(out_path.with_name(out_path.stem + "_turns.json"), {"turns": all_turns})
    fig = figure(out, out_path.with_suffix(".png"))
    if fig is not None:
        out["figure"] = str(fig)
    print(json.dumps(out))
    return 0


def agreement(turns: list) -> dict:
    """Per turn (agent, job, turn) both arms answered: prepos's prompt tokens minus
    llama-server's. First turns are the same text on both under prompts=same; later turns
    hold each server's own earlier answers (greedy on both, but not always the same text)."""
    by: dict = {}
    for t in turns:
        if t["error"] is None and t["prompt"] is not None:
            by.setdefault((t["agent"], t["job"], t["turn"]), {})[t["arm"]] = t["prompt"]
    diffs = {k: v["prepos"] - v["llama_server"] for k, v in by.items()
             if "prepos" in v and "llama_server" in v}

    def d(keys) -> dict:
        xs = [diffs[k] for k in keys]
        return {"n": len(xs), "max_abs": max((abs(x) for x in xs), default=None),
                "mean": round(statistics.fmean(xs), 2) if xs else None}

    first = [k for k in diffs if k[2] == 1]
    return {"first_turns": d(first), "all_turns": d(list(diffs)),
            "by_turn": {str(k[0]) + "." + str(k[1]) + "." + str(k[2]): diffs[k]
                        for k in sorted(diffs)}}


def _met(value, test) -> bool | None:
    """Whether a target is met (None: not measured)."""
    return None if value is None else bool(test(value))


if __name__ == "__main__":
    sys.exit(main())
