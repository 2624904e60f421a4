"""SIGTERM and Ctrl-C stop a run after the step in progress, with a checkpoint, a message and exit status 75.

The recipe runs as a user runs it (``tune run``, a real signal from
``os.kill``); the resumed run must equal an uninterrupted one. Signals
while a process exits run in a process of their own. Two ranks:
tests/integration/recipes/test_resume_chain.py. In this process:
tests/unit/run/test_preemption.py.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from omegaconf import OmegaConf

from tests.support import resume_jobs
from tests.support.helpers import REPO_ROOT, read_jsonl, run_tune
from torchtune_ext.checkpoint import MANIFEST, list_checkpoints, verify_checkpoint
from torchtune_ext.errors import EXIT_STOPPED, OUTCOME_FILE_ENV
from torchtune_ext.run.control.preemption import REPEAT_WINDOW_S

RECIPE = "recipes/full_finetune_single_device.py"
LONG = ["epochs=12"]  # 48 steps of a few milliseconds each: the signal arrives mid-run


def start_tune(config, *args):
    return subprocess.Popen(["tune", "run", *args, RECIPE, "--config", str(config)], cwd=REPO_ROOT,
                            env=resume_jobs.subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(proc, metrics, n, timeout=300):
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, "the run ended before it could be signalled: " + proc.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny setup's YAML and the uninterrupted run's metrics (in process)."""
    root = tmp_path_factory.mktemp("tiny")
    setup_yaml = resume_jobs.setup(root)
    assert resume_jobs.run("full_single", resume_jobs.config(setup_yaml, "full_single", root / "ref", *LONG)) == 0
    return setup_yaml, resume_jobs.by_step(root / "ref")


def write_config(tiny, out):
    path = out.parent / f"{out.name}.yaml"
    OmegaConf.save(resume_jobs.config(tiny[0], "full_single", out, *LONG), path)
    return path


