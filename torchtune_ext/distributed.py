"""What the distributed recipes share: process group, device mesh, tensor parallelism, FSDP2, full state dicts.

The ranks form a device mesh (:func:`build_parallelism`): one ``dp`` dimension
over all ranks (data parallel only), or ``dp`` x ``tp`` with
``tensor_parallel_dim: T`` (N/T data-parallel groups of T tensor-parallel
ranks; the ranks of a tensor-parallel group are neighbours, so on several
nodes each group stays inside a node when T divides the GPUs per node).
Tensor parallelism (:func:`apply_tensor_parallel`) splits each layer's
weights over the ``tp`` ranks with torch's ``parallelize_module`` and a plan
(torchtune's ``base_llama_tp_plan`` by default); FSDP2 then shards what
remains over the ``dp`` ranks.

FSDP2 normally *averages* gradients over ranks; :func:`shard_model` makes it
*sum* them instead, because :mod:`torchtune_ext.step` already divides each
rank's local summed loss by the *global* token count of the step:

    grad = d/dθ  Σ_dp-ranks local_summed_loss_r / global_num_tokens
         = Σ_dp-ranks  grad_r

so the summed gradient is exactly the gradient of the global step loss, and no
gradient is rescaled after backward. The ranks of one tensor-parallel group
see the same samples: their tokens are counted once, which is why the count,
the summed loss and the metrics are reduced over the ``dp`` dimension only
(:attr:`Parallelism.dp_group`). The reduction stays a plain SUM (no
``PREMUL_SUM``), which gloo supports, so the same code runs on CPU (gloo) and
CUDA (nccl).

Checkpoints are written in the single-device format: every rank takes part
in gathering the full state dicts (``DTensor.full_tensor`` undoes both the
FSDP2 and the tensor-parallel split), rank 0 receives them (on CPU) and
writes; a load splits them again for whatever mesh the resumed run has, so a
tensor-parallel run resumes on data parallelism alone and back.
"""

import contextlib
import logging
import os
import random
import re
import warnings
from dataclasses import dataclass
from fnmatch import fnmatchcase
from math import gcd
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.nn.modules.module import _IncompatibleKeys
from torchtune import config as tt_config
from torchtune import training
from torchtune.modules import MultiHeadAttention, TiedLinear
from torchtune.utils import get_logger

