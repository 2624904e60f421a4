"""A resume with other settings applies them, or refuses them, and says so: nothing is dropped in silence.

Each test stops a tiny single-device run after step 2 (of 4 per epoch, 16
samples, 4 per step) with a real SIGTERM, resumes it with a changed setting
and compares with the uninterrupted run.
"""

import logging

import pytest

import resume_jobs
from torchtune_ext.config import ConfigError
from torchtune_ext.preemption import STOPPED_EXIT_STATUS


@pytest.fixture(scope="module")
def setup_yaml(tmp_path_factory):
    return resume_jobs.setup(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(setup_yaml, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    assert resume_jobs.run("full_single", resume_jobs.config(setup_yaml, "full_single", out)) == 0
    return resume_jobs.by_step(out)


def stopped_at_2(setup_yaml, out, *overrides):
    status = resume_jobs.run("full_single", resume_jobs.config(setup_yaml, "full_single", out, *overrides),
                             stop_after=2)
    assert status == STOPPED_EXIT_STATUS


def resume(setup_yaml, out, *overrides):
    cfg = resume_jobs.config(setup_yaml, "full_single", out, *overrides, "resume_from_checkpoint=true")
    assert resume_jobs.run("full_single", cfg) == 0
    return resume_jobs.by_step(out)


def messages(caplog):
    return [r.getMessage() for r in caplog.records]


def test_changed_learning_rate_is_applied_and_reported(setup_yaml, reference, tmp_path, caplog):
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out)
    with caplog.at_level(logging.INFO):
        got = resume(setup_yaml, out, "optimizer.lr=0.002")
    for step in range(3, 13):  # the same schedule, scaled by the new peak
        assert got[step]["lr"] == pytest.approx(reference[step]["lr"] * 0.2, rel=1e-12), step
    assert any("changed settings, applied from step 3: optimizer.lr 0.01 -> 0.002" in m for m in messages(caplog))


@pytest.mark.parametrize("saves", [[], ["save_every_n_steps=2"]], ids=["epoch-end-save", "periodic-save"])
def test_a_finished_run_says_that_nothing_is_left(setup_yaml, tmp_path, caplog, saves):
    """Resuming a finished run with a larger max_steps_per_epoch: no step runs, and the log says why
    instead of announcing the change "from step 3"; also when the epoch's last step was saved by a
    periodic save (its checkpoint ends the epoch, as the end-of-epoch save's does)."""
    out = tmp_path / "out"
    short = ["epochs=1", "max_steps_per_epoch=2", *saves]
    assert resume_jobs.run("full_single", resume_jobs.config(setup_yaml, "full_single", out, *short)) == 0
    with caplog.at_level(logging.INFO):
        got = resume(setup_yaml, out, "epochs=1", "max_steps_per_epoch=3", *saves)
    assert sorted(got) == [1, 2]
    said = [m for m in messages(caplog) if "Nothing is left to train" in m or "changed settings" in m]
    assert said == ["Nothing is left to train: the checkpoint (step 2) has finished 1 epoch(s) and epochs=1; raise "
                    "epochs to train more. Changed settings, not applied: max_steps_per_epoch 2 -> 3 "
                    "(an epoch that has ended stays ended)"]
    assert not (out / ".staging").exists()
    got = resume(setup_yaml, out, "epochs=2", "max_steps_per_epoch=3", *saves)  # more epochs: the new length
    assert sorted(got) == [1, 2, 3, 4, 5]


def test_changed_weight_decay_is_applied(setup_yaml, reference, tmp_path):
    """Not only the lr: every optimizer hyper-parameter comes from the config (the loss shows it)."""
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out, "optimizer.weight_decay=0.0")
    got = resume(setup_yaml, out, "optimizer.weight_decay=0.0")
    changed = tmp_path / "changed"
    stopped_at_2(setup_yaml, changed, "optimizer.weight_decay=0.0")
    other = resume(setup_yaml, changed, "optimizer.weight_decay=50.0")
    assert other[3]["loss"] == got[3]["loss"]  # step 3 runs on the weights saved after step 2
    assert other[4]["loss"] != got[4]["loss"]  # step 3's update already used the new weight decay


def test_unchanged_settings_report_nothing(setup_yaml, reference, tmp_path, caplog):
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out)
    with caplog.at_level(logging.INFO):
        got = resume(setup_yaml, out)
    reports = ("Resuming with changed settings", "LR schedule is rebuilt", "The global batch changes", "seed=")
    assert not [m for m in messages(caplog) if m.startswith(reports)]
    assert all(got[s]["loss"] == reference[s]["loss"] and got[s]["lr"] == reference[s]["lr"] for s in reference)


def test_another_global_batch_continues_at_the_right_sample(setup_yaml, reference, tmp_path, caplog):
    """4 samples per step, stopped after 8 samples; resumed at 8 per step: the rest of epoch 0 in one step."""
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out)
    with caplog.at_level(logging.INFO):
        got = resume(setup_yaml, out, "gradient_accumulation_steps=4")
    # 2 steps done + 1 step for samples 8..15 + 2 epochs of 2 steps
    assert sorted(got) == list(range(1, 8))
    assert got[3]["num_tokens"] == reference[3]["num_tokens"] + reference[4]["num_tokens"]
    assert got[4]["num_tokens"] == reference[5]["num_tokens"] + reference[6]["num_tokens"]  # epoch 1, in order
    lines = messages(caplog)
    assert any("The global batch changes at resume: 4 -> 8 samples per optimizer step" in m
               and "epoch 0 continues at sample 8" in m for m in lines), lines
    assert any("The LR schedule is rebuilt for 7 optimizer steps (was 12) and continues at step 3" in m
               for m in lines), lines
    assert got[7]["lr"] < got[3]["lr"]  # still the cosine decay, now over 7 steps


def test_another_seed_is_reported_and_the_runs_seed_kept(setup_yaml, reference, tmp_path, caplog):
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out)
    with caplog.at_level(logging.INFO):
        got = resume(setup_yaml, out, "seed=99")
    assert any("seed=99 is not used: the run continues with its seed 7" in m for m in messages(caplog))
    assert [got[s]["loss"] for s in reference] == [reference[s]["loss"] for s in reference]


def test_shuffle_change_mid_epoch_is_refused(setup_yaml, tmp_path):
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out)
    cfg = resume_jobs.config(setup_yaml, "full_single", out, "shuffle=false", "resume_from_checkpoint=true")
    with pytest.raises(ConfigError, match="'shuffle'.*middle of epoch 0"):
        resume_jobs.run("full_single", cfg)


def test_each_start_keeps_its_config(setup_yaml, tmp_path):
    """torchtune_config.yaml (written by torchtune's metric loggers) keeps the first start's config;
    logs/config_<k>.yaml holds each start's."""
    out = tmp_path / "out"
    disk_logger = ["metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
                   f"metric_logger.log_dir={out / 'logs'}"]
    stopped_at_2(setup_yaml, out, *disk_logger)
    first = (out / "torchtune_config.yaml").read_text()
    assert "lr: 0.01" in first
    resume(setup_yaml, out, *disk_logger, "optimizer.lr=0.002")
    assert (out / "torchtune_config.yaml").read_text() == first
    configs = sorted((out / "logs").glob("config_*.yaml"))
    assert [p.name for p in configs] == ["config_0.yaml", "config_1.yaml"]
    assert "lr: 0.01" in configs[0].read_text() and "lr: 0.002" in configs[1].read_text()
    assert configs[1].read_text().startswith("# start 1 of the run in this output_dir: resumed")
