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

``backward`` (the config key of the same name) says how the micro-batches
are backpropagated; all three give the same gradients up to floating-point
summation order:

* ``"once_per_step"`` keeps the graphs of all micro-batches and calls
  backward once on the accumulated sum (the loss recomputes its output
  projection in backward, so no graph keeps vocabulary-wide logits);
* ``"per_micro_batch"`` calls backward after each micro-batch (activation
  memory independent of the number of micro-batches) and, under FSDP2, syncs
  gradients only on the last one;
* ``"auto"`` lets a :class:`torchtune_ext.memory.MemoryGuard` choose per step:
  once per step where it fits its limit, else per micro-batch.

Data parallelism: each rank's loss is its *local* sum divided by the
*global* token count, so the gradient of the step loss is the SUM of the
ranks' gradients. The distributed recipes set FSDP's gradient divide factor
to 1 so that FSDP sums instead of averaging.
"""

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from torchtune_ext.accounting import TokenTally, TokenTotals, dp_is_active
from torchtune_ext.config import BACKWARD_MODES, enabled
from torchtune_ext.errors import TrainingHealthError
from torchtune_ext.grad_norm import grad_norm_and_clip
from torchtune_ext.health import StepHealth
from torchtune_ext.loss import SummedCrossEntropyLoss, TokenSums, shift_labels
from torchtune_ext.memory import MemoryGuard, MicroBatchShape, shapes_of
from torchtune_ext.optim_in_bwd import OptimizerInBackward

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
        once_per_step (bool | None): the step's gradient came from one
            backward (True) or one per micro-batch (False); None when no
            backward ran.
        wait_seconds (float): wall time this rank spent in the step's own
            collectives (the token count before any forward, the memory
            guard's figures, the loss sums, the gradient norm): time waiting
            for the slowest rank to get there, since each moves a few numbers
            only. FSDP's gathers and reduce-scatters are not included. 0 with
            one process.
    """

    loss: Optional[float]
    num_tokens: int
    local_num_tokens: int
    grad_norm: Optional[float]
    skipped: Optional[str] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    once_per_step: Optional[bool] = None
    wait_seconds: float = 0.0


class RankWait:
    """Adds up the wall time of a step's blocking collectives on this rank (:attr:`StepResult.wait_seconds`).

    Args:
        device: the training device; on CUDA the queued work is finished
            before and after each collective, so that only the collective
            (and the wait for the other ranks in it) is timed.
        active: False with one process: nothing is measured.
    """

    def __init__(self, device: torch.device, active: bool):
        self.device, self.active, self.seconds = device, active, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds += time.perf_counter() - start


def waiting_shares(result: StepResult, step_seconds: float, data_seconds: float = 0.0) -> Dict[str, float]:
    """Where a step's wall time went besides computing: the step record's waiting keys.

    The wall time is ``data_seconds + step_seconds`` (loading the step's
    samples, then the step itself).

    Returns:
        dict: ``data_seconds``; ``data_wait_fraction``, the share of it spent
        loading the data (:attr:`torchtune_ext.data.StepData.load_seconds`);
        ``rank_wait_fraction``, the share spent waiting for the other ranks in
        the step's collectives (:attr:`StepResult.wait_seconds`). Shares are 0
        when no time was measured.
    """
    total = data_seconds + step_seconds
    return {
        "data_seconds": data_seconds,
        "data_wait_fraction": data_seconds / total if total > 0 else 0.0,
        "rank_wait_fraction": result.wait_seconds / total if total > 0 else 0.0,
    }


def build_lr_scheduler(cfg_lr_scheduler: Any, optimizer: torch.optim.Optimizer, num_training_steps: int):
    """Instantiate the ``lr_scheduler`` config for ``num_training_steps`` optimizer steps.

    ``num_training_steps`` counts optimizer steps, short end-of-epoch steps
    included. Returns None when the config is null (or ``lr_scheduler=null``
    on the command line).
    """
    from torchtune import config as tt_config

    if enabled(cfg_lr_scheduler) is None:
        return None
    # A skipped step (nothing to learn, or non-finite) still counts on the schedule, by design; torch
    # would warn that the schedule stepped before the optimizer when the run's first step is skipped.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",
                            category=UserWarning)
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
                 shifted_labels: torch.Tensor, recompute_output: bool = False) -> TokenSums:
    """Forward one prepared micro-batch and return the loss's sums over its trainable tokens.

    ``recompute_output``: the graph will wait for a later backward, so the
    loss should keep hidden states rather than vocabulary-wide log-probabilities
    (see :class:`torchtune_ext.loss.SummedCrossEntropyLoss`).
    """
    inputs = dict(inputs)
    tokens = inputs.pop("tokens")
    return loss_fn(model(tokens, **inputs), shifted_labels, recompute_output=recompute_output)


