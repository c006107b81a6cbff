"""Conversations the client names: many conversations asked round robin, each named the way
a stock client names one, against llama-server, which ignores the name.

Each conversation has a system prompt of about --system-tokens tokens of its own and --turns
user turns, asked in turn (turn 1 of every conversation, then turn 2, ...), greedy,
--max-tokens tokens an answer, one request at a time. Three modes, each on a fresh
`prepos serve --model MODEL` (its defaults but --kv-ram, --journal none), one server alive at
a time:

  header            chat completions with the whole conversation, `X-Session-ID: conv-<i>`
  prompt_cache_key  the same, named by the body's `prompt_cache_key`
  conversations     the OpenAI SDK's Conversations API: `conversations.create()` once, then
                    `responses.create(conversation=..., instructions=<system>, input=<the
                    new user message>)`, the server keeping the conversation

  llama_server      llama-server on the same GGUF, the same threads, one slot, its prompt
                    cache in RAM of the same size (--cache-ram = prepos's --kv-ram), --jinja,
                    every turn resending the whole conversation (it ignores names)

The arms run in --blocks blocks of the conversations, ordered ABBA (the modes then
llama-server, then llama-server then the modes backwards, ...), each block on fresh servers:
the machine's drift over the run falls on every arm alike; an arm's figures pool its blocks.
Every server holds every conversation of its block (prepos's tiers, llama-server's RAM cache
of the same size), so a block's cache hits are the whole run's.

Reported per mode: `errors`, turn latency (client side, median and P99 with n, first and later
turns apart), `cached_fraction_after_first` (cached prompt tokens over the later turns'
prompt tokens) beside the ceiling any cache could reach (each later turn's prompt less its
new user message), `cached_over_ceiling`, and `turn_ratio_vs_llama_server` (the mode's median
later turn over llama-server's). The JSON summary is the last line of stdout (and
results/named_conversations.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from many_conversations import (  # noqa: E402
    KEY,
    ask,
    llama_arm,
    run_arm,
    system_prompt,
    turn_totals,
)
from stock_clients import resolve, start_prepos, stop  # noqa: E402

from common import RESULTS, machine, write  # noqa: E402
from prepos.backends.llama_server import find_binary  # noqa: E402

MODES = ("header", "prompt_cache_key", "conversations")


def named_asker(url: str, model: str, max_tokens: int, mode: str):
    """Conversation i's turn, the whole conversation sent and named as `mode` names it."""
    def asker(http, i, msgs):
        name = f"conv-{i}"
        if mode == "header":
            return ask(http, url, model, KEY, msgs, max_tokens, headers={"X-Session-ID": name})
        return ask(http, url, model, KEY, msgs, max_tokens, extra={"prompt_cache_key": name})
    return asker


