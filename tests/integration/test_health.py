"""Training that goes bad, through the recipe: stopped, never pointing at a checkpoint saved after the damage.

The checks themselves, on the step: tests/unit/train/test_health.py.
"""

import pytest
from omegaconf import OmegaConf

from tests.support.helpers import (
    read_jsonl,
    recipe_class,
    run_recipe,
    run_tune,
)
from torchtune_ext.config import validate
from torchtune_ext.train.health import TrainingHealthError

RECIPE = "recipes/full_finetune_single_device.py"


def test_destroyed_model_stops_and_names_the_checkpoint_before_the_damage(tiny_run):
    """optimizer.lr=1e6: step 1 trains at lr 0 (warm-up), step 2's update destroys the model, step 3 shows it."""
    config = tiny_run(batch_size=4, gradient_accumulation_steps=1, save_every_n_steps=1, **{"optimizer.lr": 1e6})
    for extra in ([], ["skip_nonfinite_steps=true"]):
        out = config.parent / ("skip" if extra else "out")
        proc = run_tune(RECIPE, "--config", str(config), f"output_dir={out}", *extra)
        assert proc.returncode == 3, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr
        assert "optimizer step 3" in errors[0]
        assert f"Last checkpoint from before the damage: {out / 'step_1'}" in errors[0]
        assert "not to be resumed from: step_2" in errors[0]
        assert [r["step"] for r in read_jsonl(out / "logs/metrics.jsonl")] == [1, 2]


def test_loss_spike_nats_stops_a_diverging_run(tiny_run):
    """The LR is multiplied by 1e4 from step 6 on: the loss explodes without becoming non-finite."""
    losses = {}
    for spike in (3.0, None):
        cfg = OmegaConf.load(tiny_run(f"spike_{spike}", batch_size=2, gradient_accumulation_steps=1,
                                      max_steps_per_epoch=9, save_final_checkpoint=False, loss_spike_nats=spike,
                                      save_every_n_steps=5))
        cfg.lr_scheduler = {"_component_": "tests.support.helpers.lr_jump_schedule", "at_step": 6, "factor": 1e4}
        recipe = recipe_class(RECIPE, "FullFinetuneRecipeSingleDevice")
        if spike is None:
            run_recipe(recipe, validate(cfg))
        else:
            with pytest.raises(TrainingHealthError, match="loss jumped at optimizer steps 7 and 8"):
                run_recipe(recipe, validate(cfg))
        losses[spike] = [r["loss"] for r in read_jsonl(f"{cfg.output_dir}/logs/metrics.jsonl")]
    assert len(losses[3.0]) == 7 and len(losses[None]) == 9
    assert losses[None][7] > losses[None][4] + 3  # the same divergence, not stopped

    # Resumed from the unchecked run's step_5 with the check on: the history of steps 1-5 comes back with the
    # checkpoint, so the run stops where the uninterrupted one did (with an empty history it needed 3 new
    # healthy steps, took the jumped losses of steps 7 and 8 for them, and ran on)
    cfg.loss_spike_nats, cfg.resume_from_checkpoint = 3.0, True
    with pytest.raises(TrainingHealthError, match="loss jumped at optimizer steps 7 and 8"):
        run_recipe(recipe, validate(cfg))
