"""A run whose optimizer steps all fall inside the LR warm-up is said at start-up (issue 40 item 18)."""

import torch
from omegaconf import OmegaConf

from torchtune_ext.run.preflight import warm_up_outlasts_the_run
from torchtune_ext.train.step import build_lr_scheduler

COSINE = {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup", "num_warmup_steps": 100}


def _lr_of_each_step(cfg, total_steps):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(cfg, optimizer, total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_a_run_inside_the_warm_up_is_named_with_its_steps_and_the_rate_its_last_step_reaches():
    cfg = OmegaConf.create(COSINE)
    one = warm_up_outlasts_the_run(cfg, 1)
    assert one.startswith("this run makes 1 optimizer step in all, and lr_scheduler.num_warmup_steps=100: the "
                          "learning rate never leaves warm-up (its last step trains at 0% of optimizer.lr)")
    assert _lr_of_each_step(cfg, 1) == [0.0]  # what the shipped LoRA config on 12 records did: one step at lr 0
    sixty = warm_up_outlasts_the_run(cfg, 61)
    assert f"trains at {_lr_of_each_step(cfg, 61)[-1]:.0%} of optimizer.lr" in sixty and "60%" in sixty
    assert warm_up_outlasts_the_run(cfg, 100) is not None  # step 100 trains at 99%


def test_a_run_that_leaves_the_warm_up_or_has_none_is_not_warned():
    assert warm_up_outlasts_the_run(OmegaConf.create(COSINE), 101) is None
    assert _lr_of_each_step(OmegaConf.create(COSINE), 101)[-1] == 1.0  # its last step trains at optimizer.lr
    assert warm_up_outlasts_the_run(None, 1) is None
    assert warm_up_outlasts_the_run(OmegaConf.create({"_component_": "x.constant"}), 1) is None
