"""`prepos demo`: a streaming market session and an agentic tool-call session, in process,
printing for every request the path that served it and its first-token latency.

With `--agentic`, a tool-calling loop instead, answered by the model itself (meant for a real
chat model: `--model smollm2 --agentic`): each question's turn is generated, its tool call
parsed and run, and the turn after each tool result starts from the envelope pre-positioned
while the tool ran. A turn that holds no well-formed call is reported as such, and the
demo's agent client issues the call in its place, so the paths are shown either way.

With `--url`, the same replay runs against a running server instead.
"""

from __future__ import annotations

import argparse
import random
import time

from prepos.config import EngineConfig
from prepos.core import Request, Result, SamplingParams
from prepos.engine import Engine
from prepos.lab.demo_client import LOOP_QUESTIONS, LOOP_SYSTEM, WEATHER_TOOL, get_weather, loop_call
from prepos.lab.task import market
from prepos.paths import DEFAULT_MODEL

ONE = SamplingParams(max_tokens=1)
COLUMNS = f"{'request':<46} {'path':<13} {'match':<8} {'gap':>6} {'TTFT ms':>9}  answer"


def row(label: str, res: Result, truth: str | None = None) -> str:
    gap = f"{res.gap:6.2f}" if res.gap is not None else "     -"
    answer = res.text.strip() or "(none)"
    if truth is not None:
        answer += f"   (truth: {truth})"
    return (f"{label[:46]:<46} {res.path.value:<13} {res.match.value:<8} {gap} "
            f"{res.timing.ttft * 1e3:9.3f}  {answer}")


def streaming_demo(eng: Engine, seed: int, updates: int) -> None:
    rng = random.Random(seed)
    stream = market.generate_stream(rng, market.PRICES_PER_MESSAGE * (updates + 4))
    t = stream.ticker
    wordings = [q.text for q in market.queries(t, "up", ("trend",))]
    standing, adhoc = wordings[0], wordings[-1]
    live = eng.create_session("streaming", system=market.SYSTEM_PROMPT, standing=[standing],
                              fast_path="relaxed")
    cold = eng.create_session("streaming", system=market.SYSTEM_PROMPT, preposition=False)
    msgs = stream.messages()
    print(f"\nStreaming session: {t} prices appended; queries arrive in the idle window.")
    print(COLUMNS)
    for i, msg in enumerate(msgs[: updates + 2], start=1):
        eng.append(live, msg)
        eng.append(cold, msg)
        if i < 3:
            continue  # let two messages of history build up
        eng.wait_idle()  # the idle window: the pre-position runs here, off the critical path
        truth = stream.trend_after(i)
        rising = "yes" if truth == "up" else "no"
        print(f"-- update {i}: {msg}")
        print(row(f"standing: {standing}", eng.query(live, standing, Request(ONE)).result(), truth))
        # an ad-hoc trend question in other words: the gate may answer it from the header
        print(row(f"ad-hoc:   {adhoc}", eng.query(live, adhoc, Request(ONE)).result(), truth))
        # a polar question: its answer is not the question-independent token, so it is
        # asked with the gate off and falls through (served relaxed, it would be a false
        # accept: the pre-commitment divergence the calibration measures)
        print(row(f"ad-hoc:   Is {t} rising? (gate off)",
                  eng.query(live, f"Is {t} rising?",
                            Request(ONE, fast_path="off")).result(), rising))
        print(row(f"cold:     {standing}", eng.query(cold, standing, Request(ONE)).result(), truth))


def agentic_demo(eng: Engine) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_prices", "description": "latest prices of a ticker",
        "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}}}}}]
    sid = eng.create_session("agentic", system=market.SYSTEM_PROMPT, tools=tools)
    print("\nAgentic session: the agent client issues a tool call; its result resumes "
          "delta-only.")
    print(COLUMNS)
    eng.add_message(sid, "user", "Which way is ACME moving?")
    call = {"type": "function", "function": {"name": "get_prices",
                                             "arguments": {"ticker": "ACME"}}}
    eng.add_message(sid, "assistant", "", tool_calls=[call])  # issued by the agent client
    eng.wait_idle()  # the tool's round trip: the envelope is pre-positioned meanwhile
    result = market.format_data("ACME", [41, 43, 44, 47, 48, 50])
    print(row("tool result -> next turn", eng.tool_result(sid, result, Request(ONE)).result()))
    eng.add_message(sid, "user", "And BOLT?")
    eng.add_message(sid, "assistant", "", tool_calls=[
        {"type": "function", "function": {"name": "get_prices", "arguments": {"ticker": "BOLT"}}}])
    eng.add_message(sid, "tool", market.format_data("BOLT", [60, 58, 57, 55, 52, 50]))
    eng.wait_idle()  # the result is committed; the next turn's header is pre-positioned
    print(row("next turn after a committed result", eng.turn(sid, None, Request(ONE)).result()))


