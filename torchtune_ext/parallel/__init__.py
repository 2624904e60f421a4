"""Scale: the job's ranks as a device mesh, FSDP2 that sums gradients, tensor parallelism.

* :mod:`~torchtune_ext.parallel.mesh`: the process group, the ``dp`` x ``tp`` device mesh, per-rank seeds;
* :mod:`~torchtune_ext.parallel.fsdp`: FSDP2 sharding per decoder layer, gradients summed over ranks;
* :mod:`~torchtune_ext.parallel.tensor_parallel`: torchtune decoders' plans, their checks, applying them;
* :mod:`~torchtune_ext.parallel.lora`: a LoRA linear takes the split of its base;
* :mod:`~torchtune_ext.parallel.hf_plan`: a transformers model's own ``tp_plan``.

Whole state dicts of a sharded model (gathered for a save, split on load) are
the checkpoint package's (:mod:`torchtune_ext.checkpoint.state_dict`); they
are re-exported here for code written against ``torchtune_ext.distributed``,
the module these came from.
"""

from torchtune_ext.checkpoint.state_dict import (
    gather_full_model_state_dict,
    gather_full_optimizer_state_dict,
    gather_rng_states,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from torchtune_ext.parallel.fsdp import shard_model
from torchtune_ext.parallel.mesh import (
    Parallelism,
    build_parallelism,
    destroy_process_group,
    init_process_group,
    seed_data_parallel_rank,
)
from torchtune_ext.parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, tensor_parallel_plan

__all__ = [
    "Parallelism",
    "apply_tensor_parallel",
    "build_parallelism",
    "check_tensor_parallel",
    "destroy_process_group",
    "gather_full_model_state_dict",
    "gather_full_optimizer_state_dict",
    "gather_rng_states",
    "init_process_group",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "seed_data_parallel_rank",
    "shard_model",
    "tensor_parallel_plan",
]
