"""One run per output folder: a second run stops at once with one line; a crashed run leaves no stuck lock.

Two ranks of one job are one run, and all of them refuse a folder held by
another run: tests/test_resume_chain.py (``test_two_ranks_refuse_a_held_folder``).
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

import resume_jobs
from helpers import REPO_ROOT
from torchtune_ext.config import ConfigError
from torchtune_ext.run_lock import LOCK_FILE, OutputDirLock, check_not_in_use, holder

RECIPE = "recipes/full_finetune_single_device.py"


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def setup_yaml(tmp_path_factory):
    return resume_jobs.setup(tmp_path_factory.mktemp("tiny"))


def tune(config, *overrides):
    return subprocess.run(["tune", "run", RECIPE, "--config", str(config), *overrides], cwd=REPO_ROOT,
                          env=resume_jobs.subprocess_env(), capture_output=True, text=True, timeout=600)


def test_free_folder_has_no_holder_and_probing_writes_nothing(tmp_path):
    assert holder(str(tmp_path / "absent")) is None and not (tmp_path / "absent").exists()
    lock = OutputDirLock(str(tmp_path / "out"))
    lock.release()
    assert holder(str(tmp_path / "out")) is None  # released: the file stays, unlocked
    check_not_in_use(str(tmp_path / "out"))


def test_second_run_stops_with_one_line_and_writes_nothing(setup_yaml, tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    OmegaConf.save(resume_jobs.config(setup_yaml, "full_single", out), config)
    lock = OutputDirLock(str(out))  # this test process is the other run
    try:
        before = snapshot(out)
        proc = tune(config)
        assert snapshot(out) == before
    finally:
        lock.release()
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: config key 'output_dir': '{out}' is in use by another run (pid {os.getpid()} "
                           f"on host {socket.gethostname()}, started ")
    assert line.endswith("wait for it to end, or choose another output_dir")


def test_two_real_runs_in_one_folder(setup_yaml, tmp_path):
    """The issue's case: run A trains, run B (a resume, say) is started in the same folder: B is refused."""
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    OmegaConf.save(resume_jobs.config(setup_yaml, "full_single", out, "epochs=2000", "keep_last_n_checkpoints=2"),
                   config)  # runs until stopped
    first = subprocess.Popen(["tune", "run", RECIPE, "--config", str(config)], cwd=REPO_ROOT,
                             env=resume_jobs.subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        metrics = out / "logs" / "metrics.jsonl"
        deadline = time.time() + 300
        while not metrics.exists():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        second = tune(config, "resume_from_checkpoint=true")
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"is in use by another run (pid {first.pid} on host {socket.gethostname()}" in second.stderr
        assert not (out / "logs" / "config_1.yaml").exists()  # the second run wrote nothing
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
    assert first.returncode == 75  # stopped by the signal, with a checkpoint: the first run is intact


def test_a_killed_holder_leaves_no_stuck_lock(tmp_path):
    out = tmp_path / "out"
    script = ("import sys, time; from torchtune_ext.run_lock import OutputDirLock; "
              f"lock = OutputDirLock({str(out)!r}); print('locked', flush=True); time.sleep(600)")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    who = holder(str(out))
    assert who is not None and who.startswith(f"pid {proc.pid} on host {socket.gethostname()}")
    with pytest.raises(ConfigError, match=f"'output_dir'.*in use by another run \\(pid {proc.pid} "):
        OutputDirLock(str(out))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert holder(str(out)) is None  # the kernel released it with the process
    OutputDirLock(str(out)).release()
    assert (out / LOCK_FILE).is_file()
