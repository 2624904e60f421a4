"""How a recipe run ends: one line, a documented exit status (:mod:`torchtune_ext.errors`), once per job.

The recipes' ``recipe_main`` is torchtune's ``@config.parse`` function, run as::

    if __name__ == "__main__":
        exits.run_main(recipe_main)

:func:`run_main` wraps it in :func:`exit_on_user_error`, which sees the
command line *before* torchtune's ``config.parse`` reads it
(:func:`torchtune_ext.run.control.command_line.check_command_line`), and turns the
library's expected errors into one line and their exit status:
:class:`~torchtune_ext.errors.UserError` 2,
:class:`~torchtune_ext.errors.TrainingHealthError` 3,
:class:`~torchtune_ext.errors.CheckpointSaveError` 74. Anything else is a bug
or a crash and keeps its traceback.

Under ``torchrun`` (``tune run --nproc_per_node N``) every rank meets the same
bad input. Rank 0 prints the line; every rank also writes it to torchrun's
per-worker error file (``TORCHELASTIC_ERROR_FILE``), and rank 0 records the
status it ends with for the launcher (:func:`record_outcome`), which exits
with it (:mod:`torchtune_ext.run.control.launcher`).

Under ``tune run --nproc_per_node N``, a worker killed by a signal (the OOM
killer's or a user's SIGKILL) ends the job: the other workers end without a
traceback, and the launcher prints one line naming the rank, the signal, the
newest complete checkpoint and the command that continues the run, and exits
with 128 + the signal number (137 for SIGKILL): the status a single-process
run killed by that signal has, and the one a second SIGTERM gives. A job whose
workers lost their connection to each other with none of them killed exits 1,
with such a line too.

The workers end with their launcher, however it ends (:func:`end_with_launcher`,
Linux): torchrun starts each in a session of its own, so a launcher killed
with SIGKILL would otherwise leave them training as orphans, holding the
output folder. A checkpoint being written then is cut short in its staging
folder, never listed, so the newest complete one is where a resume starts.
"""

import ctypes
import functools
import json
import os
import re
import signal
import sys
import time
from typing import Any, Callable, List, Optional

from torchtune_ext import ranks
from torchtune_ext.config import command_line_keys
from torchtune_ext.errors import (
    EXIT_IO_ERROR,
    EXIT_TRAINING_FAILED,
    EXIT_USER_ERROR,
    LAUNCHER_PID_ENV,
    OUTCOME_FILE_ENV,
    CheckpointSaveError,
    TrainingHealthError,
    UserError,
)
from torchtune_ext.run.control.command_line import check_command_line

# What torchrun's launcher sends the workers still running once one has failed, instead of torchrun's SIGTERM:
# SIGTERM asks a worker to save a checkpoint and stop (torchtune_ext.run.control.preemption), which it cannot do
# with a rank gone, and it would say so first. No worker handles this one: its default action ends the worker at
# once, and the launcher tells such an end (a consequence) from the failure that caused it.
STOP_OTHERS_SIGNAL = signal.SIGRTMIN
# How a worker's error line starts when it lost the connection to another rank (also a consequence)
LOST_PEER = "error: lost the connection to another rank"


def write_line(text: str) -> None:
    """Write ``text`` as the run's last line of stderr: progress bars still open are closed first.

    A bar left open is closed when the process exits, and on a file or pipe
    (a SLURM log, ``| tee``) tqdm's closing redraw would then come after the
    line that says how the run ended. For the main thread (tqdm takes a
    lock); a signal handler writes with ``os.write`` instead.
    """
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    tqdm.write(text, file=sys.stderr)
    sys.stderr.flush()


def finish_wandb(status: int, quiet: bool = False) -> None:
    """End this process's W&B run, if any, as failed with ``status``.

    Otherwise W&B's exit hook ends it later and prints its run summary after
    the error line, which should be the last thing the user reads.
    ``quiet``: without W&B's summary, whose ``wandb sync <folder>`` would name
    a folder about to be removed (a setup that failed is rolled back).
    """
    wandb = sys.modules.get("wandb")  # imported only where a W&B logger was built
    if wandb is None or getattr(wandb, "run", None) is None:
        return
    try:
        if quiet:
            wandb.run._settings.quiet = True  # no public switch once the run has started (wandb 0.31)
    except Exception:
        pass
    try:
        wandb.finish(exit_code=status)
    except Exception:  # the error line matters more than W&B's bookkeeping
        pass


