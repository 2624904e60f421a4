"""A preference-tuning run: the shared run (:mod:`torchtune_ext.run.loop`) with pairs as its unit.

:class:`PreferenceRun` differs from :class:`~torchtune_ext.run.loop.TrainingRun`
in what it builds before the model: the data are preference pairs
(:mod:`torchtune_ext.data.preference`), the objective is
:class:`~torchtune_ext.train.preference.PreferenceObjective` with the
config's ``loss`` (:mod:`torchtune_ext.config.preference`). Everything
else -- the step that counts the pairs of all micro-batches and ranks before
any forward and divides once, checkpoints, resume, signals, validation,
metrics -- is the shared run's. The recipe gives the reference model
(:meth:`PreferenceRun.use_reference`) once it has built its model.
"""

from typing import Any, Callable, ContextManager, Dict, Optional

from torch import nn
from torchtune import training

from torchtune_ext.config import validation_enabled
from torchtune_ext.config.preference import preference_loss_arguments
from torchtune_ext.data.preference import build_pair_loader
from torchtune_ext.run.loop import TrainingRun
from torchtune_ext.run.preflight import model_max_seq_len, model_vocab_size
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.preference import ModelReference, PreferenceLoss, PreferenceObjective


class PreferenceRun(TrainingRun):
    """A :class:`~torchtune_ext.run.loop.TrainingRun` over preference pairs (DPO and its variants).

    ``loss_fn`` owns the policy's output projection (the model returns hidden
    states and only the responses' trainable positions are projected), with
    ``num_output_chunks: auto``; ``objective`` sums the pairs' losses.
    """

    def build_objective_and_data(self) -> None:
        cfg = self.cfg
        self.loss_fn = SummedCrossEntropyLoss(token_metrics=False)
        if cfg.compile:
            self.loss_fn.compile_chunk()
        self.objective = PreferenceObjective(self.loss_fn, PreferenceLoss(**preference_loss_arguments(cfg.loss)))
        common = dict(ignore_index=self.loss_fn.ignore_index, model_max_seq_len=model_max_seq_len(cfg.model),
                      model_vocab_size=model_vocab_size(cfg.model),  # a token id past the embedding: refused
                      dp_rank=self.dp_rank, dp_world_size=self.world_size)
        self.data = build_pair_loader(cfg, self.tokenizer, seed=self.progress.data_seed, **common)
        self.val_data = (build_pair_loader(cfg, self.tokenizer, seed=0, key="dataset_val", training=False, **common)
                         if validation_enabled(cfg) else None)

    @property
    def needs_reference(self) -> bool:
        """Whether the configured loss reads a reference model (not SimPO or reference-free DPO)."""
        return self.objective.loss.needs_reference

    def use_reference(self, model: nn.Module, lm: Optional[SummedCrossEntropyLoss] = None,
                      context: Optional[Callable[[], ContextManager]] = None) -> None:
        """The reference the objective reads, run without autograd.

        Args:
            model: the policy itself (LoRA, with ``context`` disabling its
                adapters) or a frozen copy (full fine-tuning).
            lm: the loss owning ``model``'s output projection; None: the
                run's (the policy's: LoRA).
            context: entered around each reference forward.
        """
        kwargs = {"context": context} if context is not None else {}
        self.objective.use_reference(ModelReference(model, lm or self.loss_fn, **kwargs))

    def reference_state(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """The reference's weights: the base checkpoint's (``checkpoint`` itself unless the run resumed, whose
        checkpoint holds the trained policy)."""
        if self.resume_from is None:
            return checkpoint[training.MODEL_KEY]
        return self.checkpoints.load(None)[training.MODEL_KEY]

    def use_frozen_reference(self, model: nn.Module) -> None:
        """A separate reference model (full fine-tuning): frozen, in eval mode, with its own output projection."""
        model.requires_grad_(False)
        model.eval()
        lm = SummedCrossEntropyLoss(token_metrics=False)
        lm.take_output_projection(model)
        self.use_reference(model, lm)
