"""Training that silently goes bad is stopped, and never points at a checkpoint saved after the damage."""

import pytest
import torch
from omegaconf import OmegaConf

from helpers import IGNORE, read_jsonl, recipe_class, run_recipe, run_tune, text_samples, tiny_model, windows
from torchtune_ext.config import validate
from torchtune_ext.train.health import NonFiniteError, StepHealth, TrainingHealthError, parameters_finite
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
RECIPE = "recipes/full_finetune_single_device.py"


def step_once(model, optimizer, health=None, step=1, seed=0):
    (window,) = windows(text_samples([12, 9], seed=seed), batch_size=2, grad_accum=1)
    return train_step(model, optimizer, SummedCrossEntropyLoss(1, IGNORE), window, device=CPU, health=health, step=step)


def test_update_that_makes_parameters_nonfinite_stops_even_when_skipping():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e37)  # every weight moves by about 1e38: sums overflow
    health = StepHealth(skip_nonfinite_steps=True, start_step=4)
    with pytest.raises(TrainingHealthError, match="update of optimizer step 5 made parameters non-finite") as err:
        step_once(model, optimizer, health, step=5)
    assert err.value.suspect_from == 5  # step 4's parameters produced a healthy step: they are fine
    assert not parameters_finite(model.parameters())


def test_zero_gradient_with_trainable_tokens_stops():
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # uniform predictions, every gradient exactly zero: what lr=1e6 leaves behind
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(TrainingHealthError, match="gradient is exactly zero at optimizer step 3") as err:
        step_once(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), step=3)
    assert err.value.suspect_from == 2  # the parameters of step 2 produced it
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None  # no update, not even weight decay


def test_nonfinite_steps_skip_until_five_in_a_row():
    health = StepHealth(skip_nonfinite_steps=True)
    assert health.before_update(1, 2.0, 1.0, 10) is False
    for step in (2, 3, 4, 5):
        assert health.before_update(step, float("nan"), 1.0, 10) is True
    with pytest.raises(NonFiniteError, match="the 5th in a row \\(steps 2-6\\)") as err:
        health.before_update(6, float("inf"), 1.0, 10)
    assert err.value.suspect_from == 1


def test_one_loss_spike_warns_two_in_a_row_stop():
    health = StepHealth(loss_spike_nats=3.0)
    for step, loss in enumerate([2.0, 2.4, 1.9], start=1):
        assert health.before_update(step, loss, 1.0, 10) is False
    health.before_update(4, 9.0, 1.0, 10)  # more than 3 above 2.4: a spike, warned; the step still trains
    health.before_update(5, 2.1, 1.0, 10)  # back in range: the incident is over
    health.before_update(6, 5.3, 1.0, 10)  # 2.9 above the highest healthy loss: a healthy step
    health.before_update(7, 8.0, 1.0, 10)  # 2.7 above 5.3: healthy, the range has grown
    health.before_update(8, 12.0, 1.0, 10)  # 4.0 above 8.0: a spike
    with pytest.raises(TrainingHealthError, match="loss jumped at optimizer steps 8 and 9") as err:
        health.before_update(9, 12.5, 1.0, 10)  # a second one in a row
    assert err.value.suspect_from == 7  # the parameters of step 7 produced the first spike of the incident

    quiet = StepHealth(loss_spike_nats=None)
    for step, loss in enumerate([2.0, 2.4, 1.9, 50.0, 60.0], start=1):
        assert quiet.before_update(step, loss, 1.0, 10) is False


def test_run_that_ends_in_skipped_nonfinite_steps_is_not_a_success():
    health = StepHealth(skip_nonfinite_steps=True, start_step=10)
    health.before_update(11, 2.0, 1.0, 10)
    health.empty(12)
    health.before_update(13, float("nan"), float("nan"), 10)
    health.before_update(14, 2.0, 1.0, 10)
    summary = health.finish()
    assert "4 optimizer steps in this run (steps 11-14)" in summary
    assert "1 non-finite (steps 13)" in summary and "1 empty (steps 12)" in summary

    health.before_update(15, float("nan"), 1.0, 10)
    with pytest.raises(TrainingHealthError, match="ended with 1 non-finite optimizer step"):
        health.finish()


@pytest.mark.slow
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


@pytest.mark.slow
def test_loss_spike_nats_stops_a_diverging_run(tiny_run):
    """The LR is multiplied by 1e4 from step 6 on: the loss explodes without becoming non-finite."""
    losses = {}
    for spike in (3.0, None):
        cfg = OmegaConf.load(tiny_run(f"spike_{spike}", batch_size=2, gradient_accumulation_steps=1,
                                      max_steps_per_epoch=9, save_final_checkpoint=False, loss_spike_nats=spike))
        cfg.lr_scheduler = {"_component_": "helpers.lr_jump_schedule", "at_step": 6, "factor": 1e4}
        recipe = recipe_class(RECIPE, "FullFinetuneRecipeSingleDevice")
        if spike is None:
            run_recipe(recipe, validate(cfg))
        else:
            with pytest.raises(TrainingHealthError, match="loss jumped at optimizer steps 7 and 8"):
                run_recipe(recipe, validate(cfg))
        losses[spike] = [r["loss"] for r in read_jsonl(f"{cfg.output_dir}/logs/metrics.jsonl")]
    assert len(losses[3.0]) == 7 and len(losses[None]) == 9
    assert losses[None][7] > losses[None][4] + 3  # the same divergence, not stopped


def test_finish_summary_of_one_step():
    health = StepHealth(start_step=2)
    health.before_update(3, 2.0, 1.0, 10)
    assert health.finish().startswith("Training finished: 1 optimizer step in this run (step 3), none skipped")
