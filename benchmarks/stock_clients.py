"""A stock OpenAI client's agent conversation, prepos beside llama-server: what a client that
never names a session pays per turn (implicit sessions, docs/ARCHITECTURE.md), with the
same conversation on a named agentic session and through the Responses API beside it.

The workload: CONVERSATIONS (`--conversations`, default 16) conversations of 8 turns, each
turn one `chat.completions.create` through the OpenAI SDK with no prepos-specific parameter
(no session_id, no extra_body), max_tokens 32, temperature 0, the function tool `get_prices`
declared on every request. Every conversation sends the same agent-framework system prompt
(a few hundred tokens) and its own user questions about its own tickers. Turns 1, 3, 5, 7
add a user message; turns 2, 4, 6, 8 add the assistant's `get_prices` call (an id, the name,
JSON arguments) and the tool's result (a JSON table of daily prices, a few hundred tokens),
so the history passes 2,000 tokens by turn 8. The model's own answer to each request is
appended as the next assistant message, so each request's prompt is everything before plus
the new user message or call and result.

Why the calls are replayed, not generated: SmolLM2-135M-Instruct does not call tools by
itself, llama-server ignores `tool_choice` for this template (a named function is refused as
the wrong type, `required` changes nothing, and the tools are not rendered in its prompt),
and prepos's forced call is cut by max_tokens 32 into arguments that are not JSON. So the
client replays an agent's trace, the same on both servers (`tool_calls_mode` in the output).
The same messages are not the same tokens: SmolLM2's template renders neither tools nor
calls, so prepos writes a <tools> block into the system message and each call as
<tool_call> markup (ARCHITECTURE, "Tools on any template"), while llama-server's render drops
both (a call is an empty assistant message): prepos's prompts are a few hundred tokens longer
by turn 8 (`prompt_tokens_last_turn` of each arm).
Where a model writes a call itself (prepos parses it), the next request answers it first with
a tool result, as an agent loop would; those are counted (`model_tool_calls`).

The arms, run conversation by conversation with the order rotated each conversation, and
prepos waited to be idle (its queue empty) before each arm, so no arm runs while another's
server works:
  prepos          prepos serve, the stock client (implicit sessions)
  llama_server    llama-server on the same GGUF, same threads, one slot (-np 1), its prompt
                  cache on (cache_prompt is its default), --jinja
  llama_server_same_prompt  the same llama-server given the messages as prepos renders them
                  for this template (its tools block, calls and results as text; no `tools`),
                  so both servers get the same prompt tokens (`prompt_tokens_equal` checks):
                  `turn_ratio_vs_llama_server` is against this arm, the servers on the same
                  tokens; `own_render` against the one above
  prepos_session  the same conversation with a named agentic session (POST /sessions, then
                  extra_body={"session_id": ...}): prepos-specific on purpose
  prepos_responses  the same turns through /v1/responses with previous_response_id: only
                  the new items each turn; skipped (null, with a note) where the route 404s
Each prepos arm uses its own API key, so prepos's prefix index (never across keys) cannot
hand one arm's KV to another's first turn. The time of a turn is the client-observed wall
time of its request (non-streamed, loopback, keep-alive). Both servers run for the whole
benchmark; only one works at a time. `per_token_vs_llama_server` divides prepos's server-side
prefill and decode time per token by llama-server's: the turn ratio apart from the two
workloads' difference (prepos's longer prompts and, from them, other answers).

    python benchmarks/stock_clients.py [--conversations 16] [--model smollm2|DIR|FILE.gguf]
The last line printed is the JSON summary; results/stock_clients.json keeps every turn.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, cpu_model, machine, metric_samples, summarize, write  # noqa: E402
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402

TURNS = 8
MAX_TOKENS = 32
THREADS = 2
KEYS = {"prepos": "stock-client", "prepos_session": "session-client",
        "prepos_responses": "responses-client"}
ARMS = ("prepos", "llama_server", "llama_server_same_prompt", "prepos_session",
        "prepos_responses")

SYSTEM = """You are Ledger, a market research assistant embedded in a brokerage's research \
desk. You help analysts and retail clients understand how individual stocks have traded.

