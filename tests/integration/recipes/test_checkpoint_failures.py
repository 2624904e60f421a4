"""Checkpoints through the real recipe (``tune run``, tiny model): truthful messages, disk use, a full disk."""

import json
import re
import resource
import subprocess
from collections import namedtuple

import pytest
from omegaconf import OmegaConf, open_dict

from tests.support import resume_jobs
from tests.support.helpers import REPO_ROOT
from torchtune_ext.checkpoint import DiskSpaceError, list_checkpoints, verify_checkpoint, writer
from torchtune_ext.config import ConfigError
from torchtune_ext.run.control.rollback import output_dir_unchanged_on_error

RECIPE = "recipes/full_finetune_single_device.py"


@pytest.fixture(scope="module")
def setup_yaml(tmp_path_factory):
    return resume_jobs.setup(tmp_path_factory.mktemp("tiny"))


def write_config(setup_yaml, out, *overrides, default_keep=False):
    cfg = resume_jobs.config(setup_yaml, "full_single", out, *overrides)
    if default_keep:
        with open_dict(cfg):
            del cfg["keep_last_n_checkpoints"]
    path = out.parent / f"{out.name}.yaml"
    OmegaConf.save(cfg, path)
    return path


def tune(config, *overrides, max_file_bytes=None, extra_env=None):
    env = resume_jobs.subprocess_env()
    env.update(extra_env or {})

    def limit_file_size():  # ulimit -f: a write past it fails with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run(["tune", "run", RECIPE, "--config", str(config), *overrides], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600,
                          preexec_fn=limit_file_size if max_file_bytes else None)


def error_lines(proc):
    return [line[line.index("error:"):] for line in proc.stderr.splitlines() if "error:" in line]  # after the bar


