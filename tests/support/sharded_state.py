"""A small trained model and optimizer for the sharded-checkpoint tests, in one process or on every torchrun rank.

Used by tests/unit/checkpoint/test_sharded_checkpoint.py, by the process that
tests/integration/distributed/test_sharded_checkpoint.py kills during a save, and by
its torchrun worker (tests/support/sharded_failure_worker.py).
"""

import torch
from torchtune.models.llama3_2 import llama3_2

from torchtune_ext.checkpoint import Progress


def llama(layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A random llama3_2 decoder of width 32 (vocabulary 64), seeded."""
    torch.manual_seed(seed)
    return llama3_2(vocab_size=64, num_layers=layers, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                    intermediate_dim=64)


def trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with moments after two steps (so that the optimizer state is not its initial one)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randint(0, 64, (2, 8))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def progress(step: int) -> Progress:
    """The progress of a run after optimizer step ``step``."""
    out = Progress()
    out.step = step
    return out
