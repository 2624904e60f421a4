"""Knowledge distillation on many devices, data parallel with FSDP2: the student and the teacher both sharded.

    tune run --nproc_per_node 2 recipes/knowledge_distillation_distributed.py \\
        --config configs/smollm2/135M_KD_lora.yaml [key=value ...]

``batch_size`` is per rank; the step's trainable tokens are counted over all
ranks before any forward, and ``(1 - kd_ratio) * CE + kd_ratio * KD`` is
summed and divided once by that count, so any split of the global batch
gives the same loss and gradients. The student (LoRA or full, from the
``model`` builder) is built on meta, sharded per decoder layer and loaded
shard by shard as in the fine-tuning recipes; the teacher is sharded the same
way (it is often the larger model) but frozen, without optimizer state, and
never saved (``torchtune_ext.run.distillation``).
"""

from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import set_trainable_params

from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import (
    adapter_params,
    build_model,
    initialize_adapters,
    load_sharded_model_state,
    shard_model,
)
from torchtune_ext.model.lora import load_lora_weights, lora_checkpoint_state
from torchtune_ext.model.runtime import wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.distillation import check_teacher_vocabulary, distil, distillation_keys, student_is_lora
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe


class KDRecipeDistributed(FinetuneRecipe):
    """Data-parallel (FSDP2) distillation, LoRA or full student; see the module docstring."""

    distributed = True

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        self.lora = student_is_lora(cfg.model)
        check_teacher_vocabulary(cfg)  # on the meta device, before any weight loads
        checkpoint = run.load_data_and_checkpoint(adapter=self.lora)  # checks, lock, resume point, data, weights
        model = build_model(cfg.model, run.dtype, torch.device("meta"))
        if self.lora:
            initialize_adapters(model, run.progress.seed)  # small: in full on CPU, ready for sharding
            set_trainable_params(model, adapter_params(model))
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        shard = dict(parallelism=run.parallelism, cpu_offload=cfg.fsdp_cpu_offload,
                     reshard_after_forward=cfg.fsdp_reshard_after_forward,
                     custom_sharded_layers=cfg.custom_sharded_layers)
        shard_model(model, run.device, **shard)
        load = partial(load_sharded_model_state, model, device=run.device, cpu_offload=cfg.fsdp_cpu_offload)
        if self.lora:
            load_lora_weights(model, cfg.model, checkpoint[training.MODEL_KEY],
                              partial(load, strict=False, source=cfg.checkpointer.checkpoint_dir,
                                      model_name=describe_model(cfg)),
                              checkpoint.get(training.ADAPTER_KEY), partial(load, strict=False),
                              adapter_source=run.resume_from)
        else:
            load(checkpoint[training.MODEL_KEY], source=run.resume_from or cfg.checkpointer.checkpoint_dir,
                 model_name=describe_model(cfg))
        # Sharding replaced every parameter: the trainable ones are collected anew.
        trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        training.validate_expected_param_dtype(trainable.items(), dtype=run.dtype)
        self.model = model
        distil(run, shard=shard)  # the frozen teacher, sharded like the student
        run.setup_training(model, trainable.values(), lora=self.lora)  # the student alone is optimized

    def save_checkpoint(self) -> Path:
        if not self.lora:
            return self.run.save({training.MODEL_KEY: self.run.full_model_state()})  # every rank gathers
        adapter_only = self.cfg.save_adapter_weights_only
        state = lora_checkpoint_state(self.model, self.run.full_model_state(), self.cfg.model, adapter_only)
        return self.run.save(state, adapter_only=adapter_only)  # every rank gathers; rank 0 writes


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(KDRecipeDistributed, cfg, extra_keys=distillation_keys(cfg, distributed=True))


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