Tools: you have one tool, get_prices, which returns recent daily prices for one ticker as a \
JSON table with the columns date, open, high, low, close and volume. Call it whenever a \
question depends on prices you have not already retrieved in this conversation; never guess \
a price, and never reuse numbers from memory. Call it once per ticker; if the user asks about \
several tickers, call it for each in turn.

When you answer:
- Lead with the direct answer in one sentence, then give at most three short supporting \
points taken from the tool results (dates and closing prices, percentage changes rounded to \
one decimal place, volume when it matters).
- Compare like with like: the same date range for every ticker you compare.
- Say plainly when the data cannot answer the question (for example, earnings or news are \
not in the price table) instead of speculating.
- Do not give personalised investment advice or tell the user to buy or sell; describe what \
the prices did.
- Use plain text, no markdown tables, and keep the whole answer under 120 words.

If a tool call fails or returns an error object, say so and ask whether to retry. Dates are \
trading days in the exchange's time zone; prices are in the listed currency, unadjusted for \
dividends. Today is the last date in the most recent table you retrieved."""

TOOL = {"type": "function", "function": {
    "name": "get_prices",
    "description": "Recent daily prices (open, high, low, close, volume) for one ticker.",
    "parameters": {"type": "object", "properties": {
        "ticker": {"type": "string", "description": "the exchange ticker, e.g. ACME"},
        "days": {"type": "integer", "description": "trading days to return (1-30)"}},
        "required": ["ticker"]}}}
TOOL_RESPONSES = {"type": "function", **TOOL["function"]}  # the Responses API's shape

TICKERS = ["ACME", "BOLT", "CRUX", "DYNA", "ECHO", "FLUX", "GRID", "HALO", "IONX", "JUNO",
           "KRAK", "LUMA", "MIRA", "NOVA", "ORCA", "PIKE", "QUAD", "RUNE", "SOLA", "TIDE",
           "UMBR", "VOLT", "WREN", "XENO", "YARD", "ZETA"]
OPENERS = [
    "I'm looking at {t} for a possible swing trade. How has it traded over the last {d} days?",
    "My manager asked me for a quick read on {t}. What did the stock do over the past {d} "
    "sessions?",
    "Can you check how {t} has been moving lately? I care about the last {d} trading days.",
    "{t} came up in our morning meeting. Was it up or down over the last {d} days, and by "
    "how much?",
    "Before I write my note on {t}: what was its closing range over the last {d} trading days?",
    "A client holds {t} and is nervous. Has it been volatile over the last {d} sessions?",
    "Give me the short version of how {t} performed over the past {d} trading days.",
    "I keep hearing about {t}. What did its price and volume look like over the last {d} days?",
]
FOLLOWUPS = [
    "Thanks. How does {t} compare over the same period?",
    "Now do the same for {t}, so I can put them side by side.",
    "Interesting. Was {t} any steadier over those days?",
    "What about {t}? Same window, please.",
    "And {t}? I want to know whether it moved with the first one or against it.",
    "Could you also look at {t}? I suspect it had a bigger drawdown.",
    "Let's add {t} to the comparison. Did it close higher or lower than it opened the period?",
    "OK. Check {t} next; the desk thinks it lagged the others.",
]


def conversation(i: int) -> dict:
    """Conversation i: its four tickers, four user messages and four price tables (seeded)."""
    rng = random.Random(1000 + i)
    tickers = rng.sample(TICKERS, 4)
    days = rng.choice([7, 8, 9])
    users = [OPENERS[i % len(OPENERS)].format(t=tickers[0], d=days)]
    for k, t in enumerate(tickers[1:]):
        users.append(FOLLOWUPS[(i + 3 * k) % len(FOLLOWUPS)].format(t=t))
    tables = [price_table(t, days, rng) for t in tickers]
    return {"tickers": tickers, "days": days, "users": users, "tables": tables,
            "call_ids": [f"call_{i:02d}_{k}" for k in range(4)]}


