"""LoRA preference tuning (DPO and its variants) on one device: the adapters train, the base is the reference.

    tune run recipes/lora_dpo_single_device.py \\
        --config configs/smollm2/135M_lora_dpo_single_device.yaml [key=value ...]

Each optimizer step is normalized by the preference pairs of all its
micro-batches: batch N pairs, or batch 1 with N accumulation steps, gives the
same loss and gradients (docs/preference.md). The setup order, the loop and
saving are ``torchtune_ext.run.loop``, the pairs and their loss
``torchtune_ext.run.preference``; here: the LoRA model as in
``lora_finetune_single_device``, and its reference, the same model with its
adapters disabled (no second copy in memory).
"""

from functools import partial
from pathlib import Path

from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import set_trainable_params

from torchtune_ext.config import LORA_KEYS
from torchtune_ext.config.preference import PREFERENCE_KEYS
from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import adapter_params, build_model, initialize_adapters, load_model_state
from torchtune_ext.model.lora import adapters_disabled, load_lora_weights, lora_checkpoint_state
from torchtune_ext.model.runtime import use_low_cpu_ram, wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe
from torchtune_ext.run.preference import PreferenceRun


class LoRADPORecipeSingleDevice(FinetuneRecipe):
    """Single-device LoRA preference tuning; see the module docstring."""

    run_class = PreferenceRun

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        checkpoint = run.load_data_and_checkpoint(adapter=True)  # checks, lock, resume point, pairs, weights
        use_low_cpu_ram(cfg.low_cpu_ram)  # before building: QLoRA builders pick their state-dict hook
        model = build_model(cfg.model, run.dtype, run.device)
        initialize_adapters(model, run.progress.seed)
        adapter = adapter_params(model)  # named before activation checkpointing renames them
        set_trainable_params(model, adapter)
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        load_base = partial(load_model_state, model, device=run.device, source=cfg.checkpointer.checkpoint_dir,
                            strict=False, model_name=describe_model(cfg))
        load_lora_weights(model, cfg.model, checkpoint[training.MODEL_KEY], load_base,
                          checkpoint.get(training.ADAPTER_KEY), partial(model.load_state_dict, strict=False),
                          adapter_source=run.resume_from)
        training.validate_expected_param_dtype(adapter.items(), dtype=run.dtype)
        self.model = model
        run.use_reference(model, context=partial(adapters_disabled, model))  # the base: the adapters off
        run.setup_training(model, adapter.values(), lora=True)  # optimizer ... metrics; RNG state last

    def save_checkpoint(self) -> Path:
        adapter_only = self.cfg.save_adapter_weights_only
        state = lora_checkpoint_state(self.model, self.model.state_dict(), self.cfg.model, adapter_only)
        return self.run.save(state, adapter_only=adapter_only)


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(LoRADPORecipeSingleDevice, cfg, extra_keys={**LORA_KEYS, **PREFERENCE_KEYS})


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
