"""Exact evaluation (torchtune_ext.run.evaluate) on tiny models, in process.

The 1- and 2-rank (FSDP2) cases of the same claims are in test_distributed.py.
"""

import json
import logging
import math
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.support.helpers import IGNORE, ConstantLossModel, constant_loss_sample, synthetic_val_dataset, tiny_model
from torchtune_ext.checkpoint import CheckpointManager, Progress, file_sha256
from torchtune_ext.config import ConfigError
from torchtune_ext.data import StepLoader, make_collate
from torchtune_ext.run import evaluate as evaluate_module
from torchtune_ext.run.evaluate import (
    EvalResult,
    Validator,
    base_model_config,
    build_eval_loader,
    build_val_loader,
    describe,
    evaluate,
    perplexity,
)
from torchtune_ext.train.accounting import TokenTotals, count_trainable_tokens
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.objective import forward_sums, prepare_micro_batch

CPU = torch.device("cpu")
TOL = 1e-6


def loader(samples, batch_size, packed=False):
    return StepLoader(samples, make_collate(packed, 0, IGNORE), batch_size=batch_size, shuffle=False,
                      ignore_index=IGNORE, group_by_length=False)


def exact(model, samples, batch_size, chunks=1):
    if hasattr(model, "set_num_output_chunks"):
        model.set_num_output_chunks(chunks)
    return evaluate(model, SummedCrossEntropyLoss(chunks, IGNORE), loader(samples, batch_size), device=CPU).metrics()


def mean_of_batch_means(model, samples, batch_size):
    """The common implementation, deliberately wrong: each batch's mean loss, averaged over batches."""
    loss_fn = SummedCrossEntropyLoss(1, IGNORE)
    means = []
    with torch.no_grad():
        for step in loader(samples, batch_size).epoch(0):
            for micro_batch in step.micro_batches:
                inputs, labels = prepare_micro_batch(micro_batch, CPU, IGNORE)
                n = count_trainable_tokens(labels, IGNORE)
                if n:
                    means.append(forward_sums(model, loss_fn, inputs, labels).loss.item() / n)
    return sum(means) / len(means)


def relative_spread(values):
    return max(abs(v - values[0]) for v in values) / abs(values[0])


def binary_entropy(p):
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def test_hand_computed_tiny_case():
    """10 tokens at CE 0.1 and 100 at CE 0.9 (two-word vocabulary, label 0 everywhere)."""
    model = ConstantLossModel([0.1, 0.9])
    samples = [constant_loss_sample(0, 10), constant_loss_sample(1, 100)]
    # p(label) = exp(-CE): 0.905 for the first sample (argmax right), 0.407 for the second (wrong)
    expected = {"loss": (0.1 * 10 + 0.9 * 100) / 110, "token_accuracy": 10 / 110,
                "entropy": (10 * binary_entropy(math.exp(-0.1)) + 100 * binary_entropy(math.exp(-0.9))) / 110}
    for batch_size in (1, 2):
        got = exact(model, samples, batch_size)
        assert got["num_tokens"] == 110 and got["num_samples"] == 2
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=TOL), (batch_size, key)
        assert got["perplexity"] == pytest.approx(math.exp(expected["loss"]), rel=TOL)
    assert expected["loss"] == pytest.approx(0.82727, abs=1e-5)
    # what averaging per-batch means gives at batch size 1: (0.1 + 0.9) / 2
    assert mean_of_batch_means(model, samples, 1) == pytest.approx(0.5, rel=TOL)