def _backward_once(model, loss_fn, prepared, tally: TokenTally, num_tokens: int) -> None:
    """Forward every micro-batch, keep the graphs, one backward on the step's sum / tokens."""
    step_loss = 0
    for inputs, labels in prepared:
        # The graph waits for the step's backward: keep hidden states, not log-probabilities.
        sums = forward_sums(model, loss_fn, inputs, labels, recompute_output=True)
        tally.add(sums)
        step_loss = step_loss + sums.loss
    (step_loss / num_tokens).backward()


def _backward_per_micro_batch(model, loss_fn, prepared, tally: TokenTally, num_tokens: int,
                              defer_sync: bool = True) -> None:
    """Forward and backward each micro-batch on its sum / step tokens.

    ``defer_sync``: under FSDP2, reduce-scatter once per step, after the last
    micro-batch (each rank keeps unsharded gradients until then); False:
    after every micro-batch, keeping only gradient shards (torchtune's way).
    """
    can_defer_sync = defer_sync and hasattr(model, "set_requires_gradient_sync")
    last = len(prepared) - 1
    for i, (inputs, labels) in enumerate(prepared):
        if can_defer_sync:
            model.set_requires_gradient_sync(i == last)
        sums = forward_sums(model, loss_fn, inputs, labels)
        (sums.loss / num_tokens).backward()
        tally.add(sums)
    if can_defer_sync:
        model.set_requires_gradient_sync(True)


def _largest_over_ranks(values: Sequence[int], device: torch.device, dp_group) -> List[int]:
    """The element-wise maximum of integers over the data-parallel ranks (one tiny all-reduce).

    ``device`` is where the process group's backend reduces (CPU for gloo, CUDA for nccl).
    """
    if not dp_is_active(dp_group):
        return list(values)
    largest = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=dp_group)
    return [int(v) for v in largest.tolist()]


def backward_mode(backward: Optional[str] = None, backward_once_per_step: Optional[bool] = None) -> str:
    """The backward mode from the ``backward`` argument, or else from the older boolean.

    ``backward_once_per_step`` True reads as ``"auto"`` (without a memory guard
    that is once per step), False as ``"per_micro_batch"``; neither given:
    ``"auto"``.

    Raises:
        ValueError: ``backward`` is not one of :data:`torchtune_ext.config.BACKWARD_MODES`.
    """
    if backward is None:
        return "per_micro_batch" if backward_once_per_step is False else "auto"
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_MODES)}, got {backward!r}")
    return backward


