"""Step records, the rank-aware JSONL logger, and what reaches W&B offline.

The peak-memory probe, in a fresh process: tests/integration/test_metrics.py.
"""

import errno
import json
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.wandb_reader import read_offline_run
from torchtune_ext.run.metrics import MetricLogger, build_metric_logger, step_record
from torchtune_ext.train.step import StepResult

CPU = torch.device("cpu")


def test_step_record_keys_and_throughput():
    r = StepResult(loss=1.5, num_tokens=300, local_num_tokens=150, grad_norm=2.0)
    rec = step_record(r, step=3, epoch=0, lr=1e-4, step_seconds=2.0, device=CPU, dp_world_size=2)
    assert rec["loss"] == 1.5 and rec["grad_norm"] == 2.0 and rec["num_tokens"] == 300
    assert rec["tokens_per_second"] == 150.0 and rec["tokens_per_second_per_device"] == 75.0
    assert rec["peak_memory_gib"] > 0


def test_skipped_step_logs_no_loss():
    r = StepResult(loss=None, num_tokens=0, local_num_tokens=0, grad_norm=None, skipped="empty")
    rec = step_record(r, step=1, epoch=0, lr=1e-4, step_seconds=1.0, device=CPU, skipped_steps=1)
    assert "loss" not in rec and "grad_norm" not in rec and rec["skipped_steps"] == 1


class RecordingBackend:
    def __init__(self):
        self.rows, self.closed = [], False

    def log_config(self, cfg):
        self.cfg = cfg

    def log_dict(self, payload, step):
        self.rows.append((step, dict(payload)))

    def close(self):
        self.closed = True


def test_jsonl_and_backend_on_rank_zero_only(tmp_path):
    backend = RecordingBackend()
    logger = MetricLogger(tmp_path / "logs" / "metrics.jsonl", backend, rank=0)
    logger.log({"step": 1, "loss": 0.5})
    assert backend.rows == [(1, {"loss": 0.5})]  # at once: W&B's own loss panel draws it while the run goes
    logger.log({"step": 2, "loss": 0.25})
    logger.close()
    lines = [json.loads(l) for l in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    assert backend.rows == [(1, {"loss": 0.5}), (2, {"loss": 0.25})] and backend.closed

    other = RecordingBackend()
    silent = MetricLogger(tmp_path / "rank1" / "metrics.jsonl", other, rank=1)
    silent.log({"step": 1, "loss": 0.5})
    silent.close()
    assert not (tmp_path / "rank1").exists() and other.rows == []


def test_jsonl_appends_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        logger = MetricLogger(path, None, rank=0)
        logger.log({"step": step})
        logger.close()
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2]


def test_wandb_offline_run_receives_metrics_and_config(tmp_path):
    cfg = OmegaConf.create({
        "output_dir": str(tmp_path),
        "batch_size": 3,
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.WandBLogger",
            "project": "test", "mode": "offline", "log_dir": str(tmp_path / "logs"),
        },
    })
    logger = build_metric_logger(cfg, rank=0)
    logger.log_config(cfg)
    logger.log({"step": 1, "loss": 0.75, "num_tokens": 10})
    logger.log({"step": 2, "loss": 0.5, "num_tokens": 12})
    logger.close()
    run = read_offline_run(str(tmp_path / "logs"))
    rows = [r for r in run["history"] if "loss" in r]
    assert [(r["global_step"], r["loss"], r["num_tokens"]) for r in rows] == [(1, 0.75, 10), (2, 0.5, 12)]
    assert run["config"]["batch_size"] == 3
    assert run["name"] == tmp_path.name  # the output folder's name, not a random one


