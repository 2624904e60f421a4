"""End to end: `tune run --nproc_per_node 2` of the FSDP2 full-finetune recipe (gloo on CPU)."""

import json
import math
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import read_jsonl, rel_diff, run_tune, write_tiny_hf_checkpoint
from wandb_reader import read_offline_run

RECIPE = "recipes/full_finetune_distributed.py"
CONFIG = "configs/smollm2/135M_full.yaml"
KEYS = {"step", "epoch", "loss", "lr", "grad_norm", "num_tokens", "tokens_per_second", "peak_memory_gib",
        "dp_world_size", "tokens_per_second_per_device"}
WEIGHTS = "model-00001-of-00001.safetensors"


def test_real_checkpoint_two_steps(smollm2_assets, tmp_path):
    out = tmp_path / "run"
    proc = run_tune("--nproc_per_node", "2", RECIPE, "--config", CONFIG, f"output_dir={out}",
                    "max_steps_per_epoch=2", "batch_size=1", "gradient_accumulation_steps=1")
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


def tiny_run(ckpt, out, nproc, batch_size, *extra):
    """The shipped config on a random tiny model and the first 16 Alpaca samples."""
    proc = run_tune(
        "--nproc_per_node", str(nproc), RECIPE, "--config", CONFIG, f"output_dir={out}",
        "model._component_=torchtune_ext.models.tiny_llama", f"checkpointer.checkpoint_dir={ckpt}",
        f"dataset.data_files={ckpt / 'alpaca16.json'}",
        "tokenizer.max_seq_len=128", "metric_logger=null", "epochs=2", "max_steps_per_epoch=2",
        f"batch_size={batch_size}", "gradient_accumulation_steps=2", "optimizer.lr=1e-3", *extra,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(out / "logs" / "metrics.jsonl")


def test_resume_on_another_world_size(smollm2_assets, tmp_path):
    """A 2-rank run's checkpoint resumes on 1 rank (same global batch) and continues identically."""
    ckpt = tmp_path / "tiny"
    write_tiny_hf_checkpoint(ckpt)
    alpaca = json.loads((smollm2_assets / "data" / "alpaca_en_demo.json").read_text())
    (ckpt / "alpaca16.json").write_text(json.dumps(alpaca[:16]))
    straight = tiny_run(ckpt, tmp_path / "a", 2, 1)
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    # interrupted after epoch 0: only its checkpoint survives
    shutil.copytree(tmp_path / "a" / "step_2", tmp_path / "b" / "step_2")
    resumed = tiny_run(ckpt, tmp_path / "b", 1, 2, "resume_from_checkpoint=true")
    assert [r["step"] for r in resumed] == [3, 4]
    for got, ref in zip(resumed, straight[2:]):
        assert got["num_tokens"] == ref["num_tokens"] and got["lr"] == pytest.approx(ref["lr"])
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    a, b = load_file(str(tmp_path / "a" / "step_4" / WEIGHTS)), load_file(str(tmp_path / "b" / "step_4" / WEIGHTS))
    assert a.keys() == b.keys()
    for key in a:
        # AdamW's first steps move each weight by about +-lr, so compare on that scale
        assert rel_diff(b[key], a[key]) <= 1e-4, key


def test_bad_config_fails_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = run_tune(RECIPE, "--config", CONFIG, f"output_dir={out}", "fsdp_cpu_offload=sometimes")
    assert proc.returncode == 2
    assert "fsdp_cpu_offload" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
