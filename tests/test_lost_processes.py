"""A process of a ``tune run --nproc_per_node 2`` job dies however it dies (SIGKILL): the rest of the job ends.

Issue 33: with the launcher killed, its workers trained on as orphans (and held the output folder); with one
worker killed, the job ended with ~100 lines of gloo and torchrun tracebacks and never named the checkpoint
to resume from. The launcher's classification of failures is tested without processes at the end.
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

import resume_jobs
from helpers import REPO_ROOT, read_jsonl
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


@pytest.mark.slow
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
@pytest.mark.slow
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


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_the_job_continues_exactly(setup_yaml, tmp_path):
    """Issue 31 (torchrun elastic): ``--max-restarts 1`` and ``resume_from_checkpoint=auto``. Rank 1 of the
    first attempt dies by SIGKILL after step 3 (tests/elastic_recipe.py); torchrun starts both workers again
    with the same command line, they continue from step_2, and the job ends with status 0 and, at every step,
    the loss and gradient norm of one uninterrupted rank on the same global batch (<= 1e-5)."""
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    OmegaConf.save(resume_jobs.config(setup_yaml, "full_dist", out, "save_every_n_steps=2",
                                      "resume_from_checkpoint=auto"), config)
    done = subprocess.run(["tune", "run", "--nproc_per_node", "2", "--max-restarts", "1", "tests/elastic_recipe.py",
                           "--config", str(config)], cwd=REPO_ROOT, env=resume_jobs.subprocess_env(),
                          capture_output=True, text=True, timeout=300)
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


# ------------------------------------------------------------ the launcher's part
def failure(tmp_path, rank, exitcode, message=None):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error_{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": message, "timestamp": 100}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


LOST = ("error: lost the connection to another rank (Read error [127.0.0.1]:1234: Connection reset by peer): another "
        "rank has ended or cannot be reached")
STOPPED = -int(STOP_OTHERS_SIGNAL)  # how torchrun ended the workers still running


@pytest.mark.parametrize("failures,status,line", [
    ({0: (LOST, STOPPED), 1: (None, -9)}, 137, "rank 1 (pid 1001) was killed by SIGKILL, and the job stopped; "),
    ({0: (None, -9), 1: (None, STOPPED)}, 137, "rank 0 (pid 1000) was killed by SIGKILL, and the job stopped; "),
    ({0: (None, -15), 1: (None, -6)}, 134, "rank 1 (pid 1001) was killed by SIGABRT, and the job stopped; "),
    ({0: (LOST, STOPPED), 1: (LOST, STOPPED)}, 1, "the ranks lost their connection to each other (Read error "
                                                  "[127.0.0.1]:1234: Connection reset by peer), and the job stopped; "),
    ({0: (None, 1), 1: (None, STOPPED)}, None, None),  # a crash with its traceback: torchrun's report
    ({0: (None, 1), 1: (LOST, STOPPED)}, None, None),
], ids=["other-rank-killed", "rank0-killed", "aborted", "connection-lost", "crash", "crash-then-lost"])
def test_the_launcher_names_the_lost_rank_and_the_checkpoint(tmp_path, capsys, monkeypatch, launcher_signal_handlers,
                                                             failures, status, line):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchtune_ext.run.control import exits, launcher

    out = tmp_path / "out"
    (out / "step_4").mkdir(parents=True)
    (out / "step_4" / "checkpoint.json").write_text("{}")
    monkeypatch.setenv(OUTCOME_FILE_ENV, "")  # restored afterwards: the launcher sets it for its workers
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("sys.argv", ["/venv/bin/tune", "run", "--nproc_per_node", "2", RECIPE, "--config", "my.yaml"])
    error = ChildFailedError("recipe", {r: failure(tmp_path, r, code, msg) for r, (msg, code) in failures.items()})

    def run(args):
        exits.record_output_dir(str(out))  # what rank 0 does once its job holds the folder
        raise error

    if status is None:
        with pytest.raises(ChildFailedError):
            launcher.quiet_reported_failures(run)(None)
        assert capsys.readouterr().err == ""
        return
    with pytest.raises(SystemExit) as exit_info:
        launcher.quiet_reported_failures(run)(None)
    assert exit_info.value.code == status
    assert capsys.readouterr().err == (  # on a new line: a worker's progress bar may have been cut short
        f"\nerror: {line}the last complete checkpoint is intact: {out / 'step_4'}. Continue with: tune run "
        f"--nproc_per_node 2 {RECIPE} --config my.yaml resume_from_checkpoint=true  (exit status {status})\n")


@pytest.fixture
def launcher_signal_handlers():
    """The launcher's wrapper ignores SIGTERM / SIGINT once its status is decided: put pytest's back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


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


