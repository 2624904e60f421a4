"""keep_freed_cpu_memory: freed tensor memory is reused instead of faulted in again; the user's allocator settings win.

The setting is process-wide, so every case runs in a fresh Python process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.helpers import REPO_ROOT
from torchtune_ext.train import allocator as runtime

pytestmark = pytest.mark.skipif(runtime._glibc() is None, reason="glibc's allocator only")

# Allocate, fill and free a 64 MiB tensor (above glibc's largest adaptive mmap threshold, 32 MiB) 14
# times, then print the minor page faults of the last four rounds, whether the setting was applied, and
# what the allocator holds free afterwards.
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from torchtune_ext.train import allocator as runtime
    applied = runtime.keep_freed_cpu_memory(torch.device(sys.argv[1]))
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):  # the heap grows over the first rounds (by up to 7 in tries), faulting in any case
        torch.ones(16 * 2**20)
    start = faults()
    for _ in range(4):
        torch.ones(16 * 2**20)
    print(applied, faults() - start, runtime.allocator_free_bytes())
""")


def probe(device="cpu", **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    full_env.update(env, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE, device], env=full_env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


def test_freed_memory_is_reused_without_page_faults():
    applied, faults, free = probe()
    assert applied
    assert faults < 1000  # four rounds of 16,384 pages each, served from the heap's pages
    assert free >= 64 * 2**20  # the last tensor's memory, held for the next one


def test_without_it_every_large_tensor_is_faulted_in_again():
    """The baseline the setting removes: glibc maps 64 MiB afresh (16,384 pages) on every allocation."""
    applied, faults, free = probe(GLIBC_TUNABLES="glibc.malloc.check=0")  # the user configured malloc: left alone
    assert not applied and free == 0
    assert faults >= 4 * 16_000


@pytest.mark.parametrize("env", [{"LD_PRELOAD": "libjemalloc.so.2"}, {"MALLOC_ARENA_MAX": "2"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}],
                         ids=["preloaded-allocator", "malloc-env", "tunables"])
def test_the_users_allocator_settings_win(env):
    if "LD_PRELOAD" in env:  # a library that does not exist: the loader warns and goes on
        env = {"LD_PRELOAD": "/nonexistent/libjemalloc.so.2"}
    assert not probe(**env)[0]


def test_not_applied_on_other_devices():
    assert not probe("meta")[0]