def forward_backward(
    model: nn.Module,
    loss_fn: SummedCrossEntropyLoss,
    micro_batches: Sequence[MicroBatch],
    *,
    device: torch.device,
    backward: Optional[str] = None,
    dp_group=None,
    memory_guard: Optional[MemoryGuard] = None,
    baseline: Optional[Sequence[MicroBatchShape]] = None,
    step: int = 0,
    backward_once_per_step: Optional[bool] = None,
    rank_wait: Optional[RankWait] = None,
) -> TokenTotals:
    """Accumulate the normalized gradient of one optimizer step.

    Once per step (``backward`` ``"once_per_step"``, or ``"auto"`` where the
    guard allows it) with more than one micro-batch, the step keeps every
    micro-batch's graph until one backward; the loss then recomputes its
    output projection in backward so that what each graph keeps is
    O(tokens x hidden), not O(tokens x vocab).

    ``"auto"``: if ``memory_guard`` estimates that the step needs more than
    its limit (torchtune's recipe's need for the same samples, or the free
    memory), the step runs backward per micro-batch instead (same gradients;
    the decision is the same on every rank; logged at DEBUG only, as it is
    the mode's own). In a single process, an out-of-memory error
    (``torch.OutOfMemoryError``, raised by CUDA) during the once-per-step
    attempt is caught: gradients are dropped, the RNG state is restored, and
    the step is redone per micro-batch (a warning). With several ranks it is
    not caught: the other ranks would be waiting in a collective.

    ``"once_per_step"``: always, and neither limit applies; if the guard
    estimates that the device lacks the memory, one warning says so, once per
    run (from each rank short of it). An out-of-memory error is not caught.

    Args:
        model: torchtune ``TransformerDecoder`` (possibly LoRA, FSDP2-sharded);
            called as ``model(tokens, mask=..., input_pos=...)``.
        loss_fn: sum-reduced loss; its ``ignore_index`` defines trainable tokens.
        micro_batches: dicts from a collator (see :func:`prepare_micro_batch`).
            Not modified.
        device: where the model lives.
        backward: ``"auto"`` (default), ``"once_per_step"`` or ``"per_micro_batch"``
            (see above and the module docstring).
        dp_group: data-parallel process group (None: default group, or none).
        memory_guard: decides whether once per step fits under ``"auto"``, and
            warns under ``"once_per_step"`` (None: auto always tries once per step).
        baseline: this rank's micro-batches as torchtune's recipe would run
            the step (:attr:`torchtune_ext.data.StepData.baseline`), for the
            guard's default limit; None: the device's memory alone decides.
        step (int): optimizer step number, for log lines.
        backward_once_per_step (bool, optional): the older argument, used when
            ``backward`` is None (:func:`backward_mode`).
        rank_wait (RankWait, optional): adds the time of the step's collectives.

    Returns:
        TokenTotals: the step's global and local trainable token counts and
        the global sums of the loss (nats) and the loss's metrics. If
        ``num_tokens`` is 0 no forward or backward ran (on any rank: the count
        is global) and every sum is 0.

    Raises:
        ValueError: an unknown ``backward``.
    """
    mode = backward_mode(backward, backward_once_per_step)
    rank_wait = rank_wait or RankWait(device, active=False)
    tally = TokenTally(loss_fn.metric_names, device, loss_fn.ignore_index)
    prepared, counts = [], []
    for micro_batch in micro_batches:
        inputs, labels = prepare_micro_batch(micro_batch, device, loss_fn.ignore_index)
        counts.append(tally.count(labels))
        prepared.append((inputs, labels))
    with rank_wait.measure():
        num_tokens = tally.global_num_tokens(dp_group)
    if num_tokens == 0:
        return TokenTotals(0, 0, dict.fromkeys(tally.names, 0.0))

    # One micro-batch: its graph waits for no other, all modes are the same.
    once = mode != "per_micro_batch" and len(prepared) > 1
    defer_sync = True  # the user's per-micro-batch mode defers FSDP2's sync (README: Two backward modes)
    if once and memory_guard is not None and (mode == "auto" or not memory_guard.warned_once_per_step):
        shapes = shapes_of(prepared, counts)
        # every rank decides on the same figures: the largest rank's needs bound the step
        needs = memory_guard.step_needs(shapes, baseline)
        with rank_wait.measure():
            needs = _largest_over_ranks(needs, device, dp_group)
        if mode == "auto":
            once, defer_sync = memory_guard.decide_step(needs)
            memory_guard.report(once, shapes, step)
        else:
            memory_guard.warn_once_per_step(needs, shapes, step)
    if not once:
        _backward_per_micro_batch(model, loss_fn, prepared, tally, num_tokens, defer_sync=defer_sync)
        return _with_mode(_totals(tally, dp_group, rank_wait), len(prepared) == 1)
    if dp_is_active(dp_group) or mode == "once_per_step":  # asked for: an out-of-memory error stands
        _backward_once(model, loss_fn, prepared, tally, num_tokens)
        return _with_mode(_totals(tally, dp_group, rank_wait), True)

    rng = _rng_state(device)
    try:
        _backward_once(model, loss_fn, prepared, tally, num_tokens)
        return _with_mode(_totals(tally, dp_group, rank_wait), True)
    except torch.OutOfMemoryError:
        pass  # handled below, once the exception (and the graph its traceback holds) is gone
    log.warning("Optimizer step %d: out of memory with backward once per step; redoing the step with a "
                "backward per micro-batch (same gradients).", step)
    for param in model.parameters():
        param.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if memory_guard is not None:
        memory_guard.note_out_of_memory(shapes_of(prepared, counts))
        memory_guard.once_per_step = False
    _set_rng_state(device, rng)
    tally = TokenTally(loss_fn.metric_names, device, loss_fn.ignore_index)
    for _inputs, labels in prepared:
        tally.count(labels)
    _backward_per_micro_batch(model, loss_fn, prepared, tally, num_tokens)
    return _with_mode(_totals(tally, dp_group, rank_wait), False)


