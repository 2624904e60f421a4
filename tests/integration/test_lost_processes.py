"""A process of a ``tune run --nproc_per_node 2`` job dies however it dies (SIGKILL): the rest of the job ends.

Issue 33: with the launcher killed, its workers trained on as orphans (and held the output folder); with one
worker killed, the job ended with ~100 lines of gloo and torchrun tracebacks and never named the checkpoint
to resume from. The launcher's classification of failures, without processes: tests/unit/run/test_lost_processes.py.
"""

import json
import os
import re
import signal
import subprocess
import textwrap
import time

import pytest
from omegaconf import OmegaConf

from tests.support import resume_jobs
from tests.support.helpers import REPO_ROOT, read_jsonl
from torchtune_ext.checkpoint import incomplete_checkpoints, list_checkpoints, verify_checkpoint
from torchtune_ext.errors import OUTCOME_FILE_ENV
from torchtune_ext.run.control.exits import STOP_OTHERS_SIGNAL
from torchtune_ext.run.control.run_lock import holder

RECIPE = "recipes/full_finetune_distributed.py"


@pytest.fixture(scope="module")
def setup_yaml(tmp_path_factory):
    return resume_jobs.setup(tmp_path_factory.mktemp("tiny"))


def start_job(setup_yaml, root, stderr):
    """A 2-process job that trains until stopped, saving every 2 steps; returns (launcher, config, out)."""
    out = root / "out"
    config = root / "run.yaml"
    OmegaConf.save(resume_jobs.config(setup_yaml, "full_dist", out, "epochs=2000", "save_every_n_steps=2",
                                      "keep_last_n_checkpoints=null"), config)
    launcher = subprocess.Popen(["tune", "run", "--nproc_per_node", "2", RECIPE, "--config", str(config)],
                                cwd=REPO_ROOT, env=resume_jobs.subprocess_env(), stdout=subprocess.DEVNULL,
                                stderr=stderr, text=True)
    return launcher, config, out


def wait_for_steps(launcher, out, n, timeout=300):
    metrics = out / "logs" / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert launcher.poll() is None and time.time() < deadline
        time.sleep(0.05)


def workers_of(pid):
    """{rank: pid} of the worker processes whose parent is ``pid``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
    return found


def alive(pid):
    """Whether any thread of ``pid`` runs (a zombie waiting for its new parent to reap it has ended).

    Every thread counts: a killed multi-threaded process shows its main thread as a zombie while its other
    threads still exit, and they hold its open files (its run lock) until the last one is gone.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except OSError:
            continue
    return False


def assert_checkpoints_whole(out):
    assert incomplete_checkpoints(str(out)) == []  # a save cut short stays in .staging, never a step_<N>
    checkpoints = list_checkpoints(str(out))
    assert checkpoints
    for checkpoint in checkpoints:
        verify_checkpoint(checkpoint)
    return checkpoints[-1]


def test_workers_end_when_their_launcher_is_killed(setup_yaml, tmp_path):
    """Issue 33 F2: SIGKILL of the launcher left its workers training as orphans, saving unseen checkpoints,
    and a resume was refused as 'in use'. They end within seconds; every checkpoint is whole; the folder is
    free."""
    launcher, _, out = start_job(setup_yaml, tmp_path, subprocess.DEVNULL)
    try:
        wait_for_steps(launcher, out, 3)
        workers = workers_of(launcher.pid)
        assert sorted(workers) == [0, 1]
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.time() + 5
    while any(alive(pid) for pid in workers.values()):
        assert time.time() < deadline, f"workers still running: {workers}"
        time.sleep(0.05)
    assert_checkpoints_whole(out)
    assert holder(str(out)) is None  # a resume can start at once


@pytest.mark.parametrize("rank", [1])
def test_a_killed_worker_ends_the_job_with_one_line_naming_the_checkpoint(setup_yaml, tmp_path, rank):
    """Issue 33 F10: SIGKILL of one worker. The other worker and the launcher end without a traceback; the
    launcher's one line names the rank, the signal, the newest complete checkpoint and the command that
    continues the run, and it exits 128 + 9, the status of a single-process run killed the same way."""
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        launcher, config, out = start_job(setup_yaml, tmp_path, stderr)
        try:
            wait_for_steps(launcher, out, 5)
            workers = workers_of(launcher.pid)
            printed = log.stat().st_size
            os.kill(workers[rank], signal.SIGKILL)
            assert launcher.wait(timeout=120) == 128 + signal.SIGKILL
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    assert not any(alive(pid) for pid in workers.values())
    text = log.read_text()
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    after = text[printed:].strip().split("\n")  # what was printed once the worker was killed
    assert len(after) <= 2, after  # at most the rest of the progress bar's line, then the line
    checkpoint = assert_checkpoints_whole(out)
    assert after[-1] == (
        f"error: rank {rank} (pid {workers[rank]}) was killed by SIGKILL, and the job stopped; the last complete "
        f"checkpoint is intact: {checkpoint}. Continue with: tune run --nproc_per_node 2 {RECIPE} --config {config} "
        f"resume_from_checkpoint=true  (exit status 137)")
    assert holder(str(out)) is None


