"""Shared benchmark helpers: percentiles, the timing model, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
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