from torchtune_ext import lora_parallel, ranks
from torchtune_ext.checkpoint import rng_state
from torchtune_ext.config import check_tensor_parallel_dim
from torchtune_ext.errors import ConfigError
from torchtune_ext.upstream import first_mismatch, model_family

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
    (:data:`torchtune_ext.control.launcher.SHARED_STORE_OFF_ENV`); a plain
    ``torchrun --max-restarts`` keeps it, and a restarted rank can then wait
    forever for an address of the attempt before.
    """
    restart = ranks.torchrun_restart()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart and ranks.is_rank_zero():
        log.warning("torchrun restarted the workers (restart %s) in the store of their first start: if the job "
                    "hangs here, launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment (tune run "
                    "sets it), pytorch/pytorch#135712", restart)


# ----------------------------------------------------------------- the mesh
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
            :func:`torchtune_ext.hf.shard_model`).
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


# ---------------------------------------------------------- tensor parallel
# The plan torchtune ships (its 70B configs name it as tensor_parallel_plan).
DEFAULT_TP_PLAN = "torchtune.models.llama3.base_llama_tp_plan"
# torchtune families whose decoders name their layers as Llama's (tok_embeddings,
# layers.<i>.attn.{q,k,v,output}_proj, layers.<i>.mlp.w1/w2/w3, output) and hold no weight
# that every head shares, so the Llama plan fits them; SmolLM2 (torchtune_ext.models) is llama3_2.
PLAN_FAMILIES = ("llama2", "code_llama2", "llama3", "llama3_1", "llama3_2", "llama3_3", "mistral", "qwen2",
                 "qwen2_5")


def tensor_parallel_plan(cfg_plan: Any, model_component: str) -> Optional[Dict[str, ParallelStyle]]:
    """The tensor-parallel plan a config asks for: its ``tensor_parallel_plan``, or the Llama plan for its family.

    A transformers model (``torchtune_ext.hf.*``) with no ``tensor_parallel_plan``
    gets None: its own ``tp_plan``, read off the built model
    (:mod:`torchtune_ext.hf.tensor_parallel`).

    Args:
        cfg_plan: the ``tensor_parallel_plan`` config node (a ``_component_``
            returning ``{module name pattern: ParallelStyle}``, as torchtune's
            ``base_llama_tp_plan``), or None.
        model_component: ``model._component_``, whose family decides the default.

    Raises:
        ConfigError: (key ``tensor_parallel_plan``) no plan is named and the
            model's family has none, or the component does not return a plan.
    """
    if cfg_plan is None:
        if model_component.startswith("torchtune_ext.hf."):
            return None
        family = model_family(model_component)
        if family not in PLAN_FAMILIES:
            raise ConfigError("tensor_parallel_plan", f"{model_component} has no tensor-parallel plan (the "
                              f"default, {DEFAULT_TP_PLAN}, fits the families {', '.join(PLAN_FAMILIES)}); "
                              "name one with tensor_parallel_plan._component_, or set tensor_parallel_dim=1")
        cfg_plan = OmegaConf.create({"_component_": DEFAULT_TP_PLAN})
    try:
        plan = tt_config.instantiate(cfg_plan)
    except Exception as err:  # noqa: BLE001 -- any builder error is the config's
        raise ConfigError("tensor_parallel_plan", f"{cfg_plan.get('_component_')} cannot build a plan: {err}") \
            from None
    if not isinstance(plan, dict) or not all(isinstance(v, ParallelStyle) for v in plan.values()):
        raise ConfigError("tensor_parallel_plan", f"{cfg_plan.get('_component_')} must return a dict of module "
                          "name patterns to torch ParallelStyle objects, as torchtune's base_llama_tp_plan does")
    return dict(plan)


def _plain_name(name: str) -> List[str]:
    """A module's name without the wrappers activation checkpointing and compiling put in."""
    return [part for part in name.split(".") if part not in ("_checkpoint_wrapped_module", "_orig_mod")]


