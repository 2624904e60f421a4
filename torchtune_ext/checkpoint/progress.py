"""Where training stands: the step counters and the data position a checkpoint saves."""

from dataclasses import dataclass, field
from typing import Any, List


@dataclass
class Progress:
    """Where training stands, saved with every checkpoint.

    Attributes:
        step (int): optimizer steps completed (global, 1-based count).
        epoch (int): current epoch, 0-based.
        steps_in_epoch (int): optimizer steps completed within ``epoch`` (for
            ``max_steps_per_epoch``).
        samples_in_epoch (int): samples of ``epoch``'s order trained on so far,
            all ranks: the data position, independent of batch size,
            accumulation and world size.
        skipped_steps (int): optimizer steps skipped so far (empty/non-finite).
        seed (int): the run's seed (model initialization, LoRA adapters, dropout).
        data_seed (int): the seed of the epochs' sample order: 0, whatever ``seed`` is, as
            torchtune's recipes give their ``DistributedSampler``; a checkpoint of an
            earlier version, whose order followed ``seed``, keeps its order on resume.
        tokens_seen (int): trainable tokens (after the label shift, all ranks)
            of the optimizer steps that updated the model so far.
        total_steps (int): optimizer steps of the whole run, the length the
            LR schedule is built for (0: not known yet).
        healthy_losses (list of float): the global losses of the last healthy optimizer steps,
            oldest first (at most :data:`torchtune_ext.train.health.SPIKE_WINDOW`), that the loss-spike
            check compares against; a resumed run continues the check with them at its first step
            (empty in checkpoints of earlier versions).
    """

    step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    samples_in_epoch: int = 0
    skipped_steps: int = 0
    seed: int = 0
    data_seed: int = 0
    tokens_seen: int = 0
    total_steps: int = 0
    healthy_losses: List[float] = field(default_factory=list)

    def complete_step(self, skipped: bool, end_sample: int, num_tokens: int = 0) -> None:
        """Count a finished optimizer step (``skipped``: it did not update) that
        ended at sample ``end_sample`` of the epoch's order and trained on
        ``num_tokens`` trainable tokens."""
        self.step += 1
        self.steps_in_epoch += 1
        self.samples_in_epoch = end_sample
        self.skipped_steps += bool(skipped)
        if not skipped:
            self.tokens_seen += num_tokens

    def complete_epoch(self) -> None:
        self.epoch += 1
        self.steps_in_epoch = 0
        self.samples_in_epoch = 0

    def plan(self, loader: Any, epochs: int) -> int:
        """Set and return :attr:`total_steps`: the steps done plus those ``loader`` will run.

        Args:
            loader: a :class:`torchtune_ext.data.step_loader.StepLoader` (``steps_per_epoch``,
                ``remaining_steps``) with this run's batch size, accumulation
                and world size.
            epochs: the run's ``epochs``.

        With the settings the run started with this is ``epochs *
        steps_per_epoch``; after a resume with another global batch size, the
        steps already done keep their count and the rest is counted anew.
        """
        left = 0
        if self.epoch < epochs:
            left = loader.remaining_steps(self.samples_in_epoch, self.steps_in_epoch)
            left += (epochs - self.epoch - 1) * loader.steps_per_epoch
        self.total_steps = self.step + left
        return self.total_steps
