"""Why a write failed: a full disk, another write error, or a bug; and the message that says how to go on.

A failed save or metrics write during training ends the run with exit
status 74 (:class:`~torchtune_ext.errors.CheckpointSaveError`); anything
else raised while saving is a bug and keeps its traceback.
"""

import errno
from pathlib import Path
from typing import Any, Optional

from torchtune_ext.checkpoint.discovery import latest_checkpoint, step_of
from torchtune_ext.errors import ConfigError, OutputWriteError
from torchtune_ext.text import short


def is_disk_full(err: BaseException) -> bool:
    """A full disk or quota, in ``err`` or what it was raised from (``__cause__``)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "StorageFull" in str(err):
            return True
        err = err.__cause__
    return False


# How writers that are not Python's file objects report a failed write: torch.save's
# PyTorchStreamWriter ("unexpected pos 576 vs 534", "basic_ios::clear: iostream error",
# "file write failed", "File ... cannot be opened.") and safetensors ("I/O error: File too
# large (os error 27)"; older versions "IoError(Os { ... })").
WRITE_FAILURES = ("unexpected pos", "iostream error", "PytorchStreamWriter failed", "file write failed",
                   "cannot be opened", "I/O error", "IoError(Os")


# torch.save and safetensors name no cause when a write stops short with room on the disk
WRITE_ADVICE = "find why a write stopped short (a file size limit such as ulimit -f, a failing device)"


def is_write_failure(err: BaseException) -> bool:
    """Did writing a file fail (a full disk, any ``OSError``: a file size limit, a read-only disk...)?

    Looks at ``err`` and what it was raised from (``__cause__``), not at an
    error it was raised while handling: anything else raised during a save is
    a bug and keeps its traceback.
    """
    if is_disk_full(err):
        return True
    while err is not None:
        if isinstance(err, OSError) or any(text in str(err) for text in WRITE_FAILURES):
            return True
        err = err.__cause__
    return False


def write_failed(what: str, output_dir: Any, err: OSError, step: Optional[int] = None,
                 finished: bool = False) -> OutputWriteError:
    """The error for a failed write of ``what`` during training, naming the checkpoint to resume from.

    Args:
        what: the file, e.g. ``"the metrics of step 7 to 'out/logs/metrics.jsonl'"``.
        output_dir: the run's output folder.
        err: the write's error (``errno.ENOSPC``: the disk is full).
        step: the last optimizer step trained.
        finished: the write came after the last step (the metric logger's closing
            writes): nothing is to be resumed, the newest checkpoint is the result.
    """
    full = is_disk_full(err)
    fix = "free some space" if full else "fix the cause"
    try:
        latest = latest_checkpoint(str(output_dir))
    except ConfigError:
        latest = None
    cause = "the disk is full" if full else short(err)
    if finished:
        kept = f"{latest} is complete" if latest is not None else "no checkpoint was saved"
        return OutputWriteError(f"writing {what} failed ({cause}) after training finished: {kept}, and every "
                                f"step's metrics are in {Path(output_dir) / 'logs' / 'metrics.jsonl'}; {fix}")
    after = f" after step {step}" if step is not None else ""
    if latest is None:
        then = f"no checkpoint of this run exists yet: {fix}, then start the run again"
    else:
        first = step_of(latest) + 1
        lost = ("" if step is None or first > step else f" (step {step} is trained again)" if first == step
                else f" (steps {first}-{step} are trained again)")
        then = f"resume from {latest}: {fix}, then continue with resume_from_checkpoint=true{lost}"
    return OutputWriteError(f"writing {what} failed ({cause}): training stopped{after}; {then}")
