"""Peak memory of each optimizer step: CUDA's allocator counter, or on CPU the resident set size, sampled.

The kernel's lifetime peak (VmHWM), which ``/usr/bin/time`` and job
schedulers report, is never reset: a step's window is measured beside it
(:class:`RssSampler`).
"""

import os
import resource
import threading
import time
from typing import Optional

import torch

GIB = 1024**3


class RssSampler:
    """Peak resident set size of this process within a window, without resetting the kernel's peak.

    The kernel keeps one lifetime peak per process (VmHWM), which outside
    tools such as ``/usr/bin/time`` and job schedulers report; resetting it
    (``/proc/self/clear_refs``) would make them see only the last window. So
    the window's peak is measured here instead:

    * if VmHWM rose during the window, the new lifetime peak was reached in
      it, and it is exactly the window's peak;
    * otherwise the window stayed below an earlier peak, and a daemon thread
      sampling the current RSS (``/proc/self/statm``) every ``interval``
      seconds gives it (a spike shorter than the interval can be missed).

    Reading two small /proc files costs microseconds; the thread only starts
    at the first :meth:`reset`.
    """

    def __init__(self, interval: float = 0.005):
        self._interval = interval
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._hwm_at_reset: Optional[int] = None  # None: never reset, the window is the process's lifetime
        self._window_max = 0

    def reset(self) -> None:
        with self._lock:
            self._hwm_at_reset = lifetime_peak_rss_bytes()
            self._window_max = _read_rss_bytes()
        if self._thread is None and self._hwm_at_reset is not None:
            self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            rss = _read_rss_bytes()
            with self._lock:
                self._window_max = max(self._window_max, rss)
            time.sleep(self._interval)

    def peak_bytes(self) -> int:
        hwm = lifetime_peak_rss_bytes()
        if hwm is None:  # not Linux: the lifetime peak is all there is
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with self._lock:
            if self._hwm_at_reset is None or hwm > self._hwm_at_reset:
                return hwm
            self._window_max = max(self._window_max, _read_rss_bytes())
            return self._window_max


def lifetime_peak_rss_bytes() -> Optional[int]:
    """The process's lifetime peak resident set size (Linux VmHWM) in bytes, or None where /proc is unavailable.

    What ``/usr/bin/time`` and schedulers report, unless something clears it.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _read_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except OSError:
        return 0


_cpu_peak = RssSampler()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (see :func:`peak_memory_gib`).

    On CPU nothing outside this process is disturbed: the kernel's lifetime
    peak, which ``/usr/bin/time`` reports, is never reset. Benchmarks that
    want the peak since start-up replace this function with a no-op.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    _cpu_peak.reset()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory since the last :func:`reset_peak_memory` (or since start-up), in GiB.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only, not the caching
    allocator's reserve). CPU: the process's peak resident set size in the
    window (:class:`RssSampler`: exact when the window set a new lifetime
    peak, else sampled every 5 ms); the lifetime peak where /proc is
    unavailable.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return _cpu_peak.peak_bytes() / GIB
