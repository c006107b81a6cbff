"""Replay a streaming market session and an agentic tool-calling session against a running
prepos server, and print, per request, the path that served it and the first-token latency
the client saw.

    prepos demo --url http://127.0.0.1:8000 [--api-key KEY]

`--url` is one address: a single server's, or a cluster's front door (`docs/clusters.md`);
the demo needs to know nothing of the nodes behind it.

The market session registers a standing query and appends price data; after each update
the server pre-positions it, so the standing query is answered from the cache (fast), an
ad-hoc question resumes from the pre-paid query prefix (fall-through, or fast where the
calibrated gate fires), and the same query to a baseline session that never pre-positions
pays its whole entry (cold). Meanwhile it follows the market session's events
(`prepos.lab.following`: subscribed again, with `Last-Event-ID`, wherever a stream ends)
and says how many commits and pushed answers came, each commit once. The agentic session
runs a turn, a tool result if the model calls its tool, a turn whose user message was
committed ahead (fast), and an OpenAI-compatible chat turn with the `session_id` extension.

With `--agentic`, a tool-calling loop answered by the served model instead (serve a real
chat model: `prepos serve --model smollm2`): each question's turn, its tool call (or the
agent client's where the turn holds none), and the turn after the tool result, served from
the envelope pre-positioned while the tool ran.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import time
from urllib.parse import urlsplit

from prepos.lab.following import Follower
from prepos.lab.retrying import retrying
from prepos.lab.task.market import SYSTEM_PROMPT, generate_stream

TICKER = "ACME"
STANDING = f"Which way is {TICKER} moving?"
AD_HOC = (f"Is {TICKER} rising?", f"Is {TICKER} falling?", f"Is it false that {TICKER} is "
          "rising?")
TOOLS = [{"type": "function", "function": {
    "name": "get_price", "description": "The latest price of a ticker",
    "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}},
                   "required": ["ticker"]}}}]
AGENT_SYSTEM = "You are a trading assistant. Call get_price to look up a price."

# the tool loop (--agentic), here and in process (prepos.lab.demo)
LOOP_SYSTEM = "You are a helpful assistant."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
LOOP_QUESTIONS = (("What is the weather in Paris? Use the get_weather tool.", "Paris"),
                  ("And in Berlin? Use the get_weather tool.", "Berlin"))
FORECASTS = {"paris": "sunny, 21 C", "berlin": "light rain, 14 C"}


def get_weather(arguments: dict) -> str:
    """The demo's tool: a fixed forecast per city."""
    city = str(arguments.get("city", "")).strip()
    return f"{city}: {FORECASTS.get(city.lower(), 'no forecast for this city')}"


