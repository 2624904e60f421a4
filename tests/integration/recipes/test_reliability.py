"""Never wrong, never lost: resume, epoch ends, bad input -- through the real recipe on a tiny model."""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT, read_jsonl, run_tune

RECIPE = "recipes/full_finetune_single_device.py"


def tune(config, *overrides):
    return run_tune(RECIPE, "--config", str(config), *overrides)


def by_step(rows):
    """Last record per step (a resumed run re-logs the steps after its checkpoint)."""
    return {r["step"]: r for r in rows}


def snapshot(folder):
    """Relative path -> (size, mtime) of everything under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, folder)] = (os.path.getsize(p), os.path.getmtime(p))
    return out


def test_resume_after_sigkill_mid_epoch_is_exact(tiny_run):
    """Kill a run mid-step; resuming reproduces the uninterrupted run's losses exactly."""
    # keep every checkpoint: the one resumed from must still be there, unchanged, at the end
    overrides = dict(batch_size=2, gradient_accumulation_steps=3, epochs=2, save_every_n_steps=2,
                     keep_last_n_checkpoints=None)
    reference = tiny_run("reference", **overrides)
    assert tune(reference).returncode == 0
    expected = by_step(read_jsonl(reference.parent / "out/logs/metrics.jsonl"))
    assert len(expected) == 8  # 24 samples / (2 x 3) = 4 steps per epoch, 2 epochs

    config = tiny_run("killed", **overrides)
    out = config.parent / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(["tune", "run", RECIPE, "--config", str(config)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "logs/metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # during step 4: step 2 is the last checkpoint
    proc.wait()
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"]
    kept = snapshot(out / "step_2")

    resumed = tune(config, "resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows][:3] == [1, 2, 3]  # the earlier part is kept, then appended
    got = by_step(rows)
    assert sorted(got) == sorted(expected)
    for step, row in expected.items():
        for key in ("loss", "grad_norm", "lr", "num_tokens"):
            assert got[step][key] == pytest.approx(row[key], rel=1e-6, abs=1e-12), (step, key)
    assert snapshot(out / "step_2") == kept  # the checkpoint resumed from was not rewritten


def test_partial_window_at_epoch_end(tiny_run):
    """14 samples, 2 x 4 per step, 2 epochs: steps of 8 and 6 samples per epoch, restarting each epoch."""
    config = tiny_run(n_samples=14, batch_size=2, gradient_accumulation_steps=4, epochs=2, shuffle=True, seed=7)
    proc = tune(config)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_jsonl(config.parent / "out/logs/metrics.jsonl")
    assert [(r["step"], r["epoch"]) for r in rows] == [(1, 0), (2, 0), (3, 1), (4, 1)]

    # Recompute each step's token count from the same data and tokenizer: the epoch's
    # order (DistributedSampler's permutation, seeded 0 whatever `seed`, as torchtune's
    # recipes do), 8 samples then the remaining 6.
    from torch.utils.data import DistributedSampler
    from torchtune import config as tt_config

    cfg = OmegaConf.load(config)
    dataset = tt_config.instantiate(cfg.dataset, tt_config.instantiate(cfg.tokenizer))
    assert len(dataset) == 14
    expected = []
    for epoch in range(2):
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        counts = [sum(label != -100 for label in dataset[i]["labels"][1:]) for i in sampler]
        expected += [sum(counts[:8]), sum(counts[8:])]
    assert [r["num_tokens"] for r in rows] == expected
    # the LR schedule was built for exactly 4 steps: cosine after 1 warmup step ends at
    # 0.5 * (1 + cos(pi * 2/3)) * lr on step 4
    assert rows[-1]["lr"] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 2 / 3)).item()) * 1e-3)


