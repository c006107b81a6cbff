"""What a streaming session's data line costs to commit, by how long the session is, in
process (no server, no model): the CPU of the commit's render and tokenization, and of the
window's shift when the context fills.

A session of the model's chat format (SmolLM2's by default) is fed data lines like a
dashboard's; from each of --at line counts, the next --samples lines are timed (a session
grown to that count for each), each line's CPU (`time.thread_time_ns`), the two kinds in
separate passes:

  append        `Session.append`: the line's text (`ChatFormat.render_appended`: its
                content framed as the template frames a line, where a probe finds it does;
                else rendered on its own after a stand-in line, where the template renders
                lines so), tokenized, the new version committed
  render_whole  the render it replaces: the template's rendering of the whole conversation
                (`ChatFormat.render`), timed on the same conversations

Then the window's shift: a session of --context tokens fed lines until it has shifted
--shifts times; each shift's CPU (the commit that shifts), against the linear search the
bisection replaced (one render and tokenization per line dropped; reimplemented here as the
reference, on the same conversation). P50 / P99 in µs (shift: ms) with the number of samples;
the last line printed is the JSON summary (also results/append_cost.json).

    python benchmarks/append_cost.py [--model smollm2] [--at 10,100,400] [--samples 100]
                                     [--context 8192] [--shifts 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, write  # noqa: E402
from prepos.chat.format import ChatFormat  # noqa: E402
from prepos.engine.loading import load_tokenizer, resolve_model  # noqa: E402
from prepos.engine.session import Session  # noqa: E402
from prepos.engine.session_spec import STREAMING, SessionSpec  # noqa: E402

SYSTEM = "You watch a price feed and answer questions about it."


def line(i: int) -> str:
    return f"T{i % 8} {100 + i % 17}.{i % 10} {101 + i % 13}.5 vol {1000 + 37 * i}"


def session(fmt: ChatFormat, context: int) -> Session:
    return Session("s-0", SessionSpec(STREAMING, SYSTEM), fmt, max_context=context,
                   max_versions=8, shift_keep=0.5, reserve=64)


def cpu_us(fn) -> float:
    t0 = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - t0) / 1e3


def stats(xs: list[float], unit: str = "us") -> dict:
    xs = sorted(xs)
    n = len(xs)
    return {"n": n, f"p50_{unit}": round(xs[n // 2], 1),
            f"p99_{unit}": round(xs[min(n - 1, round(0.99 * (n - 1)))], 1)}


def by_length(fmt: ChatFormat, at: list[int], samples: int) -> dict:
    out = {}
    for target in at:
        s = session(fmt, 1 << 20)
        for i in range(target):
            s.append(line(i))
        start = len(s.snap.messages)
        # the session grows a line a sample; then the same conversations rendered whole (a
        # pass apart: a whole render between two appends would leave the caches cold)
        append = [cpu_us(lambda: s.append(line(i))) for i in range(target, target + samples)]
        msgs = s.snap.messages
        whole = [cpu_us(lambda: fmt.render(msgs[:n])) for n in range(start + 1, len(msgs) + 1)]
        a, w = stats(append), stats(whole)
        out[str(target)] = {"append": a, "render_whole": w,
                            "render_whole_over_append_p50": round(w["p50_us"] / a["p50_us"], 2)}
        print(f"{target}-{target + samples} lines: append P50 {a['p50_us']} µs (P99 "
              f"{a['p99_us']}), the whole render alone P50 {w['p50_us']} µs (n={samples})",
              flush=True)
    return out


def linear_shift(s: Session, msgs: list[dict]) -> list[dict]:
    """The linear search the bisection replaced, as it was (the reference)."""
    first = 1 if msgs and msgs[0]["role"] == "system" else 0
    target = int(s.max_context * s.shift_keep)
    drop = 0
    while first + drop < len(msgs) - 1:
        drop += 1
        trial = [*msgs[:first], *msgs[first + drop:]]
        if len(s.fmt.encode(s.fmt.render(trial))) <= target:
            break
    return [*msgs[:first], *msgs[first + drop:]]


def shifts(fmt: ChatFormat, context: int, count: int) -> dict:
    s, i = session(fmt, context), 0
    now, linear, kept = [], [], []
    while len(now) < count:
        before = [*s.snap.messages, {"role": "user", "content": line(i)}]
        n = len(s.snap.messages)
        t = cpu_us(lambda: s.append(line(i)))
        i += 1
        if len(s.snap.messages) == n + 1:
            continue
        now.append(t / 1e3)
        ref: list = []
        linear.append(cpu_us(lambda: ref.append(linear_shift(s, before))) / 1e3)
        assert ref[0] == list(s.snap.messages), "the bisection kept other lines"
        kept.append(len(s.snap.messages))
        print(f"shift at line {i}: {n} messages -> {kept[-1]}, {now[-1]:.1f} ms "
              f"(the linear search {linear[-1]:.1f} ms)", flush=True)
    b, lin = stats(now, "ms"), stats(linear, "ms")
    return {"context": context, "messages_kept": kept, "bisection": b, "linear": lin,
            "linear_over_bisection_p50": round(lin["p50_ms"] / b["p50_ms"], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, an HF model directory or a .gguf file (its tokenizer)")
    ap.add_argument("--at", default="10,100,400", help="line counts to time appends at")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--context", type=int, default=8192, help="the window, for the shifts")
    ap.add_argument("--shifts", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    fmt = ChatFormat(load_tokenizer(resolve_model(args.model)))
    summary = {"benchmark": "append_cost", "model": args.model,
               "appends_locally": fmt.appends_locally, "frames_lines": fmt.frames_lines,
               "machine": machine(),
               "by_lines": by_length(fmt, [int(x) for x in args.at.split(",")], args.samples),
               "shift": shifts(fmt, args.context, args.shifts)}
    write(args.out or "append_cost", summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
