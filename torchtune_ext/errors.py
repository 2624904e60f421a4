"""Every exception of the library and every exit status of the recipes, in one module that imports nothing of ours.

Exit statuses of the recipes (the contract a job script reads):

* 0: trained to the end.
* 2 (:data:`EXIT_USER_ERROR`): bad input -- the command line, the config file,
  a config value, a data or checkpoint file (:class:`UserError`). Found before
  training where possible; the output folder is left as it was.
* 3 (:data:`EXIT_TRAINING_FAILED`): training went bad and was stopped
  (:class:`TrainingHealthError`: non-finite values, a gradient of zero, a
  diverging loss, non-finite parameters), or the run ended with its last step
  skipped as non-finite. The message names the last checkpoint from before
  the damage.
* 74 (:data:`EXIT_IO_ERROR`, ``EX_IOERR`` of ``sysexits.h``): a checkpoint, or
  another file of the run, could not be written during training (the disk
  filled up, or a write failed: :class:`CheckpointSaveError`); the partial
  checkpoint is removed, earlier ones are intact, and the message says how to
  go on.
* 75 (:data:`EXIT_STOPPED`, ``EX_TEMPFAIL``): stopped by SIGTERM or SIGINT
  after a checkpoint was saved; continue with ``resume_from_checkpoint=true``
  (:mod:`torchtune_ext.run.control.preemption`).

Each ends the run with one line on stderr (:mod:`torchtune_ext.run.control.exits`).
Anything else is a bug or a crash and keeps its traceback.

Only the standard library is imported here: the ``tune`` launcher, the asset
download and every layer of the library use these names.
"""

from typing import Optional

# The command that creates the bundled model, tokenizer and data (torchtune_ext.tools.download).
DOWNLOAD_COMMAND = "python -m torchtune_ext.download"

EXIT_USER_ERROR = 2
EXIT_TRAINING_FAILED = 3
# EX_IOERR of sysexits.h, "an error occurred while doing I/O on some file": a save failed
EXIT_IO_ERROR = 74
# EX_TEMPFAIL of sysexits.h, "a temporary failure; retry": a checkpoint was saved, resume to continue
EXIT_STOPPED = 75
# The statuses whose one line a worker has printed itself: the launcher adds no report of its own.
REPORTED_EXIT_CODES = (EXIT_USER_ERROR, EXIT_TRAINING_FAILED, EXIT_IO_ERROR, EXIT_STOPPED)

# Set by the launcher for its workers: rank 0 writes the exit status it ends with (and has said why)
# to this file (torchtune_ext.run.control.exits.record_outcome), so that the launcher exits with that
# status even when a scheduler's signal reached it too and torchrun's agent ended with its own
# SignalException, which carries no worker status: a stop (75), and also a stop whose save failed (74).
OUTCOME_FILE_ENV = "TORCHTUNE_EXT_OUTCOME_FILE"
# Set by the launcher for its workers: its pid; a worker ends when that process does
# (torchtune_ext.run.control.exits.end_with_launcher).
LAUNCHER_PID_ENV = "TORCHTUNE_EXT_LAUNCHER_PID"
# Set by the launcher for its workers: its own command line (``tune run ...``), from which a stopped
# job of several nodes says how to continue (torchtune_ext.run.control.preemption.resume_command).
LAUNCH_COMMAND_ENV = "TORCHTUNE_EXT_LAUNCH_COMMAND"


class UserError(ValueError):
    """An expected mistake in the command line, the config or an input file.

    The recipes print it as one line and exit with status 2
    (:func:`torchtune_ext.run.control.exits.exit_on_user_error`); the message says
    what is wrong and how to fix it.
    """


class ConfigError(UserError):
    """A config value is missing, of the wrong type or out of range.

    Args:
        key (str): dotted config key, e.g. ``gradient_accumulation_steps``.
        message (str): what is expected / how to fix it.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


class DiskSpaceError(ConfigError):
    """Not enough free space in ``output_dir`` for one checkpoint, found before training (key ``output_dir``)."""


class MissingAssetError(FileNotFoundError):
    """An asset the download command creates is not on disk.

    The message names every missing path and the command that creates it
    (:func:`torchtune_ext.data.assets.require_assets`).
    """


class ChecksumError(RuntimeError):
    """A downloaded archive does not have the sha256 recorded in :mod:`torchtune_ext.tools.download`."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written during training: the disk was full, or a write failed.

    The staging folder is removed and earlier checkpoints are intact; the
    message says which one to resume from, if any. The recipes exit with
    :data:`EXIT_IO_ERROR` (74).
    """


class OutputWriteError(CheckpointSaveError):
    """Another file of the run could not be written during training (the step's metrics): a full disk, a failing device.

    Training stops at once, without a checkpoint (the disk that refused a line of
    metrics would refuse one); the message names the newest checkpoint to resume
    from. A :class:`CheckpointSaveError`, so that the recipes exit alike, with 74.
    """


class TrainingHealthError(RuntimeError):
    """Training has gone bad and was stopped (:mod:`torchtune_ext.train.health`); the recipes exit with 3.

    Attributes:
        step (int): the optimizer step at which it was detected.
        suspect_from (int): the first optimizer step whose parameters are
            suspect; checkpoint ``step_<j>`` predates the damage iff ``j < suspect_from``.
    """

    def __init__(self, step: int, reason: str, suspect_from: int, advice: str = ""):
        self.step, self.suspect_from = step, suspect_from
        super().__init__(reason + advice)


class NonFiniteError(TrainingHealthError):
    """The loss or the gradient norm of an optimizer step is NaN or infinite."""

    def __init__(self, step: int, loss: float, grad_norm: float, advice: str = "",
                 suspect_from: Optional[int] = None):
        self.loss, self.grad_norm = loss, grad_norm
        super().__init__(step, f"non-finite values at optimizer step {step}: loss={loss}, grad_norm={grad_norm}",
                         step - 1 if suspect_from is None else suspect_from, advice)
