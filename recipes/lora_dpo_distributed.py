"""LoRA preference tuning (DPO and its variants) on many devices, data parallel with FSDP2; the base is the reference.

    tune run --nproc_per_node 2 recipes/lora_dpo_distributed.py \\
        --config configs/smollm2/135M_lora_dpo.yaml [key=value ...]

``batch_size`` counts pairs per rank; the step's pairs are counted over all
ranks before any forward, so any split of the global batch gives the same
loss and gradients (docs/preference.md). The setup order, the loop and saving
are ``torchtune_ext.run.loop``, the pairs and their loss
``torchtune_ext.run.preference``; here: the LoRA model as in
``lora_finetune_distributed``, and its reference, the same sharded model with
its adapters disabled (no second copy in memory).
"""

from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import set_trainable_params

from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS
from torchtune_ext.config.preference import PREFERENCE_KEYS
from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import (
    adapter_params,
    build_model,
    initialize_adapters,
    load_sharded_model_state,
    shard_model,
)
from torchtune_ext.model.lora import adapters_disabled, load_lora_weights, lora_checkpoint_state
from torchtune_ext.model.runtime import wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe
from torchtune_ext.run.preference import PreferenceRun


class LoRADPORecipeDistributed(FinetuneRecipe):
    """Data-parallel (FSDP2) LoRA preference tuning; see the module docstring."""

    distributed = True
    run_class = PreferenceRun

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        checkpoint = run.load_data_and_checkpoint(adapter=True)  # checks, lock, resume point, pairs, weights
        model = build_model(cfg.model, run.dtype, torch.device("meta"))
        initialize_adapters(model, run.progress.seed)  # small: in full on CPU, ready for sharding
        set_trainable_params(model, adapter_params(model))
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        shard_model(model, run.device, parallelism=run.parallelism, cpu_offload=cfg.fsdp_cpu_offload,
                    reshard_after_forward=cfg.fsdp_reshard_after_forward,
                    custom_sharded_layers=cfg.custom_sharded_layers)
        load = partial(load_sharded_model_state, model, device=run.device, cpu_offload=cfg.fsdp_cpu_offload,
                       strict=False)
        load_base = partial(load, source=cfg.checkpointer.checkpoint_dir, model_name=describe_model(cfg))
        load_lora_weights(model, cfg.model, checkpoint[training.MODEL_KEY], load_base,
                          checkpoint.get(training.ADAPTER_KEY), load, adapter_source=run.resume_from)
        # Sharding replaced every parameter: the adapter's are collected anew.
        adapter = {name: p for name, p in model.named_parameters() if p.requires_grad}
        training.validate_expected_param_dtype(adapter.items(), dtype=run.dtype)
        self.model = model
        run.use_reference(model, context=partial(adapters_disabled, model))  # the base: the adapters off
        run.setup_training(model, adapter.values(), lora=True)  # the adapter alone is optimized; RNG state last

    def save_checkpoint(self) -> Path:
        adapter_only = self.cfg.save_adapter_weights_only
        state = lora_checkpoint_state(self.model, self.run.full_model_state(), self.cfg.model, adapter_only)
        return self.run.save(state, adapter_only=adapter_only)  # every rank gathers; rank 0 writes


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(LoRADPORecipeDistributed, cfg, extra_keys={**LORA_KEYS, **DISTRIBUTED_KEYS, **PREFERENCE_KEYS})


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