def test_torchrun_restarts_a_killed_worker_and_the_job_continues_exactly(setup_yaml, tmp_path):
    """Issue 31 (torchrun elastic): ``--max-restarts 1`` and ``resume_from_checkpoint=auto``. Rank 1 of the
    first attempt dies by SIGKILL after step 3 (tests/support/elastic_recipe.py); torchrun starts both workers again
    with the same command line, they continue from step_2, and the job ends with status 0 and, at every step,
    the loss and gradient norm of one uninterrupted rank on the same global batch (<= 1e-5)."""
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    OmegaConf.save(resume_jobs.config(setup_yaml, "full_dist", out, "save_every_n_steps=2",
                                      "resume_from_checkpoint=auto"), config)
    done = subprocess.run(["tune", "run", "--nproc_per_node", "2", "--max-restarts", "1",
                           "tests/support/elastic_recipe.py", "--config", str(config)], cwd=REPO_ROOT,
                          env=resume_jobs.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout + done.stderr
    assert "no complete checkpoint in output_dir yet, so a new run" in text  # the first attempt
    assert re.search(r"\nrank 1 \(pid \d+\) was killed by SIGKILL: torchrun starts every worker again \(restart 1 "
                     r"of 1\)\n", done.stderr), done.stderr[-3000:]  # the launcher says why
    assert "torchrun's restart 1 of 1 after a worker failed" in text  # rank 0 of the restarted workers
    assert f"Resuming from {out / 'step_2'} (step 2)" in text  # the restarted one
    steps = [r["step"] for r in read_jsonl(out / "logs" / "metrics.jsonl") if "loss" in r]
    assert steps[:2] == [1, 2] and steps[-4:] == [3, 4, 5, 6] and len(steps) <= 7  # step 3 again after the restart
    assert holder(str(out)) is None

    reference = resume_jobs.config(setup_yaml, "full_dist", tmp_path / "ref", "gradient_accumulation_steps=4")
    assert resume_jobs.run("full_dist", reference) == 0
    got, want = resume_jobs.by_step(out), resume_jobs.by_step(tmp_path / "ref")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in want:
        for field in ("loss", "grad_norm"):
            assert got[step][field] == pytest.approx(want[step][field], rel=1e-5), (step, field)
        assert got[step]["num_tokens"] == want[step]["num_tokens"]


LOSES_A_PEER = textwrap.dedent("""
    import sys
    from torchtune_ext.run.control.exits import exit_on_user_error

    @exit_on_user_error
    def recipe_main(cfg):
        raise RuntimeError(sys.argv[1])

    recipe_main(None)  # an argument: no command line to check
""")


GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13231: Connection reset "
        "by peer. This is typically caused by a remote worker hanging or bugs in the application.")


@pytest.mark.parametrize("launcher", [True, False], ids=["tune-run", "plain-torchrun"])
def test_a_worker_that_loses_a_peer_ends_quietly_as_a_consequence(tmp_path, launcher):
    """gloo's error often reaches a survivor before torchrun's stop signal does: no traceback; the line goes to
    the error file for the launcher (printed by rank 0 only without our launcher), and the worker ends as
    torchrun ends the others, which tells the launcher that it is not the cause. Other errors keep their
    traceback."""
    import sys

    from torchtune_ext.errors import LAUNCHER_PID_ENV
    from torchtune_ext.run.control.exits import LOST_PEER

    error_file = tmp_path / "error.json"
    env = {k: v for k, v in os.environ.items() if k not in (LAUNCHER_PID_ENV, OUTCOME_FILE_ENV)}
    env.update(PYTHONPATH=str(REPO_ROOT), RANK="0", WORLD_SIZE="2", TORCHELASTIC_ERROR_FILE=str(error_file))
    if launcher:
        env[LAUNCHER_PID_ENV] = str(os.getpid())
    proc = subprocess.run([sys.executable, "-c", LOSES_A_PEER, GLOO], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -STOP_OTHERS_SIGNAL, proc.stderr
    line = (f"{LOST_PEER} (Read error [127.0.0.1]:13231: Connection reset by peer): another rank has ended or "
            f"cannot be reached")
    assert json.loads(error_file.read_text())["message"] == line
    assert proc.stderr == ("" if launcher else line + "\n")
    if not launcher:
        return
    proc = subprocess.run([sys.executable, "-c", LOSES_A_PEER, "a bug"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RuntimeError: a bug" in proc.stderr