def test_a_worker_killed_before_the_job_held_its_folder_names_no_checkpoint(tmp_path, capsys):
    """Killed during its imports or before the lock: no folder of this job to look in (it may be another
    run's), so the line says to start again."""
    from torchtune_ext.run.control import launcher

    with pytest.raises(SystemExit) as exit_info:
        launcher._exit_for_lost_rank({1: failure(tmp_path, 1, -9), 0: failure(tmp_path, 0, STOPPED)}, None)
    assert exit_info.value.code == 137
    assert capsys.readouterr().err == ("\nerror: rank 1 (pid 1001) was killed by SIGKILL, and the job stopped; it "
                                       "stopped before it held its output_dir: start it again with the same command"
                                       "  (exit status 137)\n")


@pytest.mark.parametrize("preset", [None, "0"], ids=["default", "users-own"])
def test_the_launcher_gives_each_rendezvous_round_a_store_of_its_own(monkeypatch, launcher_signal_handlers, preset):
    """torch >= 2.5 shares its agent's store with every attempt of a job, and a restarted rank read the dead
    rank's address from it: the restart case above hung or failed in 2 of 4 runs (none of 4 since). The launcher
    turns the sharing off for torchrun's run; a value the user set stays."""
    from torchtune_ext.run.control import launcher

    if preset is None:
        monkeypatch.delenv(launcher.SHARED_STORE_OFF_ENV, raising=False)
    else:
        monkeypatch.setenv(launcher.SHARED_STORE_OFF_ENV, preset)
    seen = []
    launcher.quiet_reported_failures(lambda args: seen.append(os.environ.get(launcher.SHARED_STORE_OFF_ENV)))(None)
    assert seen == [preset or "1"]


def test_a_restart_in_torchruns_shared_store_says_what_to_set(monkeypatch, caplog):
    """Plain torchrun keeps the shared store: rank 0 of a restarted job says, before the group forms (where it
    would hang), what to set."""
    import logging

    from torchtune_ext.parallel import mesh as distributed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for restart, said in (("0", False), ("1", True)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            distributed._warn_of_a_shared_store_on_restart()
        assert ("launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text) == said, restart
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # tune run's launcher: a store per round
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        distributed._warn_of_a_shared_store_on_restart()
    assert caplog.text == ""


@pytest.mark.parametrize("failures,said,restarts_left", [
    ({0: (None, STOPPED), 1: (None, -9)}, "rank 1 (pid 1001) was killed by SIGKILL", 1),
    ({0: (None, 1), 1: (LOST, STOPPED)}, "rank 0 (pid 1000) exited with status 1", 1),
    ({0: ("error: config key 'x': bad", 2), 1: ("error: config key 'x': bad", 2)}, None, 0),
    ({0: ("error: ...", 75), 1: (None, STOPPED)}, None, 0),
    ({0: ("error: ...", 74), 1: (None, -9)}, "rank 1 (pid 1001) was killed by SIGKILL", 1),
], ids=["killed", "crashed", "bad-input", "stopped", "io-error-and-killed"])
def test_a_restart_names_the_failure_and_a_reported_one_ends_the_job(tmp_path, capsys, failures, said,
                                                                       restarts_left):
    """Issue 31 trial: torchrun restarted the workers without a word on why (an OOM kill left no trace), and
    restarted a bad config twice, printing its error three times. Now one line names the failure before a
    restart, and a failure the recipe reported itself (exit 2, 3, 74, 75) uses up the restarts, so the agent
    ends the job with that status (the launcher's usual line) instead of meeting it again or undoing a stop."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from torchtune_ext.run.control import launcher

    result = RunResult(state=WorkerState.FAILED,
                       failures={r: failure(tmp_path, r, code, msg) for r, (msg, code) in failures.items()})
    agent = SimpleNamespace(_remaining_restarts=1)
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=3))
    assert launcher._say_before_a_restart(lambda a, g: result)(agent, group) is result
    assert agent._remaining_restarts == restarts_left
    err = capsys.readouterr().err
    assert err == (f"\n{said}: torchrun starts every worker again (restart 3 of 3)\n" if said else "")
    agent._remaining_restarts = 0  # none left: the agent ends the job, and the launcher's line says why
    launcher._say_before_a_restart(lambda a, g: result)(agent, group)
    assert capsys.readouterr().err == ""
    healthy = RunResult(state=WorkerState.HEALTHY)
    agent._remaining_restarts = 1
    assert launcher._say_before_a_restart(lambda a, g: healthy)(agent, group) is healthy
    assert agent._remaining_restarts == 1 and capsys.readouterr().err == ""
