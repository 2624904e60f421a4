"""Full-parameter fine-tuning on one device, with exact gradient accumulation.

    tune run recipes/full_finetune_single_device.py \\
        --config configs/smollm2/135M_full_single_device.yaml [key=value ...]

Every optimizer step is normalized by the number of trainable label tokens
in the whole step (all its micro-batches), so batch size N, or batch size 1
with N gradient accumulation steps, gives the same loss and gradients. The
loop, the setup order and saving are ``torchtune_ext.loop.TrainingRun``; the
accounting is ``torchtune_ext.step``. This file builds the model and says
what its checkpoint holds.
"""

from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, training

from torchtune_ext.checkpoint import expected_checkpoint_bytes
from torchtune_ext.control import exits
from torchtune_ext.loop import TrainingRun, run_recipe
from torchtune_ext.models import build_model, load_model_state
from torchtune_ext.runtime import embedding_rows_into_grad, wrap_activations
from torchtune_ext.upstream import describe_model


class FullFinetuneRecipeSingleDevice:
    """Single-device full fine-tuning; see the module docstring.

    Args:
        cfg (DictConfig): a config already checked by ``torchtune_ext.config.validate``.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run = TrainingRun(cfg)  # device, dtype, seed, signal handling

    def setup(self) -> None:
        run = self.run
        checkpoint = run.load_data_and_checkpoint()  # checks, lock, resume point, data, then the weights
        self.model = self._setup_model(checkpoint[training.MODEL_KEY], run.resume_from)
        run.setup_training(self.model, self.model.parameters(),  # optimizer ... metrics; RNG state last
                           checkpoint_bytes=partial(expected_checkpoint_bytes, self.model))

    def _setup_model(self, state_dict: Dict[str, Any], source: Optional[Path]) -> torch.nn.Module:
        cfg, run = self.cfg, self.run
        model = build_model(cfg.model, run.dtype, run.device)
        wrap_activations(model, checkpointing=cfg.enable_activation_checkpointing,
                         offloading=cfg.enable_activation_offloading)
        load_model_state(model, state_dict, run.device, source or cfg.checkpointer.checkpoint_dir,
                         model_name=describe_model(cfg))
        training.validate_expected_param_dtype(model.named_parameters(), dtype=run.dtype)
        # Same gradients; on CPU the tied embedding adds its rows to .grad instead of a vocabulary-sized tensor.
        embedding_rows_into_grad(model, run.device, compiled=cfg.compile)
        if cfg.compile:
            training.compile_model(model)
        run.loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
        run.log_model(model)
        return model

    def train(self) -> int:
        return self.run.train(self.save_checkpoint)

    def save_checkpoint(self) -> Path:
        return self.run.save({training.MODEL_KEY: self.model.state_dict()})

    def cleanup(self) -> None:
        self.run.cleanup()


@exits.exit_on_user_error  # outside config.parse: it also checks the command line torchtune parses
@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(FullFinetuneRecipeSingleDevice, cfg)


if __name__ == "__main__":
    exits.run_main(recipe_main)
