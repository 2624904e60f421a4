"""Stop on SIGTERM or SIGINT without losing work.

SIGTERM is what SLURM, Kubernetes and spot-instance reclaims send before they
kill a job; SIGINT is Ctrl-C. On the first one the run finishes the optimizer
step in progress, saves a checkpoint, prints where it is and the command that
continues it, and exits with 75 (:data:`torchtune_ext.errors.EXIT_STOPPED`).
A second signal stops at once (exit ``128 + signal number``, the shell's
convention for "killed by a signal"), without saving; the last complete
checkpoint is intact.

Why 75: it is ``EX_TEMPFAIL`` of ``sysexits.h``, "a temporary failure; the
user is invited to retry". A job script can tell it from success (0), a
crash (1), a bad config (2) and a kill without a checkpoint (137 for SIGKILL,
143 for SIGTERM): 75 means "a checkpoint was saved; resume to continue".

Under ``tune run --nproc_per_node N`` the launcher exits 75 as well, without
torchrun's failure report (:func:`torchtune_ext.run.control.launcher.quiet_reported_failures`).

Under torchrun every rank must stop after the same optimizer step: saving
gathers the model from all ranks. Each rank checks before every step, and the
ranks agree with one all-reduce (MAX) of a one-element flag, so a signal that
reaches only some ranks stops all of them at the same step (measured cost:
``python -m bench.stop_flag``).

torchrun's agent forwards the signal it receives to its workers, and schedulers
signal every process of a job, so a worker often receives the same request
twice within milliseconds. A repeat within :data:`REPEAT_WINDOW_S` of the
first signal counts as the same request.
"""

import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from torchtune_ext import ranks
from torchtune_ext.checkpoint import latest_checkpoint
from torchtune_ext.errors import EXIT_STOPPED, LAUNCH_COMMAND_ENV
from torchtune_ext.run.control.exits import finish_wandb, record_outcome, write_line

REPEAT_WINDOW_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _say(text: str) -> None:
    # os.write, not print: a handler may run while the main thread is inside a print
    os.write(sys.stderr.fileno(), (text + "\n").encode())