def record_outcome(status: int, every_node: bool = False) -> None:
    """Rank 0, after printing its last line: tell torchrun's launcher the exit status (see :data:`OUTCOME_FILE_ENV`).

    ``every_node``: a status every rank shares (a stop that all ranks agreed
    on, the end of training), which every rank calls this with: the first
    worker of each node tells its node's launcher too. Without it, a
    scheduler's SIGTERM to the launcher of a node without rank 0 would end
    that launcher with 143 while its workers saved and exited 75.

    Does nothing outside ``tune run --nproc_per_node``, or on other ranks.
    """
    path = os.environ.get(OUTCOME_FILE_ENV)
    if path and (ranks.is_rank_zero() or (every_node and ranks.local_rank() == 0)):
        try:
            with open(path, "w") as f:
                f.write(f"{status}\n")
        except OSError:  # the launcher falls back to torchrun's own report
            pass


def record_output_dir(path: str) -> None:
    """Once the job holds ``path`` (:class:`~torchtune_ext.run.control.run_lock.OutputDirLock`): tell this node's
    launcher.

    If a worker dies, the launcher's line names the newest complete
    checkpoint in it. The first worker of each node writes it (every node's
    launcher prints a line); nothing is done outside ``tune run --nproc_per_node``.
    """
    outcome = os.environ.get(OUTCOME_FILE_ENV)
    if outcome and ranks.local_rank() in (None, 0):
        try:
            with open(outcome + ".output_dir", "w") as f:
                f.write(os.path.abspath(path))
        except OSError:  # the launcher's line then names no checkpoint
            pass



def leave_for_launcher(message: str) -> None:
    """Write ``message`` to torchrun's per-worker error file, where its launcher reads a worker's failure.

    torchelastic names the file in ``$TORCHELASTIC_ERROR_FILE`` (absent
    without torchrun); the launcher reads ``{"message": ..., "timestamp": ...}``.
    A write that fails is skipped: the line was already printed or is a
    consequence of another rank's failure.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass


def report_and_exit(message: str, status: int) -> None:
    """Print ``message`` on rank 0, leave it for torchrun's launcher, and exit with ``status``.

    An active W&B run is finished first, as failed with ``status``, so that
    the message is the last line printed.
    """
    finish_wandb(status)
    if ranks.is_rank_zero():
        write_line(message)  # an error during training may come while the progress bar is drawn
        record_outcome(status)
    leave_for_launcher(message)
    sys.exit(status)


def run_main(recipe_main: Callable[[], Any]) -> None:
    """A recipe file's ``__main__``: run ``recipe_main`` and exit with its status, also on a late signal.

    ``recipe_main`` is run through :func:`exit_on_user_error` (unless it is
    wrapped already), so bad input ends it with one line and its exit status.

    Once the status is decided (0, or a reported 2, 3, 74 or 75), the
    interpreter still has to shut down: W&B's exit hooks can take seconds, and
    the signal handlers of :class:`torchtune_ext.run.control.preemption.GracefulStop` are
    gone by then. A SIGTERM or SIGINT in that window would end the process
    with 128 + signal, which a job script reads as a kill without a
    checkpoint. Here, during the exit hooks, it ends the process at once with
    the decided status; after them, when the interpreter puts the default
    handlers back in place of Python ones and tears its modules down (seconds
    with torch loaded), it is ignored.
    """
    import atexit

    end_with_launcher()
    decided: List[int] = []

    def ignore_late_signals() -> None:  # registered first, so it runs after the exit hooks registered later
        if decided:
            ignore_signals_while_exiting()  # the interpreter's finalization keeps SIG_IGN

    atexit.register(ignore_late_signals)
    if not getattr(recipe_main, "reports_user_errors", False):
        recipe_main = exit_on_user_error(recipe_main)
    try:
        status = recipe_main()
    except SystemExit as done:  # report_and_exit's
        status = done.code
    if isinstance(status, int) or status is None:
        decided.append(status or 0)

        def exit_now(signum: int, frame: Any) -> None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(decided[0])

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, exit_now)
    sys.exit(status)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_launcher() -> None:
    """A worker of ``tune run --nproc_per_node N``: end (SIGKILL) when the launcher does, however it ends.

    Linux's ``PR_SET_PDEATHSIG`` sends the signal when the thread that
    started this process ends; torchrun's agent starts its workers from the
    launcher's main thread, which ends only with the launcher. A launcher
    already gone by now (this runs after the recipe's imports) is seen as a
    parent other than the launcher, whose pid it gave in
    :data:`LAUNCHER_PID_ENV`. Elsewhere, or outside torchrun, nothing is done.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or ranks.local_rank() is None or not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != int(launcher) and not _running(int(launcher)):
        os._exit(128 + signal.SIGKILL)  # as if the signal had come: the launcher ended before it could


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process by now
        return True
    return True


# gloo's words when a peer's connection ends (NCCL's: ncclRemoteError): the peer died or cannot be reached
_LOST_PEER_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ncclRemoteError")


def _lost_peer(err: BaseException) -> Optional[str]:
    """gloo's (or NCCL's) short description of a lost connection to another rank in ``err`` or its causes."""
    if ranks.world_size() < 2:
        return None
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if isinstance(err, RuntimeError) and any(word in text for word in _LOST_PEER_WORDS):
            # "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer. This is..."
            return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0].strip()
        err = err.__cause__ or err.__context__
    return None


