"""What the distributed recipes share: process group, FSDP2 sharding, full state dicts.

Sharding is data parallel only (one ``dp`` mesh dimension over all ranks).
FSDP2 normally *averages* gradients over ranks; :func:`shard_model` makes it
*sum* them instead, because :mod:`torchtune_ext.step` already divides each
rank's local summed loss by the *global* token count of the step:

    grad = d/dθ  Σ_ranks local_summed_loss_r / global_num_tokens
         = Σ_ranks  grad_r

so the summed gradient is exactly the gradient of the global step loss, and no
gradient is rescaled after backward. The reduction stays a plain SUM (no
``PREMUL_SUM``), which gloo supports, so the same code runs on CPU (gloo) and
CUDA (nccl).

Checkpoints are written in the single-device format: every rank takes part
in gathering the full state dicts, rank 0 receives them (on CPU) and writes.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.nn.modules.module import _IncompatibleKeys
from torchtune import training

from torchtune_ext import ranks
from torchtune_ext.checkpoint import rng_state
from torchtune_ext.errors import ConfigError
from torchtune_ext.upstream import first_mismatch


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
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return ranks.rank(), ranks.process_group_size()


def _is_layer(name: str) -> bool:
    """``layers.<i>`` at any depth: one FSDP unit per transformer block."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()


def shard_model(
    model: nn.Module, device: torch.device, *, cpu_offload: bool = False, reshard_after_forward: bool = True,
    custom_sharded_layers: Optional[List[str]] = None, is_block: Optional[Callable[[str, nn.Module], bool]] = None,
) -> List[FSDPModule]:
    """Shard ``model`` in place with FSDP2, summing (not averaging) gradients.

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
            (:func:`torchtune_ext.hf.shard_model`).

    Returns:
        The FSDP units, root last.

    Raises:
        ValueError: if the model has no transformer block.
        ConfigError: (key ``custom_sharded_layers``) a name that is not a module of the model.
    """
    mesh = init_device_mesh(device.type, (ranks.process_group_size(),), mesh_dim_names=("dp",))
    kwargs: Dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
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
    from torchtune.modules import TiedLinear

    if "tok_embeddings" in custom and isinstance(getattr(model, "output", None), TiedLinear):
        raise ConfigError("custom_sharded_layers", "tok_embeddings is tied to the output projection in this model "
                          "and must stay in the root FSDP unit; remove it from the list")
    # children before their parents, as fully_shard needs (named_modules lists parents first)
    blocks = [m for n, m in reversed(list(modules.items()))
              if n and (is_block(n, m) or n in custom) and any(True for _ in m.parameters())]
    # The root (embeddings, final norm, output projection) stays unsharded from
    # forward to backward: the loss applies the output projection after the
    # root's forward and again in backward when it recomputes
    # (torchtune_ext.loss.SummedCrossEntropyLoss.take_output_projection), and
    # backward needs these weights first anyway (FSDP2's own default for the root).
    root_kwargs = {**kwargs, "reshard_after_forward": False}
    units = [fully_shard(m, **kwargs) for m in blocks] + [fully_shard(model, **root_kwargs)]
    for unit in units:
        # The step loss is already divided by the global token count: sum over
        # ranks, and keep the collective a plain SUM (gloo has no PREMUL_SUM).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units


def load_full_model_state_dict(
    model: nn.Module,
    full_state_dict: Dict[str, torch.Tensor],
    device: torch.device,
    *,
    cpu_offload: bool = False,
    strict: bool = True,
    source: str = "the checkpoint",
    model_name: Optional[str] = None,
) -> Any:
    """Load an unsharded state dict (e.g. from the HF checkpointer) into a sharded model.

    Every rank passes the full state dict (torchtune checkpointers load it on
    every rank); rank 0's values are broadcast and each rank keeps its shard.
    Non-persistent buffers (the RoPE cache) are rebuilt on ``device`` first,
    since a model built on the meta device has none.

    Args:
        strict: False loads a subset (LoRA: base weights, then the adapter);
            the caller checks the returned keys.
        source: where the weights came from, for error messages.
        model_name: the configured model (:func:`torchtune_ext.upstream.describe_model`);
            when given, a misfit names it and the first mismatching key
            (:func:`torchtune_ext.upstream.first_mismatch`).

    Returns:
        ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict``.

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) if a key (strict)
            or a shape of the state dict does not fit the model.
        RuntimeError: if a parameter or buffer is still on the meta device afterwards.
    """
    model_state = model.state_dict()
    mismatch = first_mismatch(model_state, full_state_dict) if model_name else None
    if mismatch:
        raise ConfigError("checkpointer.checkpoint_dir", f"the weights in '{source}' do not fit the model "
                          f"{model_name}: {mismatch}. Check that `model` and checkpointer.model_type match the "
                          "checkpoint's architecture.")
    expected = set(model_state)
    unexpected = [key for key in full_state_dict if key not in expected]
    try:
        if strict and unexpected:
            raise RuntimeError(f"Unexpected key(s) in state_dict: {', '.join(unexpected[:5])}")
        with device:
            for module in model.modules():
                if hasattr(module, "rope_init"):
                    module.rope_init()
        # torchtune's loader fails on keys the model lacks: report them instead
        known = {k: v for k, v in full_state_dict.items() if k in expected}
        keys = training.load_from_full_model_state_dict(model, known, device, strict=strict, cpu_offload=cpu_offload)
    except RuntimeError as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines()[:4] if line.strip())
        raise ConfigError(
            "checkpointer.checkpoint_dir",
            f"the weights in '{source}' do not fit the configured model ({detail}). "
            "Check that `model` matches the checkpoint's architecture.",
        ) from err
    training.validate_no_params_on_meta_device(model)
    return _IncompatibleKeys(list(keys.missing_keys), list(keys.unexpected_keys) + unexpected)


def gather_full_model_state_dict(model: nn.Module, device: torch.device) -> Dict[str, torch.Tensor]:
    """All ranks gather; rank 0 gets the full state dict on CPU, other ranks ``{}``."""
    return training.gather_cpu_state_dict(model, is_rank_zero=ranks.is_rank_zero(), device=device)


def gather_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """All ranks gather; rank 0 gets the unsharded optimizer state (keyed by parameter name), others ``{}``."""
    return training.get_full_optimizer_state_dict(model, optimizer, is_rank_zero=ranks.is_rank_zero())


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, full_state_dict: Dict[str, Any], device: torch.device
) -> None:
    """Shard an optimizer state saved by :func:`gather_full_optimizer_state_dict` into ``optimizer``."""
    training.load_from_full_optimizer_state_dict(model, optimizer, full_state_dict, device)


def gather_rng_states() -> Optional[List[Dict[str, Any]]]:
    """Every rank's RNG states (:func:`torchtune_ext.checkpoint.rng_state`) in rank order, on rank 0.

    Ranks draw different random numbers (torchtune seeds rank ``r`` with
    ``seed + r``; dropout), so an exact resume needs each rank's own state,
    not only rank 0's (:class:`torchtune_ext.checkpoint.ResumeState`). Other ranks get None.
    """
    states = [None] * ranks.process_group_size()
    dist.all_gather_object(states, rng_state())
    return states if ranks.is_rank_zero() else None


def destroy_process_group() -> None:
    """Leave the process group (after the last collective), if one was joined."""
    if ranks.in_process_group():
        dist.destroy_process_group()
