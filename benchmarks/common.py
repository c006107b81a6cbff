"""Shared benchmark helpers: percentiles, the timing model, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def summarize(samples_s: list[float]) -> dict:
    xs = sorted(samples_s)
    n = len(xs)

    def pct(p: float) -> float:
        return xs[min(n - 1, max(0, round(p / 100 * (n - 1))))] * 1e3

    return {"n": n, "p50_ms": pct(50), "p99_ms": pct(99), "mean_ms": statistics.fmean(xs) * 1e3,
            "min_ms": xs[0] * 1e3}


def timing_model_dir() -> Path:
    """DESIGN.md's timing model (seeded random weights), built once and cached."""
    from prepos.tiny import timing_model

    out = RESULTS / "timing-model"
    if not (out / "config.json").is_file():
        timing_model(out)
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
