"""Preference tuning (DPO and its variants): the loss per pair and the objective whose unit is a pair.

A micro-batch of ``P`` pairs holds ``2P`` rows: the chosen responses (rows
``0 .. P-1``) then the rejected ones (rows ``P .. 2P-1``), each a prompt and a
response (:mod:`torchtune_ext.data.preference`). For every row the policy's
log-probability of the response is the SUM over the row's trainable tokens
after the label shift (:func:`sequence_log_probs`); the reference's is the
same sum from the frozen reference model. :class:`PreferenceLoss` turns the
four sums of a pair into that pair's loss.

:class:`PreferenceObjective` is the training step's objective
(:mod:`torchtune_ext.train.objective`) with the pair as its unit: each
micro-batch counts its pairs before any forward, its forward returns the
SUM of the per-pair losses and metrics, and the step divides once by the
pairs of all micro-batches and ranks. So the step loss is the mean over
the step's pairs however they were split (batch N == 1 x N accumulation
== N ranks), which a mean per micro-batch divided by the accumulation
steps is not (it weighs a pair of a short micro-batch more).
"""

import contextlib
from typing import Callable, ContextManager, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtune_ext.train.loss import SummedCrossEntropyLoss, TokenSums, rows_per_output_chunk
from torchtune_ext.train.objective import MicroBatch, Prepared, prepare_micro_batch

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "reference_free")

# Sums per pair the objective returns besides the loss, in a fixed order; divided by the step's pairs they are
# the means W&B shows. ``num_tokens`` is a count, not a mean: the step reports its sum (non-padding tokens of
# both responses, prompts included).
PREFERENCE_METRICS: Tuple[str, ...] = (
    "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
    "logps/chosen", "logps/rejected", "num_tokens",
)