def test_the_loss_chart_against_tokens_names_its_x_column_tokens_seen():
    """W&B's line_series would call the x column ``step`` on the tokens chart; ours names it after the axis."""
    from torchtune_ext.run.metrics.wandb_charts import loss_chart

    records = [{"step": 1, "loss": 2.0, "tokens_seen": 10}, {"step": 2, "loss": 1.5, "tokens_seen": 25},
               {"step": 2, "val_loss": 1.7, "tokens_seen": 25}]
    chart = loss_chart(records, "tokens_seen")
    assert chart.table.columns == ["tokens_seen", "curve", "loss"]
    assert chart.table.data == [[10, "loss", 2.0], [25, "loss", 1.5], [25, "val_loss", 1.7]]
    assert chart.spec.fields["step"] == "tokens_seen"
    assert loss_chart([{"step": 1, "tokens_seen": 3}], "step") is None  # a skipped step only: no chart


def test_log_lines_during_training_are_written_above_the_progress_bar(monkeypatch, tmp_path):
    """A line logged while the bar is shown (the memory guard's, a checkpoint save) starts a line of its
    own instead of being appended to the bar's; after close() the logger's handler is the original again."""
    import io
    import logging

    from torchtune_ext.run.metrics import StepReporter
    from torchtune_ext.run.metrics import reporter as reporter_module

    console = io.StringIO()
    monkeypatch.setattr(sys, "stderr", console)  # where the bar and a console handler write
    handler = logging.StreamHandler(console)
    monkeypatch.setattr(reporter_module.log, "handlers", [handler])
    reporter = StepReporter(MetricLogger(tmp_path / "metrics.jsonl"), torch.device("cpu"), total_steps=3)
    reporter_module.log.warning("a line during training")
    reporter.close()
    before = console.getvalue().split("a line during training")[0]
    assert "0/3" in before  # the bar was drawn first
    assert before.endswith(("\r", "\n")), repr(before[-40:])
    assert reporter_module.log.handlers == [handler]


# ------------------------------------------------------ a disk that fills during a step (issue 33 F3)
class FullDiskFile:
    """A JSONL file on a full disk: every write fails with ENOSPC."""

    def __init__(self):
        self.closed = False

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.closed = True


class SlowClosingBackend(RecordingBackend):
    """W&B with the disk full: closing waits on its service's writes for minutes (401 s in the issue)."""

    def close(self):
        time.sleep(60)


def fake_checkpoint(output_dir, step):
    folder = output_dir / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "checkpoint.json").write_text(json.dumps({"step": step, "files": {}}))
    return folder


def test_a_full_disk_while_logging_a_step_stops_within_seconds_naming_the_checkpoint(tmp_path, monkeypatch):
    from torchtune_ext.checkpoint import CheckpointSaveError, OutputWriteError
    from torchtune_ext.run.metrics import logger as logger_module

    monkeypatch.setattr(logger_module, "BACKEND_CLOSE_TIMEOUT_S", 0.5)
    latest = fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 2)
    logger = MetricLogger(tmp_path / "logs" / "metrics.jsonl", SlowClosingBackend(), rank=0)
    logger.log({"step": 5, "loss": 1.0})
    logger._jsonl.close()
    logger._jsonl = full = FullDiskFile()
    start = time.monotonic()
    with pytest.raises(OutputWriteError) as err:
        logger.log({"step": 7, "loss": 1.0})
    assert time.monotonic() - start < 5  # not waiting for the backend's close
    assert isinstance(err.value, CheckpointSaveError)  # the recipes exit with 74, as for a failed save
    assert str(err.value) == (
        f"writing the metrics of step 7 to '{tmp_path / 'logs' / 'metrics.jsonl'}' failed (the disk is full): "
        f"training stopped after step 7; resume from {latest}: free some space, then continue with "
        "resume_from_checkpoint=true (steps 5-7 are trained again)")
    assert full.closed
    logger.close()  # nothing more to write: the recipe's cleanup does not fail again


def test_a_write_error_other_than_a_full_disk_and_no_checkpoint_yet(tmp_path):
    from torchtune_ext.checkpoint import OutputWriteError

    logger = MetricLogger(tmp_path / "logs" / "metrics.jsonl", None, rank=0)
    logger._jsonl.close()
    logger._jsonl = FullDiskFile()
    logger._jsonl.write = lambda text: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error"))
    with pytest.raises(OutputWriteError, match=r"^writing the metrics of step 1 to '.*metrics.jsonl' failed "
                       r"\(OSError: \[Errno 5\] Input/output error\): training stopped after step 1; no checkpoint "
                       r"of this run exists yet: fix the cause, then start the run again$"):
        logger.log({"step": 1})


