"""Tensor parallelism for torchtune's decoders: the plan a config names, its checks, and applying it.

Tensor parallelism (:func:`apply_tensor_parallel`) splits each layer's
weights over the ``tp`` ranks of the mesh (:mod:`torchtune_ext.parallel.mesh`)
with torch's ``parallelize_module`` and a plan (torchtune's
``base_llama_tp_plan`` by default); FSDP2 then shards what remains over the
``dp`` ranks (:mod:`torchtune_ext.parallel.fsdp`). LoRA linears take the
split of their base (:mod:`torchtune_ext.parallel.lora`); transformers models
bring their own plan (:mod:`torchtune_ext.parallel.hf_plan`).
"""

from fnmatch import fnmatchcase
from math import gcd
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torchtune import config as tt_config
from torchtune import training
from torchtune.modules import MultiHeadAttention, TiedLinear

from torchtune_ext.config.upstream import model_family
from torchtune_ext.errors import ConfigError
from torchtune_ext.moved import canonical
from torchtune_ext.parallel import lora as lora_parallel

# ---------------------------------------------------------- tensor parallel
# The plan torchtune ships (its 70B configs name it as tensor_parallel_plan).
DEFAULT_TP_PLAN = "torchtune.models.llama3.base_llama_tp_plan"

# torchtune families whose decoders name their layers as Llama's (tok_embeddings,
# layers.<i>.attn.{q,k,v,output}_proj, layers.<i>.mlp.w1/w2/w3, output) and hold no weight
# that every head shares, so the Llama plan fits them; SmolLM2 (torchtune_ext.model.build) is llama3_2.
PLAN_FAMILIES = ("llama2", "code_llama2", "llama3", "llama3_1", "llama3_2", "llama3_3", "mistral", "qwen2",
                 "qwen2_5")

def tensor_parallel_plan(cfg_plan: Any, model_component: str) -> Optional[Dict[str, ParallelStyle]]:
    """The tensor-parallel plan a config asks for: its ``tensor_parallel_plan``, or the Llama plan for its family.

    A transformers model (``torchtune_ext.model.hf.*``) with no ``tensor_parallel_plan``
    gets None: its own ``tp_plan``, read off the built model
    (:mod:`torchtune_ext.parallel.hf_plan`).

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
        if canonical(model_component).startswith("torchtune_ext.model.hf."):
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
    (:mod:`torchtune_ext.parallel.lora`; not DoRA, QLoRA's NF4 base or an
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
    plain tensor, which is what :class:`torchtune_ext.train.loss.SummedCrossEntropyLoss`
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
