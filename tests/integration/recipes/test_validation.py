"""Validation in the four recipes, on a tiny checkpoint with the real tokenizer and Alpaca records.

Single-device recipes run in process: validation does not change training,
its schedule survives a resume, the records and the W&B run hold what they
should, and ``python -m torchtune_ext.evaluate`` on a saved step folder gives
the logged numbers. The distributed recipes run on 2 ranks and their
step-0 validation equals the command's on one process.
"""

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.support.helpers import (
    REPO_ROOT,
    read_jsonl,
    recipe_class,
    run_recipe,
    run_tune,
    tiny_alpaca16_config,
    write_tiny_hf_checkpoint,
)
from tests.support.wandb_reader import read_offline_run
from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, ConfigError, validate
from torchtune_ext.run import evaluate as evaluate_module

TINY_LORA = {"_component_": "torchtune_ext.model.builders.lora_tiny_llama", "lora_attn_modules": ["q_proj", "v_proj"],
             "apply_lora_to_mlp": True, "apply_lora_to_output": False, "lora_rank": 4, "lora_alpha": 8,
             "lora_dropout": 0.1}
TINY_FULL = {"_component_": "torchtune_ext.model.builders.tiny_llama"}
RECIPES = {
    # name: (recipe file, class, config, tiny model, schema keys)
    "full": ("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice",
             "configs/smollm2/135M_full_single_device.yaml", TINY_FULL, None),
    "lora": ("recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice",
             "configs/smollm2/135M_lora_single_device.yaml", TINY_LORA, LORA_KEYS),
    "full_distributed": ("recipes/full_finetune_distributed.py", "FullFinetuneRecipeDistributed",
                         "configs/smollm2/135M_full.yaml", TINY_FULL, DISTRIBUTED_KEYS),
    "lora_distributed": ("recipes/lora_finetune_distributed.py", "LoRAFinetuneRecipeDistributed",
                         "configs/smollm2/135M_lora.yaml", TINY_LORA, {**LORA_KEYS, **DISTRIBUTED_KEYS}),
}
# 16 training samples, 2 x 2 per step: 4 optimizer steps
SETTINGS = ["batch_size=2", "gradient_accumulation_steps=2", "lr_scheduler.num_warmup_steps=1", "optimizer.lr=0.01"]
TRAIN_KEYS = ("loss", "grad_norm", "lr", "num_tokens", "token_accuracy", "entropy", "tokens_seen")
ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
VAL_KEYS = {"val_loss", "val_perplexity", "val_token_accuracy", "val_entropy", "val_num_tokens", "val_num_samples",
            "val_seconds", "step", "epoch", "tokens_seen"}


def config(name, assets, tmp_path, output_dir, *overrides, validation=True):
    """The shipped config on a tiny checkpoint whose predictions are not saturated (loss near
    ln(vocab), entropy of several nats), 16 Alpaca records; validation on records 16 to 27."""
    _, _, config_file, model, _ = RECIPES[name]
    checkpoint_dir, val_file = tmp_path / "base_model", tmp_path / "alpaca_val.json"
    if not val_file.exists():
        write_tiny_hf_checkpoint(checkpoint_dir, embedding_std=0.02)
        val_file.write_text(json.dumps(json.loads((assets / "data" / "alpaca_en_demo.json").read_text())[16:28]))
    cfg = tiny_alpaca16_config(config_file, model, assets, tmp_path, output_dir, *SETTINGS,
                               f"checkpointer.checkpoint_dir={checkpoint_dir}", *overrides)
    if validation:
        cfg.dataset_val = OmegaConf.merge(cfg.dataset, {"data_files": str(val_file)})
    return cfg


def run(name, cfg):
    recipe_file, cls, _, _, keys = RECIPES[name]
    run_recipe(recipe_class(recipe_file, cls), validate(cfg, extra_keys=keys))
    rows = read_jsonl(cfg.output_dir + "/logs/metrics.jsonl")
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


