"""`CpuShare` (benchmarks/common.py): where the machine's CPU went while a case ran.
A child that burns a known amount of CPU inside the window is counted as the server's, and
the CPU the benchmark's own process burns meanwhile is not (no timing: CPU seconds the
processes report themselves)."""

import subprocess
import sys
import time

from benchmarks.common import CpuShare

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
            own = time.process_time()
            while time.process_time() - own < 0.3:  # the benchmark's own CPU: not the server's
                pass
        tick = 0.02  # /proc counts in clock ticks
        assert burnt - tick <= share.server < burnt + 0.2
        row = share.summary()
        assert set(row) == {"server_cpu_pct", "outside_cpu_pct", "steal_pct"}
        assert row["server_cpu_pct"] > 0
    finally:
        child.kill()
        child.wait()
