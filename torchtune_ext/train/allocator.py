"""The CPU allocator: keep the memory tensors free for the next step, and say how much is held that way.

On CPU with glibc, :func:`keep_freed_cpu_memory` stops the allocator from
returning freed memory to the kernel (and faulting it in again every step);
:func:`allocator_free_bytes` is what it then holds free, which the memory
guard (:mod:`torchtune_ext.train.memory`) counts as available to the process.
"""

import ctypes
import functools
import os
import platform
from typing import Optional

import torch

# glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

@functools.lru_cache(maxsize=None)
def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None

_kept = False  # set once keep_freed_cpu_memory has applied the settings in this process

def keep_freed_cpu_memory(device: torch.device) -> bool:
    """On CPU with glibc, keep the memory that tensors free for the next tensors of the process.

    Why: glibc's malloc gives large blocks (from 128 KiB, adaptively up to
    32 MiB, and always above) pages fresh from the kernel (``mmap``) and
    hands them back when they are freed, and it returns the free top of its
    heap to the kernel too. Activations and gradients are such blocks, so
    every step faults in and zero-fills its memory again: SmolLM2-135M at
    batch 1 x 4 accumulation steps x 256 tokens, fp32, 2 threads, took
    about 300,000 minor page faults and 1 s of system CPU time per step
    (``getrusage``). With ``mmap`` off (``M_MMAP_MAX`` 0) and the heap not
    trimmed (``M_TRIM_THRESHOLD`` at its maximum, 2 GiB of free top), a step
    reuses the pages of the one before: from the third step on, a few dozen
    faults per step. Numbers are unchanged (only where tensors live).

    The cost: the process's resident memory stays at its high-water mark
    (plus fragmentation: peak RSS +5% and +12% in two runs, flat over 25 steps) instead of shrinking
    between steps; :func:`allocator_free_bytes` reports the free part, which
    :func:`torchtune_ext.train.memory.available_memory_bytes` counts as available
    to this process.

    Memory freed after a checkpoint save or an evaluation stays with the
    process too (later steps reuse it), and on CPU ``peak_memory_gib`` (the
    process's peak RSS) includes what is kept. :func:`allocator_free_bytes`
    counts free chunks wherever they lie, so fragmented holes count as
    available; CPU plans with 70% of the available memory
    (:data:`torchtune_ext.train.memory.HEADROOM`).

    Not applied on other devices (the host memory is not the step's), off
    Linux/glibc or before glibc 2.33 (no ``mallinfo2``), or when the user
    configured the allocator: ``GLIBC_TUNABLES`` naming ``glibc.malloc``, any
    ``MALLOC_*`` variable, or an ``LD_PRELOAD`` (jemalloc, tcmalloc). To keep glibc's defaults, start the
    run with ``GLIBC_TUNABLES=glibc.malloc.check=0`` (a tunable at its default).

    Args:
        device: where the run trains.

    Returns:
        True if the allocator now keeps freed memory (also when already set
        by an earlier call in this process).
    """
    global _kept
    if device.type != "cpu":
        return False
    if _kept:
        return True
    # The user's allocator settings win: glibc tunables, glibc's MALLOC_* variables, a preloaded allocator.
    if ("glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or os.environ.get("LD_PRELOAD")
            or any(name.startswith("MALLOC_") for name in os.environ)):
        return False
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return False  # before glibc 2.33 the memory guard could not see what is kept
    # mallopt returns 1 on success; the trim threshold is an int in this interface
    _kept = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _kept

def allocator_free_bytes() -> int:
    """Bytes that glibc's allocator holds free for this process (``mallinfo2().fordblks``); 0 if unknown.

    Memory this process can reuse without asking the kernel; the kernel's
    ``MemAvailable`` does not include it. Only counted once
    :func:`keep_freed_cpu_memory` has applied its settings (otherwise glibc
    returns large free blocks to the kernel by itself).
    """
    if not _kept:
        return 0
    mallinfo2 = _glibc().mallinfo2  # present: keep_freed_cpu_memory checked
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)
