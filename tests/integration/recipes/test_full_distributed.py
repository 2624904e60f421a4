"""End to end: the FSDP2 full-finetune recipe under `tune run --nproc_per_node 2` (gloo on CPU)."""

import math
import shutil

import pytest
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from tests.support.helpers import (
    read_jsonl,
    recipe_class,
    rel_diff,
    run_recipe,
    run_tune,
    tiny_alpaca16_config,
)
from tests.support.wandb_reader import read_offline_run
from torchtune_ext import distributed
from torchtune_ext.checkpoint import list_checkpoints
from torchtune_ext.config import DISTRIBUTED_KEYS, ConfigError, validate

RECIPE = "recipes/full_finetune_distributed.py"
CONFIG = "configs/smollm2/135M_full.yaml"
KEYS = {"step", "epoch", "loss", "lr", "grad_norm", "num_tokens", "tokens_per_second", "peak_memory_gib",
        "dp_world_size", "tokens_per_second_per_device"}
WEIGHTS = "model-00001-of-00001.safetensors"


def test_real_checkpoint_two_steps(smollm2_assets, tmp_path):
    out = tmp_path / "run"
    proc = run_tune("--nproc_per_node", "2", RECIPE, "--config", CONFIG, f"output_dir={out}",
                    "max_steps_per_epoch=2", "batch_size=1", "gradient_accumulation_steps=1",
                    "tokenizer.max_seq_len=128",  # the real weights, shorter steps (512 tokens: ~4x the compute)
                    # the shipped config validates before and after training: this test trains only
                    "run_val_every_n_steps=null", "run_val_at_start=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # one writer: rank 0
    for r in rows:
        assert KEYS <= r.keys() and r["dp_world_size"] == 2
        assert 0.3 < r["loss"] < 4.0 and math.isfinite(r["grad_norm"])
        assert r["num_tokens"] > 0 and r["tokens_per_second"] == pytest.approx(r["num_tokens"] / r["step_seconds"])
        assert r["tokens_per_second_per_device"] == pytest.approx(r["tokens_per_second"] / 2)
    # the checkpoint is gathered into the single-device HF format
    ckpt = out / "step_2"
    for name in (WEIGHTS, "config.json", "tokenizer.json", "recipe_state.pt", "checkpoint.json"):
        assert (ckpt / name).is_file(), name
    with safe_open(str(ckpt / WEIGHTS), "pt") as saved, \
            safe_open(str(smollm2_assets / "SmolLM2-135M-Instruct" / "model.safetensors"), "pt") as base:
        assert set(saved.keys()) == set(base.keys())
        assert saved.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    # a single W&B run (rank 0's), holding what metrics.jsonl holds
    assert len(list((out / "logs" / "wandb").glob("offline-run-*"))) == 1
    run = read_offline_run(str(out / "logs"))
    logged = [h for h in run["history"] if "loss" in h]
    assert [(h["global_step"], h["tokens_per_second_per_device"]) for h in logged] == \
        [(r["step"], r["tokens_per_second_per_device"]) for r in rows]


def tiny_config(assets, tmp_path, output_dir, *overrides):
    """The shipped config on a random tiny model and the first 16 Alpaca samples (unvalidated)."""
    return tiny_alpaca16_config(CONFIG, {"_component_": "torchtune_ext.models.tiny_llama"}, assets, tmp_path,
                                output_dir, *overrides)


def test_resume_on_another_world_size(smollm2_assets, tmp_path):
    """A 2-rank run saved mid-epoch resumes on 1 rank (same global batch) and continues as it would have."""
    settings = ["max_steps_per_epoch=4", "save_every_n_steps=2", "gradient_accumulation_steps=2",
                "lr_scheduler.num_warmup_steps=1", "optimizer.lr=1e-3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    config = tmp_path / "straight.yaml"
    OmegaConf.save(tiny_config(smollm2_assets, tmp_path, straight, *settings, "batch_size=1"), config)
    proc = run_tune("--nproc_per_node", "2", RECIPE, "--config", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(straight / "step_2", resumed / "step_2")  # as if the run had stopped after step 2
    cfg = tiny_config(smollm2_assets, tmp_path, resumed, *settings, "batch_size=2", "resume_from_checkpoint=true")
    run_recipe(recipe_class(RECIPE, "FullFinetuneRecipeDistributed"), validate(cfg, extra_keys=DISTRIBUTED_KEYS))

    expected = read_jsonl(straight / "logs" / "metrics.jsonl")
    got = read_jsonl(resumed / "logs" / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4] and [r["step"] for r in got] == [3, 4]
    assert expected[2]["lr"] > 0  # warmup ended: a scheduler reset to step 0 would show here
    for a, b in zip(got, expected[2:]):
        assert a["num_tokens"] == b["num_tokens"] and a["lr"] == b["lr"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    final = load_file(straight / "step_4" / WEIGHTS)
    for key, weight in load_file(resumed / "step_4" / WEIGHTS).items():
        # AdamW's first steps move each weight by about +-lr: compare on that scale
        assert rel_diff(weight, final[key]) <= 1e-4, key


def test_config_checks_the_distributed_keys(smollm2_assets, tmp_path):
    cfg = tiny_config(smollm2_assets, tmp_path, tmp_path / "run", "fsdp_cpu_offload=sometimes")
    with pytest.raises(ConfigError, match="'fsdp_cpu_offload'"):
        validate(cfg, extra_keys=DISTRIBUTED_KEYS)
    assert validate(OmegaConf.load(CONFIG), extra_keys=DISTRIBUTED_KEYS).fsdp_cpu_offload is False


def test_weights_that_do_not_fit_are_a_config_error(smollm2_assets, tmp_path):
    cfg = tiny_config(smollm2_assets, tmp_path, tmp_path / "run", "model.embed_dim=32", "model.num_heads=2",
                      "model.num_kv_heads=1")
    recipe = recipe_class(RECIPE, "FullFinetuneRecipeDistributed")(validate(cfg, extra_keys=DISTRIBUTED_KEYS))
    try:
        with pytest.raises(ConfigError, match="'checkpointer.checkpoint_dir'.*'tok_embeddings.weight' has shape"):
            recipe.setup()
    finally:
        distributed.destroy_process_group()


def test_two_ranks_stop_together_with_one_line(smollm2_assets, tmp_path):
    """Under torchrun a destroyed model and a save that fills the disk end the job with one line and the recipe's
    exit status (3, 74), not torchrun's ChildFailedError report; the ranks agree on the step at which they stop
    (rank 1 learns of rank 0's failed save). Bad input (2): test_tensor_parallel_recipe.py's refusal."""
    cases = {"save_failed": (["save_every_n_steps=1",
                              "checkpointer._component_=tests.support.fake_checkpointer.DiskFullAtStep",
                              "checkpointer.full_at_step=2"], 74, "the disk filled up while saving step_2"),
             "destroyed": (["optimizer.lr=1e6", "lr_scheduler.num_warmup_steps=1", "save_every_n_steps=1"], 3,
                           "optimizer step 3")}
    for name, (overrides, status, words) in cases.items():
        out = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        OmegaConf.save(tiny_config(smollm2_assets, tmp_path, out, "batch_size=2", "gradient_accumulation_steps=1",
                                   *overrides), config)
        proc = run_tune("--nproc_per_node", "2", RECIPE, "--config", str(config), timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == status, proc.stderr[-3000:]
        assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert [p.name for p in list_checkpoints(str(tmp_path / "save_failed"))] == ["step_1"]
    assert not (tmp_path / "save_failed" / ".staging").exists()
    assert "Last checkpoint from before the damage" in errors[0] and "step_2" in errors[0]
    assert [r["step"] for r in read_jsonl(tmp_path / "destroyed" / "logs" / "metrics.jsonl")] == [1, 2]
