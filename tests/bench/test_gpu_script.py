"""benchmarks/gpu.sh, the GPU run, exercised end to end on the CPU with the CPU-sized "test"
timing model: every step runs, writes its JSON, and the summary table has no hole. (Its
numbers mean nothing here; the point is that the script works on a GPU host.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_script_runs_on_cpu(tmp_path):
    env = dict(os.environ, SIZES="test", DEVICE="cpu", DTYPE="float32", SAMPLES="4",
               GPU_OUT=str(tmp_path / "gpu"), PREPOS_RESULTS=str(tmp_path / "results"),
               PYTHON=sys.executable)
    run = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "gpu" / "test"
    for name in ("prefill", "engine_paths", "http_ttft", "energy"):
        data = json.loads((out / f"{name}.json").read_text())
        assert "float32 on cpu" in data["model"], data["model"]
    http = json.loads((out / "http_ttft.json").read_text())["ttft"]
    assert http["wrong_path"] == 0
    assert all(http["json"]["client"][p]["n"] == 4 for p in ("fast", "cold", "peer"))
    energy = json.loads((out / "energy.json").read_text())
    # no NVML on a CPU run: RAPL where readable, else an estimate labelled as one
    assert energy["estimate"] == energy["source"].startswith("ESTIMATE"), energy["source"]
    summary = (tmp_path / "gpu" / "summary.md").read_text()
    assert "| test |" in summary.splitlines()[0]
    assert "not run" not in summary and "incomplete" not in summary, summary