def test_save_messages_tell_the_truth(setup_yaml, tmp_path):
    """One accurate line per checkpoint; none of torchtune's lines about ".staging/epoch_N" or a "final" save;
    the disk use to expect at start-up; by default the two newest checkpoints are kept."""
    out = tmp_path / "out"
    # 4 steps per epoch, 2 epochs, a save every 2 steps: the epoch end at step 4 is also a periodic save
    proc = tune(write_config(setup_yaml, out, "epochs=2", "save_every_n_steps=2", default_keep=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    for step in (2, 4, 6, 8):
        assert text.count(f"Checkpoint saved: {out / f'step_{step}'} (") == 1, step
    for wrong in (".staging", "epoch_", "Saving final epoch checkpoint", "saved successfully", "Checkpoint saved:"
                  " " + str(out / "step_4") + "\nCheckpoint saved"):
        assert wrong not in text, wrong
    (each, at_most) = re.search(r"Checkpoints: about ([\d.]+ [KMG]?i?B) each, 4 to write, the newest 2 kept "
                                r"\(keep_last_n_checkpoints=2\): up to ([\d.]+ [KMG]?i?B) in '" + re.escape(str(out)),
                                text).groups()
    each, at_most = parse_bytes(each), parse_bytes(at_most)
    assert [p.name for p in list_checkpoints(str(out))] == ["step_6", "step_8"]
    written = sum(p.stat().st_size for p in (out / "step_8").rglob("*") if p.is_file())
    # an upper bound, and a close one: the small entries' allowance is ~100 KiB, not a MiB
    assert written <= each <= written + 160 * 2**10, (written, each)
    assert at_most == pytest.approx(3 * each, rel=0.01)  # 2 kept + the one being written


def parse_bytes(text: str) -> float:
    """``'422 KiB'`` -> 432128.0: the inverse of :func:`torchtune_ext.text.format_bytes`."""
    number, unit = text.split()
    return float(number) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(unit)


def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(setup_yaml, tmp_path):
    out = tmp_path / "out"
    config = write_config(setup_yaml, out, "save_every_n_steps=1")
    proc = tune(config, "checkpointer._component_=tests.support.fake_checkpointer.DiskFullAtStep",
                "checkpointer.full_at_step=2")
    assert proc.returncode == 74, proc.stderr[-3000:]  # EX_IOERR: not bad input
    assert "Traceback" not in proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 1 and errors[0].startswith(
        f"error: the disk filled up while saving step_2 in output_dir '{out}' ([Errno 28] No space "
        "left on device): it needs about ")
    assert f"{out / 'step_1'} is intact" in errors[0] and "resume_from_checkpoint=true" in errors[0]
    assert not (out / ".staging").exists()
    assert [p.name for p in list_checkpoints(str(out))] == ["step_1"]
    verify_checkpoint(out / "step_1")
    resumed = tune(config, "resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(resume_jobs.by_step(out)) == list(range(1, 13))


def test_a_write_that_fails_during_a_save_is_one_line(setup_yaml, tmp_path):
    """A real failing write (a file size limit, so torch.save fails with room on the disk), at the first save:
    one line naming the checkpoint, exit 74, no staging left, and no resume suggested (there is nothing to resume);
    the same command without the limit then trains."""
    out = tmp_path / "out"
    config = write_config(setup_yaml, out, "save_every_n_steps=1")
    # the model's weights file (~110 KB) fits; the optimizer state in recipe_state.pt (~220 KB) does not
    proc = tune(config, max_file_bytes=160_000)
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: saving step_1 in output_dir '{out}' failed (RuntimeError: "), errors[0]
    assert errors[0].endswith("the partial checkpoint was removed and no checkpoint of this run exists yet: find why "
                              "a write stopped short (a file size limit such as ulimit -f, a failing device), then "
                              "start the run again"), errors[0]
    assert not (out / ".staging").exists() and list_checkpoints(str(out)) == []
    again = tune(config)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(resume_jobs.by_step(out)) == list(range(1, 13))


def test_no_room_for_one_checkpoint_stops_before_training(setup_yaml, tmp_path, monkeypatch):
    out = tmp_path / "out"
    cfg = resume_jobs.config(setup_yaml, "full_single", out)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**5, 10**5))
    recipe = resume_jobs.recipe_class(*resume_jobs.RECIPES["full_single"][:2])(cfg)
    with pytest.raises(DiskSpaceError, match="not enough free disk space for one checkpoint in .*: it needs about "
                                             r"\d+ KiB, 97.7 KiB are free"):
        with output_dir_unchanged_on_error(str(out)):
            recipe.setup()
    assert not out.exists()  # nothing left behind


def test_a_file_named_like_the_staging_folder_stops_before_training(setup_yaml, tmp_path):
    """Found when the checkpointer is built, before training, naming the key; the user's file stays."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".staging").write_text("a user's file")
    cfg = resume_jobs.config(setup_yaml, "full_single", out)
    recipe = resume_jobs.recipe_class(*resume_jobs.RECIPES["full_single"][:2])(cfg)
    with pytest.raises(ConfigError, match=r"^config key 'output_dir': '.*\.staging' is a file, but saves stage"):
        with output_dir_unchanged_on_error(str(out)):
            recipe.setup()
    assert (out / ".staging").read_text() == "a user's file" and list_checkpoints(str(out)) == []


@pytest.mark.parametrize("error,status", [(ConfigError("k", "bad"), 2), (RuntimeError("a crash"), 1)],
                         ids=["bad-input", "crash"])
def test_a_failed_setup_removes_what_it_added_at_any_depth_and_finishes_wandb_first(tmp_path, monkeypatch,
                                                                                   error, status):
    """A resume's setup adds logs/config_<N>.yaml and a W&B segment inside the existing logs/: they go, with
    what setup created at the top (the staging folder); every file that was there stays as it was. The W&B
    run is finished (with the status the run will end with) before its folder is removed."""
    from torchtune_ext.run.control import rollback
    from torchtune_ext.run.control.run_lock import OutputDirLock

    out = tmp_path / "out"
    old = {"logs/metrics.jsonl": "{}\n", "logs/config_1.yaml": "a: 1\n", "logs/wandb/offline-run-1/run.wandb": "x",
           "step_2/model.safetensors": "w"}
    for name, text in old.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    finished = []
    monkeypatch.setattr(rollback, "finish_wandb",
                        lambda code, quiet: finished.append((code, quiet, (out / "logs/wandb/offline-run-2").exists())))
    with pytest.raises(type(error)):
        with output_dir_unchanged_on_error(str(out)):
            OutputDirLock(str(out))  # as setup does first: what appears after it is the run's (its lock file too)
            for name in ("logs/config_2.yaml", "logs/wandb/offline-run-2/run.wandb", "logs/wandb/latest-run",
                         ".staging/x"):
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                (out / name).write_text("new")
            raise error
    found = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert found == sorted(old) and all((out / n).read_text() == t for n, t in old.items())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_dir()) == [
        "logs", "logs/wandb", "logs/wandb/offline-run-1", "step_2"]
    assert finished == [(status, True, True)]  # before the removal, without W&B's summary


def snapshot(folder):
    """Relative path -> (size, mtime_ns) of every file under ``folder``."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_size_damage_to_a_checkpoint_stops_the_resume_with_one_line(setup_yaml, tmp_path):
    """Issue 33 F11: 50% of recipe_state.pt zeroed at the same size resumed with exit 0 and other weights.
    Now: one line naming the file, exit 2, before anything loads; nothing in the output_dir changes.
    verify_checkpoint_hashes=false turns the content check off (sizes are still checked)."""
    from tests.support.helpers import damage_same_size
    from torchtune_ext.config import validate
    from torchtune_ext.run.resume import check_resume_point

    out = tmp_path / "out"
    config = write_config(setup_yaml, out, "epochs=1", "max_steps_per_epoch=1")
    assert tune(config).returncode == 0
    state = out / "step_1" / "recipe_state.pt"
    damage_same_size(state)
    before = snapshot(out)
    proc = tune(config, "resume_from_checkpoint=true")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert error_lines(proc) == [
        f"error: config key 'resume_from_checkpoint': checkpoint '{out / 'step_1'}': 'recipe_state.pt' is damaged: "
        "its content differs from what was saved (SHA-256 mismatch, same size). No earlier checkpoint of this run "
        "is intact."]
    assert snapshot(out) == before
    cfg = OmegaConf.load(config)
    cfg.resume_from_checkpoint = True
    cfg.verify_checkpoint_hashes = False
    check_resume_point(validate(cfg))  # the check is off: sizes match


@pytest.mark.parametrize("which", ["step_1", "step_2"], ids=["older", "newest"])
def test_an_unreadable_step_folder_is_one_config_error_when_the_config_is_checked(setup_yaml, tmp_path, monkeypatch,
                                                                                    which):
    """Issue 33 F4: chmod 000 on a step folder gave a PermissionError traceback from validation (exit 1)."""
    from tests.support.helpers import deny
    from torchtune_ext.config import validate
    from torchtune_ext.run.resume import check_resume_point

    out = tmp_path / "out"
    cfg = OmegaConf.load(write_config(setup_yaml, out))
    for step in (1, 2):
        (out / f"step_{step}").mkdir(parents=True)
        (out / f"step_{step}" / "checkpoint.json").write_text(json.dumps({"step": step, "files": {}}))
    cfg.resume_from_checkpoint = True
    deny(monkeypatch, out / which)
    with pytest.raises(ConfigError, match=rf"^config key 'output_dir': '{out / which}' cannot be read"):
        check_resume_point(validate(cfg))


def test_a_disk_that_fills_during_a_step_stops_in_seconds_naming_the_checkpoint(setup_yaml, tmp_path):
    """Issue 33 F3: the metrics write of step 5 fails with ENOSPC (tests/support/full_disk/sitecustomize.py, with W&B
    on): exit 74 and one line naming step_4, the checkpoint to resume from, instead of an OSError traceback
    (exit 1; 401 s to exit with W&B). The resume it names then finishes the run."""
    import time

    out = tmp_path / "out"
    wandb = ["metric_logger._component_=torchtune.training.metric_logging.WandBLogger", "metric_logger.mode=offline",
             "metric_logger.project=full-disk", f"metric_logger.log_dir={out / 'logs'}"]
    config = write_config(setup_yaml, out, "save_every_n_steps=2", *wandb)
    mark = tmp_path / "disk_full_at"
    proc = tune(config, extra_env={"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests' / 'support' / 'full_disk'}",
                                   "FULL_DISK_AFTER_LINES": "4", "FULL_DISK_MARK": str(mark)})
    seconds = time.time() - float(mark.read_text())  # from the failed write to the end of the `tune` command
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert error_lines(proc) == [
        f"error: writing the metrics of step 5 to '{out / 'logs' / 'metrics.jsonl'}' failed (the disk is full): "
        f"training stopped after step 5; resume from {out / 'step_4'}: free some space, then continue with "
        "resume_from_checkpoint=true (step 5 is trained again)"]
    print(f"{seconds:.1f} s from the failed write to the exit")
    assert seconds < 15, seconds  # the exit does not wait on W&B (a loaded 2-core machine: ~3 s)
    resumed = tune(config, "resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(resume_jobs.by_step(out)) == list(range(1, 13))


def test_an_unreadable_output_dir_is_one_config_error_for_a_new_run(setup_yaml, tmp_path, monkeypatch):
    """F4 for a run that does not resume: whether the folder holds checkpoints cannot be told."""
    import errno
    import os

    from torchtune_ext.config import validate
    from torchtune_ext.run.resume import check_resume_point

    out = tmp_path / "out"
    cfg = validate(OmegaConf.load(write_config(setup_yaml, out)))
    out.mkdir()
    real = os.listdir

    def listdir(path="."):
        if str(path) == str(out):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    with pytest.raises(ConfigError, match=rf"^config key 'output_dir': '{out}' cannot be read \(PermissionError: "):
        check_resume_point(cfg)
