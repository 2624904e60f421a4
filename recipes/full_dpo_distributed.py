"""Full-parameter preference tuning (DPO and its variants) on many devices, data parallel with FSDP2.

    tune run --nproc_per_node 2 recipes/full_dpo_distributed.py \\
        --config configs/smollm2/135M_full_dpo.yaml [key=value ...]

``batch_size`` counts pairs per rank; the step's pairs are counted over all
ranks before any forward, so any split of the global batch gives the same
loss and gradients (docs/preference.md). The setup order, the loop and saving
are ``torchtune_ext.run.loop``, the pairs and their loss
``torchtune_ext.run.preference``; here: the model as in
``full_finetune_distributed``, and its reference, a frozen copy of the base
sharded the same way (each rank holds its shard; no gradient, no optimizer
state). The SimPO and reference-free losses build no reference.
"""

from pathlib import Path

import torch
from omegaconf import DictConfig
from torchtune import config, training

from torchtune_ext.config import DISTRIBUTED_KEYS
from torchtune_ext.config.preference import PREFERENCE_KEYS
from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import build_model, load_sharded_model_state, shard_model
from torchtune_ext.model.runtime import wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe
from torchtune_ext.run.preference import PreferenceRun


class FullDPORecipeDistributed(FinetuneRecipe):
    """Data-parallel (FSDP2) full preference tuning; see the module docstring."""

    distributed = True
    run_class = PreferenceRun

    def _sharded_model(self, state: dict, source) -> torch.nn.Module:
        cfg, run = self.cfg, self.run
        # No rank materializes the full model: each receives only its shard when the weights load.
        model = build_model(cfg.model, run.dtype, torch.device("meta"))
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        shard_model(model, run.device, parallelism=run.parallelism, cpu_offload=cfg.fsdp_cpu_offload,
                    reshard_after_forward=cfg.fsdp_reshard_after_forward,
                    custom_sharded_layers=cfg.custom_sharded_layers)
        load_sharded_model_state(model, state, run.device, cpu_offload=cfg.fsdp_cpu_offload, source=source,
                                 model_name=describe_model(cfg))
        return model

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        checkpoint = run.load_data_and_checkpoint()  # checks, lock, resume point, pairs, then the weights
        if run.needs_reference:  # before the policy: a resumed run reads the base checkpoint once more
            run.use_frozen_reference(self._sharded_model(run.reference_state(checkpoint),
                                                         cfg.checkpointer.checkpoint_dir))
        model = self._sharded_model(checkpoint[training.MODEL_KEY], run.resume_from or cfg.checkpointer.checkpoint_dir)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=run.dtype)
        self.model = model
        run.setup_training(model, model.parameters())  # optimizer, schedule ... metrics; RNG state last

    def save_checkpoint(self) -> Path:
        return self.run.save({training.MODEL_KEY: self.run.full_model_state()})  # every rank gathers; rank 0 writes


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(FullDPORecipeDistributed, cfg, extra_keys={**DISTRIBUTED_KEYS, **PREFERENCE_KEYS})


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
