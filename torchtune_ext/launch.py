"""How a recipe run ends on an expected error: one line, a documented exit status, once per job.

Exit statuses of the recipes:

* 0: trained to the end.
* 2 (:data:`EXIT_USER_ERROR`): bad input -- the command line, the config file,
  a config value, a data or checkpoint file. Found before training where
  possible; the output folder is left as it was.
* 3 (:data:`EXIT_TRAINING_FAILED`): training went bad and was stopped
  (:mod:`torchtune_ext.health`: non-finite values, a gradient of zero, a
  diverging loss, non-finite parameters), or the run ended with its last step
  skipped as non-finite. The message names the last checkpoint from before
  the damage.
* 74 (:data:`EXIT_IO_ERROR`, ``EX_IOERR`` of ``sysexits.h``): a checkpoint
  could not be written during training (the disk filled up, or a write
  failed); the partial checkpoint is removed, earlier ones are intact, and
  the message says how to go on
  (:class:`torchtune_ext.checkpoint.CheckpointSaveError`).
* 75 (:data:`EXIT_STOPPED`): stopped by SIGTERM or SIGINT after a checkpoint
  was saved; continue with ``resume_from_checkpoint=true``
  (:mod:`torchtune_ext.preemption`).

Under ``tune run --nproc_per_node N``, a worker killed by a signal (the OOM
killer's or a user's SIGKILL) ends the job: the other workers end without a
traceback, and the launcher prints one line naming the rank, the signal, the
newest complete checkpoint and the command that continues the run, and exits
with 128 + the signal number (137 for SIGKILL): the status a single-process
run killed by that signal has, and the one a second SIGTERM gives. A job whose
workers lost their connection to each other with none of them killed exits 1,
with such a line too.

Anything else is a bug or a crash and keeps its traceback.

The recipes' ``recipe_main`` is wrapped as::

    @launch.exit_on_user_error
    @config.parse
    def recipe_main(cfg): ...

so the wrapper sees the command line *before* torchtune's ``config.parse``
reads it: a missing config file, a YAML syntax error (with its line and
column), a flag other than ``--config`` or an override that torchtune cannot
apply become one line here instead of a traceback from the parser.

Under ``torchrun`` (``tune run --nproc_per_node N``) every rank meets the same
bad input. Rank 0 prints the line; every rank also writes it to torchrun's
per-worker error file (``TORCHELASTIC_ERROR_FILE``). In the launcher process
(the ``tune`` command), :func:`quiet_reported_failures` wraps torchrun's
``run``: when the first worker to fail exited with one of these statuses,
the launcher exits with the same status without its ``ChildFailedError``
report, printing the failing rank's line only when rank 0 did not print it.
``torchtune_ext._local_recipes`` installs that wrapper when the ``tune``
command imports ``torchtune._cli.run``.

The workers end with their launcher, however it ends (:func:`end_with_launcher`,
Linux): torchrun starts each in a session of its own, so a launcher killed
with SIGKILL would otherwise leave them training as orphans, holding the
output folder. A checkpoint being written then is cut short in its staging
folder, never listed, so the newest complete one is where a resume starts.

Module level imports stay in the standard library: the launcher imports this
module at start-up.
"""

import ctypes
import functools
import json
import os
import re
import shlex
import signal
import sys
import time
from typing import Any, Callable, List, Optional

from torchtune_ext import ranks
from torchtune_ext.errors import (
    EXIT_IO_ERROR,
    EXIT_TRAINING_FAILED,
    EXIT_USER_ERROR,
    LAUNCHER_PID_ENV,
    OUTCOME_FILE_ENV,
    REPORTED_EXIT_CODES,
    CheckpointSaveError,
    TrainingHealthError,
    UserError,
)

# What torchrun's launcher sends the workers still running once one has failed, instead of torchrun's SIGTERM:
# SIGTERM asks a worker to save a checkpoint and stop (torchtune_ext.preemption), which it cannot do with a rank
# gone, and it would say so first. No worker handles this one: its default action ends the worker at once, and
# the launcher tells such an end (a consequence) from the failure that caused it.
STOP_OTHERS_SIGNAL = signal.SIGRTMIN
# How a worker's error line starts when it lost the connection to another rank (also a consequence)
LOST_PEER = "error: lost the connection to another rank"


