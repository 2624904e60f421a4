"""A resume with other settings applies them, or refuses them, and says so: nothing is dropped in silence.

Each test stops a tiny single-device run after step 2 (of 4 per epoch, 16
samples, 4 per step) with a real SIGTERM, resumes it with a changed setting
and compares with the uninterrupted run.
"""

import gc
import logging

import pytest
import torch

from tests.support import resume_jobs
from torchtune_ext.config import ConfigError
from torchtune_ext.errors import EXIT_STOPPED


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
    assert status == EXIT_STOPPED


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


def test_lowering_max_steps_per_epoch_below_the_step_reached_ends_the_epoch_and_says_so(setup_yaml, tmp_path,
                                                                                          caplog):
    """Issue 33 F12: stopped after step 2 of epoch 0 (of 1), resumed with max_steps_per_epoch=1: the epoch is over.
    The log said "finished 0 epoch(s) ... raise epochs" and called the key "not applied" though it ended the epoch."""
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out, "epochs=1")
    with caplog.at_level(logging.INFO):
        got = resume(setup_yaml, out, "epochs=1", "max_steps_per_epoch=1", "optimizer.lr=0.002")
    assert sorted(got) == [1, 2]
    said = [m for m in messages(caplog) if "Nothing is left to train" in m or "changed settings" in m]
    assert said == ["Nothing is left to train: max_steps_per_epoch=1 ends epoch 0, the last of epochs=1, and the "
                    "checkpoint (step 2) has run 2 optimizer steps of it; raise max_steps_per_epoch or epochs to "
                    "train more. Changed settings, applied: max_steps_per_epoch None -> 1 (the epoch ends here); "
                    "not applied, as no step is left: optimizer.lr 0.01 -> 0.002"]


# ------------------------------------------------------- resumes another model cannot continue (issue 33 F8, F9)
def lora_stopped_at_2(setup_yaml, out):
    cfg = resume_jobs.config(setup_yaml, "lora_single", out)
    assert resume_jobs.run("lora_single", cfg, stop_after=2) == EXIT_STOPPED


@pytest.mark.parametrize("override,expected", [
    ("model.lora_attn_modules=[q_proj]", "model.lora_attn_modules ['q_proj', 'v_proj'] -> ['q_proj']"),
    ("model.lora_rank=8", "model.lora_rank 4 -> 8"),
    ("model.apply_lora_to_mlp=false", "model.apply_lora_to_mlp True -> False"),
], ids=["attn-modules", "rank", "mlp"])
def test_a_lora_resume_with_another_adapter_shape_is_one_line(setup_yaml, tmp_path, override, expected):
    """F8: other lora_attn_modules raised an AssertionError ("Unexpected key loading adapter"); F9: another
    lora_rank printed torch's whole size-mismatch list (424 lines). Refused before anything loads."""
    out = tmp_path / "out"
    lora_stopped_at_2(setup_yaml, out)
    cfg = resume_jobs.config(setup_yaml, "lora_single", out, override, "resume_from_checkpoint=true")
    with pytest.raises(ConfigError) as err:
        resume_jobs.run("lora_single", cfg)
    message = str(err.value)
    assert message.startswith(f"config key 'model': the adapter in '{out / 'step_2'}' was trained with other LoRA "
                              f"settings ({expected}), so its weights do not fit this model; resume with the "
                              "settings it was trained with, or start a new run in another output_dir"), message
    assert "\n" not in message


def test_the_full_recipe_refuses_a_lora_checkpoint_in_one_line(setup_yaml, tmp_path):
    """F8: the full recipe resuming a LoRA folder failed with a ValueError on the optimizer's parameter groups.
    Refused from the saved config before anything loads; a checkpoint of an earlier version, without a saved
    config, is refused when the checkpoint is opened (it holds an adapter), before the model loads."""
    out = tmp_path / "out"
    lora_stopped_at_2(setup_yaml, out)
    cfg = resume_jobs.config(setup_yaml, "full_single", out, "resume_from_checkpoint=true")
    with pytest.raises(ConfigError) as err:
        resume_jobs.run("full_single", cfg)
    assert str(err.value) == (
        f"config key 'resume_from_checkpoint': '{out / 'step_2'}' was written by a LoRA recipe (model "
        "torchtune.models.llama3_2.lora_llama3_2): its optimizer state is the adapter's, which a full fine-tune "
        "cannot continue; resume it with a LoRA recipe (recipes/lora_finetune_single_device.py)")
    del err  # its traceback holds the failed recipe, whose open lock file keeps output_dir in use
    gc.collect()

    rewrite_recipe_state(out / "step_2", lambda state: state.pop("config"))
    with pytest.raises(ConfigError, match=rf"^config key 'resume_from_checkpoint': '{out / 'step_2'}' was written "
                       r"by a LoRA recipe \(it holds adapter/adapter_model.pt\): its optimizer state is the "
                       "adapter's, which a full fine-tune cannot continue; resume it with a LoRA recipe$"):
        resume_jobs.run("full_single", cfg)


