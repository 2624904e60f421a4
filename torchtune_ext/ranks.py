"""Which process this is in the job: the one place that asks torch.distributed or torchrun's variables.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
in every worker before any process group exists (the config is checked, and
an error line printed once, before the recipe joins the group); a process
group, once joined, gives the same numbers. A plain process has neither, and
is rank 0 of 1. Collectives of tensors stay with the code that needs them;
before one, ask :func:`several_processes` (the process group, not the
environment: a collective needs a group). Two small collectives of Python
objects are here, for the code that agrees on a decision over all ranks:
:func:`from_rank_zero` and :func:`from_every_rank`.

Nothing heavy is imported: ``torch.distributed`` is consulted only once
something else has imported it (before that, no process group can exist).
"""

import os
import sys
from typing import Any, List, Optional


def _dist() -> Any:
    """``torch.distributed`` with a process group initialized, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value else None


def launched_by_torchrun() -> bool:
    """Whether torchrun (``tune run --nproc_per_node N``) started this process: it gives a rank to join with."""
    return "RANK" in os.environ


def torchrun_restart() -> int:
    """How many times torchrun has started this job's workers again (``--max-restarts``): 0 on the first start,
    and outside torchrun. torchrun counts per node, so nodes of one job may differ."""
    return _env_int("TORCHELASTIC_RESTART_COUNT") or 0


def in_process_group() -> bool:
    """Whether this process has joined a process group (collectives can run)."""
    return _dist() is not None


def rank() -> int:
    """This process's global rank: torchrun's ``RANK``, else the process group's, else 0."""
    from_env = _env_int("RANK")
    if from_env is not None:
        return from_env
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def is_rank_zero() -> bool:
    """Whether this process speaks for the job (prints, writes shared files): global rank 0."""
    return rank() == 0


def world_size() -> int:
    """Processes of the job: torchrun's ``WORLD_SIZE``, else the process group's size, else 1."""
    from_env = _env_int("WORLD_SIZE")
    if from_env is not None:
        return from_env
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def process_group_size(group: Any = None) -> int:
    """Ranks in ``group`` (default: the whole job's group) once a process group exists, else 1."""
    dist = _dist()
    return dist.get_world_size(group) if dist is not None else 1


def several_processes(group: Any = None) -> bool:
    """Whether a collective over ``group`` (default: the job's) involves other processes."""
    return process_group_size(group) > 1


def local_rank() -> Optional[int]:
    """This worker's rank on its host (torchrun's ``LOCAL_RANK``); None outside torchrun."""
    return _env_int("LOCAL_RANK")


def local_world_size() -> Optional[int]:
    """The job's processes on this host (torchrun's ``LOCAL_WORLD_SIZE``); None outside torchrun."""
    return _env_int("LOCAL_WORLD_SIZE")


def from_rank_zero(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank of ``group`` (a collective; itself without a process group)."""
    dist = _dist()
    if not several_processes(group):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def from_every_rank(value: Any, group: Any = None) -> List[Any]:
    """Every rank's ``value``, in rank order, on every rank of ``group`` (a collective)."""
    dist = _dist()
    if not several_processes(group):
        return [value]
    values = [None] * process_group_size(group)
    dist.all_gather_object(values, value, group=group)
    return values
