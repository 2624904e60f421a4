"""Sum-reduced next-token cross-entropy: the loss the accounting divides once.

A recipe shifts the labels once with :func:`shift_labels`, counts the
trainable tokens of that *same* tensor (:func:`torchtune_ext.accounting.count_trainable_tokens`)
and feeds it to :class:`SummedCrossEntropyLoss`. Because the loss is a sum
over exactly the positions that were counted, ``loss_sum / num_tokens`` is the
mean over every trainable token of the optimizer step, however the step is
split into micro-batches or ranks.
"""

from typing import List, Union

import torch
import torch.nn.functional as F
from torch import nn

CROSS_ENTROPY_IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> torch.Tensor:
    """Align labels with the logits that predict them.

    Position ``i`` of a causal LM predicts token ``i + 1``, so the label of
    position ``i`` is ``labels[:, i + 1]``; the last position predicts nothing
    and gets ``ignore_index``.

    Args:
        labels (torch.Tensor): ``[batch, seq_len]`` integer labels as produced by
            torchtune's datasets and collators (masked prompt and padding
            positions hold ``ignore_index``).
        ignore_index (int): label value excluded from the loss.

    Returns:
        torch.Tensor: ``[batch, seq_len]`` shifted labels, same dtype and device.

    Raises:
        ValueError: if ``labels`` is not 2-D.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq_len], got shape {tuple(labels.shape)}")
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


class SummedCrossEntropyLoss(nn.Module):
    """Cross-entropy summed (not averaged) over all non-ignored positions.

    Supports the chunked output of torchtune's ``TransformerDecoder``
    (``model.set_num_output_chunks(n)`` returns a list of ``n`` logits chunks
    split along the sequence): each chunk is upcast to fp32 on its own, so the
    full ``[batch, seq_len, vocab]`` fp32 tensor never exists at once.

    Args:
        num_output_chunks (int): number of sequence chunks the model should
            produce; the recipe passes it to ``model.set_num_output_chunks``.
            1 means the model returns a single logits tensor.
        ignore_index (int): label value excluded from the loss and the count.

    Shapes:
        logits: ``[batch, seq_len, vocab]`` or a list of chunks
        ``[batch, seq_len_i, vocab]`` whose lengths add up to ``seq_len``.
        shifted_labels: ``[batch, seq_len]`` from :func:`shift_labels`.
        output: scalar fp32 tensor, the sum of per-token losses in nats.
        With no trainable position the output is exactly 0 (never NaN).
    """

    def __init__(self, num_output_chunks: int = 8, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX):
        super().__init__()
        if num_output_chunks < 1:
            raise ValueError(f"num_output_chunks must be >= 1, got {num_output_chunks}")
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index

    def _chunk_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )

    def compile_chunk(self) -> None:
        """Compile the per-chunk loss with ``torch.compile`` (used by ``compile: true``)."""
        self._chunk_sum = torch.compile(self._chunk_sum)

    def forward(
        self, logits: Union[torch.Tensor, List[torch.Tensor]], shifted_labels: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(logits, torch.Tensor):
            logits = [logits]
        lengths = [chunk.size(1) for chunk in logits]
        if sum(lengths) != shifted_labels.size(1):
            raise ValueError(
                f"logits cover {sum(lengths)} positions but labels have {shifted_labels.size(1)}"
            )
        label_chunks = shifted_labels.split(lengths, dim=1)
        total = torch.zeros((), dtype=torch.float32, device=shifted_labels.device)
        for chunk, labels in zip(logits, label_chunks):
            total = total + self._chunk_sum(chunk, labels)
        return total


def build_loss(cfg_loss, compile: bool = False) -> SummedCrossEntropyLoss:
    """Instantiate the recipe's ``loss`` config and check it is sum-reduced.

    Args:
        cfg_loss: the ``loss`` config node (``_component_`` plus arguments).
        compile (bool): compile the per-chunk loss (the recipe's ``compile`` key).

    Raises:
        ConfigError: (key ``loss``) if it is not a :class:`SummedCrossEntropyLoss`:
            a mean-reduced loss cannot be normalized exactly across micro-batches.
    """
    from torchtune import config as tt_config

    from torchtune_ext.config import ConfigError

    loss_fn = tt_config.instantiate(cfg_loss)
    if not isinstance(loss_fn, SummedCrossEntropyLoss):
        raise ConfigError(
            "loss", "must be torchtune_ext.loss.SummedCrossEntropyLoss (sum-reduced); "
            "a mean-reduced loss cannot be normalized exactly across micro-batches"
        )
    if compile:
        loss_fn.compile_chunk()
    return loss_fn
