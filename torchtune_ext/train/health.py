"""Signs that training has gone bad, checked at every optimizer step.

A finite loss is not a healthy model. With ``optimizer.lr=1e6`` the first
update destroys the weights; the next step's loss is ln(vocabulary size)
(uniform predictions) with a gradient of exactly zero, both finite, and the
broken model is saved as a checkpoint before NaN shows up a step later. So
:func:`torchtune_ext.train.step.train_step` asks a :class:`StepHealth` about every
step, using only numbers the step has anyway plus one cheap pass:

==========================  ===================================  ==========================
sign                        when                                 what happens
==========================  ===================================  ==========================
non-finite loss or          before the update                    the step is skipped with
gradient norm                                                    ``skip_nonfinite_steps``,
                                                                 else the run stops;
                                                                 5 in a row always stop it
gradient norm exactly 0     before the update                    the run stops: nothing
with trainable tokens                                            can be learned any more
loss more than              before the update                    a warning; two steps in a
``loss_spike_nats`` above                                        row stop the run
the highest loss of the
last 32 healthy steps
non-finite parameters (or   after the update: one fused norm     the run stops (an update
so large that their norm    pass over the trained parameters     cannot be undone), before
overflows)                  (``torch._foreach_norm``)            anything is saved
==========================  ===================================  ==========================

Every decision is made from global values (the loss and gradient norm are
already reduced over ranks; the parameter check adds one scalar all-reduce),
so under FSDP all ranks agree and stop at the same step. The errors raised
(:class:`~torchtune_ext.errors.TrainingHealthError`, :class:`~torchtune_ext.errors.NonFiniteError`)
live in :mod:`torchtune_ext.errors`.

Which checkpoint to trust: the parameters saved as ``step_<j>`` are
confirmed healthy once step ``j + 1`` runs on them without a sign. A sign at
step ``k`` before the update makes the parameters of step ``k - 1`` suspect
(they produced it); a sign after the update, those of step ``k``. The error
names the newest checkpoint from before the first suspect step of the
incident, and the checkpoints saved after the damage, which must not be
resumed from. A healthy step ends an incident (a single spike from one odd
batch is forgotten).

A run whose last step was skipped as non-finite did not end well: its final
parameters produce non-finite values. :meth:`StepHealth.finish` says so and
raises; otherwise it logs one summary line with the skipped steps.
"""

import logging
import math
from pathlib import Path
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtune_ext import ranks
from torchtune_ext.checkpoint import list_checkpoints
from torchtune_ext.errors import ConfigError, NonFiniteError, TrainingHealthError

log = logging.getLogger(__name__)

# With skip_nonfinite_steps, this many non-finite steps in a row stop the run:
# the parameters themselves, not a few odd batches, produce the values.
MAX_NONFINITE_IN_A_ROW = 5
# The loss-spike rule compares against the highest loss of this many healthy steps
# (at least SPIKE_MIN_HISTORY of them).
SPIKE_WINDOW = 32
SPIKE_MIN_HISTORY = 3