def _config_paths(argv: List[str]) -> List[str]:
    """Every ``--config`` file given, in order (torchtune's parser reads the last one: argparse's rule)."""
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def check_command_line(argv: List[str]) -> List[str]:
    """Check a recipe's command line the way torchtune's ``config.parse`` will read it.

    Args:
        argv: the arguments after the program name: ``--config <file>`` and
            ``key=value`` / ``~key`` overrides.

    Returns:
        the keys of the ``key=value`` overrides, in order (``optimizer.lr``).

    Raises:
        UserError: the config file is missing, not YAML (with line and
            column), or not a mapping; two different ``--config`` files
            (argparse would read the last only); an argument is a flag other than
            ``--config``, an override not of the form ``key=value``, or a
            ``~key`` that names no key of the file or a component (torchtune
            cannot remove those; ``key=null`` turns an optional one off).
    """
    import yaml
    from omegaconf import DictConfig, OmegaConf

    paths = _config_paths(argv)
    if not paths:
        return []  # torchtune's parser says that --config is required
    if len(set(paths)) > 1:  # a user may expect the files to be merged; argparse keeps the last one only
        raise UserError(f"--config is given {len(paths)} times ({', '.join(repr(p) for p in paths)}): only one "
                        f"file is read, not a merge; give one --config and key=value overrides")
    path = paths[-1]
    if not os.path.isfile(path):
        what = "is a directory, not a YAML file" if os.path.isdir(path) else "does not exist"
        raise UserError(f"--config '{path}' {what}")
    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as err:
        # the parser notices a typo where it expected something else, often on the next line:
        # the context's mark ("while parsing a flow sequence" at the '[') points back at it
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or str(err)
        if err.problem and err.context:
            started = err.context_mark
            elsewhere = started is not None and (started.line, started.column) != (mark.line, mark.column)
            at = f" at line {started.line + 1}, column {started.column + 1}" if elsewhere else ""
            problem += f" ({err.context}{at})"
        raise UserError(f"--config '{path}'{where}: {problem}") from None
    except Exception as err:  # unreadable, not text, an OmegaConf error
        raise UserError(f"--config '{path}' cannot be read: {type(err).__name__}: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise UserError(f"--config '{path}' must hold a mapping of config keys, not a list")

    skip, keys = False, []
    for i, arg in enumerate(argv):
        if skip or arg == "--config" or arg.startswith("--config="):
            skip = arg == "--config"
            continue
        if arg.startswith("-"):
            raise UserError(f"command line '{arg}': only --config <file> and key=value overrides are accepted")
        if arg.startswith("~"):
            key = arg[1:].split("=")[0]
            node = OmegaConf.select(loaded, key, default=_ABSENT)
            if node is _ABSENT:
                raise UserError(f"command line '{arg}': '{key}' is not a key of '{path}'")
            if "_component_" in key.split(".") or (isinstance(node, DictConfig) and "_component_" in node):
                raise UserError(f"command line '{arg}': '{key}' is a component, which torchtune cannot remove "
                                f"from the command line ({key}=null turns an optional component off)")
            continue
        if arg.count("=") != 1 or not arg.split("=")[0]:
            raise UserError(f"command line '{arg}': expected key=value" +
                            (" (torchtune's parser does not accept '=' inside a value)" if arg.count("=") > 1 else ""))
        keys.append(arg.split("=")[0])
    return keys


_ABSENT = object()


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


def record_outcome(status: int) -> None:
    """Rank 0, after printing its last line: tell torchrun's launcher the exit status (see :data:`OUTCOME_FILE_ENV`).

    Does nothing outside ``tune run --nproc_per_node`` or on other ranks.
    """
    path = os.environ.get(OUTCOME_FILE_ENV)
    if path and ranks.is_rank_zero():
        try:
            with open(path, "w") as f:
                f.write(f"{status}\n")
        except OSError:  # the launcher falls back to torchrun's own report
            pass


def record_output_dir(path: str) -> None:
    """Once the job holds ``path`` (:class:`torchtune_ext.run_lock.OutputDirLock`): tell this node's launcher.

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


def report_and_exit(message: str, status: int) -> None:
    """Print ``message`` on rank 0, leave it for torchrun's launcher, and exit with ``status``.

    An active W&B run is finished first, as failed with ``status``, so that
    the message is the last line printed.
    """
    finish_wandb(status)
    if ranks.is_rank_zero():
        write_line(message)  # an error during training may come while the progress bar is drawn
        record_outcome(status)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass
    sys.exit(status)


def run_main(recipe_main: Callable[[], Any]) -> None:
    """A recipe file's ``__main__``: run ``recipe_main`` and exit with its status, also on a late signal.

    Once the status is decided (0, or a reported 2, 3, 74 or 75), the
    interpreter still has to shut down: W&B's exit hooks can take seconds, and
    the signal handlers of :class:`torchtune_ext.preemption.GracefulStop` are
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
            _ignore_signals_while_exiting()  # the interpreter's finalization keeps SIG_IGN

    atexit.register(ignore_late_signals)
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
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(STOP_OTHERS_SIGNAL, signal.SIG_DFL)
    os.kill(os.getpid(), STOP_OTHERS_SIGNAL)  # no teardown: it could wait on the lost rank


def exit_on_user_error(recipe_main: Callable[..., Any]) -> Callable[..., Any]:
    """Run a recipe's entry point; expected errors end it with one line and an exit status.

    Wrap torchtune's ``config.parse``-decorated ``recipe_main`` (see the
    module docstring): called without arguments, the command line is checked
    first (:func:`check_command_line`), and its override keys are given to
    :func:`torchtune_ext.config.validate`, which refuses one that names no key
    of the recipe (:func:`torchtune_ext.config.command_line_keys`).

    * :class:`torchtune_ext.config.UserError` (``ConfigError`` included):
      ``error: <message>``, exit status 2.
    * :class:`torchtune_ext.health.TrainingHealthError`: ``error: training
      stopped: <message>``, exit status 3.
    * :class:`torchtune_ext.checkpoint.CheckpointSaveError`: ``error:
      <message>``, exit status 74.
    * under torchrun, a lost connection to another rank (that rank died):
      quietly, as torchrun ends the other workers (:func:`_exit_lost_peer`).
    """
    from torchtune_ext.config import command_line_keys

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

    return wrapper


def quiet_reported_failures(run: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap torchrun's ``run`` in the launcher: a job whose workers reported their own error exits quietly.

    When rank 0 recorded its exit status (:func:`record_outcome`: a stop, an
    expected error it printed, the end of training, a second signal), the
    launcher exits with that status, whether torchrun's agent raised
    ``ChildFailedError`` or, when a scheduler signalled the launcher too,
    ``SignalException``; a ``SignalException`` with no status recorded exits
    with 128 + signal number, in one line. Otherwise,
    when the first worker to fail exited with a status of
    :data:`REPORTED_EXIT_CODES`, the workers have printed the one line that
    matters (see :func:`report_and_exit`), and the launcher exits with that
    status instead of raising ``ChildFailedError`` (a traceback and a
    failure report); if rank 0 did not print it, the failing rank's line,
    read from its error file, is printed. When a worker was killed by a
    signal, or the workers lost their connection to each other, one line says
    so and names the newest complete checkpoint and the command that
    continues the run (:func:`_exit_for_lost_rank`). Other failures are
    reported by torchrun as usual.

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

        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        from torch.distributed.elastic.multiprocessing import api as elastic_api

        outcome_file = os.path.join(tempfile.gettempdir(), f"torchtune_ext_outcome_{os.getpid()}_{time.time_ns()}")
        os.environ[OUTCOME_FILE_ENV] = outcome_file
        launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        # PContext.close() without a signal, which torchrun calls only when a worker has failed, takes this one
        # (torch 2.x); if a later torch drops the function, the workers get SIGTERM as before
        default_signal = getattr(elastic_api, "_get_default_signal", None)
        if default_signal is not None:
            elastic_api._get_default_signal = lambda: STOP_OTHERS_SIGNAL
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
            _ignore_signals_while_exiting()
            for path in (outcome_file, outcome_file + ".output_dir"):
                if os.path.exists(path):
                    os.remove(path)
            if default_signal is not None:
                elastic_api._get_default_signal = default_signal
            if launcher_pid is None:
                os.environ.pop(LAUNCHER_PID_ENV, None)
            else:
                os.environ[LAUNCHER_PID_ENV] = launcher_pid

    return wrapper


def _is_consequence(failure: Any) -> bool:
    """A worker ended by torchrun because another one failed, or one that lost its connection to another."""
    return failure.exitcode in (-signal.SIGTERM, -STOP_OTHERS_SIGNAL) or (
        isinstance(failure.message, str) and failure.message.startswith(LOST_PEER))


def _exit_for_lost_rank(failures: dict, output_dir: Optional[str]) -> None:
    """Exit with one line if a worker was killed by a signal, or the workers lost each other; else return.

    ``failures``: torchrun's ``{rank: ProcessFailure}``; ``output_dir``: the
    folder the job held (:func:`record_output_dir`), None if it never did.
    A worker killed by signal N: exit 128 + N. Only lost connections (no
    worker killed, none crashed): exit 1. The line names the newest complete
    checkpoint in ``output_dir`` and the command that continues the run.
    """
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and not _is_consequence(f)}
    crashed = [f for f in failures.values() if f.exitcode >= 0 and not _is_consequence(f)]
    lost = [f for f in failures.values() if isinstance(f.message, str) and f.message.startswith(LOST_PEER)]
    if killed:
        rank, failure = min(killed.items(), key=lambda item: (item[1].timestamp, item[0]))
        signum = -failure.exitcode
        name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
        what, status = f"rank {rank} (pid {failure.pid}) was killed by {name}", 128 + signum
    elif lost and not crashed:
        detail = lost[0].message[len(LOST_PEER):].split("):")[0].strip(" (")
        what, status = f"the ranks lost their connection to each other ({detail})", 1
    else:
        return
    if output_dir is None:
        where = "it stopped before it held its output_dir: start it again with the same command"
    else:
        from torchtune_ext.preemption import where_to_continue  # torch: imported by torchrun's launcher already

        where = where_to_continue(output_dir, _launcher_resume_command())
    # on a line of its own: rank 0's progress bar, cut short, leaves the cursor at its end
    print(f"\nerror: {what}, and the job stopped; {where}  (exit status {status})", file=sys.stderr, flush=True)
    sys.exit(status)


def _launcher_resume_command() -> str:
    """The launcher's own command line (``tune run --nproc_per_node N ...``) with ``resume_from_checkpoint=true``."""
    args = [arg for arg in sys.argv[1:] if not arg.startswith("resume_from_checkpoint=")]
    return shlex.join(["tune", *args, "resume_from_checkpoint=true"])


def _ignore_signals_while_exiting() -> None:
    """The exit status is decided: a SIGTERM or SIGINT from now on (a scheduler's repeats) changes nothing."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


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
