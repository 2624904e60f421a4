"""Token accounting: count, sum, reduce over ranks once, divide once.

Every number the recipes report per token -- the training loss, the
validation loss, token accuracy, entropy -- is

    value = (sum over dp ranks r, micro-batches m, positions t of x[r, m, t])
            / (number of those positions whose shifted label != ignore_index)

i.e. the mean over every trainable token of an optimizer step (training) or
of a whole evaluation pass. It does not depend on how the samples are split
into micro-batches, gradient accumulation steps or data-parallel ranks, which
is the property the recipes promise. A mean of per-micro-batch means is not
this quantity: with one 10-token sample at mean 0.1 and one 100-token sample
at mean 0.9, the step loss is (0.1 * 10 + 0.9 * 100) / 110 = 0.82727, while the
mean of means is 0.5.

:class:`TokenTally` is the one implementation, used by the training step
(:mod:`torchtune_ext.train.step`) and the evaluation loop
(:mod:`torchtune_ext.run.evaluate`) alike, for any loss that returns
:class:`torchtune_ext.train.loss.TokenSums`.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from torchtune_ext import ranks
from torchtune_ext.train.loss import CROSS_ENTROPY_IGNORE_INDEX, TokenSums


def count_trainable_tokens(
    shifted_labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX
) -> int:
    """Number of positions a sum-reduced loss sums over.

    Args:
        shifted_labels (torch.Tensor): labels *after* the next-token shift
            (:func:`torchtune_ext.train.loss.shift_labels`), any shape.
        ignore_index (int): label value excluded from the loss.

    Returns:
        int: count of entries different from ``ignore_index``.
    """
    return int((shifted_labels != ignore_index).sum().item())


def dp_is_active(group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when a process group with more than one rank is initialised."""
    return ranks.several_processes(group)


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


@dataclass
class TokenTotals:
    """Global totals of a :class:`TokenTally` (all micro-batches, all ranks).

    Attributes:
        num_tokens (int): trainable tokens, all ranks.
        local_num_tokens (int): trainable tokens on this rank.
        sums (dict): ``"loss"`` and every metric name -> global sum (float,
            nats for the loss).
        once_per_step (bool | None): set by the training step
            (:func:`torchtune_ext.train.step.forward_backward`): True if the step's
            gradient came from one backward, False if from one per
            micro-batch; None elsewhere (evaluation, a step with no token).
    """

    num_tokens: int
    local_num_tokens: int
    sums: Dict[str, float] = field(default_factory=dict)
    once_per_step: Optional[bool] = None

    def mean(self, name: str) -> Optional[float]:
        """``sums[name] / num_tokens``; None when there is no trainable token (never 0 or NaN)."""
        if self.num_tokens == 0:
            return None
        return self.sums[name] / self.num_tokens

    def means(self) -> Dict[str, float]:
        """Every sum divided by the token count; empty when there is no trainable token."""
        if self.num_tokens == 0:
            return {}
        return {name: value / self.num_tokens for name, value in self.sums.items()}


class TokenTally:
    """Running token count and sums of one optimizer step or one evaluation pass.

    Count each micro-batch with :meth:`count` from the same shifted labels
    that go to the loss, add the loss's sums with :meth:`add`, and reduce
    over ranks with :meth:`totals` (one all-reduce of a small float64
    vector). Sums are accumulated in float64 so that the result does not
    depend on how many micro-batches they came in, beyond fp32 rounding of
    each micro-batch's own sum.

    Args:
        metric_names: the metric sums the loss returns besides ``loss``
            (``loss_fn.metric_names``); every rank must pass the same names.
        device: where the sums live (the process group's device).
        ignore_index (int): label value that is not a trainable token.
    """

    def __init__(self, metric_names: Sequence[str], device: torch.device,
                 ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX):
        self.names = ("loss", *metric_names)
        self.ignore_index = ignore_index
        self.local_num_tokens = 0
        self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)

    def count(self, shifted_labels: torch.Tensor) -> int:
        """Add a micro-batch's trainable tokens; returns that micro-batch's count."""
        return self.add_count(count_trainable_tokens(shifted_labels, self.ignore_index))

    def add_count(self, n: int) -> int:
        """Add ``n`` units counted by an objective (:attr:`torchtune_ext.train.objective.Prepared.count`);
        returns ``n``."""
        self.local_num_tokens += int(n)
        return int(n)

    def add(self, sums: TokenSums) -> None:
        """Add a micro-batch's sums (detached; the graph is not kept)."""
        values = [sums.loss.detach()] + [sums.metrics[name].detach() for name in self.names[1:]]
        self._sums += torch.stack([v.to(self._sums.device, torch.float64) for v in values])

    def global_num_tokens(self, group: Optional[dist.ProcessGroup] = None) -> int:
        """The token count summed over ranks (one scalar all-reduce)."""
        local = torch.tensor(self.local_num_tokens, dtype=torch.int64, device=self._sums.device)
        return int(global_sum(local, group).item())

    def totals(self, group: Optional[dist.ProcessGroup] = None) -> TokenTotals:
        """Count and sums over all ranks, in one all-reduce of ``[count, sums...]``."""
        local = torch.cat([torch.tensor([float(self.local_num_tokens)], dtype=torch.float64,
                                        device=self._sums.device), self._sums])
        total = global_sum(local, group).tolist()
        return TokenTotals(num_tokens=int(round(total[0])), local_num_tokens=self.local_num_tokens,
                           sums=dict(zip(self.names, total[1:])))
