"""LoRA fine-tuning on one device, with exact gradient accumulation.

    tune run recipes/lora_finetune_single_device.py \\
        --config configs/smollm2/135M_lora_single_device.yaml [key=value ...]

Only the low-rank adapters (and DoRA magnitudes) train; the base weights are
frozen and stay bit-identical. Every optimizer step is normalized by the
number of trainable label tokens in the whole step, exactly as in the
full-finetune recipe. The loop, the setup order and saving are
``torchtune_ext.loop.TrainingRun``; this file builds the LoRA model, says
what trains and what its checkpoint holds.

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

from torchtune_ext.checkpoint import expected_checkpoint_bytes
from torchtune_ext.config import LORA_KEYS
from torchtune_ext.control import exits
from torchtune_ext.loop import TrainingRun, run_recipe
from torchtune_ext.lora import load_lora_weights, lora_checkpoint_state
from torchtune_ext.models import adapter_params, build_model, initialize_adapters, load_model_state
from torchtune_ext.runtime import use_low_cpu_ram, wrap_activations
from torchtune_ext.upstream import describe_model


class LoRAFinetuneRecipeSingleDevice:
    """Single-device LoRA fine-tuning; see the module docstring.

    Args:
        cfg (DictConfig): a config already checked by ``torchtune_ext.config.validate``
            with ``torchtune_ext.config.LORA_KEYS``.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run = TrainingRun(cfg)  # device, dtype, seed, signal handling

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
        use_low_cpu_ram(cfg.low_cpu_ram)  # before building: QLoRA builders pick their state-dict hook
        model = build_model(cfg.model, run.dtype, run.device)
        initialize_adapters(model, run.progress.seed)  # the same adapter as the distributed recipe, on any device
        # Before wrapping for activation checkpointing, which renames the parameters.
        self._adapter_params = adapter_params(model)
        set_trainable_params(model, self._adapter_params)
        wrap_activations(model, checkpointing=cfg.enable_activation_checkpointing,
                         offloading=cfg.enable_activation_offloading)
        load_lora_weights(model, cfg.model, base_state, partial(
            load_model_state, model, device=run.device, source=cfg.checkpointer.checkpoint_dir, strict=False,
            model_name=describe_model(cfg)), adapter_state, partial(model.load_state_dict, strict=False),
                          adapter_source=run.resume_from)
        training.validate_expected_param_dtype(self._adapter_params.items(), dtype=run.dtype)
        if cfg.compile:
            training.compile_model(model)
        run.loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
        run.log_model(model)
        return model

    def train(self) -> int:
        return self.run.train(self.save_checkpoint)

    def save_checkpoint(self) -> Path:
        adapter_only = self.cfg.save_adapter_weights_only
        state = lora_checkpoint_state(self.model, self.model.state_dict(), self.cfg.model, adapter_only)
        return self.run.save(state, adapter_only=adapter_only)

    def cleanup(self) -> None:
        self.run.cleanup()


@exits.exit_on_user_error  # outside config.parse: it also checks the command line torchtune parses
@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(LoRAFinetuneRecipeSingleDevice, cfg, extra_keys=LORA_KEYS)


if __name__ == "__main__":
    exits.run_main(recipe_main)