def test_nonfinite_values_stop_and_never_recommend_a_later_checkpoint(tiny_run):
    config = tiny_run(batch_size=4, gradient_accumulation_steps=1, save_every_n_steps=1, clip_grad_norm=None,
                      **{"optimizer._component_": "torch.optim.SGD", "optimizer.weight_decay": 0.0,
                         "lr_scheduler": None})
    # SGD at lr 1e25: step 1's update overflows the weights; caught before step_1 is saved.
    proc = tune(config, "optimizer.lr=1e25")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "the update of optimizer step 1 made parameters non-finite" in proc.stderr
    assert "Last checkpoint from before the damage: none (only the base model)" in proc.stderr
    assert not list((config.parent / "out").glob("step_*"))

    # At lr 1e15 the weights stay finite (step_1 is saved) but step 2 is NaN. Skipping does not
    # help when the parameters themselves are broken: 5 non-finite steps in a row stop the run.
    out = config.parent / "skip"
    proc = tune(config, "optimizer.lr=1e15", f"output_dir={out}", "skip_nonfinite_steps=true",
                "keep_last_n_checkpoints=null")  # keep them all: the message must list every later one
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "non-finite values at optimizer step 6" in proc.stderr and "the 5th in a row (steps 2-6)" in proc.stderr
    assert "Last checkpoint from before the damage: none (only the base model)" in proc.stderr
    assert "not to be resumed from: step_1, step_2, step_3, step_4, step_5" in proc.stderr
    assert [r["skipped_steps"] for r in read_jsonl(out / "logs/metrics.jsonl")] == [0, 1, 2, 3, 4]


CONFIG_ERRORS = {
    # override -> words the error must contain; caught by validate() (or, for where a run starts,
    # check_resume_point()) before any work
    "batch_size=0": ["batch_size", "positive integer"],
    "gradient_accumulation_steps=-1": ["gradient_accumulation_steps", "positive integer"],
    "gradient_accumulation_steps=2.5": ["gradient_accumulation_steps", "positive integer"],
    "backward_once_per_step=false": ["backward_once_per_step", "use backward=per_micro_batch"],
    "once_per_step_memory_limit=gpu": ["once_per_step_memory_limit", "torchtune, device"],
    "optimizer_in_bwd=true": ["optimizer_in_bwd", "gradient_accumulation_steps"],
    "tokenizer.max_seq_len=1": ["tokenizer.max_seq_len", ">= 2"],
    "dataset.data_files=/nonexistent/data.json": ["dataset.data_files", "/nonexistent/data.json"],
    "checkpointer.checkpoint_files=[missing.safetensors]": ["checkpointer.checkpoint_files", "missing.safetensors"],
    "resume_from_checkpoint=true": ["resume_from_checkpoint", "no complete checkpoint"],
    "dtype=fp16": ["dtype", "fp32, bf16"],
    "peak_tflops_per_device=-5": ["peak_tflops_per_device", "positive number"],
    "loss.num_output_chunks=0": ["loss.num_output_chunks", "auto or a positive integer"],
    # torch would take any truthy value as true (a quoted "false" would run fused)
    "optimizer.fused=maybe": ["optimizer.fused", "true or false"],
    "optimizer.foreach=1": ["optimizer.foreach", "true or false"],
    "loss.token_metrics=maybe": ["loss.token_metrics", "true or false"],
}


@pytest.mark.parametrize("override", sorted(CONFIG_ERRORS))
def test_config_errors_name_the_key(tiny_run, override):
    from torchtune_ext.config import ConfigError, validate
    from torchtune_ext.run.resume import check_resume_point

    config = tiny_run(gradient_accumulation_steps=2)
    cfg = OmegaConf.merge(OmegaConf.load(config), OmegaConf.from_dotlist([override]))
    with pytest.raises(ConfigError) as err:
        check_resume_point(validate(cfg))
    for word in CONFIG_ERRORS[override]:
        assert word in str(err.value)