def price_table(ticker: str, days: int, rng: random.Random) -> str:
    price = rng.uniform(20, 400)
    rows, day = [], 3
    for _ in range(days):
        o = price * (1 + rng.gauss(0, 0.004))
        c = o * (1 + rng.gauss(0.0005, 0.018))
        hi = max(o, c) * (1 + abs(rng.gauss(0, 0.006)))
        lo = min(o, c) * (1 - abs(rng.gauss(0, 0.006)))
        rows.append([f"2024-06-{day:02d}", round(o, 2), round(hi, 2), round(lo, 2), round(c, 2),
                     int(rng.lognormvariate(14, 0.4))])
        price, day = c, day + (3 if day % 7 == 0 else 1)
    return json.dumps({"ticker": ticker, "currency": "USD", "interval": "1d",
                       "columns": ["date", "open", "high", "low", "close", "volume"],
                       "rows": rows})


def tool_for(call: dict, convo: dict, k: int) -> str:
    """The tool's result for a call the model wrote itself: the table of the ticker it asked
    for when it is one of this conversation's, else an error object (as a tool would)."""
    try:
        t = json.loads(call["function"]["arguments"] or "{}").get("ticker")
    except (json.JSONDecodeError, AttributeError):
        t = None
    if t in convo["tickers"]:
        return convo["tables"][convo["tickers"].index(t)]
    return json.dumps({"error": f"unknown ticker {t!r}"})


def scripted_call(convo: dict, k: int) -> dict:
    return {"id": convo["call_ids"][k], "type": "function", "function": {
        "name": "get_prices",
        "arguments": json.dumps({"ticker": convo["tickers"][k], "days": convo["days"]})}}


# -- servers -------------------------------------------------------------------------------
def start_prepos(model: str, log: Path, threads: int, extra: list[str]
                 ) -> tuple[subprocess.Popen, str]:
    return serve_prepos(model, log, ["--threads", str(threads),
                                     *[a for k in KEYS.values() for a in ("--api-key", k)],
                                     *extra])


def serve_prepos(model: str, log: Path, args: list[str]) -> tuple[subprocess.Popen, str]:
    """`prepos serve` on a free port, no journal, with `args`; waited for until ready."""
    port_file = log.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "prepos.cli", "serve", "--model", model, "--port", "0",
           "--port-file", str(port_file), "--journal", "none", "--log-level", "warning",
           *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prepos serve exited: {log.read_text()[-2000:]}")
        if port_file.exists() and port_file.read_text().strip():
            url = f"http://127.0.0.1:{int(port_file.read_text())}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("prepos serve not ready in 900 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def metrics(url: str) -> dict[str, float]:
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS['prepos']}"},
                  timeout=30)
    return metric_samples(r.text)


