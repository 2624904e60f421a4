"""One optimizer step over a window of micro-batches: the loop every recipe shares.

Order of work, the same in every backward mode and for every objective
(:mod:`torchtune_ext.train.objective`: what a micro-batch's units are and
what its forward sums):

1. prepare every micro-batch: labels shifted once (never across the
   documents of a pack) and its units counted from that shifted tensor
   (trainable tokens; pairs for a preference objective), before any forward;
2. sum the count over data-parallel ranks (one scalar all-reduce);
3. decide how to backpropagate (:func:`plan_backward`, the one place that
   does), then forward each micro-batch for its summed loss and backward on
   ``summed_loss / global_count`` -- normalized before backward, so no
   gradient ever holds an unnormalized sum and none is rescaled afterwards;
4. sum the loss and the metrics over ranks (one small all-reduce);
5. global gradient norm (before clipping), optional clipping, health checks
   (:mod:`torchtune_ext.train.health`: non-finite values, a zero gradient, loss
   spikes), optimizer step, a check that the parameters are still finite.

``backward`` (the config key of the same name) says how the micro-batches
are backpropagated; all give the same gradients up to floating-point
summation order:

* ``"once_per_step"`` keeps the graphs of all micro-batches and calls
  backward once on the accumulated sum (the loss recomputes its output
  projection in backward, so no graph keeps vocabulary-wide logits): the
  design this project started from, one backward per optimizer step;
* ``"per_micro_batch"`` calls backward after each micro-batch (activation
  memory independent of the number of micro-batches) and, under FSDP2, syncs
  gradients only on the last one;
* ``"auto"`` lets a :class:`torchtune_ext.train.memory.MemoryGuard` choose per step:
  once per step where it fits its limit, else per micro-batch.

Data parallelism: each rank's loss is its *local* sum divided by the
*global* count, so the gradient of the step loss is the SUM of the ranks'
gradients. The distributed recipes set FSDP's gradient divide factor to 1
so that FSDP sums instead of averaging.

Tensor parallelism: the ranks of one tensor-parallel group train on the same
samples, so the count, the loss and the metrics are summed over the
data-parallel group only (``dp_group``); summed over every rank they would
count each unit once per tensor-parallel rank. Decisions every rank must
share (the memory guard's, whether an out-of-memory error may be caught)
are taken over all ranks.
"""

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchtune_ext.config import BACKWARD_MODES, enabled
from torchtune_ext.errors import TrainingHealthError
from torchtune_ext.train.accounting import TokenTally, TokenTotals, dp_is_active
from torchtune_ext.train.grad_norm import grad_norm_and_clip
from torchtune_ext.train.health import StepHealth
from torchtune_ext.train.memory import MemoryGuard, MicroBatchShape, shapes_of
from torchtune_ext.train.objective import Objective, Prepared, as_objective
from torchtune_ext.train.optim_in_bwd import OptimizerInBackward

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
        unit (str): what the step's loss and metrics are means over: ``"tokens"`` (trainable tokens), or
            ``"pairs"`` (a preference objective, :mod:`torchtune_ext.train.preference`): then ``loss`` and
            ``metrics`` are means over the step's ``num_pairs`` pairs (all ranks), and ``num_tokens`` /
            ``local_num_tokens`` count the non-padding tokens of both responses of every pair.
        num_pairs (int): preference pairs of the step, all dp ranks (0 when the unit is a token).
    """

    loss: Optional[float]
    num_tokens: int
    local_num_tokens: int
    grad_norm: Optional[float]
    skipped: Optional[str] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    once_per_step: Optional[bool] = None
    wait_seconds: float = 0.0
    unit: str = "tokens"
    num_pairs: int = 0


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
        loading the data (:attr:`torchtune_ext.data.step_loader.StepData.load_seconds`);
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


@dataclass(frozen=True)
class BackwardPlan:
    """How one step backpropagates (:func:`plan_backward`).

    Attributes:
        once (bool): keep every micro-batch's graph and call backward once on the step's sum.
        defer_sync (bool): per micro-batch under FSDP2: reduce-scatter once, after the last micro-batch
            (each rank keeps unsharded gradients until then); False: after each one (torchtune's way).
        retry_per_micro_batch (bool): once per step may be tried and, on an out-of-memory error, the step
            redone per micro-batch (one process, ``"auto"``: no other rank waits in a collective).
    """

    once: bool
    defer_sync: bool = True
    retry_per_micro_batch: bool = False


def check_backward(backward: str) -> str:
    """``backward`` if it is one of :data:`torchtune_ext.config.BACKWARD_MODES`.

    Raises:
        ValueError: another value.
    """
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward must be one of {', '.join(BACKWARD_MODES)}, got {backward!r}")
    return backward


def plan_backward(backward: str, prepared: Sequence[Prepared], *, device: torch.device,
                  memory_guard: Optional[MemoryGuard] = None, baseline: Optional[Sequence[MicroBatchShape]] = None,
                  step: int = 0, rank_wait: Optional["RankWait"] = None) -> BackwardPlan:
    """The one place where a step's backward mode is decided.

    * one micro-batch: its graph waits for no other, so it is backpropagated right away in every mode (the
      step had one backward: reported as once per step), without recomputing the output projection;
    * ``"per_micro_batch"``: per micro-batch, FSDP2's sync deferred to the last one;
    * ``"once_per_step"``: once; if ``memory_guard`` estimates that the device
      lacks the memory, one warning says so, once per run;
    * ``"auto"``: once where ``memory_guard`` estimates that the step fits its
      limit, else per micro-batch (the guard decides whether to defer the
      sync too); every rank decides on the largest rank's figures. Without a
      guard: once. In one process an out-of-memory error may then be caught
      and the step redone per micro-batch (:attr:`BackwardPlan.retry_per_micro_batch`).
    """
    if backward == "per_micro_batch" or len(prepared) <= 1:
        return BackwardPlan(once=False)
    alone = not dp_is_active()
    if memory_guard is None or (backward == "once_per_step" and memory_guard.warned_once_per_step):
        return BackwardPlan(once=True, retry_per_micro_batch=alone and backward == "auto")
    shapes = shapes_of(prepared)
    needs = memory_guard.step_needs(shapes, baseline)
    with (rank_wait or RankWait(device, active=False)).measure():
        needs = _largest_over_ranks(needs, device)  # the largest rank's needs bound the step
    if backward == "once_per_step":
        memory_guard.warn_once_per_step(needs, shapes, step)
        return BackwardPlan(once=True)
    once, defer_sync = memory_guard.decide_step(needs)
    memory_guard.report(once, shapes, step)
    return BackwardPlan(once=once, defer_sync=defer_sync, retry_per_micro_batch=once and alone)


def _backward_once(model: nn.Module, objective: Objective, prepared: Sequence[Prepared], tally: TokenTally,
                   count: int) -> None:
    """Forward every micro-batch, keep the graphs, one backward on the step's sum / count."""
    step_loss = 0
    for micro_batch in prepared:
        # The graph waits for the step's backward: keep hidden states, not log-probabilities.
        sums = objective(model, micro_batch, recompute_output=True)
        tally.add(sums)
        step_loss = step_loss + sums.loss
    (step_loss / count).backward()


def _backward_per_micro_batch(model: nn.Module, objective: Objective, prepared: Sequence[Prepared],
                              tally: TokenTally, count: int, defer_sync: bool = True) -> None:
    """Forward and backward each micro-batch on its sum / step count (see :attr:`BackwardPlan.defer_sync`)."""
    can_defer_sync = defer_sync and hasattr(model, "set_requires_gradient_sync")
    last = len(prepared) - 1
    for i, micro_batch in enumerate(prepared):
        if can_defer_sync:
            model.set_requires_gradient_sync(i == last)
        sums = objective(model, micro_batch)
        (sums.loss / count).backward()
        tally.add(sums)
    if can_defer_sync:
        model.set_requires_gradient_sync(True)


def _largest_over_ranks(values: Sequence[int], device: torch.device) -> List[int]:
    """The element-wise maximum of integers over all ranks of the job (one tiny all-reduce).

    All ranks, not only the data-parallel ones: the ranks of a tensor-parallel
    group run each other's collectives inside every forward and backward, so
    they must choose the same backward mode. ``device`` is where the process
    group's backend reduces (CPU for gloo, CUDA for nccl).
    """
    if not dp_is_active():
        return list(values)
    largest = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return [int(v) for v in largest.tolist()]


def forward_backward(
    model: nn.Module,
    objective: Any,
    micro_batches: Sequence[MicroBatch],
    *,
    device: torch.device,
    backward: str = "auto",
    dp_group=None,
    memory_guard: Optional[MemoryGuard] = None,
    baseline: Optional[Sequence[MicroBatchShape]] = None,
    step: int = 0,
    rank_wait: Optional[RankWait] = None,
) -> TokenTotals:
    """Accumulate the normalized gradient of one optimizer step.

    Prepare and count every micro-batch, sum the count over ranks, decide
    the backward mode (:func:`plan_backward`), then forward and backward.
    Once per step with more than one micro-batch, the step keeps every
    micro-batch's graph until one backward; the loss then recomputes its
    output projection in backward so that what each graph keeps is
    O(tokens x hidden), not O(tokens x vocab). In a single process under
    ``"auto"``, an out-of-memory error (``torch.OutOfMemoryError``, raised by
    CUDA) during the once-per-step attempt is caught: gradients are dropped,
    the RNG state is restored, and the step is redone per micro-batch (a
    warning). With several ranks it is not caught: the other ranks would be
    waiting in a collective.

    Args:
        model: torchtune ``TransformerDecoder`` or transformers model (possibly
            LoRA, FSDP2-sharded), called as ``model(tokens, mask=..., input_pos=...)``.
        objective: an :class:`~torchtune_ext.train.objective.Objective`, or a
            sum-reduced token loss (:class:`~torchtune_ext.train.objective.TokenObjective`
            then wraps it).
        micro_batches: dicts from a collator. Not modified.
        device: where the model lives.
        backward: ``"auto"`` (default), ``"once_per_step"`` or ``"per_micro_batch"``
            (see the module docstring and :func:`plan_backward`).
        dp_group: the data-parallel process group, which the count and the
            sums are reduced over (:attr:`torchtune_ext.parallel.mesh.Parallelism.dp_group`;
            None: the default group, i.e. every rank, or none).
        memory_guard: decides whether once per step fits under ``"auto"``, and
            warns under ``"once_per_step"`` (None: auto always tries once per step).
        baseline: this rank's micro-batches as torchtune's recipe would run
            the step (:attr:`torchtune_ext.data.step_loader.StepData.baseline`), for the
            guard's default limit; None: the device's memory alone decides.
        step (int): optimizer step number, for log lines.
        rank_wait (RankWait, optional): adds the time of the step's collectives.

    Returns:
        TokenTotals: the step's global and local counts and the global sums of
        the loss and the metrics. If the count is 0 no forward or backward ran
        (on any rank: the count is global) and every sum is 0.

    Raises:
        ValueError: an unknown ``backward``.
    """
    mode = check_backward(backward)
    objective = as_objective(objective)
    rank_wait = rank_wait or RankWait(device, active=False)
    prepared = [objective.prepare(micro_batch, device) for micro_batch in micro_batches]
    tally = TokenTally(objective.metric_names, device, objective.ignore_index)
    for micro_batch in prepared:
        tally.add_count(micro_batch.count)
    with rank_wait.measure():
        count = tally.global_num_tokens(dp_group)
    if count == 0:
        return TokenTotals(0, 0, dict.fromkeys(tally.names, 0.0))

    plan = plan_backward(mode, prepared, device=device, memory_guard=memory_guard, baseline=baseline, step=step,
                         rank_wait=rank_wait)
    if not plan.once:
        _backward_per_micro_batch(model, objective, prepared, tally, count, defer_sync=plan.defer_sync)
        return _with_mode(_totals(tally, dp_group, rank_wait), len(prepared) == 1)
    if not plan.retry_per_micro_batch:
        _backward_once(model, objective, prepared, tally, count)
        return _with_mode(_totals(tally, dp_group, rank_wait), True)

    rng = _rng_state(device)
    try:
        _backward_once(model, objective, prepared, tally, count)
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
        memory_guard.note_out_of_memory(shapes_of(prepared))
        memory_guard.once_per_step = False
    _set_rng_state(device, rng)
    tally = TokenTally(objective.metric_names, device, objective.ignore_index)
    for micro_batch in prepared:
        tally.add_count(micro_batch.count)
    _backward_per_micro_batch(model, objective, prepared, tally, count)
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
    objective: Any,
    micro_batches: Sequence[MicroBatch],
    *,
    device: torch.device,
    backward: str = "auto",
    clip_grad_norm: Optional[float] = None,
    health: Optional[StepHealth] = None,
    step: int = 0,
    dp_group=None,
    memory_guard: Optional[MemoryGuard] = None,
    baseline: Optional[Sequence[MicroBatchShape]] = None,
) -> StepResult:
    """Run one optimizer step over ``micro_batches`` (see the module docstring).

    Gradients are zeroed afterwards whether or not the step ran. A step with
    no trainable token on any rank is skipped: parameters and optimizer state
    stay unchanged and a warning is logged.

    With an :class:`~torchtune_ext.train.optim_in_bwd.OptimizerInBackward` the
    parameters are updated by its hooks during the step's single backward
    (``backward="once_per_step"`` is implied), ``grad_norm`` is what the hooks
    summed, and ``clip_grad_norm`` must be None.

    Args:
        backward (str, optional): ``"auto"`` (default), ``"once_per_step"`` or
            ``"per_micro_batch"``: see :func:`forward_backward`.
        step (int): 1-based optimizer step number, for messages.
        clip_grad_norm (float, optional): max total gradient norm; None: no clipping.
        health (StepHealth, optional): the run's health checks
            (:class:`torchtune_ext.train.health.StepHealth`, which keeps a loss
            history and decides about non-finite steps); None: a fresh one
            that stops at any sign.
        memory_guard (MemoryGuard, optional): falls back to a backward per
            micro-batch when once per step would not fit (see :func:`forward_backward`).
        baseline: see :func:`forward_backward`.
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
    mode = check_backward(backward)
    rank_wait = RankWait(device, active=dp_is_active())
    totals = forward_backward(
        model, objective, micro_batches, device=device,
        # in backward: one backward per step, so each hook sees the parameter's whole step gradient
        # (no fallback to a backward per micro-batch either)
        backward="once_per_step" if in_backward else mode, dp_group=dp_group,
        memory_guard=None if in_backward else memory_guard, baseline=baseline, step=step, rank_wait=rank_wait,
    )
    num_tokens, local_num_tokens = totals.num_tokens, totals.local_num_tokens
    unit = getattr(as_objective(objective), "unit", "tokens")
    by_unit = {} if unit == "tokens" else {"unit": unit, "num_pairs": num_tokens}
    if unit != "tokens" and num_tokens:  # the tally counted pairs; their tokens are a sum the objective returned
        num_tokens = int(round(totals.sums.pop("num_tokens")))
        local_num_tokens = 0  # not reduced per rank; nothing reads it for pairs
    if totals.num_tokens == 0:
        optimizer.zero_grad(set_to_none=True)
        health.empty(step)  # says so, once per job
        return StepResult(None, 0, 0, None, skipped="empty", wait_seconds=rank_wait.seconds, **by_unit)

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
                          once_per_step=totals.once_per_step, wait_seconds=rank_wait.seconds, **by_unit)

    optimizer.step()  # in backward: the hooks updated already; this finds no gradient
    optimizer.zero_grad(set_to_none=True)
    health.after_update(step, params, loss, grad_norm)
    return StepResult(loss, num_tokens, local_num_tokens, grad_norm, metrics=means, once_per_step=totals.once_per_step,
                      wait_seconds=rank_wait.seconds, **by_unit)
