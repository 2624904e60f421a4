"""FSDP2 sharding that sums gradients over the data-parallel ranks instead of averaging them.

FSDP2 normally *averages* gradients over ranks; :func:`shard_model` makes it
*sum* them instead, because :mod:`torchtune_ext.train.step` already divides each
rank's local summed loss by the *global* token count of the step:

    grad = d/dθ  Σ_dp-ranks local_summed_loss_r / global_num_tokens
         = Σ_dp-ranks  grad_r

so the summed gradient is exactly the gradient of the global step loss, and no
gradient is rescaled after backward. The reduction stays a plain SUM (no
``PREMUL_SUM``), which gloo supports, so the same code runs on CPU (gloo) and
CUDA (nccl).
"""

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle
from torchtune.modules import TiedLinear

from torchtune_ext.errors import ConfigError
from torchtune_ext.parallel.mesh import Parallelism, build_parallelism
from torchtune_ext.parallel.tensor_parallel import apply_tensor_parallel


def _is_layer(name: str) -> bool:
    """``layers.<i>`` at any depth: one FSDP unit per transformer block."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()

def shard_model(
    model: nn.Module, device: torch.device, *, cpu_offload: bool = False, reshard_after_forward: bool = True,
    custom_sharded_layers: Optional[List[str]] = None, is_block: Optional[Callable[[str, nn.Module], bool]] = None,
    parallelism: Optional[Parallelism] = None,
    tensor_parallel: Optional[Callable[[nn.Module, DeviceMesh, Optional[Dict[str, ParallelStyle]]], None]] = None,
) -> List[FSDPModule]:
    """Shard ``model`` in place with FSDP2, summing (not averaging) gradients; tensor parallel first if asked.

    Each transformer block becomes its own FSDP unit (parameters all-gathered
    just before it runs), then the root takes the rest (embeddings, final
    norm; a tied output projection shares the embedding weight, so it stays
    in the root unit with it). Works on a model on the meta device (load
    weights afterwards with :func:`load_full_model_state_dict`) or on a
    materialized one (its values are kept).

    Apply activation checkpointing and ``torch.compile`` before this.

    Args:
        model: a torchtune ``TransformerDecoder`` (full or LoRA).
        device: this rank's compute device; its type names the mesh.
        cpu_offload: keep sharded parameters, gradients and optimizer state
            on CPU (FSDP2 ``CPUOffloadPolicy``); the optimizer step runs on CPU.
        reshard_after_forward: free each block's gathered parameters after
            its forward and gather again in backward (less memory, more
            traffic). The root unit never reshards after forward (see below).
        custom_sharded_layers: names of further modules (as in
            ``model.named_modules()``, e.g. ``["tok_embeddings", "output"]``)
            that become FSDP units of their own, as torchtune's key of that
            name: their parameters are gathered only while they run (an
            output projection of its own is gathered again each time the loss
            applies it). A tied output projection has no parameters of its
            own and is skipped.
        is_block: ``(name, module) -> bool``, true for the transformer
            blocks; default: modules named ``layers.<i>`` (torchtune's
            decoders). transformers models pass their ``_no_split_modules``
            (:func:`torchtune_ext.model.hf.shard_model`).
        parallelism: the job's mesh (:func:`build_parallelism`); with a
            ``tp`` dimension the model is split by its plan first
            (:func:`apply_tensor_parallel`) and FSDP2 shards over ``dp``.
            None: a ``("dp",)`` mesh over all ranks.
        tensor_parallel: ``(model, tp_mesh, plan)`` splitting the model over
            the ``tp`` ranks; default :func:`apply_tensor_parallel` (torchtune's
            decoders); transformers models pass their own
            (:func:`torchtune_ext.parallel.hf_plan.apply_tensor_parallel`).

    Returns:
        The FSDP units, root last.

    Raises:
        ValueError: if the model has no transformer block.
        ConfigError: (key ``custom_sharded_layers``) a name that is not a module of the model.
    """
    parallelism = parallelism or build_parallelism(device)
    kwargs: Dict[str, Any] = {"mesh": parallelism.dp_mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        # Pinned host memory speeds host<->GPU copies; there is no GPU to pin for on CPU.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    modules = dict(model.named_modules())
    is_block = is_block or (lambda name, _module: _is_layer(name))
    if not any(is_block(n, m) for n, m in modules.items()):
        raise ValueError("shard_model: no transformer block found (torchtune: 'layers.<i>' submodules)")
    custom = list(custom_sharded_layers or [])
    unknown = [n for n in custom if n not in modules and n != "output"]  # a tied output is no module
    if unknown:
        raise ConfigError("custom_sharded_layers", f"the model has no module {unknown[0]!r} (names as in "
                          "model.named_modules(), e.g. tok_embeddings, output)")
    if "tok_embeddings" in custom and isinstance(getattr(model, "output", None), TiedLinear):
        raise ConfigError("custom_sharded_layers", "tok_embeddings is tied to the output projection in this model "
                          "and must stay in the root FSDP unit; remove it from the list")
    if parallelism.tp_mesh is not None:
        (tensor_parallel or apply_tensor_parallel)(model, parallelism.tp_mesh, parallelism.tensor_parallel_plan)
    # children before their parents, as fully_shard needs (named_modules lists parents first)
    blocks = [m for n, m in reversed(list(modules.items()))
              if n and (is_block(n, m) or n in custom) and any(True for _ in m.parameters())]
    # The root (embeddings, final norm, output projection) stays unsharded from
    # forward to backward: the loss applies the output projection after the
    # root's forward and again in backward when it recomputes
    # (torchtune_ext.train.loss.SummedCrossEntropyLoss.take_output_projection), and
    # backward needs these weights first anyway (FSDP2's own default for the root).
    root_kwargs = {**kwargs, "reshard_after_forward": False}
    units = [fully_shard(m, **kwargs) for m in blocks] + [fully_shard(model, **root_kwargs)]
    for unit in units:
        # The step loss is already divided by the global token count: sum over
        # ranks, and keep the collective a plain SUM (gloo has no PREMUL_SUM).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units