@pytest.mark.parametrize("name", ["full", "lora"])
def test_validation_does_not_change_training(name, smollm2_assets, tmp_path):
    """Validation before training and after every step leaves the training run bit-identical (LoRA: dropout on)."""
    plain, _ = run(name, config(name, smollm2_assets, tmp_path, tmp_path / "plain", validation=False))
    train, val = run(name, config(name, smollm2_assets, tmp_path, tmp_path / "validated",
                                  "run_val_every_n_steps=1", "run_val_at_start=true", "batch_size_val=5"))
    assert [r["step"] for r in plain] == [1, 2, 3, 4]
    for a, b in zip(train, plain):
        assert [a[k] for k in TRAIN_KEYS] == [b[k] for k in TRAIN_KEYS], a["step"]
    weights = "adapter/adapter_model.pt" if name == "lora" else "model-00001-of-00001.safetensors"
    load = torch.load if name == "lora" else load_file
    kwargs = {"weights_only": True} if name == "lora" else {}
    final, other = load(tmp_path / "plain" / "step_4" / weights, **kwargs), load(
        tmp_path / "validated" / "step_4" / weights, **kwargs)
    assert all(torch.equal(final[k], other[k]) for k in final)

    # one record per validation: before training, then after every step
    assert [r["step"] for r in val] == [0, 1, 2, 3, 4]
    assert all(r.keys() == VAL_KEYS for r in val)
    assert [r["tokens_seen"] for r in val] == [0] + [r["tokens_seen"] for r in train]
    assert train[-1]["tokens_seen"] == sum(r["num_tokens"] for r in train)
    assert len({r["val_num_tokens"] for r in val}) == 1 and val[0]["val_num_samples"] == 12
    for r in val:
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]))
        assert 0 <= r["val_token_accuracy"] <= 1 and r["val_entropy"] > 0
    assert val[-1]["val_loss"] < val[0]["val_loss"]  # it learned, and validation saw it


def test_resume_continues_the_validation_schedule(smollm2_assets, tmp_path):
    """Every 3 steps and at the end: steps 3 and 4; a run resumed after step 2 validates at the same steps, alike."""
    settings = ["save_every_n_steps=2", "run_val_every_n_steps=3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _, expected = run("full", config("full", smollm2_assets, tmp_path, straight, *settings))
    resumed.mkdir()
    shutil.copytree(straight / "step_2", resumed / "step_2")  # as if the run had stopped after step 2
    _, got = run("full", config("full", smollm2_assets, tmp_path, resumed, *settings, "resume_from_checkpoint=true"))
    assert [r["step"] for r in expected] == [3, 4] and [r["step"] for r in got] == [3, 4]
    for a, b in zip(got, expected):
        assert {k: v for k, v in a.items() if k != "val_seconds"} == {k: v for k, v in b.items() if k != "val_seconds"}


def test_wandb_run_has_validation_axes_and_the_combined_chart(smollm2_assets, tmp_path):
    out = tmp_path / "run"
    cfg = config("full", smollm2_assets, tmp_path, out, "run_val_every_n_steps=2", "run_val_at_start=true")
    cfg.metric_logger = {"_component_": "torchtune.training.metric_logging.WandBLogger", "project": "evalx",
                         "mode": "offline", "log_dir": str(out / "logs")}
    train, val = run("full", cfg)
    wb = read_offline_run(str(out / "logs"))
    logged_val = [h for h in wb["history"] if "val_loss" in h]
    assert [(h["global_step"], h["val_loss"], h["tokens_seen"]) for h in logged_val] == \
        [(r["step"], r["val_loss"], r["tokens_seen"]) for r in val]
    assert [h["tokens_seen"] for h in wb["history"] if "loss" in h] == [r["tokens_seen"] for r in train]
    # x axes: torchtune's global_step for every metric (val_loss too), and tokens_seen
    assert wb["metrics"]["*"]["step_metric"] == "global_step" and "tokens_seen" in wb["metrics"]
    assert wb["metrics"]["val_loss"]["step_metric"] == "global_step"
    # training and validation loss on one chart, against step and against tokens_seen
    for x in ("step", "tokens_seen"):
        assert f"_wandb/visualize/loss_vs_{x}" in wb["config"]
        (table,) = glob.glob(f"{wb['run_dir']}/files/media/table/loss_vs_{x}_table_*.table.json")
        data = json.loads(open(table).read())
        rows = {(line, xv, yv) for xv, line, yv in data["data"]}
        assert rows == {("loss", r[x], r["loss"]) for r in train} | {("val_loss", r[x], r["val_loss"]) for r in val}


def test_no_trainable_validation_token_warns_and_logs_no_val_loss(smollm2_assets, tmp_path, caplog):
    cfg = config("full", smollm2_assets, tmp_path, tmp_path / "run", "run_val_every_n_steps=1")
    cfg.dataset_val = {"_component_": "tests.support.helpers.synthetic_val_dataset", "all_masked": True}
    with caplog.at_level("WARNING"):
        train, val = run("full", cfg)
    assert len(train) == 4 and val == []
    assert not any(k.startswith("val_") for r in read_jsonl(tmp_path / "run/logs/metrics.jsonl") for k in r)
    assert "dataset_val: none of its 13 samples has a trainable token" in caplog.text


def test_empty_dataset_val_stops_the_recipe_before_training(smollm2_assets, tmp_path):
    out = tmp_path / "run"
    (tmp_path / "empty.json").write_text("[]")
    cfg = config("full", smollm2_assets, tmp_path, out, "run_val_every_n_steps=2")
    cfg.dataset_val.data_files = str(tmp_path / "empty.json")
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    proc = run_tune(RECIPES["full"][0], "--config", str(tmp_path / "config.yaml"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert "config key 'dataset_val'" in line and "empty.json" in line
    assert not out.exists()  # nothing was written


@pytest.mark.parametrize("name", ["full", "lora"])
def test_command_evaluates_a_step_folder_with_the_logged_numbers(name, smollm2_assets, tmp_path, capsys):
    """``python -m torchtune_ext.evaluate`` on step_4 (LoRA: the merged model) equals the val_loss logged at
    step 4; on the base checkpoint it equals the step-0 validation."""
    out = tmp_path / "run"
    cfg = config(name, smollm2_assets, tmp_path, out, "run_val_every_n_steps=4", "run_val_at_start=true",
                 "batch_size_val=4")
    _, val = run(name, cfg)
    config_file = tmp_path / "config.yaml"
    OmegaConf.save(cfg, config_file)
    base = str(cfg.checkpointer.checkpoint_dir)
    # merged LoRA weights W + (alpha/r) B A are rounded once in fp32: 1e-5, not 1e-6
    tol = {"full": 1e-6, "lora": 1e-5}[name]
    for folder, logged in ((out / "step_4", val[-1]), (base, val[0])):
        result = evaluate_module.evaluate_checkpoint(
            OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"checkpointer.checkpoint_dir={folder}", "batch_size_val=3"])))
        assert result["dataset"] == "dataset_val" and result["num_tokens"] == logged["val_num_tokens"]
        for key in ("loss", "token_accuracy", "entropy", "perplexity"):
            assert result[key] == pytest.approx(logged[f"val_{key}"], rel=tol), (folder, key)
    assert val[-1]["val_loss"] != pytest.approx(val[0]["val_loss"], rel=1e-3)  # the two folders differ

    if name == "full":  # the command line itself, once: printed JSON, --output file, exit 2 on bad input
        json_file = tmp_path / "result.json"
        proc = subprocess.run(
            [sys.executable, "-m", "torchtune_ext.evaluate", "--config", str(config_file), "--output", str(json_file),
             f"checkpointer.checkpoint_dir={out / 'step_4'}", "--dataset", "dataset_val"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = json.loads(proc.stdout.strip().splitlines()[-1])
        assert printed == json.loads(json_file.read_text())
        assert printed["loss"] == pytest.approx(val[-1]["val_loss"], rel=1e-6)
        code = evaluate_module.main(["--config", str(config_file), f"checkpointer.checkpoint_dir={tmp_path / 'gone'}"])
        (line,) = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
        assert code == 2 and line.startswith("error: config key 'checkpointer.checkpoint_dir'") and "gone" in line


def test_command_refuses_an_adapter_only_folder(smollm2_assets, tmp_path):
    out = tmp_path / "run"
    cfg = config("lora", smollm2_assets, tmp_path, out, "save_adapter_weights_only=true", "max_steps_per_epoch=1",
                 validation=False)
    run("lora", cfg)
    with pytest.raises(ConfigError, match="'checkpointer.checkpoint_dir'.*save_adapter_weights_only"):
        evaluate_module.evaluate_checkpoint(
            OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"checkpointer.checkpoint_dir={out / 'step_1'}"])), "dataset")


