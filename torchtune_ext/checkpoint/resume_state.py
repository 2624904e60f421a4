"""``recipe_state.pt``: what a checkpoint holds besides the model, and reading it back."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torchtune import training

from torchtune_ext.checkpoint.discovery import RECIPE_STATE, intact_before, verify_checkpoint
from torchtune_ext.checkpoint.progress import Progress
from torchtune_ext.checkpoint.sharded import SHARDED_FORMAT
from torchtune_ext.errors import ConfigError
from torchtune_ext.text import short


@dataclass
class ResumeState:
    """What a checkpoint holds besides the model: all a run needs to continue exactly.

    The one definition of ``recipe_state.pt``: :meth:`CheckpointManager.save`
    writes it, :func:`load_recipe_state` reads it back.

    Attributes:
        progress (Progress): step counters and data position.
        optimizer (dict or None): the full (unsharded) optimizer state dict; None in a sharded checkpoint.
        rng_by_rank (list): :func:`rng_state` of every rank, in rank order.
        dp_world_size (int): data-parallel ranks of the run that wrote it.
        config (dict or None): the resolved config of the run that wrote it
            (None in checkpoints of earlier versions).
        path (Path or None): the checkpoint folder it was read from, for messages.
        run_dir (str or None): the working directory of the run that wrote it, against which its
            config's relative paths are taken (None in checkpoints of earlier versions).
        sharded (bool): a sharded checkpoint: the model and optimizer state are
            in its ``dcp/`` shards (:mod:`torchtune_ext.checkpoint.sharded`),
            and ``optimizer`` is None.

    The LR scheduler is not saved: a resumed run builds it from its config
    and advances it to ``progress.step`` (:mod:`torchtune_ext.run.resume`).
    """

    progress: Progress
    optimizer: Dict[str, Any]
    rng_by_rank: List[Dict[str, Any]]
    dp_world_size: int = 1
    config: Optional[Dict[str, Any]] = None
    path: Optional[Path] = None
    sharded: bool = False
    run_dir: Optional[str] = None

    @property
    def saved_total_steps(self) -> int:
        """The run's total optimizer steps when it was saved (its LR schedule length; 0: unknown)."""
        return self._saved_total_steps

    def __post_init__(self) -> None:
        self._saved_total_steps = self.progress.total_steps  # the recipe plans the progress anew

    def rng_for(self, rank: int, world_size: int) -> Dict[str, Any]:
        """The RNG states rank ``rank`` of a ``world_size``-rank run continues with.

        Its own when the checkpoint was written by as many ranks; otherwise
        rank 0's, so the run continues, though random draws such as dropout
        masks then differ from an uninterrupted run.
        """
        if len(self.rng_by_rank) == world_size:
            return self.rng_by_rank[rank]
        return self.rng_by_rank[0]


def load_recipe_state(path: Path) -> ResumeState:
    """Verify a checkpoint folder and load its ``recipe_state.pt``.

    Args:
        path: the checkpoint folder.

    Returns:
        :class:`ResumeState`. Restore its RNG states (:meth:`ResumeState.rng_for`,
        :func:`set_rng_state`) once setup is done: building a model draws
        random numbers for weight init, and dropout draws more in training.

    Raises:
        ConfigError: if the folder does not match its manifest.
    """
    verify_checkpoint(path)
    try:
        state = torch.load(path / RECIPE_STATE, map_location="cpu", weights_only=False)
        return ResumeState(
            # before data_seed was saved, the order followed the run's seed
            progress=Progress(**{"data_seed": state["progress"]["seed"], **state["progress"]}),
            optimizer=state[training.OPT_KEY],
            rng_by_rank=state.get("rng_by_rank") or [state["rng"]],
            dp_world_size=state.get("dp_world_size", 1),
            config=state.get("config"),
            path=path,
            sharded=state.get("format") == SHARDED_FORMAT,
            run_dir=state.get("run_dir"),
        )
    except Exception as err:
        raise ConfigError("resume_from_checkpoint", f"'{path / RECIPE_STATE}' cannot be read ({short(err)})."
                          + intact_before(path)) from err
