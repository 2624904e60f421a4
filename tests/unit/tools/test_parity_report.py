"""The parity report: case planning, comparison, plots, the control's maths, its command line's checks.

The end-to-end runs (each case a ``tune run``): tests/integration/test_parity_report.py.
"""

import math

import pytest
import tomllib
import torch
from omegaconf import OmegaConf

from tests.support.helpers import IGNORE, REPO_ROOT, clone, collate, instruct_samples, rel_diff, tiny_model
from tests.support.tiny_setup import write_tiny_setup
from torchtune_ext.config import ConfigError, validate
from torchtune_ext.tools.parity_report import analysis, plots
from torchtune_ext.tools.parity_report.cases import Case, case_command, case_overrides, plan_cases, select_cases
from torchtune_ext.tools.parity_report.cli import main, resolve_tolerance
from torchtune_ext.tools.parity_report.control import mean_of_means_forward_backward, recipe_module
from torchtune_ext.train.loss import SummedCrossEntropyLoss, shift_labels

CPU = torch.device("cpu")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss", "grad_norm", "tokens_per_second", "memory")


# ---------------------------------------------------------------- cases
def test_cases_for_n4_cover_every_split_in_both_modes_and_the_control():
    cases = plan_cases(4)
    assert [c.name for c in cases] == [
        "bs4_ga1_once", "bs4_ga1_each", "bs1_ga4_once", "bs1_ga4_each", "bs2_ga2_once", "bs2_ga2_each",
        "control_bs1_ga4_mean_of_means",
    ]
    assert all(c.global_batch_size == 4 for c in cases)
    assert [c.control for c in cases] == [False] * 6 + [True]
    assert cases[0].once_per_step and not cases[1].once_per_step


def test_cases_with_ranks_and_small_or_odd_n():
    dp = [c for c in plan_cases(4, nproc=4) if c.nproc > 1]
    assert [(c.name, c.batch_size, c.gradient_accumulation_steps) for c in dp] == [
        ("dp4_bs1_ga1_once", 1, 1), ("dp4_bs1_ga1_each", 1, 1)
    ]
    # N = 2: "N/2 with 2 steps" is "1 with N steps", listed once; N odd has no N/2 split
    assert [c.name for c in plan_cases(2)][:4] == ["bs2_ga1_once", "bs2_ga1_each", "bs1_ga2_once", "bs1_ga2_each"]
    assert len(plan_cases(2)) == 5 and len(plan_cases(3)) == 5
    with pytest.raises(ValueError, match="--global-batch-size"):
        plan_cases(1)
    with pytest.raises(ValueError, match="--nproc"):
        plan_cases(4, nproc=3)


def test_select_cases_keeps_the_reference_and_names_the_valid_ones():
    cases = plan_cases(4)
    assert [c.name for c in select_cases(cases, ["bs1_ga4_each"])] == ["bs4_ga1_once", "bs1_ga4_each"]
    with pytest.raises(ValueError, match="bs1_ga4_once"):
        select_cases(cases, ["bs1_ga8_once"])


def test_case_command_and_overrides(tmp_path):
    control = plan_cases(4)[-1]
    overrides = case_overrides(control, steps=5, output_dir=tmp_path, seed=3, wandb_group="g")
    for expected in ("batch_size=1", "gradient_accumulation_steps=4", "backward=per_micro_batch",
                     "once_per_step_memory_limit=device",
                     "max_steps_per_epoch=5", f"output_dir={tmp_path}", "seed=3", "save_final_checkpoint=false",
                     "metric_logger.group=g", f"metric_logger.name={control.name}"):
        assert expected in overrides
    assert not any(o.startswith("metric_logger") for o in case_overrides(
        control, steps=5, output_dir=tmp_path, seed=3, wandb_group=None))
    # the control goes through the report's own launcher, never through a config key
    control_module = "torchtune_ext.tools.parity_report.control"
    assert case_command(control, "r.py", "c.yaml", [])[1:4] == ["-m", control_module, "r.py"]
    dp = plan_cases(4, nproc=2)[-2]
    assert case_command(dp, "r.py", "c.yaml", [])[3:7] == ["run", "--nproc_per_node", "2", "r.py"]
    assert recipe_module("recipes/full_finetune_single_device.py") == "recipes.full_finetune_single_device"


def test_tolerance_defaults_by_dtype():
    assert resolve_tolerance(None, "fp32") == 1e-5 and resolve_tolerance(None, "bf16") == 2e-2
    assert resolve_tolerance(3e-4, "bf16") == 3e-4


def test_console_script_points_at_main():
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tune-parity-report"] == "torchtune_ext.tools.parity_report.cli:main"


# ----------------------------------------------------------- comparison
def _rows(losses, grad_norms, tokens=(10, 20, 30)):
    return [{"step": i + 1, "loss": l, "grad_norm": g, "num_tokens": t, "tokens_per_second": 100.0 * (i + 1),
             "peak_memory_gib": 1.0 + i} for i, (l, g, t) in enumerate(zip(losses, grad_norms, tokens))]


