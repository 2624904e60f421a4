"""LoRA fine-tuning on one device: the low-rank adapters (and DoRA magnitudes) train, the base stays frozen.

    tune run recipes/lora_finetune_single_device.py \\
        --config configs/smollm2/135M_lora_single_device.yaml [key=value ...]

Each optimizer step is normalized by the trainable tokens of all its
micro-batches, as in the full-finetune recipes. The setup order, the loop and
saving are ``torchtune_ext.run.loop``; here: the LoRA model is built on the device
(QLoRA's low-RAM state-dict hook chosen first), the adapters initialized from
the seed, and the checkpoint holds the adapter and the merged model (layout:
docs/lora.md). A resume takes the base weights from the base checkpoint and
the adapter from the latest step folder.
"""

from functools import partial
from pathlib import Path

from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import set_trainable_params

from torchtune_ext.config import LORA_KEYS
from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import adapter_params, build_model, initialize_adapters, load_model_state
from torchtune_ext.model.lora import load_lora_weights, lora_checkpoint_state
from torchtune_ext.model.runtime import use_low_cpu_ram, wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe


class LoRAFinetuneRecipeSingleDevice(FinetuneRecipe):
    """Single-device LoRA fine-tuning; see the module docstring."""

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        checkpoint = run.load_data_and_checkpoint(adapter=True)  # checks, lock, resume point, data, weights
        use_low_cpu_ram(cfg.low_cpu_ram)  # before building: QLoRA builders pick their state-dict hook
        model = build_model(cfg.model, run.dtype, run.device)
        initialize_adapters(model, run.progress.seed)  # the same adapter as the distributed recipe, on any device
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
        # Only the adapter is optimized: the step's grad_norm and clipping cover exactly it.
        run.setup_training(model, adapter.values(), lora=True)  # optimizer ... metrics; RNG state last

    def save_checkpoint(self) -> Path:
        adapter_only = self.cfg.save_adapter_weights_only
        state = lora_checkpoint_state(self.model, self.model.state_dict(), self.cfg.model, adapter_only)
        return self.run.save(state, adapter_only=adapter_only)


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(LoRAFinetuneRecipeSingleDevice, cfg, extra_keys=LORA_KEYS)


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
