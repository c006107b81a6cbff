"""HW-6: energy per pre-position and idle versus busy power.

On a GPU (`--device cuda`) reads the GPU's NVML energy counter (the GPU board alone); on the
CPU, RAPL package counters (/sys/class/powercap/intel-rapl*) where the machine exposes them.
Where neither is readable (this CPU machine has no powercap at all), it ESTIMATES energy from
the CPU time the pre-positions use and a stated power per busy core, and labels every such
number as an estimate. Idle power: the same counter over 2 s with nothing running. Timing
model (seeded RANDOM weights), 512-token state, one pre-position (Algorithm 1: header + query
prefix) per update. JSON last line.

    python benchmarks/energy.py [--rounds 32] [--watts-per-core 12] [--idle-watts 20]
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import machine, model_args, model_dir, model_label, summarize, write  # noqa: E402
from prepos.config import EngineConfig  # noqa: E402
from prepos.engine import Engine  # noqa: E402


def rapl_reader():
    """A function returning joules so far, or None where RAPL is not readable."""
    files = [f for f in glob.glob("/sys/class/powercap/intel-rapl:*/energy_uj")
             if f.count(":") == 1]
    try:
        for f in files:
            int(Path(f).read_text())
    except OSError:
        return None
    if not files:
        return None
    return lambda: sum(int(Path(f).read_text()) for f in files) / 1e6


def nvml_reader():
    """A function returning the GPU's joules so far (NVML, Volta or newer), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:  # no package, no driver, or a GPU without the counter
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--watts-per-core", type=float, default=12.0,
                    help="stated power of one busy core, for the estimate")
    ap.add_argument("--idle-watts", type=float, default=20.0,
                    help="stated package power at idle, for the estimate")
    model_args(ap, "energy")
    args = ap.parse_args(argv)
    eng = Engine.from_pretrained(model_dir(args), EngineConfig(device=args.device,
                                                              dtype=args.dtype,
                                                              backend=args.backend))
    sid = eng.create_session("streaming", system="You read market data.")
    i = 0
    while len(eng.session(sid).snap.tokens) < 512:
        eng.append(sid, f"AAPL {100 + i % 7}.25 {101 + i % 5}.75 {99 + i % 3}.5", wait=False)
        i += 1
    eng.wait_idle()
    gpu = args.device.startswith("cuda")
    joules_so_far = nvml_reader() if gpu else rapl_reader()  # None: not readable
    cpu, wall, joules = [], [], []
    for r in range(args.rounds):
        eng.append(sid, f"MSFT {r} {200 + r}.5")  # committed and ingested (foreground)
        c0, w0 = time.process_time(), time.perf_counter()
        e0 = joules_so_far() if joules_so_far else None
        eng.wait_idle()  # the pre-position, alone on the machine's worker
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        if joules_so_far:
            joules.append(joules_so_far() - e0)
    c0, w0 = time.process_time(), time.perf_counter()
    e0 = joules_so_far() if joules_so_far else None
    time.sleep(2.0)
    idle_s = time.perf_counter() - w0
    idle_cpu = (time.process_time() - c0) / idle_s
    idle_measured = (joules_so_far() - e0) / idle_s if joules_so_far else None
    eng.close()
    cpu_s = summarize(cpu)["p50_ms"] / 1e3
    wall_s = summarize(wall)["p50_ms"] / 1e3
    if joules_so_far:
        source = ("measured: NVML GPU energy counter (the GPU board only)" if gpu
                  else "measured: RAPL package energy counters")
        e_pp = sorted(joules)[len(joules) // 2]
        busy_w = e_pp / wall_s
        idle_w = idle_measured
    else:
        source = (f"ESTIMATE: no RAPL readable; CPU time x {args.watts_per_core} W per "
                  f"busy core (stated), idle {args.idle_watts} W (stated)")
        e_pp = cpu_s * args.watts_per_core
        busy_w = args.idle_watts + (cpu_s / wall_s) * args.watts_per_core
        idle_w = args.idle_watts + idle_cpu * args.watts_per_core
    summary = {"benchmark": "energy", "source": source, "estimate": not joules_so_far,
               "model": f"{model_label(args)}, 512-token state",
               "rounds": args.rounds, "machine": machine(),
               "preposition_wall": summarize(wall), "preposition_cpu": summarize(cpu),
               "energy_per_preposition_j": e_pp, "busy_power_w": busy_w,
               "idle_power_w": idle_w, "cores_busy_during_preposition": cpu_s / wall_s}
    write(args.out, summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
