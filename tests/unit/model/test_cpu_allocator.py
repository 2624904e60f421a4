"""keep_freed_cpu_memory: freed memory counts as available.

The setting itself is process-wide, so its cases run each in a fresh process: tests/integration/test_cpu_allocator.py.
"""


import pytest
import torch

from torchtune_ext.train import memory


def test_freed_memory_counts_as_available(monkeypatch):
    """What the allocator holds free is this process's to reuse: the memory guard counts it, as CUDA's cache."""
    monkeypatch.setattr(memory, "allocator_free_bytes", lambda: 0)
    without = memory.available_memory_bytes(torch.device("cpu"))
    monkeypatch.setattr(memory, "allocator_free_bytes", lambda: 3 * 2**30)
    assert memory.available_memory_bytes(torch.device("cpu")) == pytest.approx(without + 3 * 2**30, rel=0.01)