def test_compare_passes_within_tolerance_and_fails_outside():
    cases = [Case("ref", 4, 1, True), Case("close", 1, 4, True), Case("far", 1, 4, False),
             Case("other_data", 2, 2, True), Case("control", 1, 4, False, control=True), Case("crashed", 2, 2, False)]
    metrics = {
        "ref": _rows([2.0, 1.5, 1.0], [4.0, 3.0, 2.0]),
        "close": _rows([2.0 * (1 + 5e-6), 1.5, 1.0], [4.0, 3.0, 2.0 * (1 - 5e-6)]),
        "far": _rows([2.0, 1.5, 1.0], [4.0, 3.0, 2.0 * (1 + 1e-4)]),
        "other_data": _rows([2.0, 1.5, 1.0], [4.0, 3.0, 2.0], tokens=(10, 20, 31)),
        "control": _rows([2.2, 1.5, 1.0], [4.0, 3.0, 2.0]),
        "crashed": _rows([2.0], [4.0], tokens=(10,)),
    }
    results = analysis.compare(cases, metrics, 1e-5, failed_runs=["crashed"])
    status = {r.case.name: r.status for r in results}
    assert status == {"ref": "reference", "close": "PASS", "far": "FAIL", "other_data": "FAIL",
                      "control": "control", "crashed": "run failed"}
    by_name = {r.case.name: r for r in results}
    assert by_name["close"].loss_diff == pytest.approx(5e-6) and by_name["far"].grad_norm_diff == pytest.approx(1e-4)
    assert by_name["control"].loss_diff == pytest.approx(0.1) and not by_name["control"].failed
    assert "not the same data" in by_name["other_data"].reasons[0]
    assert by_name["ref"].final_loss == 1.0 and by_name["ref"].median_tokens_per_second == 200.0
    assert by_name["ref"].peak_memory_gib == 3.0

    text = analysis.render_markdown(results, tolerance=1e-5, title_lines=["t"])
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(table) == len(cases) and "**Result: FAIL**" in text
    assert "| **FAIL** |" in table[2] and "off, as expected" in table[4]


def test_max_relative_difference_edge_cases():
    assert analysis.max_relative_difference([1.0, 2.0], [1.0]) == math.inf
    assert analysis.max_relative_difference([None, 2.0], [1.0, 2.0]) == 0.0
    assert analysis.max_relative_difference([0.5], [0.0]) == 0.5
    assert analysis.max_relative_difference([float("nan")], [1.0]) == math.inf


# ---------------------------------------------------------------- plots
def test_figures_have_one_curve_or_bar_per_case():
    cases = [Case("ref", 4, 1, True), Case("a", 1, 4, True), Case("control", 1, 4, False, control=True)]
    metrics = {"ref": _rows([2.0, 1.5, 1.0], [4, 3, 2]), "a": _rows([2.0, 1.5, 1.0], [4, 3, 2]),
               "control": _rows([2.2, 1.6, 1.1], [4, 3, 2])}
    fig = plots.curve_figure(cases, metrics, "loss", title="t", ylabel="nats", tolerance=1e-5)
    top, bottom = fig.axes
    assert [line.get_label() for line in top.get_lines()] == ["ref", "a", "control"]
    assert len(bottom.get_lines()) == 2 + 1  # non-reference cases + tolerance line
    bars = plots.bar_figure(cases, {"ref": 1.0, "a": 2.0, "control": None}, title="t", xlabel="GiB")
    assert len(bars.axes[0].patches) == 3


# --------------------------------------------------------------- control
def test_control_optimizes_the_mean_of_per_micro_batch_means():
    model = tiny_model()
    by_hand = clone(model)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1)
    micro_batches = [collate([s]) for s in instruct_samples([4, 3], [10, 100])]

    totals = mean_of_means_forward_backward(model, loss_fn, micro_batches, device=CPU)
    num_tokens = totals.num_tokens

    sums, counts = [], []
    for mb in micro_batches:
        labels = shift_labels(mb["labels"])
        sums.append(loss_fn(by_hand(mb["tokens"]), labels).loss)
        counts.append(int((labels != IGNORE).sum()))
    mean_of_means = (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    mean_of_means.backward()
    assert counts == [10, 100] and num_tokens == 110
    # what train_step logs (summed / num_tokens) is the quantity the control optimizes
    assert totals.mean("loss") == pytest.approx(mean_of_means.item(), rel=1e-6)
    for p, q in zip(model.parameters(), by_hand.parameters()):
        assert rel_diff(p.grad, q.grad) < 1e-5
    exact = (sums[0] + sums[1]).item() / 110
    assert abs(mean_of_means.item() - exact) / exact > 1e-3


# ------------------------------------------------- save_final_checkpoint
def test_save_final_checkpoint_defaults_true_and_must_be_boolean(tmp_path):
    config = write_tiny_setup(tmp_path, num_samples=4, metric_logger=False)
    cfg = OmegaConf.load(config)
    assert validate(cfg).save_final_checkpoint is True
    cfg.save_final_checkpoint = "no"
    with pytest.raises(ConfigError, match="'save_final_checkpoint'.*true or false"):
        validate(cfg)


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root (tune run resolves recipes/ there), with this checkout importable."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_bad_arguments_exit_2_before_running_anything(tmp_path, in_repo, capsys):
    config = write_tiny_setup(tmp_path, num_samples=4, metric_logger=False)
    out = tmp_path / "report"
    assert main(["--config", str(config), "--cases", "bs9_ga1_once", "--output-dir", str(out)]) == 2
    assert "unknown case" in capsys.readouterr().err
    assert main(["--config", str(config), "--nproc", "2", "--distributed-recipe", "recipes/nope.py",
                 "--output-dir", str(out)]) == 2
    assert "--distributed-recipe 'recipes/nope.py' not found" in capsys.readouterr().err
    assert main(["--config", str(config), "batch_size", "--output-dir", str(out)]) == 2
    assert not out.exists()