def _exit_lost_peer(detail: str) -> None:
    """A worker whose connection to another rank was lost: end quietly; the launcher says what happened.

    Under ``tune run`` the launcher names the rank that ended and the
    checkpoint to resume from; a worker knows neither, so it prints nothing
    there (rank 0 prints its line under plain torchrun) and leaves the line
    in its error file. It ends as torchrun's launcher ends the workers left
    once one has failed (:data:`STOP_OTHERS_SIGNAL`), which is what it is: a
    consequence, not the cause. Nothing is recorded as the run's outcome:
    that would stand in for the launcher's own line.
    """
    message = f"{LOST_PEER} ({detail}): another rank has ended or cannot be reached"
    finish_wandb(1, quiet=True)
    if ranks.is_rank_zero() and not os.environ.get(LAUNCHER_PID_ENV):
        write_line(message)
    leave_for_launcher(message)
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(STOP_OTHERS_SIGNAL, signal.SIG_DFL)
    os.kill(os.getpid(), STOP_OTHERS_SIGNAL)  # no teardown: it could wait on the lost rank


def exit_on_user_error(recipe_main: Callable[..., Any]) -> Callable[..., Any]:
    """Run a recipe's entry point; expected errors end it with one line and an exit status.

    Wrap torchtune's ``config.parse``-decorated ``recipe_main`` (see the
    module docstring): called without arguments, the command line is checked
    first (:func:`~torchtune_ext.run.control.command_line.check_command_line`), and its override keys are given to
    :func:`torchtune_ext.config.validate`, which refuses one that names no key
    of the recipe (:func:`torchtune_ext.config.command_line_keys`).

    * :class:`torchtune_ext.errors.UserError` (``ConfigError`` included):
      ``error: <message>``, exit status 2.
    * :class:`torchtune_ext.errors.TrainingHealthError`: ``error: training
      stopped: <message>``, exit status 3.
    * :class:`torchtune_ext.errors.CheckpointSaveError`: ``error:
      <message>``, exit status 74.
    * under torchrun, a lost connection to another rank (that rank died):
      quietly, as torchrun ends the other workers (:func:`_exit_lost_peer`).
    """
    @functools.wraps(recipe_main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            typed = check_command_line(sys.argv[1:]) if not args and not kwargs else []
            with command_line_keys(typed):
                return recipe_main(*args, **kwargs)
        except UserError as err:
            report_and_exit(f"error: {err}", EXIT_USER_ERROR)
        except TrainingHealthError as err:
            report_and_exit(f"error: training stopped: {err}", EXIT_TRAINING_FAILED)
        except CheckpointSaveError as err:
            report_and_exit(f"error: {err}", EXIT_IO_ERROR)
        except Exception as err:
            detail = _lost_peer(err)
            if detail is None:
                raise
            _exit_lost_peer(detail)

    wrapper.reports_user_errors = True
    return wrapper


def ignore_signals_while_exiting() -> None:
    """The exit status is decided: a SIGTERM or SIGINT from now on (a scheduler's repeats) changes nothing."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