def test_a_full_disk_when_the_run_has_finished_says_what_is_complete(tmp_path):
    """W&B's disk filled during training (its service fails quietly): the closing charts fail. Training is over;
    the error says so, and that the final checkpoint and every step's metrics are there."""
    from torchtune_ext.checkpoint import OutputWriteError

    latest = fake_checkpoint(tmp_path, 12)

    class FullDiskBackend(RecordingBackend):
        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    logger = MetricLogger(tmp_path / "logs" / "metrics.jsonl", FullDiskBackend(), rank=0)
    logger.log({"step": 12, "loss": 1.0})
    with pytest.raises(OutputWriteError) as err:
        logger.close()
    assert str(err.value) == (
        "writing the metric logger's last records failed (the disk is full) after training finished: "
        f"{latest} is complete, and every step's metrics are in {tmp_path / 'logs' / 'metrics.jsonl'}; "
        "free some space")


# ----------------------------------------------- the learning rate at full precision (issue 33 U6)
def test_lr_is_logged_at_full_precision_and_the_last_step_line_shows_it(tmp_path, caplog):
    """W&B's console run summary printed "lr 0.0" for 2.9e-06: it rounds every float to 5 decimals. The value
    logged is the optimizer's, to the last bit, in the JSONL file and in W&B's history; the run's own last
    line shows it in 3 significant figures."""
    import logging

    from torchtune_ext.run.metrics import StepReporter

    lr = 2.9e-06 * (1 + 1e-12)  # not a round number: any rounding on the way would show
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "metric_logger": {
        "_component_": "torchtune.training.metric_logging.WandBLogger", "project": "test", "mode": "offline",
        "log_dir": str(tmp_path / "logs")}})
    logger = build_metric_logger(cfg, rank=0)
    reporter = StepReporter(logger, CPU, total_steps=1, log_peak_memory=False)
    reporter.start_step()
    reporter.end_step(StepResult(loss=1.5, num_tokens=30, local_num_tokens=30, grad_norm=0.25), step=1, epoch=0,
                      lr=lr, skipped_steps=0)
    with caplog.at_level(logging.INFO):
        reporter.close()
    logger.close()
    assert json.loads((tmp_path / "logs" / "metrics.jsonl").read_text())["lr"] == lr
    assert [r["lr"] for r in read_offline_run(str(tmp_path / "logs"))["history"] if "lr" in r] == [lr]
    assert "Last optimizer step 1: loss 1.5000, lr 2.9e-06, grad_norm 0.25, " in caplog.text


def test_a_distributed_recipe_on_one_rank_logs_the_distributed_keys(tmp_path):
    """So that a run resumed from 2 ranks on 1 keeps its keys (docs/metrics.md); a single-device run has none."""
    r = StepResult(loss=1.5, num_tokens=300, local_num_tokens=300, grad_norm=2.0)
    one = step_record(r, step=1, epoch=0, lr=1e-4, step_seconds=2.0, device=CPU, distributed=True)
    assert one["dp_world_size"] == 1 and one["tokens_per_second_per_device"] == one["tokens_per_second"] == 150.0
    alone = step_record(r, step=1, epoch=0, lr=1e-4, step_seconds=2.0, device=CPU)
    assert "dp_world_size" not in alone and "tokens_per_second_per_device" not in alone
    from torchtune_ext.run.metrics import StepReporter

    reporter = StepReporter(MetricLogger(tmp_path / "metrics.jsonl"), CPU, total_steps=1, distributed=True)
    reporter.start_step()
    record = reporter.end_step(r, step=1, epoch=0, lr=1e-4, skipped_steps=0)
    reporter.close()
    assert record["dp_world_size"] == 1 and "tokens_per_second_per_device" in record


