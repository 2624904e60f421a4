"""Training that silently goes bad is stopped, and never points at a checkpoint saved after the damage.

Through the recipe (tune run, a run in process): tests/integration/test_health.py.
"""

import pytest
import torch

from tests.support.helpers import (
    IGNORE,
    text_samples,
    tiny_model,
    windows,
)
from torchtune_ext.train.health import NonFiniteError, StepHealth, TrainingHealthError, parameters_finite
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")


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


def test_a_resumed_run_checks_its_first_steps_against_the_losses_before_the_checkpoint():
    """The history is the run's Progress.healthy_losses, kept in place: a checkpoint saves it, a resume hands it
    back, and a loss of 303 after 10.6 (a resume with optimizer.lr=5.0) is a spike at once, stopped a step later."""
    saved = []
    before = StepHealth(loss_spike_nats=3.0, history=saved)
    for step, loss in enumerate([10.9, 10.7, 10.6], start=1):
        before.before_update(step, loss, 1.0, 10)
    assert saved == [10.9, 10.7, 10.6]
    resumed = StepHealth(loss_spike_nats=3.0, start_step=3, history=list(saved))
    resumed.before_update(4, 303.0, 50.0, 10)  # a spike at the first step after the resume: warned
    with pytest.raises(TrainingHealthError, match="loss jumped at optimizer steps 4 and 5"):
        resumed.before_update(5, 1.2e9, 50.0, 10)
    fresh = StepHealth(loss_spike_nats=3.0, start_step=3)  # what a run without the history did: blind
    fresh.before_update(4, 303.0, 50.0, 10)
    fresh.before_update(5, 1.2e9, 50.0, 10)


def test_the_history_keeps_the_last_window_of_healthy_steps():
    history = [float(i) for i in range(40)]
    health = StepHealth(loss_spike_nats=3.0, history=history)
    assert history == [float(i) for i in range(8, 40)]  # a longer list is cut to the window
    health.before_update(1, 39.5, 1.0, 10)
    assert len(history) == 32 and history[0] == 9.0 and history[-1] == 39.5
    health.before_update(2, 99.0, 1.0, 10)  # a spike: not a healthy loss, not kept
    assert history[-1] == 39.5


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


def test_finish_summary_of_one_step():
    health = StepHealth(start_step=2)
    health.before_update(3, 2.0, 1.0, 10)
    assert health.finish().startswith("Training finished: 1 optimizer step in this run (step 3), none skipped")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_skipped_step_is_said_once_per_job_by_rank_zero(monkeypatch, caplog, rank):
    """Every rank takes the same decision from global values: 2 ranks printed "Optimizer step N skipped" twice."""
    import logging

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    health = StepHealth(skip_nonfinite_steps=True)
    with caplog.at_level(logging.WARNING):
        health.empty(1)
        assert health.before_update(2, float("nan"), 1.0, 10) is True
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    expected = ["Optimizer step 1 skipped: no trainable token in any of its micro-batches.",
                "Optimizer step 2 skipped: loss=nan grad_norm=1.0"]
    assert said == (expected if rank == "0" else [])
    spiky = StepHealth(loss_spike_nats=3.0, start_step=3, history=[2.0, 2.1, 2.2])
    with caplog.at_level(logging.WARNING):
        spiky.before_update(4, 9.0, 1.0, 10)  # a spike, warned (the same on every rank)
    spikes = [r.getMessage() for r in caplog.records if "above the highest loss" in r.getMessage()]
    assert len(spikes) == (1 if rank == "0" else 0)
