"""Token accounting for one optimizer step.

The step loss is

    loss = (sum over dp ranks r, micro-batches m, positions t of ce[r, m, t])
           / (number of those positions whose shifted label != ignore_index)

i.e. the mean next-token cross-entropy over every trainable token of the
step. It does not depend on how the step's samples are split into
micro-batches, gradient accumulation steps or data-parallel ranks, which is
the property the recipes promise. A mean of per-micro-batch means is not this
quantity: with one 10-token sample at mean 0.1 and one 100-token sample at
mean 0.9, the step loss is (0.1 * 10 + 0.9 * 100) / 110 = 0.82727, while the
mean of means is 0.5.
"""

from typing import Optional

import torch
import torch.distributed as dist

from torchtune_ext.loss import CROSS_ENTROPY_IGNORE_INDEX


def count_trainable_tokens(
    shifted_labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX
) -> int:
    """Number of positions the sum-reduced loss sums over.

    Args:
        shifted_labels (torch.Tensor): labels *after* the next-token shift
            (:func:`torchtune_ext.loss.shift_labels`), any shape.
        ignore_index (int): label value excluded from the loss.

    Returns:
        int: count of entries different from ``ignore_index``.
    """
    return int((shifted_labels != ignore_index).sum().item())


def dp_is_active(group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def global_sum(value: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum a tensor over the data-parallel ranks (identity on one rank).

    Args:
        value (torch.Tensor): tensor on the device the process group works
            with (CPU for gloo, CUDA for nccl). Not modified.
        group (ProcessGroup, optional): data-parallel group; default group if None.

    Returns:
        torch.Tensor: a new tensor holding the element-wise sum over ranks.
    """
    total = value.detach().clone()
    if dp_is_active(group):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total
