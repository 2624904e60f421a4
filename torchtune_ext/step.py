"""One optimizer step over a window of micro-batches: the loop every recipe shares.

Order of work, the same in both backward modes:

1. shift every micro-batch's labels once (never across the documents of a
   pack) and count the trainable tokens of that shifted tensor, before any
   forward (:class:`torchtune_ext.accounting.TokenTally`);
2. sum the count over data-parallel ranks (one scalar all-reduce);
3. forward each micro-batch with a sum-reduced loss and backward on
   ``summed_loss / global_num_tokens`` -- normalized before backward, so no
   gradient ever holds an unnormalized sum and none is rescaled afterwards;
4. sum the loss and the token metrics over ranks (one small all-reduce);
5. global gradient norm (before clipping), optional clipping, health checks
   (:mod:`torchtune_ext.health`: non-finite values, a zero gradient, loss
   spikes), optimizer step, a check that the parameters are still finite.

``backward_once_per_step=True`` keeps the graphs of all micro-batches and
calls backward once on the accumulated sum; ``False`` calls backward after
each micro-batch (activation memory independent of the number of
micro-batches) and, under FSDP2, syncs gradients only on the last one.
Both produce the same gradients up to floating-point summation order.

Data parallelism: each rank's loss is its *local* sum divided by the
*global* token count, so the gradient of the step loss is the SUM of the
ranks' gradients. The distributed recipes set FSDP's gradient divide factor
to 1 so that FSDP sums instead of averaging.
"""

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ext.accounting import TokenTally, TokenTotals
from torchtune_ext.health import NonFiniteError, StepHealth, TrainingHealthError  # noqa: F401 (re-exported)
from torchtune_ext.loss import SummedCrossEntropyLoss, TokenSums, shift_labels

log = logging.getLogger(__name__)

MicroBatch = Dict[str, Any]


@dataclass
class StepResult:
    """What one optimizer step did.

    Attributes:
        loss (float | None): global mean cross-entropy per trainable token
            (nats) -- exactly the normalized quantity that was optimized;
            None if the step was skipped before computing it.
        num_tokens (int): trainable label tokens of the step, all dp ranks.
        local_num_tokens (int): the same, on this rank only.
        grad_norm (float | None): total L2 norm of the normalized gradient
            over all trainable parameters (all shards), before clipping.
        skipped (str | None): why the optimizer step was skipped ("empty":
            no trainable token on any rank; "non-finite"), None if it ran.
        metrics (dict): the loss's token metrics as means over the step's
            trainable tokens, all ranks (``token_accuracy``: fraction of
            positions whose argmax is the label; ``entropy``: nats); empty
            when the step had no trainable token.
    """

    loss: Optional[float]
    num_tokens: int
    local_num_tokens: int
    grad_norm: Optional[float]
    skipped: Optional[str] = None
    metrics: Dict[str, float] = field(default_factory=dict)


def build_lr_scheduler(cfg_lr_scheduler: Any, optimizer: torch.optim.Optimizer, num_training_steps: int):
    """Instantiate the ``lr_scheduler`` config for ``num_training_steps`` optimizer steps.

    ``num_training_steps`` counts optimizer steps, short end-of-epoch steps
    included. Returns None when the config is null (or ``lr_scheduler=null``
    on the command line).
    """
    from torchtune import config as tt_config

    from torchtune_ext.config import enabled

    if enabled(cfg_lr_scheduler) is None:
        return None
    return tt_config.instantiate(cfg_lr_scheduler, optimizer, num_training_steps=num_training_steps)


def prepare_micro_batch(
    micro_batch: MicroBatch, device: torch.device, ignore_index: int
) -> Tuple[MicroBatch, torch.Tensor]:
    """Split a collated micro-batch into model inputs and shifted labels, on ``device``.

    The labels are shifted here and nowhere else (:func:`torchtune_ext.loss.shift_labels`),
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
                 shifted_labels: torch.Tensor) -> TokenSums:
    """Forward one prepared micro-batch and return the loss's sums over its trainable tokens."""
    inputs = dict(inputs)
    tokens = inputs.pop("tokens")
    return loss_fn(model(tokens, **inputs), shifted_labels)


def forward_backward(
    model: nn.Module,
    loss_fn: SummedCrossEntropyLoss,
    micro_batches: Sequence[MicroBatch],
    *,
    device: torch.device,
    backward_once_per_step: bool = True,
    dp_group=None,
) -> TokenTotals:
    """Accumulate the normalized gradient of one optimizer step.

    Args:
        model: torchtune ``TransformerDecoder`` (possibly LoRA, FSDP2-sharded);
            called as ``model(tokens, mask=..., input_pos=...)``.
        loss_fn: sum-reduced loss; its ``ignore_index`` defines trainable tokens.
        micro_batches: dicts from a collator (see :func:`prepare_micro_batch`).
            Not modified.
        device: where the model lives.
        backward_once_per_step: one backward on the accumulated sum (True) or
            one backward per micro-batch (False).
        dp_group: data-parallel process group (None: default group, or none).

    Returns:
        TokenTotals: the step's global and local trainable token counts and
        the global sums of the loss (nats) and the loss's metrics. If
        ``num_tokens`` is 0 no forward or backward ran (on any rank: the count
        is global) and every sum is 0.
    """
    tally = TokenTally(loss_fn.metric_names, device, loss_fn.ignore_index)
    prepared = []
    for micro_batch in micro_batches:
        inputs, labels = prepare_micro_batch(micro_batch, device, loss_fn.ignore_index)
        tally.count(labels)
        prepared.append((inputs, labels))
    num_tokens = tally.global_num_tokens(dp_group)
    if num_tokens == 0:
        return TokenTotals(0, 0, dict.fromkeys(tally.names, 0.0))

    can_defer_sync = hasattr(model, "set_requires_gradient_sync")
    if backward_once_per_step:
        step_loss = 0
        for inputs, labels in prepared:
            sums = forward_sums(model, loss_fn, inputs, labels)
            tally.add(sums)
            step_loss = step_loss + sums.loss
        (step_loss / num_tokens).backward()
    else:
        last = len(prepared) - 1
        for i, (inputs, labels) in enumerate(prepared):
            if can_defer_sync:
                # FSDP2: reduce-scatter once per step, after the last micro-batch.
                model.set_requires_gradient_sync(i == last)
            sums = forward_sums(model, loss_fn, inputs, labels)
            (sums.loss / num_tokens).backward()
            tally.add(sums)
        if can_defer_sync:
            model.set_requires_gradient_sync(True)
    return tally.totals(dp_group)


