"""Shared benchmark helpers: percentiles, the timing model, JSON output, where the
machine's CPU went (`CpuShare`), bootstrap intervals of gap ratios. Run as
`python benchmarks/x.py`, a benchmark imports this as `common`; the tests import it
as `benchmarks.common`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("PREPOS_RESULTS", ROOT / "results"))
LOAD_AT_START = round(os.getloadavg()[0], 2)  # read when a benchmark imports this module


def summarize(samples_s: list[float]) -> dict:
    xs = sorted(samples_s)
    n = len(xs)

    def pct(p: float) -> float:
        return xs[min(n - 1, max(0, round(p / 100 * (n - 1))))] * 1e3

    return {"n": n, "p50_ms": pct(50), "p99_ms": pct(99), "mean_ms": statistics.fmean(xs) * 1e3,
            "min_ms": xs[0] * 1e3}


def timing_model_dir(size: str = "125m", device: str = "cpu", dtype: str = "float32") -> Path:
    """A timing model (seeded random weights), built once and cached in results/: the
    ~125M Llama by default, or another of prepos.lab.tiny.TIMING_SIZES (built on `device`)."""
    from prepos.lab.tiny import timing_model

    out = RESULTS / ("timing-model" if size == "125m" else f"timing-model-{size}-{dtype}")
    if not (out / "config.json").is_file():
        timing_model(out, size=size, device=device, dtype=dtype)
    return out


def model_args(ap: argparse.ArgumentParser, name: str) -> None:
    """The options every in-process benchmark shares: which model, where, in what dtype, and
    where its JSON goes (the GPU script, benchmarks/gpu.sh, runs them with other values)."""
    ap.add_argument("--size", default="125m", help="timing-model size (prepos.lab.tiny."
                    "TIMING_SIZES), built in results/ if missing")
    ap.add_argument("--model-dir", type=Path, help="a local model instead of a timing model")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--backend", default="torch", choices=["torch", "llama.cpp"],
                    help="the in-process back end (llama.cpp: the model exported to GGUF)")
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json")


def model_dir(args: argparse.Namespace) -> Path:
    return args.model_dir or timing_model_dir(args.size, args.device, args.dtype)


def model_label(args: argparse.Namespace) -> str:
    if args.model_dir:
        return str(args.model_dir)
    return (f"timing model {args.size} (seeded RANDOM weights, Llama), {args.dtype} on "
            f"{args.device}")


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict:
    out = {"platform": platform.platform(), "processor": platform.processor(),
           "cpu_model": cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           # the machine is shared: what else was running when this benchmark started
           "loadavg_1m_at_start": LOAD_AT_START}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def write(name: str | Path, payload: dict) -> Path:
    """results/<name>.json, or the path given."""
    path = name if isinstance(name, Path) else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def metric_samples(text: str, keep: tuple[str, ...] = ()) -> dict[str, float]:
    """Prometheus exposition text as {'name{label="value",...}': value} (prometheus-client's
    parser), histograms' buckets and `_created` samples left out; with `keep`, only the
    samples whose name starts with one of its prefixes."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith(("_bucket", "_created")) or (keep and not name.startswith(keep)):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{name}{{{labels}}}" if labels else name] = float(sample.value)
    return out


def percentile(ordered: list[float], p: float) -> float:
    """The nearest-rank percentile of sorted values (nan for none)."""
    n = len(ordered)
    return ordered[min(n - 1, round(p / 100 * (n - 1)))] if n else float("nan")