def wait_idle(url: str, limit_s: float = 30.0) -> float:
    """Until prepos's model worker has nothing queued (its pre-positions done): the seconds
    waited. So the next arm, llama-server's included, runs on a quiet prepos."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        m = metrics(url)
        if not m.get('prepos:queue_length{queue="idle"}') and \
                not m.get('prepos:queue_length{queue="foreground"}'):
            break
        time.sleep(0.05)
    time.sleep(0.05)
    return time.perf_counter() - t0


def responses_route(url: str) -> int:
    """The status of an empty POST /v1/responses: 404 where the route does not exist."""
    r = httpx.post(url + "/v1/responses", json={},
                   headers={"Authorization": f"Bearer {KEYS['prepos_responses']}"}, timeout=60)
    return r.status_code


# -- one conversation on one arm -----------------------------------------------------------
def _usage(u) -> tuple[int, int | None]:
    if u is None:
        return 0, None
    details = getattr(u, "prompt_tokens_details", None) or getattr(u, "input_tokens_details",
                                                                   None)
    prompt = getattr(u, "prompt_tokens", None)
    if prompt is None:
        prompt = getattr(u, "input_tokens", 0)
    return prompt, (getattr(details, "cached_tokens", None) if details else None)


def _server_timing(h: str | None) -> dict:
    return {k: float(v) for k, v in re.findall(r"(\w+);dur=([\d.]+)", h or "")}


def tool_support(model: str):
    """What the model's chat template renders of tools, calls and results, as prepos probes
    it at load (`prepos.chat.tool_support`)."""
    from prepos.chat.format import ChatFormat
    from prepos.engine.loading import load_tokenizer, resolve_model

    return ChatFormat(load_tokenizer(resolve_model(model))).tool_support


def run_chat(client: openai.OpenAI, model: str, convo: dict, arm: str,
             extra_body: dict | None, think_s: float, turns_n: int = TURNS,
             same_prompt=None) -> dict:
    """The 8 turns as a stock client sends them (the whole conversation each time);
    `same_prompt` (the template's ToolSupport): sent as prepos gives them to the template
    (what it does not render of the tools and calls written in: SmolLM2's, a tools block in
    the system message and each call as <tool_call> markup)."""
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    turns, errors, own_calls = [], [], 0
    for t in range(turns_n):
        k = t // 2
        answered = _answer_pending(msgs, convo, k)
        if t % 2 == 0:
            msgs.append({"role": "user", "content": convo["users"][k]})
        elif not answered:  # the agent's call and its result, replayed
            call = scripted_call(convo, k)
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": call["id"],
                         "content": convo["tables"][k]})
        if think_s:
            time.sleep(think_s)
        sent, tools = same_prompt.apply(msgs, [TOOL]) if same_prompt else (msgs, [TOOL])
        t0 = time.perf_counter()
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=sent, max_tokens=MAX_TOKENS,
                **({"tools": tools} if tools else {}),
                temperature=0, **({"extra_body": extra_body} if extra_body else {}))
            wall = time.perf_counter() - t0
            r = raw.parse()
        except openai.APIStatusError as exc:
            errors.append({"turn": t + 1, "status": exc.status_code,
                           "body": str(exc.body)[:500], "roles": [m["role"] for m in msgs]})
            break
        m = r.choices[0].message
        prompt, cached = _usage(r.usage)
        extra = r.model_extra or {}
        rec = {"turn": t + 1, "wall_s": wall, "prompt_tokens": prompt, "cached_tokens": cached,
               "completion_tokens": r.usage.completion_tokens if r.usage else None,
               "finish_reason": r.choices[0].finish_reason, "messages": len(msgs)}
        if "prepos" in extra:
            p = extra["prepos"]
            rec["path"] = p.get("path")
            rec["server"] = p.get("timing")
            rec["server_timing"] = _server_timing(raw.headers.get("server-timing"))
        if "timings" in extra:  # llama-server's own
            rec["server"] = {k: extra["timings"].get(k) for k in
                             ("cache_n", "prompt_n", "prompt_ms", "predicted_n",
                              "predicted_ms")}
        turns.append(rec)
        reply = {"role": "assistant", "content": m.content}
        calls = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls or ()]
        if same_prompt and not calls and m.content:  # a call in prepos's markup, as it parses
            from prepos.chat.tool_formats import parse_prepos

            text, parsed = parse_prepos(m.content)
            if parsed:
                reply["content"] = text or None
                calls = [{"id": f"call_own_{t}_{j}", "type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"])}}
                    for j, c in enumerate(parsed)]
        if calls:
            own_calls += 1
            reply["tool_calls"] = calls
        msgs.append(reply)
    return {"arm": arm, "turns": turns, "errors": errors, "model_tool_calls": own_calls}


def _answer_pending(msgs: list[dict], convo: dict, k: int) -> bool:
    """Tool results for calls the model wrote itself, as an agent loop answers them."""
    last = msgs[-1]
    if last["role"] != "assistant" or not last.get("tool_calls"):
        return False
    for call in last["tool_calls"]:
        msgs.append({"role": "tool", "tool_call_id": call["id"],
                     "content": tool_for(call, convo, k)})
    return True


def run_responses(client: openai.OpenAI, model: str, convo: dict, think_s: float,
                  turns_n: int = TURNS) -> dict:
    """The same turns through /v1/responses: each request sends only its new items and
    names the previous response."""
    turns, errors, own_calls = [], [], 0
    prev, pending = None, []
    for t in range(turns_n):
        k = t // 2
        items: list[dict] = []
        if t == 0:
            items.append({"role": "system", "content": SYSTEM})
        for call in pending:  # calls the model wrote itself
            items.append({"type": "function_call_output", "call_id": call["call_id"],
                          "output": tool_for({"function": {"arguments": call["arguments"]}},
                                             convo, k)})
        if t % 2 == 0:
            items.append({"role": "user", "content": convo["users"][k]})
        elif not pending:
            call = scripted_call(convo, k)
            items.append({"type": "function_call", "call_id": call["id"],
                          "name": "get_prices", "arguments": call["function"]["arguments"]})
            items.append({"type": "function_call_output", "call_id": call["id"],
                          "output": convo["tables"][k]})
        if think_s:
            time.sleep(think_s)
        t0 = time.perf_counter()
        try:
            raw = client.responses.with_raw_response.create(
                model=model, input=items, previous_response_id=prev, tools=[TOOL_RESPONSES],
                max_output_tokens=MAX_TOKENS, temperature=0)
            wall = time.perf_counter() - t0
            r = raw.parse()
        except openai.APIStatusError as exc:
            errors.append({"turn": t + 1, "status": exc.status_code,
                           "body": str(exc.body)[:500]})
            break
        prompt, cached = _usage(r.usage)
        extra = r.model_extra or {}
        rec = {"turn": t + 1, "wall_s": wall, "prompt_tokens": prompt, "cached_tokens": cached,
               "completion_tokens": getattr(r.usage, "output_tokens", None) if r.usage else None,
               "items": len(items)}
        if "prepos" in extra:
            rec["path"] = extra["prepos"].get("path")
            rec["server"] = extra["prepos"].get("timing")
        rec["server_timing"] = _server_timing(raw.headers.get("server-timing"))
        turns.append(rec)
        prev = r.id
        pending = [{"call_id": o.call_id, "arguments": o.arguments} for o in r.output
                   if getattr(o, "type", None) == "function_call"]
        own_calls += bool(pending)
    return {"arm": "prepos_responses", "turns": turns, "errors": errors,
            "model_tool_calls": own_calls}


# -- the summary ---------------------------------------------------------------------------
def later(runs: list[dict]) -> list[dict]:
    return [t for r in runs for t in r["turns"] if t["turn"] > 1]


def p50(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def cached_fraction(turns: list[dict]) -> float | None:
    got = [t for t in turns if t["cached_tokens"] is not None]
    prompt = sum(t["prompt_tokens"] for t in got)
    return round(sum(t["cached_tokens"] for t in got) / prompt, 4) if prompt else None


def cacheable_fraction(runs: list[dict]) -> float | None:
    """The most a prompt cache could hold of turns after the first: what the server saw
    before (the previous prompt and its answer), over the prompt tokens."""
    held = prompt = 0
    for r in runs:
        for a, b in zip(r["turns"], r["turns"][1:]):
            held += min(b["prompt_tokens"], a["prompt_tokens"] + (a["completion_tokens"] or 0))
            prompt += b["prompt_tokens"]
    return round(held / prompt, 4) if prompt else None


def summary_of(runs: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for arm, rs in runs.items():
        if not rs:
            continue
        rest = later(rs)
        first = [t["wall_s"] for r in rs for t in r["turns"] if t["turn"] == 1]
        whole = [sum(t["wall_s"] for t in r["turns"]) for r in rs
                 if len(r["turns"]) == TURNS]
        last = [r["turns"][-1]["prompt_tokens"] for r in rs if len(r["turns"]) == TURNS]
        a = {"turns_after_first": summarize([t["wall_s"] for t in rest]) if rest else None,
             "first_turn": summarize(first) if first else None,
             "conversation_total": summarize(whole) if whole else None,
             "user_turns_p50_ms": _ms(p50([t["wall_s"] for t in rest if t["turn"] % 2])),
             "tool_turns_p50_ms": _ms(p50([t["wall_s"] for t in rest if not t["turn"] % 2])),
             "per_turn_p50_ms": {str(k): round(p50([t["wall_s"] for r in rs for t in r["turns"]
                                                     if t["turn"] == k]) * 1e3, 1)
                                 for k in range(1, TURNS + 1)
                                 if any(t["turn"] == k for r in rs for t in r["turns"])},
             "prompt_tokens_last_turn": {"p50": p50(last), "min": min(last) if last else None,
                                         "max": max(last) if last else None},
             "completion_tokens_mean": round(statistics.fmean(
                 [t["completion_tokens"] or 0 for r in rs for t in r["turns"]]), 2),
             "cached_fraction": cached_fraction(rest),
             "cacheable_fraction": cacheable_fraction(rs),
             "model_tool_calls": sum(r["model_tool_calls"] for r in rs),
             "errors": sum(len(r["errors"]) for r in rs),
             "complete_conversations": len(whole)}
        firsts = [t["server"] for r in rs for t in r["turns"] if t["turn"] == 1
                  and t.get("server") and "restore_ms" in t["server"]]
        if firsts:  # prepos's: the first turn's time before its forward ran
            a["first_turn_admission_ms_p50"] = p50([x["restore_ms"] for x in firsts])
            a["first_turn_admission_ms_max"] = max(x["restore_ms"] for x in firsts)
            a["first_turn_queue_ms_p50"] = p50([x["queue_ms"] for x in firsts])
        if any("path" in t for t in rest):
            paths: dict[str, int] = {}
            for t in rest:
                paths[t.get("path")] = paths.get(t.get("path"), 0) + 1
            a["paths_after_first"] = paths
            srv = [t["server"]["total_ms"] for t in rest if t.get("server")]
            pre = [t["server"]["prefill_ms"] for t in rest if t.get("server")]
            ptok = [t["server"]["prefill_tokens"] for t in rest if t.get("server")]
            a["server_total_p50_ms"] = p50(srv)
            a["server_prefill_p50_ms"] = p50(pre)
            a["server_prefill_tokens_p50"] = p50(ptok)
            a["client_minus_server_p50_ms"] = p50([t["wall_s"] * 1e3 - t["server"]["total_ms"]
                                                   for t in rest if t.get("server")])
            a["prefill_ms_per_token_p50"] = p50([t["server"]["prefill_ms"]
                                                 / t["server"]["prefill_tokens"] for t in rest
                                                 if t.get("server") and
                                                 t["server"]["prefill_tokens"] >= 64])
            a["decode_ms_per_token_p50"] = p50([(t["server"]["total_ms"] - t["server"]["ttft_ms"])
                                                / (t["completion_tokens"] - 1) for t in rest
                                                if t.get("server") and
                                                (t["completion_tokens"] or 0) > 1])
        elif any(t.get("server") for t in rest):  # llama-server's timings
            s = [t["server"] for t in rest if t.get("server")]
            a["server_total_p50_ms"] = p50([x["prompt_ms"] + x["predicted_ms"] for x in s])
            a["server_prefill_p50_ms"] = p50([x["prompt_ms"] for x in s])
            a["server_prefill_tokens_p50"] = p50([x["prompt_n"] for x in s])
            a["cache_n_fraction"] = round(sum(x["cache_n"] for x in s) / max(1, sum(
                x["cache_n"] + x["prompt_n"] for x in s)), 4)
            a["client_minus_server_p50_ms"] = p50([t["wall_s"] * 1e3 - t["server"]["prompt_ms"]
                                                   - t["server"]["predicted_ms"]
                                                   for t in rest if t.get("server")])
            a["prefill_ms_per_token_p50"] = p50([x["prompt_ms"] / x["prompt_n"] for x in s
                                                 if x["prompt_n"] >= 64])
            a["decode_ms_per_token_p50"] = p50([x["predicted_ms"] / x["predicted_n"] for x in s
                                                if x["predicted_n"]])
        out[arm] = a
    return out


def turn_ratio(arms: dict, med: dict, peer: str) -> dict:
    """prepos's P50 turn after the first over `peer`'s, and the same for user and tool
    turns apart."""
    ours, theirs = arms.get("prepos", {}), arms.get(peer, {})
    return {"value": ratio(med.get("prepos"), med.get(peer)), "peer": peer,
            "prepos": ours.get("turns_after_first"), "llama_server": theirs.get(
                "turns_after_first"),
            "user_turns": ratio(ours.get("user_turns_p50_ms"), theirs.get("user_turns_p50_ms")),
            "tool_turns": ratio(ours.get("tool_turns_p50_ms"), theirs.get("tool_turns_p50_ms"))}


def prompts_equal(ours: list[dict], theirs: list[dict]) -> dict:
    """Turns whose prompt was the same number of tokens on both arms (the same conversation,
    the same turn): the check that the same-prompt arm is given the same tokens."""
    pairs = [(a["prompt_tokens"], b["prompt_tokens"]) for x, y in zip(ours, theirs)
             for a, b in zip(x["turns"], y["turns"])]
    return {"turns": len(pairs), "equal": sum(a == b for a, b in pairs),
            "max_abs_difference": max((abs(a - b) for a, b in pairs), default=None)}


def resolve(model: str) -> tuple[str, Path, str]:
    """(what prepos serve is given, the GGUF llama-server loads, a label)."""
    from prepos.engine.loading import exported_gguf, resolve_model

    p = resolve_model(model)
    if p.suffix == ".gguf":
        return model, p, f"{model} ({p.name})"
    return str(p), exported_gguf(p), f"{p.name} (HF directory; llama-server: its F32 GGUF)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, an HF model directory or a .gguf file")
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="compute threads of each server (the same for both)")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="the client's pause before each request (an agent's tool time)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `prepos serve` argument (repeatable)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    binary = find_binary()
    if binary is None:
        sys.exit("no llama-server binary: run scripts/build_llama_server.sh")
    served, gguf, label = resolve(args.model)
    name = "stock_clients" if args.model == "smollm2" else \
        f"stock_clients_{Path(args.model).stem}"
    out_path = args.out or RESULTS / f"{name}.json"
    work = Path(tempfile.mkdtemp(prefix="stock-clients-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers stopped on the way
    mach = {**machine(), "cpu_model": cpu_model()}
    think = args.think_ms / 1e3

    support = tool_support(args.model)
    proc, url = start_prepos(served, work / "prepos.log", args.threads, args.server_arg)
    llama = LlamaServer(binary, gguf, slots=1, ctx_per_slot=8192, threads=args.threads,
                        extra=("--jinja",), log=work / "llama-server.log")
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    notes: list[str] = []
    try:
        llama.start(wait=300)
        pc = {arm: openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                                 timeout=900) for arm, key in KEYS.items()}
        lc = openai.OpenAI(base_url=llama.url + "/v1", api_key="none", max_retries=0,
                           timeout=900)
        pmodel = pc["prepos"].models.list().data[0].id
        lmodel = lc.models.list().data[0].id
        status = responses_route(url)
        arms = list(ARMS)
        if status == 404:
            arms.remove("prepos_responses")
            notes.append("POST /v1/responses answered 404 on this prepos (the route is not "
                         "there yet): responses_turn_ratio_vs_chat is null, the arm not run")

        def one(arm: str, convo: dict, n: int = TURNS) -> dict:
            wait_idle(url)
            if arm.startswith("llama_server"):
                return run_chat(lc, lmodel, convo, arm, None, think, n,
                                same_prompt=support if arm.endswith("same_prompt") else None)
            if arm == "prepos":
                return run_chat(pc[arm], pmodel, convo, arm, None, think, n)
            if arm == "prepos_responses":
                return run_responses(pc[arm], pmodel, convo, think, n)
            h = {"Authorization": f"Bearer {KEYS[arm]}"}
            sid = httpx.post(url + "/sessions", headers=h, timeout=60, json={
                "kind": "agentic", "system": SYSTEM, "tools": [TOOL]}).json()["id"]
            try:
                return run_chat(pc[arm], pmodel, convo, arm, {"session_id": sid}, think, n)
            finally:
                httpx.delete(f"{url}/sessions/{sid}", headers=h, timeout=60)

        # a warm-up per arm, not counted: two turns of a conversation of its own
        warm = conversation(10_000)
        for arm in arms:
            w = one(arm, warm, 2)
            if w["errors"]:
                raise RuntimeError(f"warm-up on {arm}: {w['errors']}")
        m0 = metrics(url)
        t_start = time.perf_counter()
        for i in range(args.conversations):
            convo = conversation(i)
            order = arms[i % len(arms):] + arms[:i % len(arms)]  # each arm first in turn
            for arm in order:
                runs[arm].append(one(arm, convo))
            last = {a: round(p50([t["wall_s"] for t in runs[a][-1]["turns"]
                                  if t["turn"] > 1]) or 0, 3) for a in order}
            print(f"conversation {i + 1}/{args.conversations} ({time.perf_counter() - t_start:.0f}"
                  f" s): turn P50 s {last}", file=sys.stderr)
            write(out_path.with_suffix(".partial.json"), {"runs": runs})
        m1 = metrics(url)
    finally:
        llama.stop()
        stop(proc)

    arms_summary = summary_of(runs)
    med = {a: (s["turns_after_first"] or {}).get("p50_ms") for a, s in arms_summary.items()}
    llama_cached = arms_summary.get("llama_server", {})
    delta = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1
             if k.startswith(("prepos:implicit_sessions", "prepos:requests_by_path",
                              "prepos:kv_prefix_reuse"))
             and m1.get(k, 0) - m0.get(k, 0)}
    summary = {
        "benchmark": "stock_clients", "model": label, "conversations": args.conversations,
        "turns": TURNS, "max_tokens": MAX_TOKENS, "temperature": 0, "threads": args.threads,
        "think_ms": args.think_ms,
        "tool_calls_mode": "replayed: the assistant's get_prices call (id, name, JSON "
                           "arguments) and the tool's result are sent by the client on turns "
                           "2, 4, 6, 8; tool_choice auto (never forced)",
        "llama_server": {"binary": str(binary), "slots": 1, "ctx": 8192, "jinja": True,
                         "cache_prompt": "default (on)"},
        "order": "interleaved conversation by conversation, the arms' order rotated",
        # the same prompt tokens on both: llama-server given the messages as prepos gives
        # them to the template (ToolSupport.apply); `own_render`: llama-server's render, which
        # drops the tools and the calls (shorter prompts, so other answers)
        "turn_ratio_vs_llama_server": {
            **turn_ratio(arms_summary, med, "llama_server_same_prompt"), "target_le": 1.0,
            "prompt_tokens_equal": prompts_equal(runs["prepos"],
                                                 runs["llama_server_same_prompt"]),
            "own_render": turn_ratio(arms_summary, med, "llama_server")},
        # a conversation's first turn on a warm server: `admission_ms` is its server timing's
        # restore_ms (its batch admitted: the KV started from a prefix another holds, room
        # made, idle KVs moved down), before its forward ran
        "first_turn": {
            "admission_ms_p50": arms_summary.get("prepos", {}).get(
                "first_turn_admission_ms_p50"), "admission_target_le": 20,
            "first_turn_ratio_vs_llama_server_same_prompt": ratio(
                *[(arms_summary.get(a, {}).get("first_turn") or {}).get("p50_ms")
                  for a in ("prepos", "llama_server_same_prompt")]), "ratio_target_le": 1.0,
            "prepos": arms_summary.get("prepos", {}).get("first_turn"),
            "llama_server_same_prompt": arms_summary.get("llama_server_same_prompt", {}).get(
                "first_turn")},
        "per_token_vs_llama_server": {
            peer: {k: ratio(arms_summary.get("prepos", {}).get(f"{k}_ms_per_token_p50"),
                            arms_summary.get(peer, {}).get(f"{k}_ms_per_token_p50"))
                   for k in ("prefill", "decode")}
            for peer in ("llama_server_same_prompt", "llama_server")},
        "cached_fraction": {
            "prepos": arms_summary.get("prepos", {}).get("cached_fraction"), "target_ge": 0.9,
            "llama_server": llama_cached.get("cached_fraction"),
            "llama_server_cache_n": llama_cached.get("cache_n_fraction"),
            "llama_server_same_prompt": arms_summary.get("llama_server_same_prompt", {}).get(
                "cached_fraction"),
            "prepos_session": arms_summary.get("prepos_session", {}).get("cached_fraction"),
            "cacheable": {a: s["cacheable_fraction"] for a, s in arms_summary.items()}},
        "stateless_vs_session_ratio": {
            "value": ratio(med.get("prepos"), med.get("prepos_session")), "target_le": 1.1,
            "prepos_session": arms_summary.get("prepos_session", {}).get("turns_after_first")},
        "responses_turn_ratio_vs_chat": (
            {"value": ratio(med.get("prepos_responses"), med.get("prepos")),
             "prepos_responses": arms_summary["prepos_responses"]["turns_after_first"]}
            if "prepos_responses" in arms_summary else None),
        "arms": arms_summary, "prepos_metrics_delta": delta, "notes": notes,
        "errors": [dict(e, arm=r["arm"], conversation=i) for rs in runs.values()
                   for i, r in enumerate(rs) for e in r["errors"]][:10],
        "machine": {**mach, "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
    }
    write(out_path, {**summary, "runs": runs})
    print(f"wrote {out_path}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