def _totals(tally: TokenTally, dp_group, rank_wait: RankWait) -> TokenTotals:
    with rank_wait.measure():
        return tally.totals(dp_group)


def _with_mode(totals: TokenTotals, once_per_step: bool) -> TokenTotals:
    totals.once_per_step = once_per_step
    return totals


def _rng_state(device: torch.device):
    """The RNG states a redone step must start from (dropout draws the same masks again)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: SummedCrossEntropyLoss,
    micro_batches: Sequence[MicroBatch],
    *,
    device: torch.device,
    backward: Optional[str] = None,
    clip_grad_norm: Optional[float] = None,
    health: Optional[StepHealth] = None,
    step: int = 0,
    dp_group=None,
    memory_guard: Optional[MemoryGuard] = None,
    baseline: Optional[Sequence[MicroBatchShape]] = None,
    backward_once_per_step: Optional[bool] = None,
) -> StepResult:
    """Run one optimizer step over ``micro_batches`` (see the module docstring).

    Gradients are zeroed afterwards whether or not the step ran. A step with
    no trainable token on any rank is skipped: parameters and optimizer state
    stay unchanged and a warning is logged.

    With an :class:`~torchtune_ext.optim_in_bwd.OptimizerInBackward` the
    parameters are updated by its hooks during the step's single backward
    (``backward="once_per_step"`` is implied), ``grad_norm`` is what the hooks
    summed, and ``clip_grad_norm`` must be None.

    Args:
        backward (str, optional): ``"auto"`` (default), ``"once_per_step"`` or
            ``"per_micro_batch"``: see :func:`forward_backward`.
        step (int): 1-based optimizer step number, for messages.
        clip_grad_norm (float, optional): max total gradient norm; None: no clipping.
        health (StepHealth, optional): the run's health checks
            (:class:`torchtune_ext.health.StepHealth`, which keeps a loss
            history and decides about non-finite steps); None: a fresh one
            that stops at any sign.
        memory_guard (MemoryGuard, optional): falls back to a backward per
            micro-batch when once per step would not fit (see :func:`forward_backward`).
        baseline: see :func:`forward_backward`.
        backward_once_per_step (bool, optional): the older argument, used when
            ``backward`` is None (:func:`backward_mode`).
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
    in_backward = isinstance(optimizer, OptimizerInBackward)
    if in_backward:
        if clip_grad_norm is not None:
            raise ValueError("clip_grad_norm cannot be used with an optimizer in backward")
        optimizer.start_step()
    mode = backward_mode(backward, backward_once_per_step)
    rank_wait = RankWait(device, active=dp_is_active(dp_group))
    totals = forward_backward(
        model, loss_fn, micro_batches, device=device,
        # in backward: one backward per step, so each hook sees the parameter's whole step gradient
        # (no fallback to a backward per micro-batch either)
        backward="once_per_step" if in_backward else mode, dp_group=dp_group,
        memory_guard=None if in_backward else memory_guard, baseline=baseline, step=step, rank_wait=rank_wait,
    )
    num_tokens, local_num_tokens = totals.num_tokens, totals.local_num_tokens
    if num_tokens == 0:
        optimizer.zero_grad(set_to_none=True)
        health.empty(step)
        log.warning("Optimizer step %d skipped: no trainable token in any of its micro-batches.", step)
        return StepResult(None, 0, 0, None, skipped="empty", wait_seconds=rank_wait.seconds)

    means = totals.means()
    loss = means.pop("loss")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if in_backward:  # the hooks updated the parameters in backward and summed their gradients' squares
        grad_norm = optimizer.grad_norm().item()
    else:
        grad_norm = grad_norm_and_clip(params, clip_grad_norm, rank_wait).item()
    try:
        skip = health.before_update(step, loss, grad_norm, num_tokens)
    except TrainingHealthError:
        # nothing updated (an optimizer in backward has, and is never combined with skipping)
        optimizer.zero_grad(set_to_none=True)
        raise
    if skip:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, num_tokens, local_num_tokens, grad_norm, skipped="non-finite", metrics=means,
                          once_per_step=totals.once_per_step, wait_seconds=rank_wait.seconds)

    optimizer.step()  # in backward: the hooks updated already; this finds no gradient
    optimizer.zero_grad(set_to_none=True)
    health.after_update(step, params, loss, grad_norm)
    return StepResult(loss, num_tokens, local_num_tokens, grad_norm, metrics=means, once_per_step=totals.once_per_step,
                      wait_seconds=rank_wait.seconds)
