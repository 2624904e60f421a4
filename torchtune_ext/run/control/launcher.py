"""The ``tune`` launcher's side of a distributed run: exit like the workers, with their one line.

In the launcher process (the ``tune`` command), :func:`quiet_reported_failures`
wraps torchrun's ``run``: when the first worker to fail exited with one of
the statuses of :data:`torchtune_ext.errors.REPORTED_EXIT_CODES`, the launcher
exits with the same status without its ``ChildFailedError`` report, printing
the failing rank's line only when rank 0 did not print it.
``torchtune_ext._local_recipes`` installs that wrapper when the ``tune``
command imports ``torchtune._cli.run``.

Module level imports stay light (the standard library and our leaf modules):
the launcher imports this module at start-up.
"""

import functools
import os
import shlex
import signal
import sys
import time
from typing import Any, Callable, Optional, Tuple

from torchtune_ext.errors import LAUNCH_COMMAND_ENV, LAUNCHER_PID_ENV, OUTCOME_FILE_ENV, REPORTED_EXIT_CODES
from torchtune_ext.run.control.exits import LOST_PEER, STOP_OTHERS_SIGNAL, ignore_signals_while_exiting

# torch >= 2.5 keeps one TCP store (its agent's) for every attempt of a job, and the workers' process group
# writes the same keys in it each time: a restarted rank could read a dead rank's address and wait on it (both
# ranks of a 2-process job hung in gloo's connect, or failed, in 2 of 4 restarts here; pytorch/pytorch#135712
# for nccl). With this set, each rendezvous round makes a fresh store, as before torch 2.5, on every node alike
# (the restart count, which could name a fresh namespace instead, is counted per node and differs between them).
SHARED_STORE_OFF_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# After a job of several nodes succeeds, every node's launcher closes the c10d rendezvous, whose TCP store one of them
# hosts; the host used to exit at once, and a launcher that closed after it printed a C++ stack dump of 16 lines or
# more per failed store request (exit status 0 all the same). The host now waits this long at most for the others.
LEAVE_TIMEOUT_S = 30.0


def _recorded_output_dir(outcome_file: str) -> Optional[str]:
    try:
        with open(outcome_file + ".output_dir") as f:
            return f.read() or None
    except OSError:
        return None


