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

import hashlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
from torch import nn
from torchtune import training, utils

from torchtune_ext.config import validation_enabled
from torchtune_ext.config.preference import preference_loss_arguments
from torchtune_ext.data.preference import build_pair_loader, pairs_fingerprint
from torchtune_ext.errors import ConfigError
from torchtune_ext.run.loop import TrainingRun
from torchtune_ext.run.preflight import model_max_seq_len, model_vocab_size
from torchtune_ext.run.reference_log_probs import FILE_NAME as REFERENCE_FILE
from torchtune_ext.run.reference_log_probs import KEY as REFERENCE_KEY
from torchtune_ext.run.reference_log_probs import compute_table, load_table, run_fingerprint, save_table
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.preference import ModelReference, PrecomputedReference, PreferenceLoss, PreferenceObjective

log = logging.getLogger(__name__)


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
        self.val_data = (build_pair_loader(cfg, self.tokenizer, seed=0, key="dataset_val", training=False,
                                           index_offset=len(self.data.dataset), **common)  # after the training pairs
                         if validation_enabled(cfg) else None)
        self.precomputed: Optional[torch.Tensor] = None  # [pairs, 2] reference sums, once computed or read
        self.reference_fingerprint: Optional[Dict[str, str]] = None  # what they depend on (reference_log_probs)
        if cfg.precompute_reference_log_probs:
            self._find_precomputed()

    def _pair_datasets(self) -> List[Any]:
        return [self.data.dataset] + ([self.val_data.dataset] if self.val_data is not None else [])

    def _find_precomputed(self) -> None:
        """The run's fingerprint; a stored table for it (a resume) is used at once, another run's refused."""
        if not self.objective.loss.needs_reference:
            raise ConfigError(REFERENCE_KEY, f"the {self.objective.loss.loss_type} loss has no reference model "
                              "whose log-probabilities could be precomputed; set it false")
        datasets = self._pair_datasets()
        self._num_pairs = sum(len(d) for d in datasets)
        digest = hashlib.sha256("".join(pairs_fingerprint(d) for d in datasets).encode()).hexdigest()
        self.reference_fingerprint = run_fingerprint(self.cfg, digest)
        self._reference_file = Path(self.cfg.output_dir) / REFERENCE_FILE
        table = load_table(self._reference_file, self.reference_fingerprint, self._num_pairs)
        if table is not None:
            utils.log_rank_zero(log, f"Reference log-probabilities of {self._num_pairs} pairs read from "
                                f"{self._reference_file}: no reference model is run")
            self._use_table(table)

    def _use_table(self, table: torch.Tensor) -> None:
        self.precomputed = table
        self.objective.use_reference(PrecomputedReference(table))

    @property
    def needs_reference(self) -> bool:
        """Whether the run needs a reference model: the configured loss reads one (not SimPO or reference-free
        DPO), and its log-probabilities were not read from a precomputed file."""
        return self.objective.loss.needs_reference and self.precomputed is None

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
        reference = ModelReference(model, lm or self.loss_fn, **kwargs)
        if not self.cfg.precompute_reference_log_probs:
            self.objective.use_reference(reference)
        elif self.precomputed is None:  # else read from the run's file: nothing to run
            self._precompute(reference)

    def _precompute(self, reference: ModelReference) -> None:
        """Run ``reference`` over every pair once, store the table with the run, and train on it."""
        start = time.perf_counter()
        loaders = [self.data] + ([self.val_data] if self.val_data is not None else [])
        table = compute_table(reference, lambda batch: self.objective.prepare(batch, self.device),
                              loaders, self.data.collate_fn, batch_size=self.cfg.batch_size,
                              num_pairs=self._num_pairs, ignore_index=self.loss_fn.ignore_index,
                              dp_rank=self.dp_rank, dp_world_size=self.world_size, dp_group=self.dp_group)
        save_table(self._reference_file, table, self.reference_fingerprint)
        utils.log_rank_zero(log, f"Reference log-probabilities of {self._num_pairs} pairs computed in "
                            f"{time.perf_counter() - start:.1f} s, saved to {self._reference_file}")
        self._use_table(table)

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