_NORM_BLOCK = 1024


def _sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squared entries as a float64 scalar, accurate to ~1e-9 relative.

    Blocks of ``_NORM_BLOCK`` entries are reduced in the tensor's own dtype
    (short sums: rounding error ~1e-7 relative per block, not growing with
    the tensor's size), and the block sums are added in float64. This is as
    accurate as upcasting every entry to float64 at about a quarter of the
    cost, and faster than ``clip_grad_norm_``'s single fp32 reduction, which
    on a 135M-parameter gradient is off by ~3e-4 relative.
    """
    flat = tensor.reshape(-1)
    whole = flat.numel() // _NORM_BLOCK * _NORM_BLOCK
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    if whole:
        block_norms = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_BLOCK), dim=1)
        total += block_norms.double().square().sum()
    if whole < flat.numel():
        total += torch.linalg.vector_norm(flat[whole:], dtype=torch.float64).square()
    return total


def grad_norm_and_clip(parameters: Iterable[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
    """Total L2 norm of all gradients (all shards), then clip in place if asked.

    The squares are summed in blocks and then in float64 (:func:`_sum_of_squares`):
    one fp32 sum over ~1e8 gradient entries drifts by 1e-5 to 1e-4 relative
    with the summation order, i.e. with how the model is sharded, and the
    norm would no longer be comparable between world sizes at the 1e-5
    tolerance. Under FSDP2 every rank sums the squares
    of its own shard (shards are disjoint) and one all-reduce adds them up.

    Args:
        parameters: trainable parameters; those without ``.grad`` are ignored.
        max_norm (float, optional): clip so the total norm is at most this;
            None or <= 0 disables clipping (the norm is still computed).

    Returns:
        torch.Tensor: float64 scalar on the gradients' device, the norm
        *before* clipping, identical on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    sharded = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    replicated = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    groups = set()
    for grad in grads:
        if isinstance(grad, DTensor):
            groups.add(grad.device_mesh.get_group())
            sharded += _sum_of_squares(grad.to_local())
        else:  # a whole tensor on every rank: count it once
            replicated += _sum_of_squares(grad)
    for group in groups:
        dist.all_reduce(sharded, op=dist.ReduceOp.SUM, group=group)
    norm = (sharded + replicated).sqrt()
    if max_norm is not None and max_norm > 0:
        scale = max_norm / (norm.item() + 1e-6)
        if scale < 1.0:
            torch._foreach_mul_(grads, scale)
    return norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: SummedCrossEntropyLoss,
    micro_batches: Sequence[MicroBatch],
    *,
    device: torch.device,
    backward_once_per_step: bool = True,
    clip_grad_norm: Optional[float] = None,
    health: Optional[StepHealth] = None,
    step: int = 0,
    dp_group=None,
) -> StepResult:
    """Run one optimizer step over ``micro_batches`` (see the module docstring).

    Gradients are zeroed afterwards whether or not the step ran. A step with
    no trainable token on any rank is skipped: parameters and optimizer state
    stay unchanged and a warning is logged.

    Args:
        step (int): 1-based optimizer step number, for messages.
        clip_grad_norm (float, optional): max total gradient norm; None: no clipping.
        health (StepHealth, optional): the run's health checks
            (:class:`torchtune_ext.health.StepHealth`, which keeps a loss
            history and decides about non-finite steps); None: a fresh one
            that stops at any sign.
        Other arguments as in :func:`forward_backward`.

    Returns:
        StepResult

    Raises:
        NonFiniteError: non-finite loss or gradient norm, not skipped.
            Parameters are left unchanged.
        TrainingHealthError: a zero gradient with trainable tokens, a second
            loss spike in a row (parameters unchanged), or parameters that
            became non-finite in this step's update.
    """
    health = health if health is not None else StepHealth(start_step=max(step - 1, 0))
    totals = forward_backward(
        model, loss_fn, micro_batches, device=device,
        backward_once_per_step=backward_once_per_step, dp_group=dp_group,
    )
    num_tokens, local_num_tokens = totals.num_tokens, totals.local_num_tokens
    if num_tokens == 0:
        optimizer.zero_grad(set_to_none=True)
        health.empty(step)
        log.warning("Optimizer step %d skipped: no trainable token in any of its micro-batches.", step)
        return StepResult(None, 0, 0, None, skipped="empty")

    means = totals.means()
    loss = means.pop("loss")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = grad_norm_and_clip(params, clip_grad_norm).item()
    try:
        skip = health.before_update(step, loss, grad_norm, num_tokens)
    except TrainingHealthError:
        optimizer.zero_grad(set_to_none=True)  # nothing updated; the caller may go on with other data
        raise
    if skip:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, num_tokens, local_num_tokens, grad_norm, skipped="non-finite", metrics=means)

    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    health.after_update(step, params, loss, grad_norm)
    return StepResult(loss, num_tokens, local_num_tokens, grad_norm, metrics=means)