def conversations_asker(url: str, model: str, max_tokens: int):
    """Conversation i's turn through the Conversations API: only the new user message sent,
    the server holding the rest (the system prompt is the request's instructions)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=900)
    ids: dict[int, str] = {}

    def asker(http, i, msgs):
        t0 = time.perf_counter()
        try:
            if i not in ids:
                ids[i] = client.conversations.create().id
            r = client.responses.create(model=model, conversation=ids[i],
                                        instructions=msgs[0]["content"],
                                        input=msgs[-1]["content"],
                                        max_output_tokens=max_tokens, temperature=0.0)
        except openai.APIStatusError as exc:
            return {"ok": False, "status": exc.status_code, "s": time.perf_counter() - t0}
        except openai.APIError as exc:
            return {"ok": False, "error": type(exc).__name__, "s": time.perf_counter() - t0}
        dt = time.perf_counter() - t0
        details = r.usage.input_tokens_details
        return {"ok": True, "s": dt, "prompt": r.usage.input_tokens,
                "completion": r.usage.output_tokens,
                "cached": details.cached_tokens if details else 0, "content": r.output_text}
    return asker


def prepos_arm(served: str, args, ram: int, log: Path, mode: str, systems: list[str],
               count) -> dict:
    """One block of conversations on a fresh `prepos serve`, named as `mode` names them."""
    proc, url = start_prepos(served, log, args.threads, ["--kv-ram", str(ram), *args.server_arg])
    try:
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30).json()["data"][0]["id"]
        asker = (conversations_asker(url, model, args.max_tokens) if mode == "conversations"
                 else named_asker(url, model, args.max_tokens, mode))
        t0 = time.perf_counter()
        arm = run_arm(asker, systems, args.turns, count, samples=True)
        arm["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        stop(proc)
    return arm


def pooled(blocks: list[dict]) -> dict:
    """An arm's blocks as one: turn times pooled, token counts summed."""
    def total(key: str) -> int:
        return sum(b[key] for b in blocks)

    arm = turn_totals([x for b in blocks for x in b["first_s"]],
                      [x for b in blocks for x in b["later_s"]], total("errors"),
                      total("server_errors"), total("later_prompt_tokens"),
                      total("later_cached_tokens"), total("ceiling_tokens"))
    ceiling = arm["ceiling_tokens"]
    return {**arm,
            "cached_over_ceiling": round(arm["later_cached_tokens"] / ceiling, 4)
            if ceiling else None,
            "wall_s": round(sum(b.get("wall_s", 0) for b in blocks), 1),
            "later_p50_ms_per_block": [round(b["later_turns"]["p50_ms"], 1)
                                       for b in blocks if b["later_turns"]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-ram", default="2G", help="prepos's --kv-ram; llama-server's "
                    "--cache-ram the same")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more `prepos serve` argument (repeatable)")
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument("--blocks", type=int, default=4,
                    help="blocks of conversations, the arms ordered ABBA (default 4)")
    ap.add_argument("--out", type=Path, default=RESULTS / "named_conversations.json")
    args = ap.parse_args(argv)

    from prepos.chat.format import ChatFormat
    from prepos.engine.loading import load_tokenizer, resolve_model
    from prepos.server.http.options import size

    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    ram = size(args.kv_ram)
    served, gguf, label = resolve(args.model)
    fmt = ChatFormat(load_tokenizer(resolve_model(args.model)))
    systems = [system_prompt(fmt, i, args.system_tokens) for i in range(args.conversations)]

    def count(text: str) -> int:
        return len(fmt.encode(text))

    work = Path(tempfile.mkdtemp(prefix="named-conversations-"))
    out: dict = {"benchmark": "named_conversations", "model": label, "machine": machine(),
                 "conversations": args.conversations, "turns": args.turns,
                 "system_tokens_p50": statistics.median(count(s) for s in systems[:50]),
                 "max_tokens": args.max_tokens, "kv_ram_bytes": ram,
                 "server_args": args.server_arg, "modes": {}}
    binary = None if args.skip_llama_server else find_binary()
    arms = [*modes, *(["llama_server"] if binary is not None else [])]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    k = max(1, min(args.blocks, args.conversations))
    for b in range(k):
        block = systems[b * len(systems) // k:(b + 1) * len(systems) // k]
        for arm in arms if b % 2 == 0 else arms[::-1]:
            log = work / f"{arm}-{b}.log"
            if arm == "llama_server":
                runs[arm].append(llama_arm(binary, gguf, args, ram, log, block, count,
                                           samples=True))
            else:
                runs[arm].append(prepos_arm(served, args, ram, log, arm, block, count))
    for arm in modes:
        out["modes"][arm] = pooled(runs[arm])
    if binary is not None:
        theirs = out["llama_server"] = pooled(runs["llama_server"])
        for arm in out["modes"].values():
            a, b = arm["later_turns"], theirs["later_turns"]
            if a and b:
                arm["turn_ratio_vs_llama_server"] = round(a["p50_ms"] / b["p50_ms"], 3)
    else:
        out["llama_server"] = {"skipped": "no llama-server binary" if not
                               args.skip_llama_server else "--skip-llama-server"}
    out["blocks"] = k
    write(args.out, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
