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

Module level imports stay in the standard library: the launcher imports this
module at start-up.
"""

import functools
import json
import os
import sys
import time
from typing import Any, Callable, List, Optional

EXIT_USER_ERROR = 2
EXIT_TRAINING_FAILED = 3
# EX_IOERR of sysexits.h, "an error occurred while doing I/O on some file": a save failed
EXIT_IO_ERROR = 74
# EX_TEMPFAIL of sysexits.h, "a temporary failure; retry": a checkpoint was saved, resume to continue
EXIT_STOPPED = 75
REPORTED_EXIT_CODES = (EXIT_USER_ERROR, EXIT_TRAINING_FAILED, EXIT_IO_ERROR, EXIT_STOPPED)
# Set by the launcher for its workers: rank 0 writes the exit status it ends with (and has said why)
# to this file (record_outcome), so that the launcher exits with that status even when a scheduler's
# signal reached it too and torchrun's agent ended with its own SignalException, which carries no
# worker status: a stop (75), and also a stop whose save failed (74).
OUTCOME_FILE_ENV = "TORCHTUNE_EXT_OUTCOME_FILE"


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

    from torchtune_ext.config import UserError

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


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


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
    if path and _rank() == 0:
        try:
            with open(path, "w") as f:
                f.write(f"{status}\n")
        except OSError:  # the launcher falls back to torchrun's own report
            pass


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
    if _rank() == 0:
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
    import signal

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
    """
    from torchtune_ext.checkpoint import CheckpointSaveError
    from torchtune_ext.config import UserError, command_line_keys
    from torchtune_ext.health import TrainingHealthError

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
    read from its error file, is printed. Other failures are reported by
    torchrun as usual.
    """
    import logging

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_drop_reported_failure_log)
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(_drop_reported_failure_log)

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import tempfile

        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        outcome_file = os.path.join(tempfile.gettempdir(), f"torchtune_ext_outcome_{os.getpid()}_{time.time_ns()}")
        os.environ[OUTCOME_FILE_ENV] = outcome_file
        try:
            return run(*args, **kwargs)
        except SignalException as err:
            status = _recorded_outcome(outcome_file)
            if status is not None:  # rank 0 said how the run ended (a stop, a save that failed, a second signal)
                sys.exit(status)
            # a signal before any worker said how it ends: torchrun's traceback adds nothing to the shell's status
            import signal

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
            if not reported or (first.exitcode >= 0 and first.exitcode not in REPORTED_EXIT_CODES):
                raise  # a crash (or a signal from outside): torchrun's report is what helps
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
            if os.path.exists(outcome_file):
                os.remove(outcome_file)

    return wrapper


def _ignore_signals_while_exiting() -> None:
    """The exit status is decided: a SIGTERM or SIGINT from now on (a scheduler's repeats) changes nothing."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def _is_report(message: Any) -> bool:
    return isinstance(message, str) and message.startswith("error:")


def _drop_reported_failure_log(record: Any) -> bool:
    """torchrun logs ``failed (exitcode: N) local_rank: ...`` before raising; the worker said it already.
    Nor, once rank 0 has recorded how the run ended, ``Sending process N closing signal SIGTERM`` as it
    ends the other workers, or ``Received 15 death signal`` (a signal during the cleanup of a finished run):
    those would follow the line that should be the last."""
    args = record.args if isinstance(record.args, tuple) else ()
    if str(record.msg).startswith(("Sending process", "Received")):
        return _recorded_outcome(os.environ.get(OUTCOME_FILE_ENV, "")) is None
    return not (str(record.msg).startswith("failed (exitcode") and args and args[0] in REPORTED_EXIT_CODES)
