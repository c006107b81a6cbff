"""benchmarks/token_cadence.py's `CpuShare`: where the machine's CPU went while a case ran.
A child that burns a known amount of CPU inside the window is counted as the server's, and
nothing is counted twice (no timing: CPU seconds the child reports itself)."""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from token_cadence import CpuShare, machine_cpu, process_cpu  # noqa: E402

BURN = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
t0 = time.process_time()
while time.process_time() - t0 < 0.3:
    pass
print(time.process_time() - t0, flush=True)
sys.stdin.readline()
"""


def test_a_servers_cpu_is_counted_as_its_own():
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        share = CpuShare()
        with share.window(child.pid):
            child.stdin.write("go\n")
            child.stdin.flush()
            burnt = float(child.stdout.readline())
        tick = 0.02  # /proc counts in clock ticks
        assert share.server >= burnt - tick
        assert share.outside >= 0 and share.steal >= 0 and share.wall > 0
        row = share.summary()
        assert set(row) == {"server_cpu_pct", "outside_cpu_pct", "steal_pct"}
        assert row["server_cpu_pct"] > 0
    finally:
        child.kill()
        child.wait()


def test_the_machine_and_a_process_count_up():
    busy, steal = machine_cpu()
    assert busy > 0 and steal >= 0
    assert process_cpu(os.getpid()) > 0
