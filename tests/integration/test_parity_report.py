"""The parity report end to end: the command's ``main`` in this process, each case a ``tune run`` subprocess.

The runs use a tiny random model, a byte-level tokenizer and a synthetic Alpaca
file written into tmp_path (``tiny_setup``), so they need no downloaded assets.
On a 2-core CPU most of their time is the start-up of those subprocesses
(importing torch and torchtune). Case planning, comparison, plots and the
control's maths: tests/unit/tools/test_parity_report.py.
"""

import json
import struct
from pathlib import Path

import matplotlib.image
import pytest

from tests.support.helpers import REPO_ROOT
from tests.support.tiny_setup import write_tiny_setup
from tests.support.wandb_reader import _records
from torchtune_ext.tools.parity_report.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss", "grad_norm", "tokens_per_second", "memory")


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root (tune run resolves recipes/ there), with this checkout importable."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv("WANDB_SILENT", "true")


# ------------------------------------------------------------ end to end
def _png_size(path: Path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    return struct.unpack(">II", data[16:24])


def _wandb_run(run_dir: Path):
    """(group, display name) of the single offline W&B run under ``run_dir``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("logs/wandb/offline-run-*/run-*.wandb")
    for raw in _records(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            return record.run.run_group, record.run.display_name
    raise AssertionError(f"no run record in {path}")


def test_exact_cases_pass_and_the_control_is_reported(tmp_path, in_repo):
    """Accumulation and 2 data-parallel ranks (the distributed recipe, ``--nproc 2``) match the reference; the
    control does not. One report (one reference run) for both: the ranks' case used to be a report of its own."""
    config = write_tiny_setup(tmp_path)
    out = tmp_path / "report"
    # a subset keeps the test short: N=2 has 7 cases (the backward modes agree: tests/unit/train/test_backward_mode.py)
    cases = ["bs1_ga2_once", "dp2_bs1_ga1_once", "control_bs1_ga2_mean_of_means"]
    status = main(["--config", str(config), "--global-batch-size", "2", "--steps", "3", "--nproc", "2",
                   "--output-dir", str(out), "--cases", ",".join(cases)])
    assert status == 0, (out / "report.md").read_text()

    names = ["bs2_ga1_once", *cases]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and [c["case"]["name"] for c in summary["cases"]] == names
    assert [c["status"] for c in summary["cases"]] == ["reference", "PASS", "PASS", "control"]
    control = summary["cases"][-1]
    assert control["loss_diff"] > 1e-3  # visibly off: the synthetic answers range from 1 to 40 words

    report = (out / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == names
    assert "**Result: PASS**" in report and rows[1].endswith("| PASS |") and rows[2].endswith("| PASS |")

    for name in PLOTS:
        png = out / f"{name}.png"
        width, height = _png_size(png)
        assert matplotlib.image.imread(png).shape[:2] == (height, width)
        sidecar = json.loads(png.with_suffix(".json").read_text())
        assert [s["label"] for s in sidecar["series"]] == names, name
        assert f"({name}.png)" in report
    loss_series = json.loads((out / "loss.json").read_text())["series"]
    assert all(len(s["y"]) == 3 for s in loss_series)

    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["case"] for r in logged} == set(names) and len(logged) == 3 * len(names)
    groups = set()
    for name in names:
        run_dir = out / "runs" / name
        assert not list(run_dir.glob("step_*")), "save_final_checkpoint=false must skip the checkpoint"
        group, display_name = _wandb_run(run_dir)
        assert display_name == name
        groups.add(group)
    assert len(groups) == 1 and groups.pop().startswith("parity-")


BROKEN_RECIPE = '''\
"""The full single-device recipe with a broken normalization: it divides by every
label position, padding and masked prompt included, so the step loss depends on
how the step is split into micro-batches."""
import sys

from torchtune_ext.train import accounting


def _count_every_position(shifted_labels, ignore_index=-100):
    return shifted_labels.numel()


accounting.count_trainable_tokens = _count_every_position

from recipes.full_finetune_single_device import recipe_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(recipe_main())
'''


def test_a_broken_normalization_fails_the_report(tmp_path, in_repo, monkeypatch):
    config = write_tiny_setup(tmp_path)
    # tune run imports a recipe path as a module: broken_recipe.py -> broken_recipe, found on PYTHONPATH
    (tmp_path / "broken_recipe.py").write_text(BROKEN_RECIPE)
    monkeypatch.setenv("PYTHONPATH", f"{REPO_ROOT}:{tmp_path}")
    out = tmp_path / "report"
    status = main(["--recipe", "broken_recipe.py", "--config", str(config), "--global-batch-size", "2",
                   "--steps", "2", "--output-dir", str(out), "--cases", "bs1_ga2_once", "metric_logger=null"])
    assert status == 1
    assert not list(out.glob("runs/*/logs/wandb")), "the override metric_logger=null reached the runs"
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["passed"]
    broken = summary["cases"][1]
    assert broken["status"] == "FAIL" and broken["loss_diff"] > 1e-5
    assert "**Result: FAIL**" in (out / "report.md").read_text()