def test_a_lora_recipe_refuses_a_full_checkpoint_in_one_line(setup_yaml, tmp_path):
    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out)
    cfg = resume_jobs.config(setup_yaml, "lora_single", out, "resume_from_checkpoint=true")
    with pytest.raises(ConfigError, match=rf"^config key 'resume_from_checkpoint': '{out / 'step_2'}' was written "
                       r"by a full fine-tune \(model torchtune.models.llama3_2.llama3_2\): it holds no adapter to "
                       r"continue; resume it with recipes/full_finetune_single_device.py, or train a LoRA adapter on "
                       rf"its weights in a new output_dir with checkpointer.checkpoint_dir={out / 'step_2'}$"):
        resume_jobs.run("lora_single", cfg)


def rewrite_recipe_state(folder, change):
    """Apply ``change`` to a checkpoint's recipe_state.pt, keeping its manifest true (sizes and hashes)."""
    import json

    import torch

    from torchtune_ext.checkpoint import file_sha256

    path = folder / "recipe_state.pt"
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)
    manifest = json.loads((folder / "checkpoint.json").read_text())
    manifest["files"]["recipe_state.pt"] = path.stat().st_size
    manifest["sha256"]["recipe_state.pt"] = file_sha256(path)
    (folder / "checkpoint.json").write_text(json.dumps(manifest))


def test_a_lora_checkpoint_without_a_saved_config_and_another_rank_is_one_line(setup_yaml, tmp_path):
    """Checkpoints of earlier versions hold no config: the adapter is checked when it loads (F9's 424 lines)."""
    from torchtune_ext.checkpoint import check_adapter_fits, load_recipe_state
    from torchtune_ext.model.build import instantiate_lora_model

    out = tmp_path / "out"
    lora_stopped_at_2(setup_yaml, out)
    adapter = torch.load(out / "step_2" / "adapter" / "adapter_model.pt", weights_only=True)
    cfg = resume_jobs.config(setup_yaml, "lora_single", out, "model.lora_rank=8", "model.lora_attn_modules=[q_proj]",
                             "resume_from_checkpoint=true")
    model = instantiate_lora_model(cfg.model, torch.float32, torch.device("meta"))
    with pytest.raises(ConfigError) as err:
        check_adapter_fits(model.state_dict(), adapter, out / "step_2")
    assert str(err.value) == (
        f"config key 'resume_from_checkpoint': the adapter in '{out / 'step_2'}' does not fit this model's LoRA "
        "settings: 'layers.0.attn.q_proj.lora_a.weight' has shape [4, 32] in the saved adapter, [8, 32] in the "
        "model (19 more of 20 adapter tensors differ); resume with the LoRA settings (model.lora_rank, "
        "lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, use_dora) it was trained with")
    same = resume_jobs.config(setup_yaml, "lora_single", out, "resume_from_checkpoint=true")
    check_adapter_fits(instantiate_lora_model(same.model, torch.float32, torch.device("meta")).state_dict(),
                       adapter, out / "step_2")  # the settings it was trained with: fits
    assert load_recipe_state(out / "step_2").path == out / "step_2"


def test_an_optimizer_state_that_does_not_fit_is_one_line(setup_yaml, tmp_path):
    """Whatever else gets past the checks (an earlier version's checkpoint of another model): no traceback."""
    from torchtune_ext.checkpoint import load_recipe_state
    from torchtune_ext.run.resume import restore_training

    out = tmp_path / "out"
    stopped_at_2(setup_yaml, out)
    resumed = load_recipe_state(out / "step_2")
    cfg = resume_jobs.config(setup_yaml, "full_single", out, "resume_from_checkpoint=true")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ConfigError, match=rf"^config key 'resume_from_checkpoint': the optimizer state in "
                       rf"'{out / 'step_2'}' does not fit the parameters this run trains \(ValueError: .*\); was "
                       "it written by another recipe"):
        restore_training(resumed, cfg, optimizer, None)