# the LoRA recipe validates through the same Validator (on one process: test_command_evaluates_a_step_folder...)
@pytest.mark.parametrize("name", ["full_distributed"])
def test_distributed_recipes_validate_on_two_ranks(name, smollm2_assets, tmp_path):
    """2 ranks x batch_size_val 3 (stand-ins for the uneven end) give the single-process command's numbers."""
    out = tmp_path / "run"
    cfg = config(name, smollm2_assets, tmp_path, out, "run_val_every_n_steps=2", "run_val_at_start=true",
                 "batch_size_val=3", "max_steps_per_epoch=2", "batch_size=1", "save_final_checkpoint=false")
    config_file = tmp_path / "config.yaml"
    OmegaConf.save(cfg, config_file)
    proc = run_tune("--nproc_per_node", "2", RECIPES[name][0], "--config", str(config_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 2] and val[0]["val_num_samples"] == 12
    # the step-0 model is the base checkpoint (LoRA: B = 0), evaluated by one process with batch 1
    single = evaluate_module.evaluate_checkpoint(OmegaConf.merge(cfg, {"batch_size_val": 1}))
    assert single["num_tokens"] == val[0]["val_num_tokens"]
    for key in ("loss", "token_accuracy", "entropy"):
        assert single[key] == pytest.approx(val[0][f"val_{key}"], rel=1e-6), key