TICK = os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """The machine's CPU seconds so far, all CPUs: busy (user, nice, system, irq, softirq)
    and stolen (the hypervisor ran something else on a virtual CPU), from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / TICK, v[7] / TICK


def process_cpu(pid: int) -> float:
    """A process's CPU seconds so far, all its threads (/proc/<pid>/stat utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class CpuShare:
    """Where the machine's CPU went while a case ran, summed over its windows: the server
    under test, this benchmark (its clients and load), everything else (`outside`: other
    processes, the kernel's threads) and the hypervisor's steal. Both servers compute on
    every core, so CPU taken outside stretches their steps: a run a neighbour disturbed
    shows it here, arm by arm."""

    def __init__(self) -> None:
        self.wall = self.server = self.outside = self.steal = 0.0

    @contextlib.contextmanager
    def window(self, *pids: int):
        """Count the time inside; `pids`: the servers' processes."""
        def servers() -> float:
            return sum(process_cpu(p) for p in pids)
        t0, (busy0, steal0), srv0 = time.perf_counter(), machine_cpu(), servers()
        own0 = sum(os.times()[:2])
        try:
            yield
        finally:
            busy1, steal1 = machine_cpu()
            server, own = servers() - srv0, sum(os.times()[:2]) - own0
            self.wall += time.perf_counter() - t0
            self.server += server
            self.outside += max(0.0, busy1 - busy0 - server - own)
            self.steal += steal1 - steal0

    def summary(self) -> dict:
        def pct(s: float) -> float:
            return round(100 * s / self.wall, 2)
        return {"server_cpu_pct": pct(self.server), "outside_cpu_pct": pct(self.outside),
                "steal_pct": pct(self.steal)}


def turn_gaps(streams: list[dict], per: int) -> list[list[float]]:
    """An arm's gaps by turn (`per` streams a turn, in the order they ran)."""
    return [[g for s in streams[i:i + per] for g in s["gaps"]]
            for i in range(0, len(streams), per)]


def intervals(ours: list[dict], theirs: list[dict], per: int, draws: int = 1000) -> dict:
    """95% bootstrap intervals of the pooled gap ratios: the run's turns drawn again with
    replacement (a turn's streams on both arms kept together, as they ran side by side in
    time), the ratios computed on each draw as on the run, their 2.5th and 97.5th
    percentiles. How far the run's figures could have moved with its turns alone: a bound
    inside a figure's interval is one this run cannot tell it meets. Seeded: the same
    streams give the same intervals."""
    a, b = turn_gaps(ours, per), turn_gaps(theirs, per)
    n = min(len(a), len(b))
    if n < 2:
        return {}
    rng = random.Random(0)
    drawn: dict[str, list[float]] = {"gap_p50_ratio": [], "gap_p99_ratio": [],
                                     "mean_gap_ratio": []}
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        x = sorted(g for i in pick for g in a[i])
        y = sorted(g for i in pick for g in b[i])
        drawn["gap_p50_ratio"].append(percentile(x, 50) / percentile(y, 50))
        drawn["gap_p99_ratio"].append(percentile(x, 99) / percentile(y, 99))
        drawn["mean_gap_ratio"].append(statistics.fmean(x) / statistics.fmean(y))
    out = {}
    for k, v in drawn.items():
        v.sort()
        out[k] = [round(percentile(v, 2.5), 3), round(percentile(v, 97.5), 3)]
    return {"ratio_ci95": out}


def read_chat_stream(r, url: str, times: list[float]) -> tuple[dict | None, dict | None]:
    """A streamed chat completion read to its end (`r`, an httpx streaming response): the
    client's clock at each chunk with content appended to `times`; the usage and the last
    chunk. A status other than 200 raises, naming `url`."""
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
    usage = last = None
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
            times.append(time.perf_counter())
        usage = chunk.get("usage") or usage
        last = chunk
    return usage, last


def together(n: int, work: Callable[[int, threading.Barrier], None], what: str,
             timeout: float = 300) -> float:
    """`work(i, barrier)` on n threads that each wait at `barrier` before their requests, so
    all start together; returns that start (perf_counter). One that fails breaks the barrier
    for the rest; the first failure that is not a broken barrier is raised, naming `what`."""
    start: list[float] = []
    failed: list[BaseException] = []
    barrier = threading.Barrier(n, action=lambda: start.append(time.perf_counter()),
                                timeout=timeout)

    def run(i: int) -> None:
        try:
            work(i, barrier)
        except BaseException as exc:  # the others then leave the barrier (broken) too
            failed.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)),
                 failed[0] if failed else None)
    if first is not None:
        raise RuntimeError(f"{what} failed: {first!r}") from first
    return start[0]