def loop_call(calls: list[dict], city: str) -> tuple[dict, str]:
    """The call the turn made (its first, if it names the demo's tool), or the one the agent
    client issues in its place; and who made it."""
    for c in calls:
        if c["function"]["name"] == "get_weather":
            return c, "model"
    return {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": city}}}, "agent client"


class DemoError(RuntimeError):
    pass


class Http:
    """One keep-alive connection; JSON calls and SSE requests timed to the first token. A
    request that met a dying node (502, 503, a broken connection) is sent again with backoff
    and the same `Idempotency-Key` (`prepos.lab.retrying`), until `retry_s` has passed."""

    def __init__(self, url: str, key: str | None = None, retry_s: float = 30.0):
        self.url, self.key = url, key
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.retry_s = retry_s
        self.retries = 0
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)

    def _send(self, method: str, path: str, body: dict | None, read):
        """One attempt: (status, headers, what `read(response)` made of the body)."""

        def attempt(extra: dict[str, str]):
            try:
                self.conn.request(method, path, json.dumps(body) if body is not None else None,
                                  {**self.headers, **extra})
                r = self.conn.getresponse()
                head = {k.lower(): v for k, v in r.getheaders()}
                return r.status, head, read(r) if r.status < 300 else r.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()  # a new connection for the next attempt
                raise

        def noted(why: str) -> None:
            self.retries += 1

        try:
            return retrying(attempt, deadline_s=self.retry_s, on_retry=noted)
        except (OSError, http.client.HTTPException) as exc:
            raise DemoError(f"{method} {path}: no answer: {exc!r}") from None

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        status, _, raw = self._send(method, path, body, lambda r: r.read())
        if status >= 300:
            raise DemoError(f"{method} {path}: HTTP {status}: {raw.decode(errors='replace')}")
        return json.loads(raw)

    def follow(self, sid: str, on_event=None) -> Follower:
        """A follower of `sid`'s events through this client's URL, not started."""
        return Follower(self.url, sid, self.key, on_event, self.retry_s)

    def stream(self, path: str, body: dict) -> tuple[float | None, list[tuple[str, object]]]:
        """POST a streaming request: seconds to the first token, and the events."""
        t0 = time.perf_counter()

        def read(r):
            first, name, events = None, "message", []
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.decode().rstrip("\r\n")
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    raw = line[5:].strip()
                    data = raw if raw == "[DONE]" else json.loads(raw)
                    if first is None and (_is_token(name, data) or name == "result"):
                        first = time.perf_counter() - t0  # a relaxed answer: its result alone
                    events.append((name, data))
                    name = "message"
            r.read()  # a body with a Content-Length (a finished fast answer) ends here
            return first, events

        status, _, out = self._send("POST", path, body, read)
        if status >= 300:
            raise DemoError(f"POST {path}: HTTP {status}: {out.decode(errors='replace')}")
        return out


def _is_token(name: str, data) -> bool:
    if name == "token":
        return True
    if name == "message" and isinstance(data, dict) and data.get("choices"):
        delta = data["choices"][0].get("delta") or {}
        return bool(delta.get("content") or delta.get("tool_calls") or
                    data["choices"][0].get("text"))
    return False


class Table:
    COLS = ("#", "session", "request", "path", "match", "first token ms", "server ttft ms",
            "answer")

    def __init__(self, out=None):
        self.rows: list[tuple] = []
        self.out = out or sys.stdout  # read now, not at import (a test may have replaced it)
        print(self._fmt(self.COLS), file=out)
        print(self._fmt(tuple("-" * w for w in self.widths)), file=out)

    widths = (3, 9, 34, 12, 7, 14, 14, 20)

    def _fmt(self, cells) -> str:
        return "  ".join(str(c)[:w].ljust(w) if i in (1, 2, 3, 4, 7) else str(c)[:w].rjust(w)
                         for i, (c, w) in enumerate(zip(cells, self.widths)))

    def add(self, session: str, request: str, first: float | None, result: dict) -> None:
        timing = result.get("timing", {})
        row = (len(self.rows) + 1, session, request, result.get("path", "?"),
               result.get("match", "?"), f"{first * 1e3:.2f}" if first is not None else "-",
               f"{timing.get('ttft_ms', 0):.2f}", repr(result.get("text", ""))[:20])
        self.rows.append(row)
        print(self._fmt(row), file=self.out, flush=True)

    def summary(self) -> str:
        by: dict[str, list[float]] = {}
        for row in self.rows:
            if row[5] != "-":
                by.setdefault(row[3], []).append(float(row[5]))
        parts = [f"{p}: {len(xs)} requests, median first token "
                 f"{sorted(xs)[len(xs) // 2]:.2f} ms" for p, xs in sorted(by.items())]
        return "; ".join(parts)


def _result(events) -> dict:
    for name, data in reversed(events):
        if name == "result":
            return data
        if name == "error":
            raise DemoError(json.dumps(data))
    raise DemoError("the stream ended without a result")