def agentic_loop_demo(eng: Engine, max_tokens: int = 64) -> list[dict]:
    """The tool loop; returns one record per question (what the model wrote, who called,
    and the path of the turn after the tool result)."""
    fmt = eng.fmt
    support = "renders" if fmt.tool_support.complete else "does not render"
    print(f"\nAgentic tool loop: the chat template {support} tools; tool-call format "
          f"{fmt.tool_format.name!r}.")
    sid = eng.create_session("agentic", system=LOOP_SYSTEM, tools=[WEATHER_TOOL])
    gen = SamplingParams(max_tokens=max_tokens)
    out = []
    for i, (question, city) in enumerate(LOOP_QUESTIONS):
        eng.wait_idle()  # the user thinks: the next turn's header is pre-positioned
        before = eng.info(sid)["version"]
        asked = eng.turn(sid, question, Request(gen)).result()
        print(f"-- user: {question}")
        print(row("turn (model answers)", asked))
        call, caller = loop_call(asked.tool_calls, city)
        if caller != "model":
            print("   no well-formed get_weather call in that turn; the agent client rolls "
                  "it back and issues the call")
            eng.rollback(sid, before + 1)  # keep the question, drop the answer
            eng.add_message(sid, "assistant", "", tool_calls=[call])
        result = get_weather(call["function"]["arguments"])
        print(f"   tool call by the {caller}: get_weather({call['function']['arguments']}) "
              f"-> {result!r}")
        eng.wait_idle()  # the tool's round trip: the envelope is pre-positioned meanwhile
        if i % 2 == 0:  # the result arrives with the request for the next turn
            label = "tool result + next turn"
            res = eng.tool_result(sid, result, Request(gen)).result()
        else:  # the result is committed when it arrives; the next turn asked after it
            label = "next turn after committed result"
            eng.add_message(sid, "tool", result)
            eng.wait_idle()
            res = eng.turn(sid, None, Request(gen)).result()
        print(row(label, res))
        out.append({"question": question, "model_text": asked.text, "caller": caller,
                    "path": res.path.value, "match": res.match.value, "answer": res.text,
                    "prefilled": res.prompt_tokens - res.cached_prompt_tokens})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prepos demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--url", help="replay against a running server (or a cluster's front door: "
                    "one URL) instead of in process")
    ap.add_argument("--api-key", help="with --url: the server's Bearer key")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--agentic", action="store_true",
                    help="a tool-calling loop answered by the model (e.g. --model smollm2)")
    args = ap.parse_args(argv)
    if args.url:
        from prepos.lab.demo_client import main as client_main

        forwarded = ["--url", args.url, "--seed", str(args.seed), "--updates",
                     str(args.updates)] + (["--agentic"] if args.agentic else [])
        if args.api_key:
            forwarded += ["--api-key", args.api_key]
        return int(client_main(forwarded) or 0)
    if args.api_key:
        ap.error("--api-key goes with --url (the in-process demo has no server)")
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(args.model, EngineConfig())
    print(f"model {args.model} loaded in {time.perf_counter() - t0:.1f} s; gate tau="
          f"{eng.gate.tau:.2f}, fast-answer set {list(eng.gate.config.answers)}")
    try:
        if args.agentic:
            agentic_loop_demo(eng)
        else:
            streaming_demo(eng, args.seed, args.updates)
            agentic_demo(eng)
        m = eng.metrics()
        print(f"\npre-positions: {m['prepositions']}\npaths: {m['paths']}")
    finally:
        eng.close()
    return 0