def parameters_finite(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every entry of ``parameters`` (all shards, all ranks) is finite.

    One fused L2-norm pass (``torch._foreach_norm``, one multi-tensor kernel
    on CUDA; 56 ms for SmolLM2-135M in fp32 on 2 CPU cores) per device, the
    norms summed in float64: NaN and inf propagate into the sum. Entries
    beyond about 1e19, whose squares overflow the dtype, count as
    non-finite too: weights that large are destroyed anyway. Under FSDP2
    (and tensor parallelism) each rank checks its shards and one all-reduce
    over every rank adds the results, so every rank gets the same answer.
    """
    by_device, sharded, device = {}, False, None
    for p in parameters:
        t = p.detach()
        if isinstance(t, DTensor):
            sharded = True
            t = t.to_local()
        device = device or t.device
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    if device is None:
        return True
    total = torch.zeros((), dtype=torch.float64, device=device)
    for tensors in by_device.values():
        total += torch.stack(torch._foreach_norm(tensors)).double().sum().to(device)
    if sharded and dist.is_initialized():  # a sum over every rank holds each shard (some more than once): finite or not
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return bool(torch.isfinite(total))


class StepHealth:
    """Watches the optimizer steps of one run; see the module docstring.

    Args:
        output_dir (str, optional): the run's folder, to name the checkpoints
            to trust in messages; None leaves them out.
        skip_nonfinite_steps (bool): skip a step with a non-finite loss or
            gradient norm (no update) instead of stopping.
        loss_spike_nats (float, optional): a step whose loss is more than this
            many nats per token above the highest loss of the last 32 healthy
            steps is a spike; None turns the rule off.
        start_step (int): optimizer steps done before this run (resume).
        history (list of float, optional): the list the losses of the last healthy steps are kept
            in, oldest first, updated in place (at most :data:`SPIKE_WINDOW`). A run passes its
            :attr:`Progress.healthy_losses <torchtune_ext.checkpoint.Progress>`: every checkpoint then
            saves it, and a resumed run (or a torchrun restart) checks its first step against the
            steps before the checkpoint instead of waiting for :data:`SPIKE_MIN_HISTORY` new ones.
            None: a list of its own, empty.
    """

    def __init__(self, output_dir: Optional[str] = None, *, skip_nonfinite_steps: bool = False,
                 loss_spike_nats: Optional[float] = None, start_step: int = 0,
                 history: Optional[List[float]] = None):
        self.output_dir = output_dir
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.loss_spike_nats = loss_spike_nats
        self.start_step = self.last_step = start_step
        self._losses: List[float] = history if history is not None else []
        del self._losses[:-SPIKE_WINDOW]
        self._suspect_from: Optional[int] = None  # first suspect step of the current incident
        self._spike_at: Optional[int] = None
        self._nonfinite_run: List[int] = []  # non-finite steps in a row, up to now
        self.skipped = {"non-finite": [], "empty": []}

    @property
    def suspect_from(self) -> Optional[int]:
        """The first step whose parameters are suspect in the current incident, or None when healthy.

        Checkpoint ``step_<j>`` predates the damage iff ``j < suspect_from``; the
        checkpoint manager never prunes the newest such checkpoint.
        """
        return self._suspect_from

    # ----------------------------------------------------------------- checks
    def empty(self, step: int) -> None:
        """Step ``step`` had no trainable token on any rank and was skipped (a warning, on rank 0)."""
        self.last_step = step
        self.skipped["empty"].append(step)
        _warn_once_per_job("Optimizer step %d skipped: no trainable token in any of its micro-batches.", step)

    def before_update(self, step: int, loss: float, grad_norm: float, num_tokens: int) -> bool:
        """Check a step's global loss and gradient norm before the optimizer updates anything.

        Returns:
            True if the step must be skipped (non-finite, ``skip_nonfinite_steps``).

        Raises:
            NonFiniteError: non-finite loss or gradient norm, not skipped (or
                :data:`MAX_NONFINITE_IN_A_ROW` of them).
            TrainingHealthError: a zero gradient with trainable tokens, or a
                second loss spike in a row.
        """
        self.last_step = step
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._suspect(step - 1)
            self._nonfinite_run.append(step)
            if not self.skip_nonfinite_steps:
                raise NonFiniteError(step, loss, grad_norm, self._advice(
                    "; or set skip_nonfinite_steps=true to skip steps like this one"), self._suspect_from)
            if len(self._nonfinite_run) >= MAX_NONFINITE_IN_A_ROW:
                raise NonFiniteError(step, loss, grad_norm, f", the {len(self._nonfinite_run)}th in a row "
                                     f"(steps {self._nonfinite_run[0]}-{step}): the parameters themselves produce "
                                     "them" + self._advice(), self._suspect_from)
            self.skipped["non-finite"].append(step)
            _warn_once_per_job("Optimizer step %d skipped: loss=%s grad_norm=%s", step, loss, grad_norm)
            return True
        self._nonfinite_run = []
        if grad_norm == 0.0:
            self._suspect(step - 1)
            raise TrainingHealthError(
                step, f"the gradient is exactly zero at optimizer step {step} although the step has {num_tokens} "
                f"trainable tokens (loss={loss:.4f}): the model no longer learns; an earlier update most likely "
                "destroyed its parameters", self._suspect_from, self._advice())
        if self._is_spike(loss):
            self._suspect(step - 1)
            if self._spike_at == step - 1:
                raise TrainingHealthError(
                    step, f"the loss jumped at optimizer steps {step - 1} and {step} (now {loss:.4f}, more than "
                    f"loss_spike_nats={self.loss_spike_nats} above the highest loss of the healthy steps before, "
                    f"{max(self._losses):.4f}): training has diverged", self._suspect_from,
                    self._advice("; or raise loss_spike_nats (null turns this check off)"))
            self._spike_at = step
            _warn_once_per_job("Optimizer step %d: loss %.4f is more than loss_spike_nats=%s above the highest loss "
                               "of the last %d healthy steps (%.4f); if the next step's is too, the run stops.", step,
                               loss, self.loss_spike_nats, len(self._losses), max(self._losses))
            return False
        self._spike_at = None
        self._suspect_from = None  # the parameters of step - 1 are confirmed healthy
        self._losses.append(loss)
        del self._losses[:-SPIKE_WINDOW]
        return False

    def after_update(self, step: int, parameters: Iterable[torch.Tensor], loss: float, grad_norm: float) -> None:
        """Check the parameters the optimizer just updated.

        Raises:
            TrainingHealthError: a parameter is NaN/inf (or overflows; see
                :func:`parameters_finite`). The update cannot be undone, so
                this stops the run even with ``skip_nonfinite_steps``.
        """
        if not parameters_finite(parameters):
            self._suspect(step)
            raise TrainingHealthError(
                step, f"the update of optimizer step {step} made parameters non-finite (loss={loss:.4f}, "
                f"grad_norm={grad_norm:.4g}); an update cannot be undone", self._suspect_from, self._advice())

    # ------------------------------------------------------------- end of run
    def finish(self) -> str:
        """The run's summary line (for the recipe to log); raises if the run ended in non-finite steps.

        Raises:
            TrainingHealthError: the last optimizer step was skipped as non-finite:
                the final parameters produce non-finite values, so the run is
                not a success even though it reached its end.
        """
        if self._nonfinite_run and self._nonfinite_run[-1] == self.last_step:
            steps = self._nonfinite_run
            raise TrainingHealthError(
                self.last_step, f"the run ended with {len(steps)} non-finite optimizer step(s) in a row "
                f"({steps[0]}-{steps[-1]}), skipped: its final parameters produce non-finite values",
                self._suspect_from, self._advice())
        done = self.last_step - self.start_step
        if done == 0:
            return f"Training finished: no optimizer step was left to run after step {self.start_step}"
        parts = [f"{len(v)} {k} (steps {_steps(v)})" for k, v in self.skipped.items() if v]
        which = (f"step {self.last_step}" if done == 1 else f"steps {self.start_step + 1}-{self.last_step}")
        summary = (f"Training finished: {done} optimizer step{'s' if done > 1 else ''} in this run ({which}), "
                   + (f"skipped: {'; '.join(parts)}" if parts else "none skipped"))
        return summary

    # --------------------------------------------------------------- helpers
    def _suspect(self, step: int) -> None:
        self._suspect_from = step if self._suspect_from is None else min(self._suspect_from, step)

    def _is_spike(self, loss: float) -> bool:
        return (self.loss_spike_nats is not None and len(self._losses) >= SPIKE_MIN_HISTORY
                and loss > max(self._losses) + self.loss_spike_nats)

    def _advice(self, extra: str = "") -> str:
        """Which checkpoint predates the damage, which do not, and what to do."""
        if self.output_dir is None:
            return extra
        suspect_from = self._suspect_from if self._suspect_from is not None else self.last_step
        try:
            found = [(int(p.name.split("_")[1]), p) for p in list_checkpoints(self.output_dir)]
        except ConfigError as err:  # a folder that cannot be read must not hide why training stopped
            return f". The checkpoints cannot be listed ({err})" + extra
        before = [p for s, p in found if s < suspect_from]
        after = [Path(p).name for s, p in found if s >= suspect_from]
        text = f". Last checkpoint from before the damage: {before[-1] if before else 'none (only the base model)'}"
        if after:
            text += f"; saved after it, not to be resumed from: {', '.join(after)}"
        if not before:
            text += ". Lower optimizer.lr and start again in a new output_dir"
        else:
            text += (". Lower optimizer.lr" + (", move the later checkpoints out of output_dir" if after else "")
                     + " and resume with resume_from_checkpoint=true")
        return text + extra


def _warn_once_per_job(message: str, *args: object) -> None:
    """A warning about a step, from rank 0 only: every rank takes the same decision from the same global values,
    and N ranks printed it N times."""
    if ranks.is_rank_zero():
        log.warning(message, *args)


def _steps(steps: List[int], shown: int = 5) -> str:
    text = ", ".join(str(s) for s in steps[:shown])
    return text + (f", ... {steps[-1]}" if len(steps) > shown else "")