def test_peak_memory_logged_is_the_largest_over_ranks(monkeypatch, tmp_path):
    """On several ranks the step's peak_memory_gib is all-reduced with MAX (as tokens_per_second counts every
    rank's tokens): here another rank is made to report 3.5 GiB, more than this process's peak."""
    import torch.distributed as dist

    from torchtune_ext import ranks
    from torchtune_ext.run.metrics import StepReporter
    from torchtune_ext.run.metrics import reporter as reporter_module

    ops = []

    def all_reduce(tensor, op):  # a second rank whose peak was 3.5 GiB
        ops.append(op)
        tensor.copy_(torch.maximum(tensor, torch.full_like(tensor, 3.5)) if op == dist.ReduceOp.MAX else tensor * 2)

    monkeypatch.setattr(ranks, "several_processes", lambda group=None: True)
    monkeypatch.setattr(reporter_module.dist, "all_reduce", all_reduce)
    reporter = StepReporter(MetricLogger(tmp_path / "metrics.jsonl"), CPU, total_steps=1)
    reporter.start_step()
    record = reporter.end_step(StepResult(loss=1.5, num_tokens=30, local_num_tokens=30, grad_norm=0.25), step=1,
                               epoch=0, lr=1e-3, skipped_steps=0)
    reporter.close()
    assert ops == [dist.ReduceOp.MAX] and record["peak_memory_gib"] == 3.5


def wandb_config(tmp_path, **settings):
    """An offline W&B metric logger writing under ``tmp_path/logs``; ``settings`` are more metric_logger keys."""
    return OmegaConf.create({
        "output_dir": str(tmp_path),
        "metric_logger": {"_component_": "torchtune.training.metric_logging.WandBLogger", "project": "test",
                          "mode": "offline", "log_dir": str(tmp_path / "logs"), **settings},
    })


