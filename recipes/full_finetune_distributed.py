"""Full-parameter fine-tuning on many devices with FSDP2, exact across ranks.

    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py \\
        --config configs/smollm2/135M_full.yaml [key=value ...]

Every optimizer step is normalized by the number of trainable label tokens
of the whole step: all its micro-batches on all data-parallel ranks (one
all-reduce of the count per step, before any forward). ``batch_size`` is per
rank, so the global batch is ranks x batch_size x gradient_accumulation_steps,
and any split of it gives the same loss and gradients. The loop, the setup
order and saving are ``torchtune_ext.loop.TrainingRun``, the FSDP2 pieces
``torchtune_ext.distributed``; this file builds and shards the model and says
what its checkpoint holds (gathered to the single-device format).
"""

from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, training

from torchtune_ext import distributed
from torchtune_ext.checkpoint import expected_checkpoint_bytes
from torchtune_ext.config import DISTRIBUTED_KEYS
from torchtune_ext.control import exits
from torchtune_ext.loop import TrainingRun, run_recipe
from torchtune_ext.models import build_model, shard_model
from torchtune_ext.runtime import wrap_activations
from torchtune_ext.upstream import describe_model


class FullFinetuneRecipeDistributed:
    """Data-parallel (FSDP2) full fine-tuning; see the module docstring.

    Args:
        cfg (DictConfig): a config already checked by ``torchtune_ext.config.validate``
            with ``torchtune_ext.config.DISTRIBUTED_KEYS``.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run = TrainingRun(cfg, distributed=True)  # device, dtype, process group, seed, signal handling

    def setup(self) -> None:
        run = self.run
        checkpoint = run.load_data_and_checkpoint()  # checks, lock, resume point, data, then the weights
        self.model = self._setup_model(checkpoint[training.MODEL_KEY], run.resume_from)
        run.setup_training(self.model, self.model.parameters(),  # optimizer ... metrics; RNG state last
                           checkpoint_bytes=partial(expected_checkpoint_bytes, self.model))

    def _setup_model(self, state_dict: Dict[str, Any], source: Optional[Path]) -> torch.nn.Module:
        cfg, run = self.cfg, self.run
        # Built on the meta device: no rank materializes the full model; each
        # receives only its shard when the weights are loaded.
        model = build_model(cfg.model, run.dtype, torch.device("meta"))
        wrap_activations(model, checkpointing=cfg.enable_activation_checkpointing,
                         offloading=cfg.enable_activation_offloading)
        if cfg.compile:
            training.compile_model(model)
        shard_model(model, run.device, cpu_offload=cfg.fsdp_cpu_offload,
                    reshard_after_forward=cfg.fsdp_reshard_after_forward, custom_sharded_layers=cfg.custom_sharded_layers)
        distributed.load_full_model_state_dict(model, state_dict, run.device, cpu_offload=cfg.fsdp_cpu_offload,
                                               source=source or cfg.checkpointer.checkpoint_dir,
                                               model_name=describe_model(cfg))
        training.validate_expected_param_dtype(model.named_parameters(), dtype=run.dtype)
        run.loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
        run.log_model(model)
        return model

    def train(self) -> int:
        return self.run.train(self.save_checkpoint)

    def save_checkpoint(self) -> Path:
        return self.run.save({training.MODEL_KEY: self.run.full_model_state()})  # every rank gathers; rank 0 writes

    def cleanup(self) -> None:
        self.run.cleanup()


@exits.exit_on_user_error  # outside config.parse: it also checks the command line torchtune parses
@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(FullFinetuneRecipeDistributed, cfg, extra_keys=DISTRIBUTED_KEYS)


if __name__ == "__main__":
    exits.run_main(recipe_main)