def resume_command(argv: Optional[list] = None) -> str:
    """The command line that continues this run: the same one plus ``resume_from_checkpoint=true``.

    Args:
        argv: the recipe's ``sys.argv`` (under ``tune run``: the recipe path
            then its arguments); default ``sys.argv``.
    """
    argv = list(sys.argv if argv is None else argv)
    recipe, args = argv[0], [a for a in argv[1:] if not a.startswith("resume_from_checkpoint=")]
    launched = os.environ.get(LAUNCH_COMMAND_ENV)
    if launched and several_nodes():  # the launcher's own flags (rendezvous, nodes): the same on every node
        words = [w for w in shlex.split(launched) if not w.startswith("resume_from_checkpoint=")]
        return shlex.join(words + ["resume_from_checkpoint=true"])
    launcher = ["tune", "run"]
    nproc = ranks.local_world_size()
    if nproc is not None and ranks.world_size() > 1:
        launcher += ["--nproc_per_node", str(nproc)]
        if several_nodes():  # plain torchrun: its node and rendezvous flags are not known here
            launcher += ["--nnodes", str(ranks.world_size() // nproc)]
    if not recipe.endswith(".py") and "/" not in recipe:  # tune run passes a custom recipe as a module path
        recipe = recipe.replace(".", "/") + ".py"
    elif os.path.isabs(recipe):  # torchrun's workers get the file path
        recipe = os.path.relpath(recipe)
    return shlex.join(launcher + [recipe] + args + ["resume_from_checkpoint=true"])


def several_nodes() -> bool:
    """Whether this job's ranks span more than one node (torchrun's variables)."""
    nproc = ranks.local_world_size()
    return nproc is not None and ranks.world_size() > nproc


def continue_with(command: str) -> str:
    """``Continue with: <command>``; on several nodes, that it is to be run on each of them."""
    return f"Continue {'on every node ' if several_nodes() else ''}with: {command}"


def where_to_continue(output_dir: str, command: str) -> str:
    """After a run ended without saving: its newest complete checkpoint and ``command``, the one that continues it.

    A save cut short by that end is never listed: only complete checkpoints
    are (:func:`torchtune_ext.checkpoint.latest_checkpoint`).
    """
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        return "no checkpoint was saved yet: start again with the same command"
    return f"the last complete checkpoint is intact: {checkpoint}. {continue_with(command)}"


class GracefulStop:
    """Turns SIGTERM / SIGINT into a stop at the next optimizer-step boundary.

    Installs its handlers when created (from the main thread; elsewhere it
    installs none and never asks to stop) and puts the previous ones back
    on :meth:`close`.

    Args:
        device: the training device (the flag's all-reduce runs there).
        rank: this process's rank; only rank 0 prints.
        output_dir: the run's ``output_dir``; a second signal names its newest
            complete checkpoint and the command that continues from it.
    """

    def __init__(self, device: torch.device, rank: int = 0, output_dir: Optional[str] = None):
        self._device, self._rank, self._output_dir = device, rank, output_dir
        self._signal: Optional[int] = None
        self._first_at = 0.0
        self._exit_status: Optional[int] = None  # set once training has ended: only the cleanup is left
        self._previous: Dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self._exit_status is not None:  # training has ended (and a stop was said): only the cleanup is left
            if self._exit_status == 0 and self._rank == 0:
                _say(f"{name} received after training finished: exiting without the rest of the cleanup "
                     f"(the last checkpoint is complete; an offline W&B run may lack its summary)")
            os._exit(self._exit_status)  # torchrun also ends the ranks of a failed run this way
        if self._signal is None:
            self._signal, self._first_at = signum, now
            if self._rank == 0:
                _say(f"{name} received: stopping after the current optimizer step and saving a checkpoint "
                     f"(send it again to stop at once, without saving)")
        elif now - self._first_at > REPEAT_WINDOW_S:
            if self._rank == 0:
                _say(f"{name} received again: stopping at once, without saving; {self._where_to_continue()}")
                record_outcome(128 + signum)  # torchrun's launcher then exits with it, without a traceback
            os._exit(128 + signum)

    def _where_to_continue(self) -> str:
        if self._output_dir is None:
            return "the last complete checkpoint is intact"
        return where_to_continue(self._output_dir, resume_command())

    def requested(self) -> bool:
        """Whether to stop now; every rank gets the same answer (collective: call on all ranks)."""
        stop = self._signal is not None
        if ranks.several_processes():
            flag = torch.tensor([int(stop)], device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def stop(self, checkpoint: Optional[Path], step: int) -> int:
        """Report the stop after optimizer step ``step``; returns :data:`EXIT_STOPPED`.

        Args:
            checkpoint: the checkpoint just saved (or the one the run resumed
                from), None if the run stopped before its first step.
            step: optimizer steps completed.
        """
        finish_wandb(EXIT_STOPPED)  # W&B's summary before the line, not after it
        if self._rank == 0:  # the main thread, with the progress bar maybe still drawn
            cause = signal.Signals(self._signal).name if self._signal is not None else "a signal on another rank"
            if checkpoint is None:
                write_line(f"Stopped on {cause} before the first optimizer step: nothing to save, start again "
                           f"with the same command (exit status {EXIT_STOPPED})")
            else:
                write_line(f"Stopped on {cause} after optimizer step {step}; checkpoint: {checkpoint}. "
                           f"{continue_with(resume_command())}  (exit status {EXIT_STOPPED})")
        # for torchrun's launcher of every node, which the signal may have reached too
        record_outcome(EXIT_STOPPED, every_node=True)
        self._exit_status = EXIT_STOPPED
        if ranks.several_processes():
            dist.barrier()  # no rank exits (and makes torchrun stop the others) before this is said
        return EXIT_STOPPED

    def finished(self) -> int:
        """Training ran to its end; returns 0, the exit status.

        A signal from now on (during the cleanup: W&B's upload or summary can
        take seconds) ends the process with status 0 at once instead of
        asking for a stop that nothing would act on: the run's outcome is
        already decided, and a job script must not read it as a kill.
        """
        self._exit_status = 0
        # a signal to torchrun's launchers from now on must not turn this into a failure
        record_outcome(0, every_node=True)
        return 0

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
