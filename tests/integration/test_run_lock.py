"""One run per output folder: a second run stops at once with one line; a crashed run leaves no stuck lock.

Runs and holders are processes of their own here. Two ranks of one job are
one run, and all of them refuse a folder held by another run:
tests/integration/recipes/test_resume_chain.py (``test_two_ranks_refuse_a_held_folder``).
The lock in this process: tests/unit/run/test_run_lock.py.
"""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from omegaconf import OmegaConf

from tests.support import resume_jobs
from tests.support.helpers import REPO_ROOT, read_jsonl
from torchtune_ext.checkpoint import list_checkpoints, verify_checkpoint
from torchtune_ext.config import ConfigError
from torchtune_ext.run.control.rollback import output_dir_unchanged_on_error
from torchtune_ext.run.control.run_lock import LOCK_FILE, OutputDirLock, holder

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


def has_open(pid, path):
    """Whether process ``pid`` has ``path`` open (False once it has ended)."""
    try:
        return any(os.path.realpath(os.path.join(f"/proc/{pid}/fd", fd)) == str(path)
                   for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def test_two_runs_started_together_then_a_third(setup_yaml, tmp_path):
    """Issue 33 F1, as a user meets it: two runs of one command started at the same moment, then a third while
    the winner trains. Exactly one trains; the others exit 2 with one line naming it; its checkpoints and
    metrics are whole.

    Both runs must pass validate's read-only check and enter their setup (and its rollback) before either
    holds the folder. This test holds the lock file with a *shared* lock (the check sees no holder, and no
    run can lock it), pauses each run (SIGSTOP) once it has opened the file to take the lock, lets the first
    go on and train, and only then the second: it is refused, and its rollback meets what the winner wrote
    meanwhile (in the issue, the loser's retries took 2 s, while the winner's setup wrote)."""
    out = tmp_path / "out"
    out.mkdir()
    config = tmp_path / "run.yaml"
    OmegaConf.save(resume_jobs.config(setup_yaml, "full_single", out, "epochs=2000", "save_every_n_steps=2",
                                      "keep_last_n_checkpoints=null"), config)  # runs until stopped
    gate = open(out / LOCK_FILE, "a+")
    fcntl.flock(gate, fcntl.LOCK_SH)
    runs = [subprocess.Popen(["tune", "run", RECIPE, "--config", str(config)], cwd=REPO_ROOT,
                             env=resume_jobs.subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    paused = []
    try:
        deadline = time.time() + 300
        while len(paused) < 2:
            for run in runs:
                if run not in paused and has_open(run.pid, out / LOCK_FILE):
                    os.kill(run.pid, signal.SIGSTOP)
                    paused.append(run)
            assert time.time() < deadline and all(run.poll() is None for run in runs)
            time.sleep(0.01)
        gate.close()
        winner, loser = paused
        os.kill(winner.pid, signal.SIGCONT)
        metrics = out / "logs" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.time() < deadline and winner.poll() is None
            time.sleep(0.05)
        assert holder(str(out)).startswith(f"pid {winner.pid} ")
        os.kill(loser.pid, signal.SIGCONT)
        assert loser.wait(timeout=120) == 2
        third = tune(config)
        assert winner.poll() is None  # still training beside the refused runs
    finally:
        for run in runs:
            if run.poll() is None:
                os.kill(run.pid, signal.SIGCONT)
                run.send_signal(signal.SIGTERM)
        errors = [run.communicate(timeout=300)[1] for run in runs]
    assert winner.returncode == 75  # stopped by the signal, with a checkpoint
    refusal = f"is in use by another run (pid {winner.pid} on host {socket.gethostname()}"
    for status, stderr in ((loser.returncode, errors[runs.index(loser)]), (third.returncode, third.stderr)):
        assert status == 2 and "Traceback" not in stderr
        (line,) = stderr.strip().splitlines()
        assert refusal in line, line
    checkpoints = list_checkpoints(str(out))
    for checkpoint in checkpoints:
        verify_checkpoint(checkpoint)
    last = int(checkpoints[-1].name.split("_")[1])
    assert [int(c.name.split("_")[1]) for c in checkpoints] == [*range(2, last, 2), last]
    assert [r["step"] for r in read_jsonl(out / "logs" / "metrics.jsonl")] == list(range(1, last + 1))
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["config_0.yaml", "metrics.jsonl"]
    assert holder(str(out)) is None  # the winner's lock ended with it


def test_a_killed_holder_leaves_no_stuck_lock(tmp_path):
    out = tmp_path / "out"
    script = ("import sys, time; from torchtune_ext.run.control.run_lock import OutputDirLock; "
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


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from torchtune_ext.config import ConfigError
    from torchtune_ext.run.control.rollback import output_dir_unchanged_on_error
    from torchtune_ext.run.control.run_lock import OutputDirLock
    out, then = Path(sys.argv[1]), sys.argv[2]
    with output_dir_unchanged_on_error(str(out)):
        lock = OutputDirLock(str(out))
        (out / "logs").mkdir()
        (out / "logs" / "metrics.jsonl").write_text("{}\\n")
        print("locked", flush=True)
        time.sleep(float(sys.argv[3]))
        if then == "fail":
            raise ConfigError("dataset", "bad")  # the holder's own setup fails: its rollback runs
    print("done", flush=True)
    time.sleep(600)
""")


def start_holder(out, then="hold", pause=600):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), then, str(pause)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline() == "locked\n"
    return proc


def test_a_refused_run_removes_nothing_and_the_holder_keeps_its_lock(tmp_path):
    """Issue 33 F1: two runs start together on a folder that does not exist yet; both enter the rollback of
    their setup before either creates it. The loser's rollback removed the folder with the winner's lock file
    and logs, and a third run then trained beside the winner. A refused run touches nothing."""
    out = tmp_path / "out"
    winner = None
    try:
        with pytest.raises(ConfigError, match="is in use by another run"):
            with output_dir_unchanged_on_error(str(out)):  # entered while the folder is absent
                winner = start_holder(out)
                OutputDirLock(str(out))
        assert (out / "logs" / "metrics.jsonl").read_text() == "{}\n" and (out / LOCK_FILE).is_file()
        assert holder(str(out)).startswith(f"pid {winner.pid} on host ")
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {winner.pid} "):
            OutputDirLock(str(out))  # a third run is refused too
    finally:
        if winner is not None:
            winner.kill()
            winner.wait()


def test_a_folder_removed_by_its_holder_is_locked_anew_by_the_run_waiting_for_it(tmp_path):
    """The holder created the folder and its setup failed: its rollback removes the folder, lock file
    included, while a second run waits for the lock. The waiter must lock the file now at that path, not the
    removed one: otherwise a third run would lock a new file of the same name and both would train."""
    out = tmp_path / "out"
    first = start_holder(out, then="fail", pause=0.5)
    try:
        lock = OutputDirLock(str(out))  # waits (up to 2 s) while the holder fails and rolls back
        assert first.stdout.readline() == ""  # the holder ended with its error, after removing the folder
        assert holder(str(out)).startswith(f"pid {os.getpid()} on host ")
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} "):
            OutputDirLock(str(out))
        lock.release()
    finally:
        first.kill()
        first.wait()