def saved_checkpoint(folder, step):
    """A complete checkpoint folder as a save leaves it: its files, then the manifest with their sizes and SHA-256."""
    from torchtune_ext.checkpoint import HASHES, MANIFEST, file_sha256

    (folder / "dcp").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * step)
    (folder / "dcp" / "__0_0.distcp").write_bytes(b"shard" * step)
    (folder / "recipe_state.pt").write_bytes(b"state")
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    manifest = {"step": step, "files": files, HASHES: {name: file_sha256(folder / name) for name in files}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("log_model,logged", [(None, []), ("end", ["step_4"]),
                                              ("checkpoint", ["step_2", "step_4"])])
def test_log_model_logs_complete_checkpoints_as_model_artifacts(tmp_path, monkeypatch, log_model, logged):
    """metric_logger.log_model (as Hugging Face's): by default nothing; `end` the final checkpoint; `checkpoint`
    every one, once each (a periodic save that ends the epoch is heard of twice). Each is an artifact of type
    model in the offline run holding every file of the checkpoint, as saved; wandb.init never sees the key."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))  # W&B's staged copies of the files
    settings = {} if log_model is None else {"log_model": log_model}
    logger = build_metric_logger(wandb_config(tmp_path, **settings), rank=0)
    folders = {2: saved_checkpoint(tmp_path / "step_2", 2), 4: saved_checkpoint(tmp_path / "step_4", 4)}
    logger.checkpoint_saved(folders[2], final=False)
    logger.checkpoint_saved(folders[4], final=True)
    logger.checkpoint_saved(folders[4], final=True)
    logger.close()
    run = read_offline_run(str(tmp_path / "logs"))
    assert [a["metadata"]["step"] for a in run["artifacts"]] == [int(name.split("_")[1]) for name in logged]
    for artifact, name in zip(run["artifacts"], logged):
        folder = tmp_path / name
        assert artifact["type"] == "model" and artifact["name"].startswith("model-")
        assert name in artifact["aliases"] and ("final" in artifact["aliases"]) == (name == "step_4")
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        assert set(artifact["files"]) == on_disk and "checkpoint.json" in on_disk
        for path, staged in artifact["files"].items():
            assert open(staged, "rb").read() == (folder / path).read_bytes(), path


def test_log_model_never_logs_a_checkpoint_whose_files_changed(tmp_path, monkeypatch, caplog):
    """A file that no longer matches the manifest's SHA-256 (same size): not logged, and a warning names it."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    logger = build_metric_logger(wandb_config(tmp_path, log_model="checkpoint"), rank=0)
    folder = saved_checkpoint(tmp_path / "step_3", 3)
    damaged = bytearray((folder / "model.safetensors").read_bytes())
    damaged[:8] = bytes(8)
    (folder / "model.safetensors").write_bytes(bytes(damaged))
    with caplog.at_level("WARNING"):
        logger.checkpoint_saved(folder, final=True)
    logger.close()
    assert read_offline_run(str(tmp_path / "logs"))["artifacts"] == []
    assert "Not logged to W&B as a model artifact" in caplog.text and "model.safetensors" in caplog.text


def test_log_model_logs_from_rank_zero_only(tmp_path, monkeypatch):
    """Every rank hears of a checkpoint; only rank 0 holds a W&B run (and the other ranks start none)."""
    import wandb

    def no_run(**kwargs):
        raise AssertionError("a W&B run started on rank 1")

    monkeypatch.setattr(wandb, "init", no_run)
    logger = build_metric_logger(wandb_config(tmp_path, log_model="checkpoint"), rank=1)
    logger.checkpoint_saved(saved_checkpoint(tmp_path / "step_1", 1), final=True)
    logger.close()
    assert not (tmp_path / "logs").exists()


def test_the_loop_announces_an_asynchronous_checkpoint_only_once_it_is_complete():
    """An asynchronous save returns before its folder is complete: the metric logger hears of it only after the
    wait, which the next save (before it may prune the folder) or the end of the run does anyway."""
    from types import SimpleNamespace

    from torchtune_ext.run.loop import TrainingRun

    events = []

    class Saves:  # CheckpointManager's side: an asynchronous save is pending until waited for
        pending = False

        def wait(self):
            if self.pending:
                events.append("complete")
            self.pending = False

    run = TrainingRun.__new__(TrainingRun)
    run.cfg, run.progress, run.checkpoints = SimpleNamespace(epochs=1), SimpleNamespace(epoch=0), Saves()
    run.metric_logger = SimpleNamespace(checkpoint_saved=lambda folder, final: events.append((folder, final)))
    run._unannounced = None
    folders = iter(["step_2", "step_4", "step_6"])

    def save(asynchronous):
        def recipe_save():
            events.append("save")
            run.checkpoints.pending = asynchronous
            return next(folders)
        return recipe_save

    run._announced(save(True))()
    assert events == ["save"]  # in flight: not yet
    run._announced(save(False))()
    assert events == ["save", "complete", ("step_2", False), "save", ("step_4", False)]
    run.progress.epoch = 1  # the end of training's save
    run._announced(save(True))()
    run._announce_pending()
    assert events[-3:] == ["save", "complete", ("step_6", True)]


def test_a_checkpoint_w_and_b_cannot_copy_stops_the_run_as_a_failed_write(tmp_path, monkeypatch):
    """W&B copies an artifact's files into its staging folder: a full disk there is the run's exit 74, with the
    line naming the checkpoint to resume from, as a failed metrics write."""
    from torchtune_ext.errors import OutputWriteError
    from torchtune_ext.run.metrics import logger as logger_module

    def full_disk(folder, final):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(logger_module, "log_checkpoint_artifact", full_disk)
    backend = RecordingBackend()
    logger = MetricLogger(tmp_path / "logs" / "metrics.jsonl", backend, wandb_charts=True, log_model="end")
    folder = saved_checkpoint(tmp_path / "step_2", 2)
    logger.checkpoint_saved(folder, final=False)  # `end`: not the final one, nothing to copy
    with pytest.raises(OutputWriteError, match=r"writing checkpoint .*step_2 to W&B as a model artifact failed "
                       r"\(the disk is full\): training stopped after step 2; resume from .*step_2"):
        logger.checkpoint_saved(folder, final=True)
    assert backend.closed
