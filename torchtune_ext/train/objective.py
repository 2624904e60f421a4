"""What an optimizer step optimizes: how a micro-batch is prepared and counted, and the sums its forward gives.

The training step (:mod:`torchtune_ext.train.step`) and evaluation
(:mod:`torchtune_ext.run.evaluate`) are the same for every objective:

1. prepare every micro-batch (:meth:`Objective.prepare`): move it to the
   device, shift its labels once, and count the *units* it adds to the
   step's normalizer, before any forward;
2. sum the counts over the data-parallel ranks (one all-reduce);
3. forward each micro-batch for *sums* over its units (:meth:`Objective.__call__`
   returns :class:`~torchtune_ext.train.loss.TokenSums`: the loss, with its
   graph, and detached metric sums);
4. divide by the global count once, before backward.

What a unit is, is the objective's: a trainable token (after the label
shift) for next-token cross-entropy (:class:`TokenObjective`) and for
distillation, a preference pair for DPO. Because every value is a sum over
exactly the counted units, ``sum / count`` is the mean over every unit of
the step however its samples were split into micro-batches and ranks.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Protocol, Tuple, runtime_checkable

import torch
from torch import nn

from torchtune_ext.train import accounting
from torchtune_ext.train.loss import SummedCrossEntropyLoss, TokenSums, shift_labels

MicroBatch = Dict[str, Any]


@dataclass
class Prepared:
    """One micro-batch on its device, labels shifted, counted: ready for forward.

    Attributes:
        inputs (dict): the model's keyword arguments, ``tokens`` ``[batch,
            seq_len]`` among them (and ``mask``, ``input_pos`` for packed rows).
        labels (torch.Tensor): ``[batch, seq_len]`` shifted labels
            (:func:`~torchtune_ext.train.loss.shift_labels`); ``ignore_index``
            where nothing is learnt.
        count (int): the units this micro-batch adds to the step's
            normalizer (trainable tokens, or pairs).
        trainable_rows (int): positions whose label is learnt: the rows the
            output projection runs on (what the memory estimate needs; equal
            to ``count`` when the unit is a token).
        extra (dict): what else the objective's forward needs (a pair
            objective's layout of chosen and rejected rows, precomputed
            reference log-probabilities, ...).
    """

    inputs: Dict[str, Any]
    labels: torch.Tensor
    count: int
    trainable_rows: int
    extra: Dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Objective(Protocol):
    """The interface of an objective (see the module docstring).

    Attributes:
        metric_names: the metric sums the objective returns besides ``loss``, in a fixed order (every rank
            reduces them in one vector).
        ignore_index: the label value that is not learnt.
        unit: what :attr:`Prepared.count` counts, for messages and records (``"tokens"``, ``"pairs"``).
    """

    metric_names: Tuple[str, ...]
    ignore_index: int
    unit: str

    def prepare(self, micro_batch: MicroBatch, device: torch.device) -> Prepared:
        """The micro-batch on ``device``, its labels shifted, its units counted (no forward)."""

    def __call__(self, model: nn.Module, prepared: Prepared, *, recompute_output: bool = False) -> TokenSums:
        """Forward ``prepared``; sums over its counted units (the loss with its graph, metrics detached).

        ``recompute_output``: the graph waits for a later backward, so keep
        hidden states rather than vocabulary-wide log-probabilities."""


def prepare_micro_batch(micro_batch: MicroBatch, device: torch.device, ignore_index: int) -> Tuple[MicroBatch,
                                                                                                  torch.Tensor]:
    """Split a collated micro-batch into model inputs and shifted labels, on ``device``.

    The labels are shifted here and nowhere else (:func:`torchtune_ext.train.loss.shift_labels`),
    using the pack's ``document_ids`` when present (they are not a model input).

    Args:
        micro_batch: a collator's dict with ``tokens`` and ``labels``
            ``[batch, seq_len]`` (unshifted) and optionally ``mask``,
            ``input_pos`` and ``document_ids`` (packed data). Not modified.
        device: where the model lives.
        ignore_index: the loss's ignore index.

    Returns:
        (inputs, shifted_labels): the keyword arguments of the model (with
        ``tokens``) and the ``[batch, seq_len]`` labels the loss and the count use.
    """
    inputs = dict(micro_batch)
    labels = shift_labels(inputs.pop("labels"), ignore_index, inputs.pop("document_ids", None))
    inputs = {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in inputs.items()}
    return inputs, labels.to(device, non_blocking=True)


def forward_sums(model: nn.Module, loss_fn: SummedCrossEntropyLoss, inputs: MicroBatch,
                 shifted_labels: torch.Tensor, recompute_output: bool = False) -> TokenSums:
    """Forward one prepared micro-batch and return the loss's sums over its trainable tokens.

    ``recompute_output``: the graph will wait for a later backward, so the
    loss should keep hidden states rather than vocabulary-wide log-probabilities
    (see :class:`torchtune_ext.train.loss.SummedCrossEntropyLoss`).
    """
    inputs = dict(inputs)
    tokens = inputs.pop("tokens")
    return loss_fn(model(tokens, **inputs), shifted_labels, recompute_output=recompute_output)


class TokenObjective:
    """Next-token cross-entropy summed over the trainable tokens (fine-tuning): the unit is a token.

    Args:
        loss_fn: the sum-reduced loss (:class:`~torchtune_ext.train.loss.SummedCrossEntropyLoss`),
            owning the model's output projection or not.
    """

    unit = "tokens"

    def __init__(self, loss_fn: SummedCrossEntropyLoss):
        self.loss_fn = loss_fn

    @property
    def metric_names(self) -> Tuple[str, ...]:
        return self.loss_fn.metric_names

    @property
    def ignore_index(self) -> int:
        return self.loss_fn.ignore_index

    def prepare(self, micro_batch: MicroBatch, device: torch.device) -> Prepared:
        inputs, labels = prepare_micro_batch(micro_batch, device, self.ignore_index)
        # counted from the same shifted tensor the loss sums over
        count = accounting.count_trainable_tokens(labels, self.ignore_index)
        return Prepared(inputs, labels, count, count)

    def __call__(self, model: nn.Module, prepared: Prepared, *, recompute_output: bool = False) -> TokenSums:
        return forward_sums(model, self.loss_fn, prepared.inputs, prepared.labels, recompute_output=recompute_output)


def as_objective(loss_or_objective: Any) -> Objective:
    """``loss_or_objective`` as an :class:`Objective`: a sum-reduced token loss becomes a :class:`TokenObjective`."""
    if isinstance(loss_or_objective, Objective):
        return loss_or_objective
    return TokenObjective(loss_or_objective)
