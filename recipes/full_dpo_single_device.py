"""Full-parameter preference tuning (DPO and its variants) on one device, against a frozen copy of the base.

    tune run recipes/full_dpo_single_device.py \\
        --config configs/smollm2/135M_full_dpo_single_device.yaml [key=value ...]

Each optimizer step is normalized by the preference pairs of all its
micro-batches (docs/preference.md). The setup order, the loop and saving are
``torchtune_ext.run.loop``, the pairs and their loss
``torchtune_ext.run.preference``; here: the model as in
``full_finetune_single_device``, and its reference, a second copy of the base
weights, frozen (no gradient, no optimizer state; its forward keeps no graph).
The SimPO and reference-free losses build no reference.
"""

from pathlib import Path

from omegaconf import DictConfig
from torchtune import config, training

from torchtune_ext.config.preference import PREFERENCE_KEYS
from torchtune_ext.config.upstream import describe_model
from torchtune_ext.model.build import build_model, load_model_state
from torchtune_ext.model.runtime import embedding_rows_into_grad, wrap_model
from torchtune_ext.run.control import exits
from torchtune_ext.run.loop import FinetuneRecipe, run_recipe
from torchtune_ext.run.preference import PreferenceRun


class FullDPORecipeSingleDevice(FinetuneRecipe):
    """Single-device full preference tuning; see the module docstring."""

    run_class = PreferenceRun

    def setup(self) -> None:
        cfg, run = self.cfg, self.run
        checkpoint = run.load_data_and_checkpoint()  # checks, lock, resume point, pairs, then the weights
        if run.needs_reference:  # before the policy: a resumed run reads the base checkpoint once more
            reference = build_model(cfg.model, run.dtype, run.device)
            load_model_state(reference, run.reference_state(checkpoint), run.device, cfg.checkpointer.checkpoint_dir,
                             model_name=describe_model(cfg))
            run.use_frozen_reference(reference)
        model = build_model(cfg.model, run.dtype, run.device)
        wrap_model(model, checkpointing=cfg.enable_activation_checkpointing,
                   offloading=cfg.enable_activation_offloading, compile=cfg.compile)
        load_model_state(model, checkpoint[training.MODEL_KEY], run.device,
                         run.resume_from or cfg.checkpointer.checkpoint_dir, model_name=describe_model(cfg))
        training.validate_expected_param_dtype(model.named_parameters(), dtype=run.dtype)
        embedding_rows_into_grad(model, run.device, compiled=cfg.compile)
        self.model = model
        run.setup_training(model, model.parameters())  # optimizer, schedule ... metrics; RNG state last

    def save_checkpoint(self) -> Path:
        return self.run.save({training.MODEL_KEY: self.model.state_dict()})


@config.parse
def recipe_main(cfg: DictConfig) -> int:
    return run_recipe(FullDPORecipeSingleDevice, cfg, extra_keys=PREFERENCE_KEYS)


if __name__ == "__main__":
    exits.run_main(recipe_main)  # bad input, also on the command line config.parse reads: one line, exit 2