class PreferenceLoss(nn.Module):
    """The loss of each preference pair, from the summed log-probabilities of its two responses.

    With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (each a sum over the
    response's trainable tokens):

    * ``sigmoid`` (DPO, Rafailov et al. 2023, arXiv:2305.18290, with the
      conservative label smoothing ``eps`` of Mitchell 2023):
      ``-(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``;
    * ``ipo`` (Azar et al. 2023, arXiv:2310.12036, eq. 17): ``(h - 1 / (2 * beta))^2``;
    * ``hinge`` (SLiC / RSO, Liu et al. 2023, arXiv:2309.06657): ``relu(1 - beta * h)``;
    * ``reference_free``: ``sigmoid`` with ``ref_c = ref_r = 0`` (no reference model);
    * ``simpo`` (Meng et al. 2024, arXiv:2405.14734, eq. 6), reference-free
      and length-normalized: ``-(1 - eps) * logsigmoid(beta * (pi_c / n_c - pi_r / n_r) - gamma)
      - eps * logsigmoid(-(...))``, ``n``: the response's trainable tokens.

    The rewards reported with it are ``beta * (pi - ref)`` per response
    (SimPO: ``beta * pi / n``).

    Args:
        loss_type: one of :data:`LOSS_TYPES`.
        beta (float): > 0; the inverse temperature (IPO: the regularization ``tau``).
        label_smoothing (float): in [0, 0.5), the assumed share of flipped labels (sigmoid, reference_free, simpo).
        gamma (float): SimPO's target reward margin.

    Raises:
        ValueError: an unknown ``loss_type``, ``beta <= 0``, ``label_smoothing`` outside [0, 0.5).
    """

    def __init__(self, loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
                 gamma: float = 0.5):
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        self.loss_type, self.beta, self.label_smoothing, self.gamma = loss_type, beta, label_smoothing, gamma

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference model's log-probabilities."""
        return self.loss_type not in ("simpo", "reference_free")

    def _smoothed(self, logits: torch.Tensor) -> torch.Tensor:
        eps = self.label_smoothing
        return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)

    def forward(self, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                reference_chosen: Optional[torch.Tensor], reference_rejected: Optional[torch.Tensor],
                chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-pair losses and rewards.

        Args:
            policy_chosen, policy_rejected: ``[pairs]`` fp32 summed log-probabilities (with gradient).
            reference_chosen, reference_rejected: ``[pairs]`` the reference's, or None where
                :attr:`needs_reference` is False.
            chosen_tokens, rejected_tokens: ``[pairs]`` trainable tokens per response (SimPO's lengths).

        Returns:
            (losses, chosen_rewards, rejected_rewards): ``[pairs]`` each; the rewards detached.
        """
        if self.loss_type == "simpo":
            chosen = policy_chosen / chosen_tokens.clamp(min=1)
            rejected = policy_rejected / rejected_tokens.clamp(min=1)
            losses = self._smoothed(self.beta * (chosen - rejected) - self.gamma)
            return losses, self.beta * chosen.detach(), self.beta * rejected.detach()
        if self.needs_reference:
            chosen, rejected = policy_chosen - reference_chosen, policy_rejected - reference_rejected
        else:
            chosen, rejected = policy_chosen, policy_rejected
        h = chosen - rejected
        if self.loss_type == "ipo":
            losses = (h - 1 / (2 * self.beta)) ** 2
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - self.beta * h)
        else:
            losses = self._smoothed(self.beta * h)
        return losses, self.beta * chosen.detach(), self.beta * rejected.detach()


def sequence_log_probs(lm: SummedCrossEntropyLoss, hidden: torch.Tensor, shifted_labels: torch.Tensor,
                       recompute_output: bool = False) -> torch.Tensor:
    """The summed log-probability of each row's trainable labels.

    The output projection runs on the trainable positions only, in chunks
    (:func:`torchtune_ext.train.loss.rows_per_output_chunk`); with
    ``recompute_output`` and gradients on, each chunk is recomputed in
    backward instead of keeping its ``[rows, vocab]`` log-probabilities.

    Args:
        lm: the loss that owns the model's output projection
            (:meth:`~torchtune_ext.train.loss.SummedCrossEntropyLoss.take_output_projection`).
        hidden: ``[rows, seq_len, hidden]`` final hidden states.
        shifted_labels: ``[rows, seq_len]`` (:func:`~torchtune_ext.train.loss.shift_labels`).

    Returns:
        torch.Tensor: ``[rows]`` fp32 sums (nats, <= 0); 0 for a row without a trainable label.
    """
    trainable = shifted_labels != lm.ignore_index
    rows, targets = hidden[trainable], shifted_labels[trainable]
    owner = trainable.nonzero()[:, 0]
    sums = torch.zeros(shifted_labels.size(0), dtype=torch.float32, device=hidden.device)
    size = rows_per_output_chunk(lm.num_output_chunks, rows.size(0), lm.vocab_size)
    checkpointed = recompute_output and torch.is_grad_enabled()
    for chunk, chunk_targets, chunk_owner in zip(rows.split(size), targets.split(size), owner.split(size)):
        if checkpointed:
            log_probs = checkpoint(lm.log_probs, chunk, use_reentrant=False, preserve_rng_state=True)
        else:
            log_probs = lm.log_probs(chunk)
        picked = log_probs[torch.arange(chunk_targets.numel(), device=chunk.device), chunk_targets]
        sums = sums.index_add(0, chunk_owner, picked)
        del log_probs
    return sums


def forward_log_probs(model: nn.Module, lm: SummedCrossEntropyLoss, prepared: Prepared,
                      recompute_output: bool = False) -> torch.Tensor:
    """``[rows]`` summed log-probabilities of ``model`` on a prepared pair micro-batch (:func:`sequence_log_probs`)."""
    inputs = dict(prepared.inputs)
    tokens = inputs.pop("tokens")
    return sequence_log_probs(lm, model(tokens, **inputs), prepared.labels, recompute_output)


class ModelReference:
    """The reference model's summed log-probabilities, without autograd.

    Args:
        model: the reference: a frozen copy of the policy (full fine-tuning),
            or the policy itself (LoRA) with ``context`` disabling its adapters.
        lm: the loss owning ``model``'s output projection.
        context: a context manager factory around the forward (LoRA:
            :func:`torchtune_ext.model.lora.adapters_disabled` of the policy).
    """

    def __init__(self, model: nn.Module, lm: SummedCrossEntropyLoss,
                 context: Callable[[], ContextManager] = contextlib.nullcontext):
        self.model, self.lm, self.context = model, lm, context

    def __call__(self, prepared: Prepared) -> torch.Tensor:
        with torch.no_grad(), self.context():
            return forward_log_probs(self.model, self.lm, prepared)


class PrecomputedReference:
    """The reference's summed log-probabilities read from a table computed once before training.

    Args:
        table: ``[pairs, 2]`` fp32, nats: row ``i`` the reference's sums over the trainable tokens of pair
            ``i``'s chosen and rejected response (:func:`reference_table`).

    Called with a prepared micro-batch of ``P`` pairs whose ``extra["pair_index"]`` ``[P]`` says which rows
    of the table they are; returns ``[2P]`` (the chosen responses, then the rejected), on the labels' device.

    Raises:
        ValueError: a micro-batch without ``pair_index`` (pairs not from a
            :class:`~torchtune_ext.data.preference.PairDataset`).
    """

    def __init__(self, table: torch.Tensor):
        self.table = table.float()

    def __call__(self, prepared: Prepared) -> torch.Tensor:
        index = prepared.extra.get("pair_index")
        if index is None:
            raise ValueError("precomputed reference log-probabilities need each pair's pair_index")
        rows = self.table[index.to(self.table.device)]
        return torch.cat([rows[:, 0], rows[:, 1]]).to(prepared.labels.device)


def reference_table(reference: Callable[[Prepared], torch.Tensor], micro_batches: Iterable[Prepared],
                    num_pairs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``reference`` run over ``micro_batches``, each pair's chosen and rejected sums placed at its
    ``pair_index``; pairs a micro-batch does not count (a stand-in's) are left out.

    Returns:
        (table, filled): ``[num_pairs, 2]`` fp32 nats, zeros where no micro-batch had the pair, and
        ``[num_pairs]`` fp32, 1 where one had (the caller sums both over ranks).
    """
    table = torch.zeros(num_pairs, 2, dtype=torch.float32)
    filled = torch.zeros(num_pairs, dtype=torch.float32)
    for prepared in micro_batches:
        sums = reference(prepared).detach().float().cpu()
        pairs = sums.size(0) // 2
        counted = prepared.extra["counted"].cpu()
        index = prepared.extra["pair_index"].cpu()[counted]
        table[index, 0] = sums[:pairs][counted]
        table[index, 1] = sums[pairs:][counted]
        filled[index] = 1.0
    return table, filled


class PreferenceObjective:
    """The training step's objective for preference pairs: the unit is a pair.

    Args:
        lm: the run's loss owning the policy's output projection (its
            ``num_output_chunks`` and ``ignore_index`` apply).
        loss: :class:`PreferenceLoss`.
        reference: ``prepared -> [2P]`` reference log-probabilities
            (:class:`ModelReference`); needed when ``loss.needs_reference``,
            set before the first step (:meth:`use_reference`).
    """

    unit = "pairs"
    metric_names = PREFERENCE_METRICS

    def __init__(self, lm: SummedCrossEntropyLoss, loss: PreferenceLoss,
                 reference: Optional[Callable[[Prepared], torch.Tensor]] = None):
        self.lm, self.loss, self.reference = lm, loss, reference

    @property
    def ignore_index(self) -> int:
        return self.lm.ignore_index

    def use_reference(self, reference: Callable[[Prepared], torch.Tensor]) -> None:
        self.reference = reference

    def prepare(self, micro_batch: MicroBatch, device: torch.device) -> Prepared:
        """Shift the labels of the ``2P`` rows and count the pairs whose two responses both have a trainable
        token (a stand-in's masked pair counts none).

        ``micro_batch``: :func:`torchtune_ext.data.preference.collate_pairs`'s dict, ``tokens`` and
        ``labels`` ``[2P, seq_len]`` and ``lengths`` ``[2P]`` (non-padding tokens per row)."""
        batch = dict(micro_batch)
        lengths = batch.pop("lengths")
        pair_index = batch.pop("pair_index", None)  # where a precomputed reference looks its pairs up
        inputs, labels = prepare_micro_batch(batch, device, self.ignore_index)
        trainable = labels != self.ignore_index
        per_row = trainable.sum(dim=1)
        pairs = labels.size(0) // 2
        counted = (per_row[:pairs] > 0) & (per_row[pairs:] > 0)
        return Prepared(inputs, labels, int(counted.sum().item()), int(trainable.sum().item()),
                        extra={"counted": counted, "row_tokens": per_row, "pair_index": pair_index,
                               "lengths": torch.as_tensor(lengths, device=labels.device)})

    def __call__(self, model: nn.Module, prepared: Prepared, *, recompute_output: bool = False) -> TokenSums:
        """Sums over the micro-batch's counted pairs: the loss (with its graph) and :data:`PREFERENCE_METRICS`."""
        logps = forward_log_probs(model, self.lm, prepared, recompute_output)
        pairs = logps.size(0) // 2
        reference = (None, None)
        if self.loss.needs_reference:
            if self.reference is None:
                raise RuntimeError(f"the {self.loss.loss_type} loss needs a reference model: call use_reference")
            reference = self.reference(prepared).detach().float().split(pairs)
        tokens = prepared.extra["row_tokens"].float()
        losses, chosen, rejected = self.loss(logps[:pairs], logps[pairs:], *reference, tokens[:pairs], tokens[pairs:])
        counted = prepared.extra["counted"]
        weight = counted.float()
        detached = logps.detach()
        with torch.no_grad():
            metrics = {
                "rewards/chosen": (chosen * weight).sum(),
                "rewards/rejected": (rejected * weight).sum(),
                "rewards/margins": ((chosen - rejected) * weight).sum(),
                "rewards/accuracies": ((chosen > rejected) & counted).float().sum(),
                "logps/chosen": (detached[:pairs] * weight).sum(),
                "logps/rejected": (detached[pairs:] * weight).sum(),
                "num_tokens": (prepared.extra["lengths"].view(2, pairs).sum(0).float() * weight).sum(),
            }
        # where() rather than a product: a stand-in's pair has no trainable token, and its loss (say IPO's
        # constant) must neither count nor leave a NaN in the gradient
        loss = torch.where(counted, losses, torch.zeros_like(losses)).sum()
        return TokenSums(loss=loss, metrics=metrics)