def test_batching_independence_and_a_mean_of_batch_means_fails_it():
    """Batch sizes 1, 3, 8 (padding, masked prompts, an empty and a one-token sample, partial last
    batch): the exact loss, accuracy and entropy agree to 1e-6; a mean of batch means does not."""
    model = tiny_model(embedding_std=0.3)
    samples = synthetic_val_dataset()
    results = [exact(model, samples, b) for b in (1, 3, 8)] + [exact(model, samples, 3, chunks=4)]
    assert len({r["num_tokens"] for r in results}) == 1
    for key in ("loss", "token_accuracy", "entropy"):
        assert relative_spread([r[key] for r in results]) <= TOL, key
    assert 0 < results[0]["token_accuracy"] < 1 and results[0]["entropy"] > 0.5  # not saturated
    packed = evaluate(model, SummedCrossEntropyLoss(1, IGNORE), loader(synthetic_val_dataset(packed=True), 2, True),
                      device=CPU).metrics()
    assert packed["num_tokens"] == results[0]["num_tokens"]
    assert packed["loss"] == pytest.approx(results[0]["loss"], rel=TOL)

    # the same check, applied to the common implementation, fails
    wrong = [mean_of_batch_means(model, samples, b) for b in (1, 3, 8)]
    assert relative_spread(wrong) > 1e-3
    assert abs(wrong[0] - results[0]["loss"]) > 1e-3 * results[0]["loss"]


def test_evaluation_leaves_training_state_alone():
    """Eval mode and no_grad during the pass; afterwards each module's mode, no gradient, the same RNG stream."""
    model = tiny_model()
    model.layers[1].eval()  # a module already in eval mode stays so
    modes = [m.training for m in model.modules()]
    seen = []

    def draw_random_numbers(module, args):
        # as a component that samples in forward would: evaluation must not move the training stream
        seen.append((module.training, torch.is_grad_enabled()))
        torch.rand(1), random.random(), np.random.rand()

    model.register_forward_pre_hook(draw_random_numbers)

    def stream():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = stream()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    exact(model, synthetic_val_dataset(), 3)
    assert stream() == expected
    assert seen and all(s == (False, False) for s in seen)
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())


def test_a_validation_pass_shows_its_progress_and_the_same_result(capsys):
    """A pass over a large set takes minutes while the training bar stands still: a `validation` bar counts
    its steps (rank 0; it leaves no line behind), and it changes no number."""
    model, samples = tiny_model(), synthetic_val_dataset()
    quiet = exact(model, samples, 3)
    assert "validation" not in capsys.readouterr().err
    shown = evaluate(model, SummedCrossEntropyLoss(1, IGNORE), loader(samples, 3), device=CPU,
                     progress_bar=True).metrics()
    steps, err = len(loader(samples, 3)), capsys.readouterr().err
    assert steps > 1 and f"validation:   0%|          | 0/{steps}" in err and f"/{steps} [" in err, err
    assert {k: v for k, v in shown.items() if k != "seconds"} == {k: v for k, v in quiet.items() if k != "seconds"}


def test_no_trainable_token_gives_no_loss():
    result = EvalResult(TokenTotals(0, 0, {"loss": 0.0, "token_accuracy": 0.0, "entropy": 0.0}), 3, 0.1)
    assert result.metrics() == {"num_tokens": 0, "num_samples": 3, "seconds": 0.1}
    assert perplexity(800.0) == math.inf and perplexity(0.0) == 1.0


def test_summary_line_leaves_out_metrics_that_were_not_computed():
    """loss.token_metrics=false: the line says nothing about accuracy (not 'nan')."""
    with_metrics = EvalResult(TokenTotals(4, 4, {"loss": 4.0, "token_accuracy": 2.0, "entropy": 1.0}), 2, 0.5)
    without = EvalResult(TokenTotals(4, 4, {"loss": 4.0}), 2, 0.5)
    assert "token_accuracy 0.5000" in describe(with_metrics)
    assert "token_accuracy" not in describe(without) and "nan" not in describe(without)
    assert describe(without).startswith("loss 1.0000, perplexity 2.718 over 4 tokens of 2 samples")


def val_cfg(**overrides):
    cfg = {"dataset_val": {"_component_": "tests.support.helpers.synthetic_val_dataset"}, "run_val_every_n_steps": 2,
           "run_val_at_start": False, "batch_size_val": 3, "max_val_samples": None, "group_by_length": True,
           "max_tokens_per_micro_batch": None, "epochs": 2, "data_errors": "warn"}
    cfg.update(overrides)
    return OmegaConf.create(cfg)


TOKENIZER = SimpleNamespace(pad_id=0)


