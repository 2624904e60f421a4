"""Full-parameter fine-tuning on many devices, data parallel with FSDP2.

    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py \\
        --config configs/smollm2/135M_full.yaml [key=value ...]

``batch_size`` is per rank: the global batch is ranks x batch_size x
gradient_accumulation_steps, and any split of it gives the same loss and
gradients (the step's trainable tokens are counted over all ranks before any
forward, ``torchtune_ext.train.step``). The setup order, the loop and saving are
``torchtune_ext.run.loop``; here: the model is built on the meta device, sharded
per decoder layer, loaded shard by shard, and gathered to one file to save.
"""

from pathlib import Path

import torch
from omegaconf import DictConfig
from torchtune import config, training

from torchtune_ext.config import DISTRIBUTED_KEYS
from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import build_model, load_sharded_model_state, shard_model
from torchtune_ext.model.runtime import wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe


class FullFinetuneRecipeDistributed(FinetuneRecipe):
    """Data-parallel (FSDP2) full fine-tuning; see the module docstring."""

    distributed = True

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        checkpoint = run.load_data_and_checkpoint()  # checks, lock, resume point, data, then the weights
        # No rank materializes the full model: each receives only its shard when the weights load.
        model = build_model(cfg.model, run.dtype, torch.device("meta"))
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        shard_model(model, run.device, parallelism=run.parallelism, cpu_offload=cfg.fsdp_cpu_offload,
                    reshard_after_forward=cfg.fsdp_reshard_after_forward,
                    custom_sharded_layers=cfg.custom_sharded_layers)
        load_sharded_model_state(model, checkpoint[training.MODEL_KEY], run.device, cpu_offload=cfg.fsdp_cpu_offload,
                                 source=run.resume_from or cfg.checkpointer.checkpoint_dir,
                                 model_name=describe_model(cfg))
        training.validate_expected_param_dtype(model.named_parameters(), dtype=run.dtype)
        self.model = model
        run.setup_training(model, model.parameters())  # optimizer, schedule ... metrics; RNG state last

    def save_checkpoint(self) -> Path:
        return self.run.save({training.MODEL_KEY: self.run.full_model_state()})  # every rank gathers; rank 0 writes


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(FullFinetuneRecipeDistributed, cfg, extra_keys=DISTRIBUTED_KEYS)


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
