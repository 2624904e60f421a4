"""Full-parameter fine-tuning on one device.

    tune run recipes/full_finetune_single_device.py \\
        --config configs/smollm2/135M_full_single_device.yaml [key=value ...]

Batch size N, or batch size 1 with N gradient accumulation steps, gives the
same loss and gradients: each optimizer step is normalized by the trainable
tokens of all its micro-batches (``torchtune_ext.train.step``). The setup order, the
loop and saving are ``torchtune_ext.run.loop``; here: how the model is built (on
the device, weights loaded in place) and that the checkpoint holds all of it.
"""

from pathlib import Path

from omegaconf import DictConfig
from torchtune import config, training

from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import build_model, load_model_state
from torchtune_ext.model.runtime import embedding_rows_into_grad, wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe


class FullFinetuneRecipeSingleDevice(FinetuneRecipe):
    """Single-device full fine-tuning; see the module docstring."""

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        checkpoint = run.load_data_and_checkpoint()  # checks, lock, resume point, data, then the weights
        model = build_model(cfg.model, run.dtype, run.device)
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        load_model_state(model, checkpoint[training.MODEL_KEY], run.device,
                         run.resume_from or cfg.checkpointer.checkpoint_dir, model_name=describe_model(cfg))
        training.validate_expected_param_dtype(model.named_parameters(), dtype=run.dtype)
        # Same gradients; on CPU a tied embedding adds its rows to .grad instead of a vocabulary-sized tensor.
        embedding_rows_into_grad(model, run.device, compiled=cfg.compile)
        self.model = model
        run.setup_training(model, model.parameters())  # optimizer, schedule ... metrics; RNG state last

    def save_checkpoint(self) -> Path:
        return self.run.save({training.MODEL_KEY: self.model.state_dict()})


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(FullFinetuneRecipeSingleDevice, cfg)


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
