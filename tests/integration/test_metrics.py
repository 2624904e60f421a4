"""Peak memory as a fresh process sees it: each window follows its allocations; the kernel's peak is never reset.

Step records, the logger and W&B: tests/unit/run/test_metrics.py.
"""

import subprocess
import sys

PEAK_PROBE = """
import time
import torch
from torchtune_ext.run.metrics import peak_memory_gib, reset_peak_memory
cpu = torch.device("cpu")
GIB = 1024 ** 3

def lifetime_peak_gib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 / GIB for l in f if l.startswith("VmHWM:"))

# 1. A window that sets a new lifetime peak: the probe follows the allocation.
reset_peak_memory(cpu)
before = peak_memory_gib(cpu)
block = torch.ones(256 * 1024 * 1024 // 4)  # 256 MiB, touched
print("new_peak", peak_memory_gib(cpu) - before)
del block

# 2. What outside tools (/usr/bin/time, schedulers) read is not reset by a new window.
lifetime = lifetime_peak_gib()
reset_peak_memory(cpu)
print("lifetime_kept", lifetime_peak_gib() - lifetime)

# 3. A window below the lifetime peak: a block held for 50 ms and freed
#    before the window is read still shows (sampled).
reset_peak_memory(cpu)
base = peak_memory_gib(cpu)
block = torch.ones(128 * 1024 * 1024 // 4)  # 128 MiB, below the 256 MiB peak
time.sleep(0.05)
del block
print("below_peak", peak_memory_gib(cpu) - base, lifetime_peak_gib() - lifetime)
"""


def test_peak_memory_follows_each_window_without_resetting_the_kernel_peak():
    # In a fresh process: in the test process, memory freed by earlier tests may
    # still be resident and be reused, so a new block need not raise the peak.
    proc = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in proc.stdout.splitlines()}
    assert out["new_peak"][0] > 0.2
    assert out["lifetime_kept"][0] >= 0  # the kernel's VmHWM was not cleared
    window_rise, lifetime_rise = out["below_peak"]
    assert lifetime_rise <= 0.01 and 0.1 < window_rise < 0.2
