"""Load against a running server: many streaming sessions, each driven by one client task
that interleaves updates (appends) and queries, checking every answer for staleness.

An answer is stale when it was computed from a version other than the session's version at
the time it was asked. Each session has exactly one writer (its task), so the session's
version at any moment is the version the task's last acknowledged update returned; an
answer's `version` (the version it was computed from) must equal it."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from prepos.lab.task.market import SYSTEM_PROMPT, TICKERS, generate_stream

STANDING = "Which way is {t} moving?"
AD_HOC = ("Is {t} rising?", "Is {t} falling?", "Is it false that {t} is rising?")


def price_messages(seed: int, n: int, ticker: str | None = None) -> list[str]:
    """`n` data messages of a seeded price stream (`"ACME 41 43 44 47 48 50"`)."""
    rng = random.Random(seed)
    stream = generate_stream(rng, 6 * n, ticker=ticker)
    return stream.messages()[:n]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def summarize(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": _ms(percentile(values, 50)),
            "p99_ms": _ms(percentile(values, 99)),
            "mean_ms": _ms(statistics.fmean(values)) if values else None}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 4)


async def _session_task(client: httpx.AsyncClient, sid: str, ticker: str, data: list[str],
                        version: int, ops: int, p_update: float, rng: random.Random,
                        out: dict, think_s: float) -> None:
    feed = iter(data)
    for _ in range(ops):
        if think_s:
            await asyncio.sleep(rng.expovariate(1.0 / think_s))
        update = rng.random() < p_update
        t0 = time.perf_counter()
        try:
            if update:
                r = await client.post(f"/sessions/{sid}/append", json={"data": next(feed)})
            else:
                q = (STANDING if rng.random() < 0.5 else rng.choice(AD_HOC)).format(t=ticker)
                r = await client.post(f"/sessions/{sid}/query",
                                      json={"question": q, "max_tokens": 1})
        except httpx.HTTPError as exc:
            out["errors"].append(f"{sid}: {type(exc).__name__}: {exc}")
            continue
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            out["errors"].append(f"{sid}: HTTP {r.status_code}: {r.text[:200]}")
            continue
        body = r.json()
        if update:
            version = body["version"]
            out["update_s"].append(dt)
        else:
            path = body["path"]
            out["query_s"].setdefault(path, []).append(dt)
            if body["version"] != version:
                out["stale"].append(f"{sid}: answer from version {body['version']}, "
                                    f"session at {version}")
        out["done"] += 1
        if out.get("progress"):
            out["progress"](1)


async def load_run(url: str, sessions: int = 64, ops: int = 2048, p_update: float = 0.5,
                   state_messages: int = 8, seed: int = 0, headers: dict | None = None,
                   think_ms: float = 0.0, progress=None, settle: bool = False) -> dict:
    """`sessions` streaming sessions (one standing query each), `ops` updates and queries
    in all, run concurrently; each session's task waits an exponential think time of mean
    `think_ms` before each operation (0: a closed loop that saturates the server). Returns
    counts, throughput, latency percentiles by kind and path, errors and stale answers.

    With `settle`, after the load each session waits for its pre-position to finish and asks
    its standing query once more: `settled_fast` counts those answered from the cache (with
    a pre-position finished for the current version, every one must be), and their answers
    are checked for staleness like the others. How many queries of the load itself find a
    finished pre-position depends on the machine's speed; this count does not."""
    per = -(-ops // sessions)
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                                 headers=headers) as client:
        made = []
        for i in range(sessions):
            ticker = TICKERS[i % len(TICKERS)]
            msgs = price_messages(seed + i, state_messages + per, ticker)
            r = await client.post("/sessions", json={
                "kind": "streaming", "system": SYSTEM_PROMPT,
                "standing_queries": [STANDING.format(t=ticker)]})
            r.raise_for_status()
            sid = r.json()["id"]
            version = 0
            for m in msgs[:state_messages]:
                r = await client.post(f"/sessions/{sid}/append", json={"data": m})
                r.raise_for_status()
                version = r.json()["version"]
            made.append((sid, ticker, msgs[state_messages:], version))
        out: dict = {"errors": [], "stale": [], "update_s": [], "query_s": {}, "done": 0,
                     "progress": progress}
        t0 = time.perf_counter()
        await asyncio.gather(*[
            _session_task(client, sid, ticker, data, version, per, p_update,
                          random.Random(seed * 7919 + k), out, think_ms / 1e3)
            for k, (sid, ticker, data, version) in enumerate(made)])
        wall = time.perf_counter() - t0
        settled = [await _settle(client, sid, ticker, out) for sid, ticker, *_ in made] \
            if settle else []
        for sid, *_ in made:
            await client.delete(f"/sessions/{sid}")
    queries = [x for xs in out["query_s"].values() for x in xs]
    everything = out["update_s"] + queries
    return {
        "sessions": sessions, "think_ms": think_ms, "operations": out["done"] + len(out["errors"]),
        "updates": len(out["update_s"]), "queries": len(queries),
        "errors": len(out["errors"]), "stale": len(out["stale"]),
        "error_examples": out["errors"][:5], "stale_examples": out["stale"][:5],
        "wall_s": round(wall, 3), "throughput_ops_s": round(out["done"] / wall, 2),
        "latency": summarize(everything), "update_latency": summarize(out["update_s"]),
        "query_latency_by_path": {p: summarize(xs) for p, xs in sorted(out["query_s"].items())},
        "settled": len(settled), "settled_fast": sum(settled),
    }


async def _settle(client: httpx.AsyncClient, sid: str, ticker: str, out: dict) -> bool:
    """Wait (up to 60 s) for the session's pre-position at its current version, then ask its
    standing query; True when the answer came from the cache. Stale answers go to `out`."""
    r = await client.get(f"/sessions/{sid}", params={"wait_ready": 60})
    if r.status_code != 200:
        out["errors"].append(f"{sid}: settle: HTTP {r.status_code}: {r.text[:200]}")
        return False
    version = r.json()["version"]
    r = await client.post(f"/sessions/{sid}/query",
                          json={"question": STANDING.format(t=ticker), "max_tokens": 1})
    if r.status_code != 200:
        out["errors"].append(f"{sid}: settle query: HTTP {r.status_code}: {r.text[:200]}")
        return False
    body = r.json()
    if body["version"] != version:
        out["stale"].append(f"{sid}: settled answer from version {body['version']}, "
                            f"session at {version}")
    return body["path"] == "fast"
