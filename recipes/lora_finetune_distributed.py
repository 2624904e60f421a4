"""LoRA fine-tuning on many devices with FSDP2, exact across ranks.

    tune run --nproc_per_node 2 recipes/lora_finetune_distributed.py \\
        --config configs/smollm2/135M_lora.yaml [key=value ...]

Only the low-rank adapters (and DoRA magnitudes) train; the base weights are
frozen and stay bit-identical. Every optimizer step is normalized by the
number of trainable label tokens of the whole step on all data-parallel
ranks, exactly as in the full-finetune recipes. The loop, the setup order and
saving are ``torchtune_ext.loop.TrainingRun``, the FSDP2 pieces
``torchtune_ext.distributed``; this file builds and shards the LoRA model,
says what trains and what its checkpoint holds (gathered to the single-device
format). ``batch_size`` is per rank.

A checkpoint ``<output_dir>/step_<N>/`` holds, unless ``save_adapter_weights_only``,
the merged model in the base checkpoint's HF format (the folder loads as that
model), and the adapter in ``adapter/`` (``adapter_model.pt`` in torchtune's key
names; ``adapter_model.safetensors`` and ``adapter_config.json`` for PEFT).
Resuming loads the base weights from the base checkpoint and the adapter from
the latest step folder.
"""

from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import set_trainable_params

from torchtune_ext import distributed
from torchtune_ext.checkpoint import expected_checkpoint_bytes
from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS
from torchtune_ext.control import exits
from torchtune_ext.loop import TrainingRun, run_recipe
from torchtune_ext.lora import load_lora_weights, lora_checkpoint_state
from torchtune_ext.models import adapter_params, build_model, initialize_adapters, shard_model
from torchtune_ext.runtime import wrap_activations
from torchtune_ext.upstream import describe_model


class LoRAFinetuneRecipeDistributed:
    """Data-parallel (FSDP2) LoRA fine-tuning; see the module docstring.

    Args:
        cfg (DictConfig): a config already checked by ``torchtune_ext.config.validate``
            with ``torchtune_ext.config.LORA_KEYS`` and ``DISTRIBUTED_KEYS``.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run = TrainingRun(cfg, distributed=True)  # device, dtype, process group, seed, signal handling

    def setup(self) -> None:
        run = self.run
        checkpoint = run.load_data_and_checkpoint(adapter=True)  # checks, lock, resume point, data, then weights
        self.model = self._setup_model(checkpoint[training.MODEL_KEY], checkpoint.get(training.ADAPTER_KEY))
        # Only the adapter trains: the step's grad_norm and clipping cover exactly what the optimizer updates.
        run.setup_training(self.model, self._adapter_params.values(),  # optimizer ... metrics; RNG state last
                           checkpoint_bytes=partial(expected_checkpoint_bytes, self.model, lora=True,
                                                    adapter_only=self.cfg.save_adapter_weights_only))

    def _setup_model(self, base_state: Dict[str, Any], adapter_state: Optional[Dict[str, Any]]) -> torch.nn.Module:
        cfg, run = self.cfg, self.run
        # Built on the meta device: no rank materializes the full model; each
        # receives only its shard when the weights are loaded.
        model = build_model(cfg.model, run.dtype, torch.device("meta"))
        # The adapters are small: in full on CPU, from the run's seed, as in every recipe and world size.
        initialize_adapters(model, run.progress.seed)
        set_trainable_params(model, adapter_params(model))
        wrap_activations(model, checkpointing=cfg.enable_activation_checkpointing,
                         offloading=cfg.enable_activation_offloading)
        if cfg.compile:
            training.compile_model(model)
        shard_model(model, run.device, cpu_offload=cfg.fsdp_cpu_offload,
                    reshard_after_forward=cfg.fsdp_reshard_after_forward, custom_sharded_layers=cfg.custom_sharded_layers)
        load = partial(distributed.load_full_model_state_dict, model, device=run.device,
                       cpu_offload=cfg.fsdp_cpu_offload, strict=False)
        load_lora_weights(model, cfg.model, base_state, partial(
            load, source=cfg.checkpointer.checkpoint_dir, model_name=describe_model(cfg)), adapter_state, load,
                          adapter_source=run.resume_from)
        # Sharding replaced every parameter: collect the adapter's anew.
        self._adapter_params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        training.validate_expected_param_dtype(self._adapter_params.items(), dtype=run.dtype)
        run.loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
        run.log_model(model)
        return model

    def train(self) -> int:
        return self.run.train(self.save_checkpoint)

    def save_checkpoint(self) -> Path:
        adapter_only = self.cfg.save_adapter_weights_only
        state = lora_checkpoint_state(self.model, self.run.full_model_state(), self.cfg.model, adapter_only)
        return self.run.save(state, adapter_only=adapter_only)

    def cleanup(self) -> None:
        self.run.cleanup()


@exits.exit_on_user_error  # outside config.parse: it also checks the command line torchtune parses
@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(LoRAFinetuneRecipeDistributed, cfg, extra_keys={**LORA_KEYS, **DISTRIBUTED_KEYS})


if __name__ == "__main__":
    exits.run_main(recipe_main)