def _recorded_outcome(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None



def quiet_reported_failures(run: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap torchrun's ``run`` in the launcher: a job whose workers reported their own error exits quietly.

    When rank 0 recorded its exit status (:func:`~torchtune_ext.run.control.exits.record_outcome`: a stop, an
    expected error it printed, the end of training, a second signal), the
    launcher exits with that status, whether torchrun's agent raised
    ``ChildFailedError`` or, when a scheduler signalled the launcher too,
    ``SignalException``; a ``SignalException`` with no status recorded exits
    with 128 + signal number, in one line. Otherwise,
    when the first worker to fail exited with a status of
    :data:`REPORTED_EXIT_CODES`, the workers have printed the one line that
    matters (see :func:`~torchtune_ext.run.control.exits.report_and_exit`), and the launcher exits with that
    status instead of raising ``ChildFailedError`` (a traceback and a
    failure report); if rank 0 did not print it, the failing rank's line,
    read from its error file, is printed. When a worker was killed by a
    signal, or the workers lost their connection to each other, one line says
    so and names the newest complete checkpoint and the command that
    continues the run (:func:`_exit_for_lost_rank`). Other failures are
    reported by torchrun as usual.

    With ``--max-restarts``: each rendezvous round gets a store of its own
    (:data:`SHARED_STORE_OFF_ENV`), so that the workers torchrun starts again
    can form their process group; a restart is said in one line naming the
    failure; and a failure the recipe reported (:data:`REPORTED_EXIT_CODES`:
    bad input, a stop, a failed write, a destroyed model) ends the job instead,
    as a restart would meet it again or undo a stop.

    After a successful job of several nodes, the launcher hosting the c10d
    rendezvous store exits last, so that no other node's launcher prints torch's
    stack dump for a store that went away (:func:`_leave_together`).

    While ``run`` runs, torchrun ends the workers left once one has failed
    with :data:`STOP_OTHERS_SIGNAL` instead of SIGTERM (a signal the launcher
    receives is still forwarded as it is), and the workers end with the
    launcher (:data:`LAUNCHER_PID_ENV`).
    """
    import logging

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_drop_reported_failure_log)
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(_drop_reported_failure_log)

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import tempfile

        from torch.distributed.elastic.multiprocessing import api as elastic_api
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        outcome_file = os.path.join(tempfile.gettempdir(), f"torchtune_ext_outcome_{os.getpid()}_{time.time_ns()}")
        os.environ[OUTCOME_FILE_ENV] = outcome_file
        launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        os.environ[LAUNCH_COMMAND_ENV] = shlex.join(["tune", *sys.argv[1:]])  # for a stop's "continue with" line
        # PContext.close() without a signal, which torchrun calls only when a worker has failed, takes this one
        # (torch 2.x); if a later torch drops the function, the workers get SIGTERM as before
        default_signal = getattr(elastic_api, "_get_default_signal", None)
        if default_signal is not None:
            elastic_api._get_default_signal = lambda: STOP_OTHERS_SIGNAL
        os.environ.setdefault(SHARED_STORE_OFF_ENV, "1")  # a user's own setting stays
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        monitor = LocalElasticAgent._monitor_workers
        LocalElasticAgent._monitor_workers = _say_before_a_restart(monitor)
        undo_leave_together = _leave_together()
        try:
            return run(*args, **kwargs)
        except SignalException as err:
            status = _recorded_outcome(outcome_file)
            if status is not None:  # rank 0 said how the run ended (a stop, a save that failed, a second signal)
                sys.exit(status)
            # a signal before any worker said how it ends: torchrun's traceback adds nothing to the shell's status
            signum = int(err.sigval)
            print(f"tune run: stopped by {signal.Signals(signum).name} (exit status {128 + signum})", file=sys.stderr,
                  flush=True)
            sys.exit(128 + signum)
        except ChildFailedError as err:
            status = _recorded_outcome(outcome_file)
            if status:  # 0 (training finished) followed by a worker's failure is still a failure
                sys.exit(status)
            _, first = err.get_first_failure()
            reported = {r: f for r, f in err.failures.items() if f.exitcode in REPORTED_EXIT_CODES}
            if not reported:
                _exit_for_lost_rank(err.failures, _recorded_output_dir(outcome_file))
            if not reported or (first.exitcode >= 0 and first.exitcode not in REPORTED_EXIT_CODES):
                raise  # a crash: torchrun's report is what helps
            rank, failure = min(reported.items(), key=lambda item: (item[1].timestamp, item[0]))
            # Rank 0 prints before it writes its error file; it may have been stopped by torchrun
            # (SIGTERM) after that, while exiting, when another rank exited first.
            rank_zero = err.failures.get(0)
            if not (rank_zero is not None and _is_report(rank_zero.message)):
                message = failure.message if _is_report(failure.message) else f"error: exit status {failure.exitcode}"
                print(f"{message} (rank {rank})", file=sys.stderr, flush=True)
            sys.exit(failure.exitcode)
        finally:
            # the launcher's status is decided: torchrun's handler would turn a scheduler's repeated signals
            # into one SignalException traceback each while the launcher exits
            ignore_signals_while_exiting()
            for path in (outcome_file, outcome_file + ".output_dir"):
                if os.path.exists(path):
                    os.remove(path)
            if default_signal is not None:
                elastic_api._get_default_signal = default_signal
            LocalElasticAgent._monitor_workers = monitor
            undo_leave_together()
            os.environ.pop(LAUNCH_COMMAND_ENV, None)
            if launcher_pid is None:
                os.environ.pop(LAUNCHER_PID_ENV, None)
            else:
                os.environ[LAUNCHER_PID_ENV] = launcher_pid

    return wrapper


def _leave_together() -> Callable[[], None]:
    """Patch torchrun for one launch: after a successful job of several nodes, the launcher that hosts the c10d
    rendezvous store exits only once every node's launcher has closed the rendezvous. Returns the undo.

    torchrun's agents meet at an exit barrier when their workers have succeeded, then each closes the
    rendezvous (a few store requests) and exits. When the store's host got there first, a launcher still
    closing (or sending its keep-alive heartbeat) met a closed connection, and torch's TCP store printed a C++
    stack dump for it, on a run that succeeded. Now each launcher counts itself out in the store after its
    close, and the host waits for the count to reach the number of nodes (at most :data:`LEAVE_TIMEOUT_S`);
    the others make no request after theirs. A failed job, one node, or another rendezvous backend is left as
    torchrun has it.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    tcp_store, exit_barrier, shutdown = (c10d_backend.TCPStore, SimpleElasticAgent._exit_barrier,
                                         DynamicRendezvousHandler.shutdown)
    hosted: list = []  # the rendezvous stores this launcher serves (torchrun tries to host, then joins)
    succeeded: dict = {}

    def make_store(*args: Any, **kwargs: Any) -> Any:
        store = tcp_store(*args, **kwargs)
        if kwargs.get("is_master"):
            hosted.append(store)
        return store

    def after_success(agent: Any) -> None:
        exit_barrier(agent)  # only after the workers of this node succeeded: every node's agent is here
        succeeded["nodes"] = agent._worker_group.group_world_size

    def close(handler: Any) -> bool:
        closed = shutdown(handler)  # stops the keep-alive heartbeats, then closes the rendezvous
        nodes = succeeded.get("nodes", 1)
        if nodes > 1:
            key = f"torchtune_ext.{handler._settings.run_id}.closed"
            try:
                count = handler._store.add(key, 1)
                deadline = time.monotonic() + LEAVE_TIMEOUT_S
                while any(s is handler._store for s in hosted) and count < nodes and time.monotonic() < deadline:
                    time.sleep(0.05)
                    count = handler._store.add(key, 0)
            except Exception:  # the rendezvous is closed already; this only orders the exits
                pass
        return closed

    c10d_backend.TCPStore = make_store
    SimpleElasticAgent._exit_barrier = after_success
    DynamicRendezvousHandler.shutdown = close

    def undo() -> None:
        c10d_backend.TCPStore = tcp_store
        SimpleElasticAgent._exit_barrier = exit_barrier
        DynamicRendezvousHandler.shutdown = shutdown

    return undo


def _say_before_a_restart(monitor: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap torchrun's ``LocalElasticAgent._monitor_workers``: before the agent restarts failed workers, one line
    says which failed and how; a failure the recipe reported leaves no restart (the agent then ends the job)."""

    @functools.wraps(monitor)
    def wrapper(agent: Any, worker_group: Any) -> Any:
        result = monitor(agent, worker_group)
        if not result.is_failed() or agent._remaining_restarts <= 0:
            return result
        causes = {r: f for r, f in result.failures.items() if not _is_consequence(f)}
        if causes and all(f.exitcode in REPORTED_EXIT_CODES for f in causes.values()):
            agent._remaining_restarts = 0  # the same input, the same stop, the same disk: no restart
            return result
        max_restarts = worker_group.spec.max_restarts
        restart = max_restarts - agent._remaining_restarts + 1
        found = _failure(result.failures)
        what = found[0] if found else "a worker failed"
        # on a line of its own: rank 0's progress bar, cut short, leaves the cursor at its end
        print(f"\n{what}: torchrun starts every worker again (restart {restart} of {max_restarts})",
              file=sys.stderr, flush=True)
        return result

    return wrapper


def _failure(failures: dict) -> Optional[Tuple[str, int, bool]]:
    """What ended the workers, from torchrun's ``{rank: ProcessFailure}``: (what happened, the exit status that
    says it, whether a worker crashed), or None if each was ended by torchrun after another one failed.

    The first worker killed by a signal N (status 128 + N); else lost connections alone (status 1); else the
    first worker that exited with a status of its own.
    """
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and not _is_consequence(f)}
    crashed = {r: f for r, f in failures.items() if f.exitcode >= 0 and not _is_consequence(f)}
    lost = [f for f in failures.values() if isinstance(f.message, str) and f.message.startswith(LOST_PEER)]
    if killed:
        rank, failure = min(killed.items(), key=lambda item: (item[1].timestamp, item[0]))
        signum = -failure.exitcode
        name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
        return f"rank {rank} (pid {failure.pid}) was killed by {name}", 128 + signum, False
    if lost and not crashed:
        detail = lost[0].message[len(LOST_PEER):].split("):")[0].strip(" (")
        return f"the ranks lost their connection to each other ({detail})", 1, False
    if crashed:
        rank, failure = min(crashed.items(), key=lambda item: (item[1].timestamp, item[0]))
        return f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode}", failure.exitcode, True
    return None


def _is_consequence(failure: Any) -> bool:
    """A worker ended by torchrun because another one failed, or one that lost its connection to another."""
    return failure.exitcode in (-signal.SIGTERM, -STOP_OTHERS_SIGNAL) or (
        isinstance(failure.message, str) and failure.message.startswith(LOST_PEER))


def _exit_for_lost_rank(failures: dict, output_dir: Optional[str]) -> None:
    """Exit with one line if a worker was killed by a signal, or the workers lost each other; else return.

    ``failures``: torchrun's ``{rank: ProcessFailure}``; ``output_dir``: the
    folder the job held (:func:`~torchtune_ext.run.control.exits.record_output_dir`), None if it never did.
    A worker killed by signal N: exit 128 + N. Only lost connections (no
    worker killed, none crashed): exit 1. The line names the newest complete
    checkpoint in ``output_dir`` and the command that continues the run.
    """
    found = _failure(failures)
    if found is None or found[2]:  # a crash: torchrun's report, with the traceback, is what helps
        return
    what, status, _ = found
    if output_dir is None:
        where = "it stopped before it held its output_dir: start it again with the same command"
    else:
        # import weight: preemption loads torchtune's checkpointing, which only a lost worker's line needs, not
        # every start of the `tune` command (this module is imported then)
        from torchtune_ext.run.control.preemption import where_to_continue

        where = where_to_continue(output_dir, _launcher_resume_command())
    # on a line of its own: rank 0's progress bar, cut short, leaves the cursor at its end
    print(f"\nerror: {what}, and the job stopped; {where}  (exit status {status})", file=sys.stderr, flush=True)
    sys.exit(status)


def _launcher_resume_command() -> str:
    """The launcher's own command line (``tune run --nproc_per_node N ...``) with ``resume_from_checkpoint=true``."""
    args = [arg for arg in sys.argv[1:] if not arg.startswith("resume_from_checkpoint=")]
    return shlex.join(["tune", *args, "resume_from_checkpoint=true"])


def _is_report(message: Any) -> bool:
    return isinstance(message, str) and message.startswith("error:")


def _drop_reported_failure_log(record: Any) -> bool:
    """torchrun logs ``failed (exitcode: N) local_rank: ...`` before raising; the worker said it already
    (N of :data:`REPORTED_EXIT_CODES`), or the launcher's line will (a signal, N < 0). Nor, once rank 0 has
    recorded how the run ended, ``Sending process N closing signal SIGTERM`` as it ends the other workers, or
    ``Received 15 death signal`` (a signal during the cleanup of a finished run): those would follow the line
    that should be the last; nor ever ``Sending process N closing signal`` with :data:`STOP_OTHERS_SIGNAL`,
    which only says that a worker failed, as the line or report that follows does."""
    args = record.args if isinstance(record.args, tuple) else ()
    if str(record.msg).startswith("Sending process") and len(args) > 1 and str(args[1]) == STOP_OTHERS_SIGNAL.name:
        return False
    if str(record.msg).startswith(("Sending process", "Received")):
        return _recorded_outcome(os.environ.get(OUTCOME_FILE_ENV, "")) is None
    failed = str(record.msg).startswith("failed (exitcode") and args and isinstance(args[0], int)
    return not (failed and (args[0] in REPORTED_EXIT_CODES or args[0] < 0))
