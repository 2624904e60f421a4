"""The job's ranks: the process group, and the device mesh that splits them into data- and tensor-parallel groups.

The ranks form a device mesh (:func:`build_parallelism`): one ``dp`` dimension
over all ranks (data parallel only), or ``dp`` x ``tp`` with
``tensor_parallel_dim: T`` (N/T data-parallel groups of T tensor-parallel
ranks; the ranks of a tensor-parallel group are neighbours, so on several
nodes each group stays inside a node when T divides the GPUs per node).

The ranks of one tensor-parallel group see the same samples: their tokens
are counted once, which is why the count, the summed loss and the metrics are
reduced over the ``dp`` dimension only (:attr:`Parallelism.dp_group`).
"""

import os
import random
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ParallelStyle
from torchtune import training
from torchtune.utils import get_logger

from torchtune_ext import ranks
from torchtune_ext.config import check_tensor_parallel_dim

log = get_logger()


def init_process_group(device: torch.device, cpu_offload: bool = False) -> Tuple[int, int]:
    """Join the job's process group: gloo on CPU, nccl on CUDA.

    Under ``torchrun`` (``tune run --nproc_per_node N ...``) the rank, world
    size and rendezvous come from the environment, so multi-node jobs only
    need torchrun's own flags. Started without torchrun, the process forms a
    group of one, so the distributed recipe also runs as a plain process.

    Args:
        device: this rank's device (``cuda:<LOCAL_RANK>`` or ``cpu``).
        cpu_offload: FSDP CPU offload keeps sharded parameters and gradients on
            CPU, so collectives on CPU tensors (grad norm) need gloo next to nccl.

    Returns:
        (rank, world_size) in the default group.
    """
    backend = training.get_distributed_backend(device.type, offload_ops_to_cpu=cpu_offload and device.type != "cpu")
    if not ranks.in_process_group():
        if ranks.launched_by_torchrun():
            _warn_of_a_shared_store_on_restart()
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return ranks.rank(), ranks.process_group_size()

def _warn_of_a_shared_store_on_restart() -> None:
    """Say why a restarted job may hang: workers that torchrun started again in its agent's shared store.

    ``tune run`` turns the sharing off
    (:data:`torchtune_ext.run.control.launcher.SHARED_STORE_OFF_ENV`); a plain
    ``torchrun --max-restarts`` keeps it, and a restarted rank can then wait
    forever for an address of the attempt before.
    """
    restart = ranks.torchrun_restart()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart and ranks.is_rank_zero():
        log.warning("torchrun restarted the workers (restart %s) in the store of their first start: if the job "
                    "hangs here, launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment (tune run "
                    "sets it), pytorch/pytorch#135712", restart)

@dataclass(frozen=True)
class Parallelism:
    """How the job's ranks split the work: the device mesh, and the tensor-parallel plan when it has a ``tp`` dimension.

    Attributes:
        mesh: ``("dp",)`` over all ranks, or ``("dp", "tp")`` of shape
            ``(world_size / T, T)``: rank ``r`` is data-parallel rank
            ``r // T`` and tensor-parallel rank ``r % T``.
        tensor_parallel_plan: module name pattern -> torch ``ParallelStyle``
            (:func:`tensor_parallel_plan`); None without a ``tp`` dimension,
            or for a transformers model's own plan (applied by
            :func:`torchtune_ext.model.hf.shard_model`).
    """

    mesh: DeviceMesh
    tensor_parallel_plan: Optional[Dict[str, ParallelStyle]] = None

    @property
    def tp_size(self) -> int:
        """Ranks of one tensor-parallel group (1: data parallel only)."""
        return self.mesh["tp"].size() if "tp" in (self.mesh.mesh_dim_names or ()) else 1

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        """This rank's tensor-parallel group as a 1-D mesh; None without tensor parallelism."""
        return self.mesh["tp"] if self.tp_size > 1 else None

    @property
    def dp_mesh(self) -> DeviceMesh:
        """This rank's data-parallel group as a 1-D mesh (FSDP2 shards over it)."""
        return self.mesh["dp"]

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: groups that see different samples (world size / ``tp_size``)."""
        return self.dp_mesh.size()

    @property
    def dp_rank(self) -> int:
        """Which share of each step's samples this rank takes (the same on every rank of a tensor-parallel group)."""
        return self.dp_mesh.get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The process group the token count, the summed loss and the metrics are reduced over."""
        return self.dp_mesh.get_group()

def build_parallelism(device: torch.device, tensor_parallel_dim: int = 1,
                      tensor_parallel_plan: Optional[Dict[str, ParallelStyle]] = None) -> Parallelism:
    """The job's device mesh, after :func:`init_process_group`.

    Args:
        device: this rank's device; its type names the mesh.
        tensor_parallel_dim: ranks per tensor-parallel group (the config key);
            1: a ``("dp",)`` mesh over all ranks.
        tensor_parallel_plan: the plan to apply (:func:`tensor_parallel_plan`);
            None with ``tensor_parallel_dim > 1``: the model's own (transformers models).

    Raises:
        ConfigError: (key ``tensor_parallel_dim``) it does not divide the
            number of ranks (:func:`torchtune_ext.config.check_tensor_parallel_dim`).
    """
    world_size = ranks.process_group_size()
    check_tensor_parallel_dim(tensor_parallel_dim, world_size)
    if tensor_parallel_dim == 1:
        return Parallelism(init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",)))
    mesh = init_device_mesh(device.type, (world_size // tensor_parallel_dim, tensor_parallel_dim),
                            mesh_dim_names=("dp", "tp"))
    return Parallelism(mesh, None if tensor_parallel_plan is None else dict(tensor_parallel_plan))

def seed_data_parallel_rank(seed: int, parallelism: Parallelism) -> None:
    """Seed every generator with ``seed + dp_rank`` under tensor parallelism.

    torchtune's ``set_seed`` gives rank ``r`` the seed ``seed + r``. The ranks
    of one tensor-parallel group compute the same activations outside the
    split layers, so whatever they draw there (dropout) must be the same on
    each: they share their data-parallel rank's seed. Does nothing without
    tensor parallelism.
    """
    if parallelism.tp_size == 1:
        return
    local = seed + parallelism.dp_rank
    torch.manual_seed(local)  # CUDA's generators too
    random.seed(local)
    np.random.seed(local)

def destroy_process_group() -> None:
    """Leave the process group (after the last collective), if one was joined."""
    if ranks.in_process_group():
        dist.destroy_process_group()
