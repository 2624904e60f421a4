"""A saved checkpoint as a W&B model artifact (``metric_logger.log_model``, as Hugging Face's ``WANDB_LOG_MODEL``).

Only a checkpoint that is complete (its manifest written, its folder renamed
into place) and whose files still match their manifest, SHA-256 included, is
logged: an artifact is what a user downloads later instead of the folder, so
it must never hold a partial or damaged one.
"""

from pathlib import Path

from torchtune import utils

from torchtune_ext.checkpoint.discovery import checkpoint_problem, step_of

log = utils.get_logger("INFO")  # torchtune's: the recipes show its lines


def artifact_name(run_id: str) -> str:
    """The run's model artifact: one name per W&B run, a version per checkpoint (as Hugging Face and Lightning)."""
    return f"model-{run_id}"


def log_checkpoint_artifact(folder: Path, *, final: bool) -> bool:
    """Log checkpoint ``folder`` to the active W&B run as an artifact of type ``model`` holding all its files.

    The artifact is named :func:`artifact_name`, with the aliases ``step_<N>`` and, for the run's final
    checkpoint, ``final`` (W&B adds ``latest``); its metadata give the step and the folder. W&B copies the
    files into its staging folder (``WANDB_DATA_DIR``) until they are uploaded (offline: by ``wandb sync``),
    so a checkpoint pruned later is still uploaded whole.

    Returns:
        bool: whether it was logged: not without an active W&B run, nor when the folder's files do not match
        its manifest (a warning says which file).

    Raises:
        OSError: copying the files failed (a full disk).
    """
    import wandb

    if wandb.run is None:
        return False
    problem = checkpoint_problem(folder, content=True)
    if problem is not None:
        log.warning("Not logged to W&B as a model artifact: %s", problem)
        return False
    artifact = wandb.Artifact(artifact_name(wandb.run.id), type="model",
                              metadata={"step": step_of(folder), "checkpoint": str(folder)})
    artifact.add_dir(str(folder))
    wandb.run.log_artifact(artifact, aliases=[folder.name] + (["final"] if final else []))
    return True