def test_val_loader_off_empty_and_limited(caplog):
    assert build_val_loader(val_cfg(run_val_every_n_steps=None), TOKENIZER, ignore_index=IGNORE) is None
    with caplog.at_level(logging.WARNING):
        masked = val_cfg(dataset_val={"_component_": "tests.support.helpers.synthetic_val_dataset", "all_masked": True})
        assert build_val_loader(masked, TOKENIZER, ignore_index=IGNORE) is None
    assert "dataset_val" in caplog.text and "no validation runs" in caplog.text
    assert len(build_val_loader(val_cfg(), TOKENIZER, ignore_index=IGNORE)) == 13

    # max_val_samples: the first N samples in file order, whatever the batch size
    model = tiny_model()
    limited = [evaluate(model, SummedCrossEntropyLoss(1, IGNORE),
                        build_eval_loader(val_cfg(max_val_samples=5, batch_size_val=b), TOKENIZER, "dataset_val",
                                          ignore_index=IGNORE), device=CPU).metrics() for b in (1, 2, 8)]
    first_five = exact(model, synthetic_val_dataset()[:5], 5)
    for got in limited:
        assert got["num_samples"] == 5 and got["num_tokens"] == first_five["num_tokens"]
        assert got["loss"] == pytest.approx(first_five["loss"], rel=TOL)


def test_val_dataset_errors_name_the_key(tmp_path):
    (tmp_path / "empty.json").write_text("[]")
    cfg = val_cfg(dataset_val={"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
                               "data_files": str(tmp_path / "empty.json"), "split": "train"})
    with pytest.raises(ConfigError, match="'dataset_val'"):
        build_val_loader(cfg, TOKENIZER, ignore_index=IGNORE)


def test_schedule():
    """Before training if asked, every N optimizer steps, after the last step; global steps, so resume keeps it."""
    validator = Validator(val_cfg(run_val_every_n_steps=3, run_val_at_start=True), object(), None, None, None, CPU)
    # two epochs of 5 steps: steps 1-5 in epoch 0, 6-10 in epoch 1
    due = [s for s in range(11) if validator.is_due(s, epoch=(s - 1) // 5, end_of_epoch=s % 5 == 0)]
    assert due == [0, 3, 6, 9, 10]
    assert not Validator(val_cfg(), object(), None, None, None, CPU).is_due(0)
    assert not Validator(val_cfg(), None, None, None, None, CPU).is_due(2)  # validation off
    # at_start runs only at step 0, not when a run resumes
    assert validator.at_start(Progress(step=4)) is None


def test_base_model_of_a_lora_config():
    lora = OmegaConf.create({"_component_": "torchtune_ext.model.builders.lora_tiny_llama",
                             "lora_attn_modules": ["q_proj"],
                             "apply_lora_to_mlp": True, "lora_rank": 4, "lora_alpha": 8, "num_layers": 3})
    assert OmegaConf.to_container(base_model_config(lora)) == {"_component_": "torchtune_ext.model.builders.tiny_llama",
                                                               "num_layers": 3}
    full = OmegaConf.create({"_component_": "torchtune_ext.model.builders.tiny_llama"})
    assert base_model_config(full) is full
    with pytest.raises(ConfigError, match="'model'"):
        base_model_config(OmegaConf.create({"_component_": "torchtune_ext.model.lora_nonexistent"}))


# ---------------------------------------------------- the command's load checks (issue 33 F5)
def truncate(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])


def garbage_config(folder):
    (folder / "config.json").write_text("{not json")


def missing_config(folder):
    (folder / "config.json").unlink()


def other_head_count(folder):
    hf = json.loads((folder / "config.json").read_text())
    hf["num_attention_heads"] = 8
    (folder / "config.json").write_text(json.dumps(hf))


def garbage_tokenizer(folder):
    (folder / "tokenizer.json").write_text("garbage")


def another_model(folder):
    """A folder of another, smaller model (other widths and layer count): the same family's key names."""
    from safetensors.torch import save_file
    from torchtune.models import convert_weights

    from torchtune_ext.model.builders import tiny_llama

    model = tiny_llama(vocab_size=300, num_layers=3, embed_dim=48, num_heads=6, num_kv_heads=2, intermediate_dim=96)
    hf = convert_weights.tune_to_hf(model.state_dict(), num_heads=6, num_kv_heads=2, dim=48)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_hidden_layers=3,
                  intermediate_size=96, vocab_size=300)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def eval_folder(tiny_run):
    """(config path, a copy of the tiny run's checkpoint folder to damage)."""
    config = tiny_run()
    folder = config.parent / "copy"
    shutil.copytree(config.parent / "ckpt", folder)
    return config, folder


