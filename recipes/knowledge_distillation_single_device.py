"""Knowledge distillation on one device: a frozen teacher's next-token distributions train a student.

    tune run recipes/knowledge_distillation_single_device.py \\
        --config configs/smollm2/135M_KD_lora_single_device.yaml [key=value ...]

The step loss is ``(1 - kd_ratio) * CE + kd_ratio * KD``, each summed over the
step's trainable tokens and divided once by their number, so any split of
the step gives the same loss and gradients (``torchtune_ext.train.distill``).
The student is a LoRA model (a ``lora_*`` builder: only its adapters train)
or a plain one (every parameter trains); the setup order, the loop and saving
are ``torchtune_ext.run.loop``, the teacher ``torchtune_ext.run.distillation``.
The checkpoint holds the student only, as the fine-tuning recipes save it.
"""

from functools import partial
from pathlib import Path

from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import set_trainable_params

from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import adapter_params, build_model, initialize_adapters, load_model_state
from torchtune_ext.model.lora import load_lora_weights, lora_checkpoint_state
from torchtune_ext.model.runtime import wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.distillation import check_teacher_vocabulary, distil, distillation_keys, student_is_lora
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe


class KDRecipeSingleDevice(FinetuneRecipe):
    """Single-device distillation, LoRA or full student; see the module docstring."""

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        self.lora = student_is_lora(cfg.model)
        check_teacher_vocabulary(cfg)  # on the meta device, before any weight loads
        checkpoint = run.load_data_and_checkpoint(adapter=self.lora)  # checks, lock, resume point, data, weights
        model = build_model(cfg.model, run.dtype, run.device)
        if self.lora:
            initialize_adapters(model, run.progress.seed)
            trainable = adapter_params(model)  # named before activation checkpointing renames them
            set_trainable_params(model, trainable)
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        load = partial(load_model_state, model, device=run.device, model_name=describe_model(cfg))
        if self.lora:
            load_lora_weights(model, cfg.model, checkpoint[training.MODEL_KEY],
                              partial(load, source=cfg.checkpointer.checkpoint_dir, strict=False),
                              checkpoint.get(training.ADAPTER_KEY), partial(model.load_state_dict, strict=False),
                              adapter_source=run.resume_from)
        else:
            load(checkpoint[training.MODEL_KEY], source=run.resume_from or cfg.checkpointer.checkpoint_dir)
            trainable = dict(model.named_parameters())
        training.validate_expected_param_dtype(trainable.items(), dtype=run.dtype)
        self.model = model
        # the frozen teacher; each step now optimizes (1 - kd_ratio) * CE + kd_ratio * KD (the student generates
        # the on-policy samples)
        distil(run, student=model)
        run.setup_training(model, trainable.values(), lora=self.lora)  # the student alone is optimized

    def save_checkpoint(self) -> Path:
        if not self.lora:
            return self.run.save({training.MODEL_KEY: self.model.state_dict()})
        adapter_only = self.cfg.save_adapter_weights_only
        state = lora_checkpoint_state(self.model, self.model.state_dict(), self.cfg.model, adapter_only)
        return self.run.save(state, adapter_only=adapter_only)


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(KDRecipeSingleDevice, cfg, extra_keys=distillation_keys(cfg))


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