# SIGINT (Ctrl-C) takes the same handler (GracefulStop, SCRIPT below); one recipe process per signal is not needed
@pytest.mark.parametrize("signum", [signal.SIGTERM], ids=["SIGTERM"])
def test_signal_saves_says_how_to_resume_and_resumes_exactly(tiny, tmp_path, signum):
    out = tmp_path / "out"
    config = write_config(tiny, out)
    proc = start_tune(config)
    wait_for_steps(proc, out / "logs" / "metrics.jsonl", 3)
    os.kill(proc.pid, signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    assert "Traceback" not in stderr
    checkpoint = list_checkpoints(str(out))[-1]  # the stop's (before it: one at each epoch end)
    verify_checkpoint(checkpoint)
    step = int(checkpoint.name.split("_")[1])
    name = signal.Signals(signum).name
    expected = (f"Stopped on {name} after optimizer step {step}; checkpoint: {checkpoint}. Continue with: tune run "
                f"{RECIPE} --config {config} resume_from_checkpoint=true  (exit status 75)")
    assert expected in stderr, stderr[-2000:]
    assert [r["step"] for r in read_jsonl(out / "logs" / "metrics.jsonl")] == list(range(1, step + 1))
    assert step < 48
    if signum == signal.SIGINT:
        return  # the same path as SIGTERM from here on

    resumed = run_tune(RECIPE, "--config", str(config), "resume_from_checkpoint=true",
                       extra_env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, ref = resume_jobs.by_step(out), tiny[1]
    assert sorted(got) == sorted(ref)
    for s in ref:  # one thread in both processes: bit for bit
        assert [got[s][f] for f in resume_jobs.FIELDS] == [ref[s][f] for f in resume_jobs.FIELDS], s


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from torchtune_ext.run.control.preemption import GracefulStop
    stop = GracefulStop(torch.device("cpu"), output_dir=sys.argv[1] or None)
    assert not stop.requested()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)   # a repeat within the window: the same request (torchrun forwards)
    assert stop.requested()
    print("still running", flush=True)
    time.sleep({pause})
    os.kill(os.getpid(), signal.SIGINT)    # a second request: stop at once
    time.sleep(5)
    print("not stopped", flush=True)
""")


@pytest.mark.parametrize("saved", [None, [], [3, 7]], ids=["no-output-dir", "none-yet", "two"])
def test_second_signal_stops_at_once_and_names_the_checkpoint(tmp_path, saved):
    """The second signal exits at once; it names the newest complete checkpoint (not a save it cut short) and the
    command that continues from it, or says that there is none yet."""
    out = tmp_path / "out"
    for step in saved or []:
        (out / f"step_{step}").mkdir(parents=True)
        (out / f"step_{step}" / MANIFEST).write_text("{}")
    (out / "step_9").mkdir(parents=True)  # a save the signal cut short: no manifest
    outcome = tmp_path / "outcome"  # as under torchrun: rank 0 tells the launcher its exit status
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RANK="0", **{OUTCOME_FILE_ENV: str(outcome)})
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(pause=REPEAT_WINDOW_S + 0.2),
                           "" if saved is None else str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert outcome.read_text() == f"{128 + signal.SIGINT}\n"
    assert proc.stdout == "still running\n"
    assert "SIGTERM received: stopping after the current optimizer step" in proc.stderr
    again = [line for line in proc.stderr.splitlines() if "SIGINT received again: stopping at once" in line]
    assert len(again) == 1, proc.stderr
    if saved is None:
        assert again[0].endswith("the last complete checkpoint is intact")
    elif not saved:
        assert again[0].endswith("no checkpoint was saved yet: start again with the same command")
    else:
        assert f"the last complete checkpoint is intact: {out / f'step_{saved[-1]}'}. Continue with: " in again[0]
        assert again[0].endswith("resume_from_checkpoint=true")


@pytest.mark.parametrize("save_fails", [False, True], ids=["saved", "save-failed"])
def test_a_scheduler_signalling_the_whole_job_gets_the_workers_exit_status(tiny, tmp_path, save_fails):
    """SLURM and Kubernetes signal every process of the job, the ``tune`` launcher included: torchrun's agent then
    ends with its own SignalException, which carries no worker status. The launcher must still exit with rank 0's
    status, 75 after a saved stop and 74 when that stop's save failed, without a traceback."""
    out = tmp_path / "out"
    path = tmp_path / "dist.yaml"
    OmegaConf.save(resume_jobs.config(tiny[0], "full_dist", out, *LONG), path)
    proc = subprocess.Popen(["tune", "run", "--nproc_per_node", "2", "recipes/full_finetune_distributed.py",
                             "--config", str(path)], cwd=REPO_ROOT, env=resume_jobs.subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_steps(proc, out / "logs" / "metrics.jsonl", 3)
    if save_fails:
        (out / ".staging").touch()  # the stop's save cannot stage its checkpoint
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert "Traceback" not in stderr, stderr[-3000:]
    if save_fails:
        assert proc.returncode == 74, stderr[-3000:]
        assert "error: saving step_" in stderr and "is a file" in stderr
    else:
        assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
        assert "Stopped on SIGTERM after optimizer step" in stderr
        verify_checkpoint(list_checkpoints(str(out))[-1])


FINISHED_SCRIPT = textwrap.dedent("""
    import os, signal, time
    import torch
    from torchtune_ext.run.control.preemption import GracefulStop
    stop = GracefulStop(torch.device("cpu"))
    assert stop.finished() == 0   # training ran to its end; the cleanup (W&B's finish) follows
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("not stopped", flush=True)
""")


def test_a_signal_during_the_cleanup_of_a_finished_run_exits_0(tmp_path):
    """After training finished (checkpoint saved), a SIGTERM while W&B finishes must not read as a kill (143);
    under torchrun rank 0 tells the launcher, which the signal may reach too, that the run ended with 0."""
    outcome = tmp_path / "outcome"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RANK="0", **{OUTCOME_FILE_ENV: str(outcome)})
    proc = subprocess.run([sys.executable, "-c", FINISHED_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert outcome.read_text() == "0\n"
    assert proc.stdout == ""
    assert "SIGTERM received after training finished: exiting without the rest of the cleanup" in proc.stderr


LATE_SIGNAL_SCRIPT = textwrap.dedent("""
    import atexit, os, signal, sys, time
    from torchtune_ext.run.control import exits

    def late_signal():  # as W&B's exit hook, which takes seconds: a scheduler's SIGTERM arrives meanwhile
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    class Teardown:  # later still: while the interpreter tears its modules down, after its handlers are reset
        # (bound now: by then the modules' globals may be gone)
        def __del__(self, kill=os.kill, pid=os.getpid(), sigterm=signal.SIGTERM, sleep=time.sleep):
            kill(pid, sigterm)
            sleep(0.5)

    if sys.argv[2] == "teardown":
        teardown = Teardown()

    def recipe_main():
        if sys.argv[2] == "exit-hook":
            atexit.register(late_signal)  # during the run, as wandb.init does: runs before run_main's own hook
        if sys.argv[1] == "raise":
            sys.exit(2)  # report_and_exit's way
        return int(sys.argv[1])

    exits.run_main(recipe_main)
""")


@pytest.mark.parametrize("when", ["exit-hook", "teardown"])
@pytest.mark.parametrize("status", ["0", "75", "raise"])
def test_a_signal_while_the_interpreter_exits_keeps_the_decided_status(status, when):
    """The recipe's handlers are gone once it returned; a SIGTERM during the interpreter's shutdown (W&B's exit hook)
    ended the process with 143 after a finished run or a saved stop, which a job script reads as a kill."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", LATE_SIGNAL_SCRIPT, status, when], env=env, capture_output=True,
                          text=True,
                          timeout=120)
    assert proc.returncode == (2 if status == "raise" else int(status)), proc.stderr
    assert "Traceback" not in proc.stderr