def run_command(capsys, config, folder, *overrides, options=()):
    """``python -m torchtune_ext.evaluate`` in process on ``folder``'s weights and tokenizer (4 samples):
    (exit status, the stderr lines that say "error:", stdout, all of stderr)."""
    code = evaluate_module.main(["--config", str(config), "--dataset", "dataset", *options, "max_val_samples=4",
                                 f"checkpointer.checkpoint_dir={folder}", f"tokenizer.path={folder}", *overrides])
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if "error:" in line], captured.out, captured.err


@pytest.mark.parametrize("damage,key,words", [
    (truncate, "checkpointer.checkpoint_dir", ["model.safetensors' is cut short"]),  # the recipes' file check
    (garbage_config, "checkpointer.checkpoint_dir", ["JSONDecodeError"]),
    (missing_config, "checkpointer.checkpoint_dir", ["config.json", "No such file"]),
    (other_head_count, "checkpointer.checkpoint_dir", ["config.json' (num_attention_heads=8"]),
    (garbage_tokenizer, "tokenizer.path", ["/copy'", "expected value at line 1 column 1", "not a tokenizer"]),
    (another_model, "checkpointer.checkpoint_dir", ["does not fit the model torchtune_ext.model.builders.tiny_llama",
                                                    "'tok_embeddings.weight' has shape [300, 48] in the checkpoint"]),
], ids=["truncated-weights", "garbage-config-json", "no-config-json", "head-count", "garbage-tokenizer",
        "another-model"])
def test_the_command_refuses_a_bad_folder_in_one_line(eval_folder, capsys, damage, key, words):
    """Each gave a traceback (exit 1), and another model's folder an 8,352-byte line; now one short line, exit 2,
    naming the key and the file, from the same checks the recipes run (CheckpointManager.load, load_model_state)."""
    config, folder = eval_folder
    damage(folder)
    code, err, out, stderr = run_command(capsys, config, folder)
    assert code == 2 and out == "" and "Traceback" not in stderr
    assert len(err) == 1 and err[0].startswith(f"error: config key '{key}': "), err
    for word in words:
        assert word in err[0], err[0]
    assert len(err[0]) < 600, len(err[0])
    if key == "checkpointer.checkpoint_dir" and damage not in (another_model, truncate):  # the recipes' load message
        cfg = OmegaConf.load(config)
        cfg.checkpointer.checkpoint_dir = str(folder)
        with pytest.raises(ConfigError) as recipe_error:
            CheckpointManager(cfg.checkpointer, str(config.parent / "out")).load()
        assert err[0] == f"error: {recipe_error.value}"