# One bad input per stage of start-up, through the command line: the command
# line itself, validation, components, data loading, the data pass, the base
# checkpoint, model loading. Each exits 2 with one line and leaves the output
# folder as it was (no .staging, no logs).
@pytest.mark.parametrize("override,words", [
    ("~model", ["'~model'", "component"]),
    ("gradient_accumulation_steps=-1", ["gradient_accumulation_steps", "positive integer"]),
    ("optimizer.lr=-1", ["'optimizer'", "Invalid learning rate: -1"]),
    ("dataset.data_files=DATA", ["'dataset'", "is not valid JSON at line 1", "fix that line"]),
    ("dataset.data_files=COLUMNS", ["'dataset'", "no column 'instruction'"]),
    ("checkpointer.checkpoint_dir=TRUNCATED", ["checkpointer.checkpoint_dir", "model.safetensors"]),
    ("model.embed_dim=32", ["checkpointer.checkpoint_dir", "does not fit"]),
], ids=["command-line", "validation", "optimizer", "data", "columns", "truncated-weights", "model"])
def test_bad_input_fails_cleanly_and_writes_nothing(tiny_run, override, words):
    config = tiny_run(gradient_accumulation_steps=2)
    root = config.parent
    (root / "bad.json").write_text("{not json")
    (root / "columns.json").write_text(json.dumps([{"prompt": "a", "answer": "b"}] * 4))
    shutil.copytree(root / "ckpt", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = root / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    override = override.replace("DATA", str(root / "bad.json")).replace("COLUMNS", str(root / "columns.json"))
    proc = tune(config, override.replace("TRUNCATED", str(root / "truncated")))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1
    for word in words:
        assert word in proc.stderr, (word, proc.stderr[-1000:])
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_broken_config_file_is_one_line_with_its_line_number(tiny_run):
    config = tiny_run()
    text = config.read_text().replace("batch_size: 2", "batch_size: [2")
    config.write_text(text)
    line = text.splitlines().index("batch_size: [2") + 1
    proc = tune(config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    # the parser finds the missing ']' on the next line; the context points back at the '['
    assert re.search(re.escape(f"error: --config '{config}', line {line + 1}, column ") + r"\d+: did not find " +
                     re.escape(f"expected ',' or ']' (while parsing a flow sequence at line {line}, column 13)"),
                     proc.stderr), proc.stderr[-1000:]
    assert not (config.parent / "out").exists()


@pytest.mark.parametrize("content", ["{not json", "[]"], ids=["unparseable", "empty"])
def test_bad_dataset_file(tiny_run, content):
    from torchtune import config as tt_config

    from torchtune_ext.config import ConfigError
    from torchtune_ext.data import build_dataset

    config = tiny_run()
    (config.parent / "data.json").write_text(content)
    cfg = OmegaConf.load(config)
    with pytest.raises(ConfigError, match="'dataset'"):
        build_dataset(cfg.dataset, tt_config.instantiate(cfg.tokenizer))


def test_more_ranks_than_samples_is_refused(tiny_run):
    from torchtune import config as tt_config

    from torchtune_ext.config import ConfigError, validate
    from torchtune_ext.data import build_step_loader

    cfg = validate(OmegaConf.load(tiny_run(n_samples=3)))
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    kwargs = dict(seed=0, ignore_index=-100, dp_rank=0)
    with pytest.raises(ConfigError, match="'dataset'.*3 sample.*4 data-parallel ranks"):
        build_step_loader(cfg, tokenizer, dp_world_size=4, **kwargs)
    loader = build_step_loader(cfg, tokenizer, dp_world_size=3, **kwargs)
    assert len(loader) == 3 and loader.steps_per_epoch == 1


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, smollm2_assets):
    """A finished one-step run (one launch for the tests below): its config, and its output folder, which each
    test copies before changing anything."""
    from tests.support.tiny_run import make_tiny_run

    config = make_tiny_run(tmp_path_factory.mktemp("one_step"), smollm2_assets, max_steps_per_epoch=1)
    proc = tune(config)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return config, config.parent / "out"


def test_output_dir_with_checkpoints_is_not_overwritten(one_step_run, tmp_path):
    config, finished = one_step_run
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    before = snapshot(out)
    proc = tune(config, f"output_dir={out}")
    assert proc.returncode == 2 and "resume_from_checkpoint=true" in proc.stderr
    assert snapshot(out) == before


def test_corrupt_checkpoint_is_refused(one_step_run, tmp_path):
    config, finished = one_step_run
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    ckpt = out / "step_1"
    weights = next(ckpt.glob("model-*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    proc = tune(config, f"output_dir={out}", "resume_from_checkpoint=true")
    assert proc.returncode == 2 and "resume_from_checkpoint" in proc.stderr and weights.name in proc.stderr
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    assert manifest["step"] == 1
