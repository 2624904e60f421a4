"""Sum-reduced next-token losses: the component the accounting divides once.

Two pieces live here:

* :func:`shift_labels`, the one place where labels are aligned with the
  logits that predict them. Inside a packed sequence it never lets the last
  position of one document predict the first token of the next.
* :class:`SummedCrossEntropyLoss`, which returns *sums* over the trainable
  positions of a micro-batch (:class:`TokenSums`): the cross-entropy (with
  gradient) and, without a second pass over the model, the token metrics
  (correct argmax predictions, entropy of the predicted distribution).

Any loss that returns a :class:`TokenSums` over exactly the positions whose
shifted label is not ``ignore_index`` can be used by the training step and the
evaluation loop: they count those positions themselves (before any forward),
sum everything over micro-batches and data-parallel ranks, and divide once
(:mod:`torchtune_ext.accounting`). Because every value is a sum over exactly
the counted positions, ``sum / num_tokens`` is the mean over every trainable
token however the data was split into micro-batches or ranks.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

CROSS_ENTROPY_IGNORE_INDEX = -100

# Names of the token metrics :class:`SummedCrossEntropyLoss` sums, in a fixed
# order (every rank reduces them in one vector).
TOKEN_METRICS: Tuple[str, ...] = ("token_accuracy", "entropy")


def shift_labels(
    labels: torch.Tensor,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Align labels with the logits that predict them.

    Position ``i`` of a causal LM predicts token ``i + 1``, so the label of
    position ``i`` is ``labels[:, i + 1]``; the last position predicts nothing
    and gets ``ignore_index``. In a packed sequence (several documents in one
    row, each attending only to itself), position ``i`` predicts nothing when
    ``i + 1`` starts another document: the model cannot see the next document
    from there, and the unpacked documents have no such prediction either.

    Args:
        labels (torch.Tensor): ``[batch, seq_len]`` integer labels as produced by
            torchtune's datasets and collators (masked prompt and padding
            positions hold ``ignore_index``).
        ignore_index (int): label value excluded from the loss.
        document_ids (torch.Tensor, optional): ``[batch, seq_len]`` integers,
            equal for the positions of one document of a pack (see
            :func:`torchtune_ext.data.collate_packed`). None: every row is one
            document.

    Returns:
        torch.Tensor: ``[batch, seq_len]`` shifted labels, same dtype and device.

    Raises:
        ValueError: if ``labels`` is not 2-D or ``document_ids`` has another shape.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq_len], got shape {tuple(labels.shape)}")
    shifted = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if document_ids is not None:
        if document_ids.shape != labels.shape:
            raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}, labels {tuple(labels.shape)}")
        crosses = document_ids[:, 1:] != document_ids[:, :-1]
        shifted[:, :-1] = shifted[:, :-1].masked_fill(crosses.to(shifted.device), ignore_index)
    return shifted


@dataclass
class TokenSums:
    """Sums over the trainable positions of one micro-batch.

    Attributes:
        loss (torch.Tensor): fp32 scalar, the sum of per-token losses in nats;
            differentiable (backward runs on it after division by the step's
            token count).
        metrics (dict): name -> detached fp32 scalar, a sum over the same
            positions (e.g. ``token_accuracy``: number of positions whose
            argmax is the label). Divided by the token count they are means.
    """

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor] = field(default_factory=dict)


class SummedCrossEntropyLoss(nn.Module):
    """Next-token cross-entropy summed (not averaged) over the trainable positions.

    Supports the chunked output of torchtune's ``TransformerDecoder``
    (``model.set_num_output_chunks(n)`` returns a list of ``n`` logits chunks
    split along the sequence): each chunk is upcast to fp32 on its own, and
    only its trainable rows are, so the full ``[batch, seq_len, vocab]`` fp32
    tensor never exists at once.

    With ``token_metrics`` the same logits also give, under ``no_grad``:

    * ``token_accuracy``: the number of positions whose argmax is the label;
    * ``entropy``: the sum over positions of the entropy of the predicted
      distribution, ``H = -sum_v p_v log p_v`` in nats (Shannon's definition,
      computed from the log-softmax the loss needs anyway).

    Args:
        num_output_chunks (int): number of sequence chunks the model should
            produce; the recipe passes it to ``model.set_num_output_chunks``.
            1 means the model returns a single logits tensor.
        ignore_index (int): label value excluded from the loss and the count.
        token_metrics (bool): also sum ``token_accuracy`` and ``entropy``.

    Shapes:
        logits: ``[batch, seq_len, vocab]`` or a list of chunks
        ``[batch, seq_len_i, vocab]`` whose lengths add up to ``seq_len``.
        shifted_labels: ``[batch, seq_len]`` from :func:`shift_labels`.
        output: :class:`TokenSums`; with no trainable position every sum is
        exactly 0 (never NaN) and ``loss`` still reaches every parameter in
        backward (with zero gradient), so data-parallel ranks stay in step.

    Raises:
        ValueError: ``num_output_chunks < 1``; in ``forward``, logits that do
            not cover the labels' positions.
    """

    def __init__(
        self,
        num_output_chunks: int = 8,
        ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
        token_metrics: bool = True,
    ):
        super().__init__()
        if num_output_chunks < 1:
            raise ValueError(f"num_output_chunks must be >= 1, got {num_output_chunks}")
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index
        self.token_metrics = token_metrics

    @property
    def metric_names(self) -> Tuple[str, ...]:
        """Names of the metric sums every ``forward`` returns, in a fixed order."""
        return TOKEN_METRICS if self.token_metrics else ()

    def _chunk_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        trainable = labels != self.ignore_index
        # Only trainable rows: masked prompts and padding cost no softmax.
        rows = logits[trainable].float()
        targets = labels[trainable]
        log_probs = torch.log_softmax(rows, dim=-1)
        loss = F.nll_loss(log_probs, targets, reduction="sum")
        if not self.token_metrics:
            return (loss,)
        with torch.no_grad():
            correct = (rows.argmax(dim=-1) == targets).sum(dtype=torch.float32)
            entropy = -(log_probs.exp() * log_probs).sum(dtype=torch.float32)
        return loss, correct, entropy

    def compile_chunk(self) -> None:
        """Compile the per-chunk sums with ``torch.compile`` (used by ``compile: true``)."""
        self._chunk_sums = torch.compile(self._chunk_sums, dynamic=True)

    def forward(self, logits: Union[torch.Tensor, List[torch.Tensor]], shifted_labels: torch.Tensor) -> TokenSums:
        if isinstance(logits, torch.Tensor):
            logits = [logits]
        lengths = [chunk.size(1) for chunk in logits]
        if sum(lengths) != shifted_labels.size(1):
            raise ValueError(
                f"logits cover {sum(lengths)} positions but labels have {shifted_labels.size(1)}"
            )
        totals = [torch.zeros((), dtype=torch.float32, device=shifted_labels.device)
                  for _ in range(1 + len(self.metric_names))]
        for chunk, labels in zip(logits, shifted_labels.split(lengths, dim=1)):
            totals = [total + part for total, part in zip(totals, self._chunk_sums(chunk, labels))]
        return TokenSums(loss=totals[0], metrics=dict(zip(self.metric_names, totals[1:])))


# torchtune's cross-entropy losses, which average over tokens, and the
# arguments they share with ours. A config naming one gets our sum-reduced
# loss with the same chunking and ignore_index.
_TORCHTUNE_CE_LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": ("num_output_chunks", "ignore_index"),
    "torchtune.modules.loss.ce_chunked_output_loss.CEWithChunkedOutputLoss": ("num_output_chunks", "ignore_index"),
    "torch.nn.CrossEntropyLoss": ("ignore_index",),
}


def build_loss(cfg_loss, compile: bool = False) -> SummedCrossEntropyLoss:
    """Instantiate the recipe's ``loss`` config as a sum-reduced loss.

    torchtune's mean-reduced cross-entropy losses (``CEWithChunkedOutputLoss``,
    ``torch.nn.CrossEntropyLoss``) are replaced by :class:`SummedCrossEntropyLoss`
    with the same ``num_output_chunks`` and ``ignore_index``, and the
    replacement is logged once: a mean cannot be normalized exactly over
    micro-batches, the sum can, and the logged loss is the same mean per token.

    Args:
        cfg_loss: the ``loss`` config node (``_component_`` plus arguments).
        compile (bool): compile the per-chunk loss (the recipe's ``compile`` key).

    Raises:
        ConfigError: (key ``loss``) if it is neither ours nor a torchtune
            cross-entropy we can replace, or has arguments we cannot honour
            (e.g. ``reduction``, ``label_smoothing``, class weights).
    """
    import logging

    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    from torchtune_ext.config import ConfigError

    component = str(cfg_loss.get("_component_"))
    if component in _TORCHTUNE_CE_LOSSES:
        args = {k: v for k, v in OmegaConf.to_container(cfg_loss).items() if k != "_component_"}
        unsupported = sorted(set(args) - set(_TORCHTUNE_CE_LOSSES[component]))
        if unsupported:
            raise ConfigError(f"loss.{unsupported[0]}", f"is not supported with {component}: the recipes sum "
                              "per-token cross-entropy and divide once by the step's token count")
        logging.getLogger(__name__).info(
            "loss: %s is computed as torchtune_ext.loss.SummedCrossEntropyLoss(%s): summed per token and "
            "divided once by the optimizer step's trainable tokens (the same mean per token, exact under "
            "gradient accumulation)", component, ", ".join(f"{k}={v}" for k, v in args.items()))
        loss_fn = SummedCrossEntropyLoss(**args)
    else:
        loss_fn = tt_config.instantiate(cfg_loss)
    if not isinstance(loss_fn, SummedCrossEntropyLoss):
        raise ConfigError(
            "loss", f"{component} cannot be normalized exactly across micro-batches; use "
            "torchtune_ext.loss.SummedCrossEntropyLoss or torchtune.modules.loss.CEWithChunkedOutputLoss"
        )
    if compile:
        loss_fn.compile_chunk()
    return loss_fn