def write_manifest(folder, step):
    """Make ``folder`` look like a step folder a recipe saved: its manifest with sizes and SHA-256."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / "checkpoint.json").write_text(json.dumps(
        {"step": step, "files": files, "sha256": {name: file_sha256(folder / name) for name in files}}))


def test_the_command_checks_a_step_folders_hashes(eval_folder, capsys):
    """F11 for evaluate: same-size damage in a saved step folder is refused unless verify_checkpoint_hashes=false."""
    config, folder = eval_folder
    step = folder.parent / "out" / "step_3"
    step.parent.mkdir()
    folder.rename(step)
    write_manifest(step, 3)
    from tests.support.helpers import damage_same_size

    damage_same_size(step / "model.safetensors")  # weights zeroed, the header intact: it would load
    code, err, _, _ = run_command(capsys, config, step)
    assert code == 2 and err == [
        f"error: config key 'checkpointer.checkpoint_dir': checkpoint '{step}': 'model.safetensors' is damaged: "
        "its content differs from what was saved (SHA-256 mismatch, same size). No earlier checkpoint of this run "
        "is intact."]
    code, _, out, _ = run_command(capsys, config, step, "verify_checkpoint_hashes=false")
    assert code == 0 and json.loads(out)["num_samples"] == 4


def test_a_sharded_step_is_told_to_export_first_and_the_export_evaluates(eval_folder, capsys, monkeypatch):
    """A periodic sharded step holds dcp/ shards only: the advice was save_adapter_weights_only=false (a LoRA
    setting, for a full fine-tune). Following the new advice, export then evaluate, works."""
    from torchtune import config as tt_config

    from torchtune_ext.tools.export import main as export_main

    config, _ = eval_folder
    cfg = OmegaConf.load(config)
    monkeypatch.chdir(config.parent)
    manager = CheckpointManager(cfg.checkpointer, cfg.output_dir, run_config=cfg, sharded_saves=True)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    model = tt_config.instantiate(cfg.model)
    progress = Progress()
    progress.step = 2
    step = manager.save_sharded(model, torch.optim.SGD(model.parameters(), lr=0.1), progress)
    code, err, _, _ = run_command(capsys, config, step, f"tokenizer.path={cfg.tokenizer.path}")
    assert code == 2 and len(err) == 1
    advice = f"python -m torchtune_ext.checkpoint.export {step} {step}_hf, then evaluate with "
    assert "is a sharded checkpoint" in err[0] and advice in err[0] and "save_adapter_weights_only" not in err[0]
    assert export_main([str(step), f"{step}_hf"]) == 0
    capsys.readouterr()
    code, err, out, stderr = run_command(capsys, config, f"{step}_hf", f"tokenizer.path={cfg.tokenizer.path}")
    assert code == 0 and err == [] and json.loads(out)["num_samples"] == 4, (err, stderr[-1500:])


# ------------------------------------------------------- where the result goes (issue 33 U6, F12)
def test_the_result_goes_to_the_runs_logs_and_nothing_is_overwritten(eval_folder, capsys, monkeypatch):
    """Without --output the result is written under the run's logs (never into the working directory), a
    second evaluation beside the first; an --output file that exists is refused before anything loads."""
    config, folder = eval_folder
    step = folder.parent / "out" / "step_3"
    step.parent.mkdir()
    folder.rename(step)
    write_manifest(step, 3)
    code, err, out, stderr = run_command(capsys, config, step)
    assert code == 0, err
    first = step.parent / "logs" / "evaluate" / "step_3_dataset.json"
    assert json.loads(first.read_text()) == json.loads(out)
    assert f"Result written to {first}" in stderr
    code, err, out, _ = run_command(capsys, config, step)
    second = step.parent / "logs" / "evaluate" / "step_3_dataset.2.json"
    assert code == 0 and json.loads(second.read_text()) == json.loads(out)
    assert json.loads(first.read_text())["loss"] == json.loads(out)["loss"]

    kept = first.read_text()
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", lambda *a: pytest.fail("loaded before refusing"))
    code, err, out, _ = run_command(capsys, config, step, options=["--output", str(first)])
    assert code == 2 and out == "" and err == [
        f"error: --output '{first}' exists: nothing is overwritten; remove it or choose another file"]
    assert first.read_text() == kept


def test_a_result_written_into_the_repository_root_is_ignored_by_git():
    """U6: `--output step_6.json` in the repository root showed up as a new file in `git status`."""
    import subprocess

    from tests.support.helpers import REPO_ROOT

    ignored = subprocess.run(["git", "check-ignore", "-q", "step_6.json"], cwd=REPO_ROOT)
    kept = subprocess.run(["git", "check-ignore", "-q", "configs/step_6.json"], cwd=REPO_ROOT)
    assert ignored.returncode == 0 and kept.returncode == 1  # only the root: configs may hold JSON files