def _openai_result(events) -> dict:
    text, ext = "", {}
    for name, data in events:
        if not isinstance(data, dict):
            continue
        if "error" in data:
            raise DemoError(json.dumps(data["error"]))
        for ch in data.get("choices", []):
            text += (ch.get("delta") or {}).get("content") or ""
        ext = data.get("prepos", ext)
    return {**ext, "text": text}


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    u = urlsplit(url)
    while True:
        try:
            c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=5)
            c.request("GET", "/health")
            r = c.getresponse()
            body = r.read()
            if r.status == 200:
                return
            state = json.loads(body).get("status", r.status)
        except (OSError, ValueError) as exc:
            state = exc
        if time.monotonic() > deadline:
            raise DemoError(f"no ready server at {url} ({state}); start one with `prepos "
                            "serve`")
        time.sleep(0.25)


def market(h: Http, table: Table, updates: int, seed: int, max_tokens: int) -> None:
    msgs = generate_stream(random.Random(seed), 6 * (updates + 3), ticker=TICKER).messages()
    hot = h.call("POST", "/sessions", {"kind": "streaming", "system": SYSTEM_PROMPT,
                                       "standing_queries": [STANDING],
                                       "fast_path": "relaxed"})["id"]
    base = h.call("POST", "/sessions", {"kind": "streaming", "system": SYSTEM_PROMPT,
                                        "preposition": False})["id"]
    rng = random.Random(seed)
    pushed: list[object] = []
    feed = h.follow(hot, lambda name, data: pushed.append(data) if name == "answer" else None)
    follower = feed.start()
    last = 0  # the market session's last version
    try:
        for m in msgs[:3]:  # some history first
            for sid in (hot, base):
                last = h.call("POST", f"/sessions/{sid}/append", {"data": m})["version"]
        for m in msgs[3:3 + updates]:
            for sid in (hot, base):
                last = h.call("POST", f"/sessions/{sid}/append", {"data": m})["version"]
            h.call("GET", f"/sessions/{hot}?wait_ready=60")  # the idle time between updates
            for sid, name, q in ((hot, "market", STANDING), (hot, "market", rng.choice(AD_HOC)),
                                 (base, "baseline", STANDING)):
                first, events = h.stream(f"/sessions/{sid}/query",
                                         {"question": q, "max_tokens": max_tokens,
                                          "stream": True})
                table.add(name, q, first, _result(events))
    finally:
        for sid in (hot, base):
            h.call("DELETE", f"/sessions/{sid}")
        follower.join(30)  # the deletion's `close` ends it
        feed.stop()
    once = feed.repeated == 0 and feed.missed(last) == 0
    print(f"\nmarket session's events: {len(feed.commits)} commits, "
          f"{'each once' if once else 'NOT each once'}; {len(pushed)} standing answers pushed; "
          f"{len(feed.streams)} subscription(s)")


def agentic(h: Http, table: Table, model: str, max_tokens: int) -> None:
    sid = h.call("POST", "/sessions", {"kind": "agentic", "system": AGENT_SYSTEM,
                                       "tools": TOOLS})["id"]
    try:
        h.call("GET", f"/sessions/{sid}?wait_ready=60")
        ask = f"What is {TICKER} trading at?"
        first, events = h.stream(f"/sessions/{sid}/turn", {"user": ask, "stream": True,
                                                           "max_tokens": max_tokens})
        res = _result(events)
        table.add("agent", f"turn: {ask}", first, res)
        if res.get("tool_calls"):
            h.call("GET", f"/sessions/{sid}?wait_ready=60")
            first, events = h.stream(f"/sessions/{sid}/tool_result",
                                     {"content": json.dumps({"ticker": TICKER, "price": 48}),
                                      "stream": True, "max_tokens": max_tokens})
            table.add("agent", "tool result: get_price", first, _result(events))
        # a user message committed ahead of its turn: the turn is an exact match
        h.call("POST", f"/sessions/{sid}/messages", {"role": "user", "content": "And BOLT?"})
        h.call("GET", f"/sessions/{sid}?wait_ready=60")
        first, events = h.stream(f"/sessions/{sid}/turn", {"stream": True,
                                                           "max_tokens": max_tokens})
        table.add("agent", "turn (user committed ahead)", first, _result(events))
        # the OpenAI-compatible endpoint on the same session: only the new message is sent on
        held = h.call("GET", f"/sessions/{sid}?include=messages&wait_ready=60")["message_list"]
        convo = [_as_openai(m, i) for i, m in enumerate(held)]
        convo.append({"role": "user", "content": "Thanks. Anything else?"})
        first, events = h.stream("/v1/chat/completions", {
            "model": model, "messages": convo, "stream": True, "max_tokens": max_tokens,
            "session_id": sid})
        table.add("agent", "/v1/chat/completions + session_id", first, _openai_result(events))
    finally:
        h.call("DELETE", f"/sessions/{sid}")