def modules_matching(model: nn.Module, pattern: str) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` whose name fits ``pattern`` part by part (``*`` matches one part, e.g. a layer number)."""
    parts = pattern.split(".")
    found = []
    for name, module in model.named_modules():
        plain = _plain_name(name)
        if len(plain) == len(parts) and all(fnmatchcase(n, p) for n, p in zip(plain, parts)):
            found.append((name, module))
    return found


def tensor_parallel_fits(divisible: int, world_size: Optional[int] = None) -> str:
    """What to use instead, for an error message: the divisors of ``divisible`` (the model's counts' common
    divisor) that also divide the job's ``world_size`` ranks, and what the others need."""
    fits = [t for t in range(1, divisible + 1) if divisible % t == 0]
    if world_size is None:
        return f"use a divisor of {divisible} ({', '.join(map(str, fits))})"
    here = [t for t in fits if world_size % t == 0]
    others = [t for t in fits if t not in here]
    line = f"on {world_size} rank{'s' if world_size > 1 else ''} use {' or '.join(map(str, here))}"
    if others:
        line += f" ({', '.join(map(str, others))} need{'s' if len(others) == 1 else ''} a multiple of that many ranks)"
    return line


def check_tensor_parallel(model: nn.Module, plan: Dict[str, ParallelStyle], tensor_parallel_dim: int,
                          model_component: str, world_size: Optional[int] = None) -> None:
    """Whether ``plan`` can split ``model`` (built on the meta device) over ``tensor_parallel_dim`` ranks.

    Each tensor-parallel rank computes whole attention heads, so the number
    of query heads and of key/value heads of every attention module must be
    multiples of it; each pattern of the plan must name modules of the model,
    and those must be plain ``nn.Linear`` or ``nn.Embedding`` layers (torch's
    styles split nothing else), or LoRA linears under a column or row split
    (:mod:`torchtune_ext.lora_parallel`; not DoRA, QLoRA's NF4 base or an
    adapter bias). An ``output`` entry is skipped for a tied output
    projection: it is the split embedding.

    Raises:
        ConfigError: (key ``tensor_parallel_dim``) a head count it does not
            divide; (key ``tensor_parallel_plan``) a pattern that names no
            module, or a module the plan cannot split.
    """
    for name, module in model.named_modules():
        if not isinstance(module, MultiHeadAttention):
            continue
        counts = {"num_heads": module.num_heads, "num_kv_heads": module.num_kv_heads,
                  "embed_dim": module.embed_dim}
        bad = [f"{key}={n}" for key, n in counts.items() if n % tensor_parallel_dim]
        if bad:
            fits = gcd(gcd(module.num_heads, module.num_kv_heads), module.embed_dim)
            raise ConfigError("tensor_parallel_dim", f"{tensor_parallel_dim} does not divide the model's "
                              f"{', '.join(bad)} ({'.'.join(_plain_name(name))} of {model_component}): each "
                              f"tensor-parallel rank computes whole heads; {tensor_parallel_fits(fits, world_size)}")
    tied = isinstance(getattr(model, "output", None), TiedLinear)
    for pattern in plan:
        if pattern == "output" and tied:
            continue
        matches = modules_matching(model, pattern)
        if not matches:
            raise ConfigError("tensor_parallel_plan", f"'{pattern}' names no module of {model_component}: the "
                              "plan does not fit this model; name a plan for it, or set tensor_parallel_dim=1")
        for name, module in matches:
            why = None
            if lora_parallel.is_lora_linear(module):
                why = lora_parallel.refusal(module)
                if why is None and type(plan[pattern]) not in (ColwiseParallel, RowwiseParallel):
                    why = f"a LoRA linear is split by columns or rows only, not by {type(plan[pattern]).__name__}"
                why = why and f"{why}; train it with tensor_parallel_dim=1 (FSDP2 shards its frozen base)"
            elif type(module) not in (nn.Linear, nn.Embedding):
                why = ("torch's styles split only nn.Linear and nn.Embedding; name a plan for this model, or set "
                       "tensor_parallel_dim=1")
            if why:
                raise ConfigError("tensor_parallel_plan", f"cannot split {'.'.join(_plain_name(name))} "
                                  f"({type(module).__name__}) of {model_component}: {why}")


class GatheredTiedLinear(TiedLinear):
    """A tied output projection whose weight (the token embedding) is split over the tensor-parallel ranks.

    ``x`` ``[..., hidden]`` is the same on every rank of the group; each rank
    multiplies it by its slice of the weight and the slices of the logits
    are gathered: every rank gets the whole ``[..., vocab]`` logits, as a
    plain tensor, which is what :class:`torchtune_ext.loss.SummedCrossEntropyLoss`
    indexes, soft-maxes and measures. The gradient flows back to each slice
    and, summed over the group, to ``x``. With a weight that is not split
    (outside the model's forward under FSDP2, or no tensor parallelism) it is
    torchtune's ``TiedLinear``.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.tied_module.weight
        if not isinstance(weight, DTensor):
            return super().__call__(x)
        mesh = weight.device_mesh
        replicated = [Replicate()] * mesh.ndim
        logits = self.linear(DTensor.from_local(x, mesh, replicated, run_check=False), weight)
        return logits.redistribute(mesh, replicated).to_local()


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: Dict[str, ParallelStyle]) -> None:
    """Split ``model``'s layers over the ``tp_mesh`` ranks as ``plan`` says (before FSDP2; on meta is fine).

    torchtune's ``prepare_mha_for_tp`` first makes each attention module
    compute its local heads; then each module the plan names (activation
    checkpointing's and ``torch.compile``'s wrappers are looked through) is
    parallelized with torch's ``parallelize_module``.

    The output projection always returns whole logits on every rank: the
    loss applies it itself, to the trainable rows only, and reads token
    metrics (argmax, entropy) off the full distribution, which a
    vocabulary-split ``loss_parallel`` cannot give. So an untied ``output``
    is split by columns and its output gathered (torchtune's plan does the
    same: ``ColwiseParallel(output_layouts=Replicate())``), and a tied one
    becomes a :class:`GatheredTiedLinear` over the split embedding. The
    gathered logits cost one all-gather per output chunk and the same memory
    as without tensor parallelism.

    Raises:
        ValueError: a pattern names no module (:func:`check_tensor_parallel`
            reports it as a config error before anything loads).
    """
    training.prepare_mha_for_tp(model, tp_mesh)
    output = getattr(model, "output", None)
    for pattern, style in plan.items():
        if pattern == "output":
            if isinstance(output, TiedLinear):
                continue
            style = ColwiseParallel(output_layouts=Replicate())
        matches = modules_matching(model, pattern)
        if not matches:
            raise ValueError(f"tensor-parallel plan: '{pattern}' names no module of the model")
        for _name, module in matches:
            parallelize_module(module, tp_mesh, lora_parallel.style_for(module, style))
    if isinstance(output, TiedLinear):
        model.output = GatheredTiedLinear(output.tied_module)


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
            (:func:`torchtune_ext.hf.shard_model`).
        parallelism: the job's mesh (:func:`build_parallelism`); with a
            ``tp`` dimension the model is split by its plan first
            (:func:`apply_tensor_parallel`) and FSDP2 shards over ``dp``.
            None: a ``("dp",)`` mesh over all ranks.
        tensor_parallel: ``(model, tp_mesh, plan)`` splitting the model over
            the ``tp`` ranks; default :func:`apply_tensor_parallel` (torchtune's
            decoders); transformers models pass their own
            (:func:`torchtune_ext.hf.tensor_parallel.apply_tensor_parallel`).

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


# What torch's DTensor says, on every rank, when a gathered save makes a parameter sharded by FSDP2 over a
# tensor-parallel split (placements _StridedShard, Shard) whole: the gather takes one all-gather per mesh
# dimension, "This is suboptimal". It is about speed only (once per save, not per step) and the gathered tensor
# is exact, so the line only alarms. torch 2.13 logs it (torch.distributed.tensor._redistribute); a
# warnings.warn of the same text is silenced too.
_STRIDED_GATHER = re.compile(r"(?s).*_StridedShard.*This is suboptimal")
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def _not_strided_gather_remark(record: logging.LogRecord) -> bool:
    return not _STRIDED_GATHER.match(record.getMessage())


@contextlib.contextmanager
def quiet_strided_gather() -> Iterator[None]:
    """Silence exactly torch's "_StridedShard ... This is suboptimal" remark (see above) while gathering."""
    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    logger.addFilter(_not_strided_gather_remark)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_STRIDED_GATHER.pattern)
            yield
    finally:
        logger.removeFilter(_not_strided_gather_remark)


def gather_full_model_state_dict(model: nn.Module, device: torch.device) -> Dict[str, torch.Tensor]:
    """All ranks gather; rank 0 gets the full state dict on CPU, other ranks ``{}``."""
    with quiet_strided_gather():
        return training.gather_cpu_state_dict(model, is_rank_zero=ranks.is_rank_zero(), device=device)


def gather_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """All ranks gather; rank 0 gets the unsharded optimizer state (keyed by parameter name), others ``{}``."""
    with quiet_strided_gather():  # the moments are sharded as their parameters
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
