"""A lost process of a torchrun job, as the launcher and the workers classify it: one line naming the lost rank
and the checkpoint, without tracebacks (issue 33), in this process on torchrun's own failure records.

The jobs whose processes are killed for real: tests/integration/test_lost_processes.py.
"""

import json
import os
import signal

import pytest

from torchtune_ext.errors import OUTCOME_FILE_ENV
from torchtune_ext.run.control.exits import STOP_OTHERS_SIGNAL

RECIPE = "recipes/full_finetune_distributed.py"


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


def test_the_launcher_hosting_the_rendezvous_store_leaves_after_every_other_node(monkeypatch):
    """After a successful job of 2 nodes, the launcher that hosts the c10d store returns from closing the
    rendezvous only once the other node's launcher has closed it too (its late requests met a closed store, and
    torch printed a C++ stack dump); the other returns at once, and makes no request after counting itself out."""
    import socket
    import threading
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from torchtune_ext.run.control.launcher import _leave_together

    closes = []
    monkeypatch.setattr(SimpleElasticAgent, "_exit_barrier", lambda agent: None)  # torchrun's barrier: passed
    monkeypatch.setattr(DynamicRendezvousHandler, "shutdown", lambda handler: closes.append(handler) or True)
    undo = _leave_together()
    try:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        # what torchrun's c10d backend makes: the first launcher hosts the store, the other joins it
        host_store = c10d_backend.TCPStore("localhost", port, is_master=True, multi_tenant=True,
                                           timeout=timedelta(seconds=10))
        other_store = c10d_backend.TCPStore("localhost", port, is_master=False, multi_tenant=True,
                                            timeout=timedelta(seconds=10))
        SimpleElasticAgent._exit_barrier(SimpleNamespace(_worker_group=SimpleNamespace(group_world_size=2)))
        settings = SimpleNamespace(run_id="job")
        host = SimpleNamespace(_settings=settings, _store=host_store)
        other = SimpleNamespace(_settings=settings, _store=other_store)
        done = threading.Event()
        leaving = threading.Thread(target=lambda: DynamicRendezvousHandler.shutdown(host) and done.set())
        leaving.start()
        time.sleep(0.5)
        assert closes == [host] and not done.is_set()  # closed, and waiting for the other node
        assert DynamicRendezvousHandler.shutdown(other) is True  # returns at once
        leaving.join(10)
        assert done.is_set() and closes == [host, other]
    finally:
        undo()
    assert DynamicRendezvousHandler.shutdown.__name__ == "<lambda>"  # torchrun's own again (here: the stand-in)