def agentic_loop(h: Http, table: Table, max_tokens: int) -> None:
    sid = h.call("POST", "/sessions", {"kind": "agentic", "system": LOOP_SYSTEM,
                                       "tools": [WEATHER_TOOL]})["id"]
    try:
        for i, (question, city) in enumerate(LOOP_QUESTIONS):
            before = h.call("GET", f"/sessions/{sid}?wait_ready=60")["version"]
            first, events = h.stream(f"/sessions/{sid}/turn", {"user": question, "stream": True,
                                                               "max_tokens": max_tokens})
            res = _result(events)
            table.add("agent", f"turn: {question}", first, res)
            call, caller = loop_call(res.get("tool_calls") or [], city)
            if caller != "model":  # keep the question, drop the answer, issue the call
                h.call("POST", f"/sessions/{sid}/rollback", {"version": before + 1})
                h.call("POST", f"/sessions/{sid}/messages",
                       {"role": "assistant", "content": "", "tool_calls": [call]})
            args = call["function"]["arguments"]
            result = get_weather(json.loads(args) if isinstance(args, str) else args)
            print(f"     tool call by the {caller}: get_weather({args}) -> {result!r}")
            h.call("GET", f"/sessions/{sid}?wait_ready=60")  # the envelope, pre-positioned
            if i % 2 == 0:
                first, events = h.stream(f"/sessions/{sid}/tool_result", {
                    "content": result, "stream": True, "max_tokens": max_tokens})
                table.add("agent", "tool result + next turn", first, _result(events))
            else:
                h.call("POST", f"/sessions/{sid}/messages", {"role": "tool", "content": result})
                h.call("GET", f"/sessions/{sid}?wait_ready=60")
                first, events = h.stream(f"/sessions/{sid}/turn", {"stream": True,
                                                                   "max_tokens": max_tokens})
                table.add("agent", "next turn after committed result", first, _result(events))
    finally:
        h.call("DELETE", f"/sessions/{sid}")


def _as_openai(m: dict, i: int) -> dict:
    out = {"role": m["role"], "content": m.get("content", "")}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"]["arguments"])}}
                             for j, c in enumerate(m["tool_calls"])]
    if m["role"] == "tool":
        out["tool_call_id"] = f"call_{i - 1}_0"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prepos demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="a running prepos "
                    "server, or a cluster's front door: one URL")
    ap.add_argument("--api-key", help="Bearer key, if the server wants one")
    ap.add_argument("--updates", type=int, default=6, help="market data updates to replay")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--agentic", action="store_true",
                    help="a tool-calling loop answered by the served model")
    ap.add_argument("--wait", type=float, default=120.0,
                    help="seconds to wait for the server to be ready")
    ap.add_argument("--retry", type=float, default=30.0, help="seconds a request is retried "
                    "(502, 503, a broken connection; one Idempotency-Key) before it fails")
    args = ap.parse_args(argv)
    try:
        wait_healthy(args.url, args.wait)
        h = Http(args.url, args.api_key, args.retry)
        model = h.call("GET", "/v1/models")["data"][0]["id"]
        print(f"prepos demo against {args.url} (model {model})\n")
        table = Table()
        if args.agentic:
            agentic_loop(h, table, max(args.max_tokens, 48))
        else:
            market(h, table, args.updates, args.seed, args.max_tokens)
            agentic(h, table, model, args.max_tokens)
    except DemoError as exc:
        print(f"prepos demo: {exc}", file=sys.stderr)
        return 1
    print(f"\n{table.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
