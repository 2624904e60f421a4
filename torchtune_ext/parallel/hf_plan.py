"""Tensor parallelism for transformers models: the model's own ``tp_plan``, applied with torch's styles.

transformers names, for most decoder families, how each module splits over
tensor-parallel ranks: ``config.base_model_tp_plan`` with the causal LM's
``_tp_plan``, which ``model.tp_plan`` gives with full module names
(``model.layers.*.self_attn.q_proj: colwise``). transformers applies it with
hooks on plain tensors of its own, which FSDP2 cannot shard further. Here
each style becomes the torch ``ParallelStyle`` that computes the same thing on
DTensors (:data:`STYLES`), so FSDP2 then shards what the plan leaves over the
data-parallel ranks exactly as for torchtune's models
(:func:`torchtune_ext.parallel.fsdp.shard_model`), and every state dict,
gathered or sharded, is the one without tensor parallelism.

Each rank computes whole attention heads: transformers' attention modules
reshape their projections with ``-1`` heads, so a column split of q/k/v into
whole heads needs no change to the model code. Families whose plan gathers
instead (OLMo 2's q/k norms span every head, Phi-3's fused projections are
sliced) compute their attention in full on every rank, as in transformers.

A tied output projection stays whole on every tensor-parallel rank together
with its embedding (FSDP2 still shards both over the data-parallel ranks):
the plan's ``lm_head`` entry splits a weight that is also the embedding's.
Mixture-of-experts styles (fused, grouped or expert-parallel experts, MLA's
compressed projections) have no torch equivalent here and are refused.
"""

from math import gcd
from typing import Callable, Dict, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtune_ext.errors import ConfigError
from torchtune_ext.parallel import lora as lora_parallel
from torchtune_ext.parallel import tensor_parallel


class ReplicatedNorm(SequenceParallel):
    """torch's ``SequenceParallel`` that keeps a frozen weight frozen (a LoRA run's norms).

    torch's own makes every replicated weight a new ``nn.Parameter``, which
    requires a gradient: a LoRA recipe, which collects what it trains after
    sharding, would train the norms too.
    """

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


# transformers' style name -> (the torch style computing the same, the weight dimension it splits: 0 rows, 1
# columns, None nothing). Sources: transformers.integrations.tensor_parallel.ParallelInterface; torch's
# ColwiseParallel / RowwiseParallel (Megatron-LM's split, Shoeybi et al., 2019).
STYLES: Dict[str, "tuple[Callable[[], ParallelStyle], Optional[int]]"] = {
    # output features split; the output stays split (the next rowwise layer takes it as it is)
    "colwise": (ColwiseParallel, 0),
    # output features split, then gathered: every rank gets the whole output
    "colwise_gather_output": (lambda: ColwiseParallel(output_layouts=Replicate()), 0),
    "colwise_rep": (lambda: ColwiseParallel(output_layouts=Replicate()), 0),
    # input features split (the input arrives split), partial outputs summed
    "rowwise": (RowwiseParallel, 1),
    # the same for an input every rank holds whole: each takes its slice first
    "rowwise_split_input": (lambda: RowwiseParallel(input_layouts=Replicate()), 1),
    # a vocabulary split of an embedding (rows), the looked-up vectors summed
    "embedding_rowwise": (lambda: RowwiseParallel(input_layouts=Replicate()), 0),
    # A norm applied to each rank's own heads (Qwen 3's and Gemma 3's q/k norms): its weight is whole on every
    # rank and its gradient is the sum of the ranks' parts. Marking the input as split along its first
    # dimension says "the ranks hold different rows" (the norm runs over the last one, so any other would do);
    # DTensor then sums the weight's gradient over the group in backward and nothing in forward.
    "replicated_with_grad_allreduce": (lambda: ReplicatedNorm(sequence_dim=0, use_local_output=True), None),
}


# The styles a LoRA linear can take (:mod:`torchtune_ext.parallel.lora`): plain column and row splits.
LORA_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input")


def _is_tied(model: nn.Module) -> bool:
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return output is not None and getattr(output, "weight", None) is embedding.weight


def _model_plan(model: nn.Module, model_component: str) -> Dict[str, str]:
    """``model.tp_plan`` and its class's ``_tp_plan``, less what stays whole: a tied output projection and its
    embedding.

    Raises:
        ConfigError: (key ``tensor_parallel_plan``) the model has no plan, or
            a style :data:`STYLES` does not know.
    """
    hf_class = getattr(model, "_ext_hf_class", type(model))
    # The instance's plan (the base model's, prefixed) leaves out the causal LM class's own entry for its
    # output projection (transformers 5.5's post_init replaces the class attribute): it is added back.
    plan = {**(getattr(model, "tp_plan", None) or {}), **(getattr(hf_class, "_tp_plan", None) or {})}
    cls = hf_class.__name__
    if not plan:
        raise ConfigError("tensor_parallel_plan", f"{cls} ({model_component}) has no tensor-parallel plan in "
                          "transformers (its config's base_model_tp_plan is empty); name one with "
                          "tensor_parallel_plan._component_, or set tensor_parallel_dim=1 (FSDP2 alone shards it)")
    if _is_tied(model):
        whole = {id(model.get_output_embeddings()), id(model.get_input_embeddings())}
        plan = {pattern: style for pattern, style in plan.items()
                if not any(id(m) in whole for _n, m in tensor_parallel.modules_matching(model, pattern))}
    if not plan:  # LFM2: its plan's one entry is its tied lm_head
        raise ConfigError("tensor_parallel_dim", f"{cls}'s tensor-parallel plan in transformers splits only its output "
                          "projection, which is tied to the token embedding and stays whole: tensor parallelism would "
                          "split nothing; set tensor_parallel_dim=1 (FSDP2 alone shards it) or name a plan with "
                          "tensor_parallel_plan._component_")
    unknown = {pattern: style for pattern, style in plan.items() if style not in STYLES}
    if unknown:
        pattern, style = next(iter(unknown.items()))
        raise ConfigError("tensor_parallel_plan", f"{cls}'s tensor-parallel plan splits {pattern} as '{style}', "
                          f"which these recipes cannot apply (they apply {', '.join(STYLES)}: dense layers; "
                          "fused or expert-parallel experts are not among them); set tensor_parallel_dim=1 "
                          "(FSDP2 alone shards it)")
    return plan


def tensor_parallel_plan(model: nn.Module, model_component: str = "the model") -> Dict[str, ParallelStyle]:
    """The model's own plan as torch styles: ``{module name pattern: ParallelStyle}`` (see the module docstring).

    Raises:
        ConfigError: see :func:`_model_plan`.
    """
    return {pattern: STYLES[style][0]() for pattern, style in _model_plan(model, model_component).items()}


def check_tensor_parallel(model: nn.Module, plan: Optional[Dict[str, ParallelStyle]], tensor_parallel_dim: int,
                          model_component: str, world_size: Optional[int] = None) -> None:
    """Whether ``plan`` (None: the model's own) splits ``model`` (built on meta) over ``tensor_parallel_dim`` ranks.

    With the model's own plan: every module it splits must be a plain
    ``nn.Linear`` or ``nn.Embedding``, or a PEFT LoRA linear under a column
    or row split (:mod:`torchtune_ext.parallel.lora`), the dimension each
    style splits must be a multiple of ``tensor_parallel_dim``, and where
    q/k/v are split without gathering, so must the numbers of query and
    key/value heads. A plan of the config's own gets
    :func:`torchtune_ext.parallel.tensor_parallel.check_tensor_parallel`'s checks.

    Raises:
        ConfigError: (key ``tensor_parallel_dim``) a count it does not
            divide, a plan that splits nothing (LFM2: its one entry is its
            tied output projection); (key ``tensor_parallel_plan``) no plan, a style that
            cannot be applied, a module that cannot be split.
    """
    if plan is not None:
        tensor_parallel.check_tensor_parallel(model, plan, tensor_parallel_dim, model_component, world_size)
        return
    named = _model_plan(model, model_component)
    splits = []  # (what is split, its size)
    for pattern, style in named.items():
        dim = STYLES[style][1]
        for name, module in tensor_parallel.modules_matching(model, pattern):
            lora = lora_parallel.is_lora_linear(module)  # PEFT's LoRA layers wrap the linear they adapt
            why = lora_parallel.refusal(module) if lora else None
            if lora and why is None and style not in LORA_STYLES:
                why = f"a LoRA linear is split by columns or rows only, not as '{style}'"
            if why:
                raise ConfigError("tensor_parallel_plan", f"cannot split {name} ({type(module).__name__}) of "
                                  f"{model_component}: {why}; train it with tensor_parallel_dim=1 (FSDP2 shards "
                                  "its frozen base)")
            if dim is None:
                continue
            module = module.base_layer if lora else module
            kind = nn.Embedding if style.startswith("embedding") else nn.Linear
            if type(module) is not kind:
                raise ConfigError("tensor_parallel_plan", f"cannot split {name} ({type(module).__name__}) of "
                                  f"{model_component} as '{style}': torch's styles split a plain "
                                  f"{kind.__name__} only; set tensor_parallel_dim=1")
            splits.append((f"{module.weight.shape[dim]} {'rows' if dim == 0 else 'columns'} of {name} "
                           f"('{style}')", module.weight.shape[dim]))
    if not splits:  # every entry names modules the model does not have, or splits no weight
        raise ConfigError("tensor_parallel_dim", f"the tensor-parallel plan of {model_component} splits nothing of "
                          f"this model (its entries {', '.join(named)} match no module it splits); set "
                          "tensor_parallel_dim=1 (FSDP2 alone shards it)")
    if any(style == "colwise" and "attn" in pattern for pattern, style in named.items()):
        config = model.config.get_text_config()  # q/k/v split as they are: each rank computes whole heads
        for key in ("num_attention_heads", "num_key_value_heads"):
            if isinstance(getattr(config, key, None), int):
                splits.append((f"{key}={getattr(config, key)} (each rank computes whole heads)", getattr(config, key)))
    bad = [what for what, size in splits if size % tensor_parallel_dim]
    if bad:
        raise ConfigError("tensor_parallel_dim", f"{tensor_parallel_dim} does not divide the {bad[0]} of "
                          f"{model_component}; "
                          f"{tensor_parallel.tensor_parallel_fits(gcd(*(size for _, size in splits)), world_size)}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: Optional[Dict[str, ParallelStyle]]) -> None:
    """Split ``model``'s modules over the ``tp_mesh`` ranks (before FSDP2; on meta is fine).

    Args:
        plan: ``{module name pattern: ParallelStyle}`` (``*`` one name part;
            activation checkpointing's wrappers looked through); None: the
            model's own (:func:`tensor_parallel_plan`).

    Raises:
        ValueError: a pattern names no module (:func:`check_tensor_parallel`
            reports it as a config error before anything loads).
    """
    own = plan is None
    for pattern, style in (tensor_parallel_plan(model) if own else plan).items():
        matches = tensor_parallel.modules_matching(model, pattern)
        if not matches and not own:  # transformers' plans may name modules a config leaves out, as it skips them
            raise ValueError(f"tensor-parallel plan: '{pattern}' names no module of the model")
        for _name, module in matches:
            parallelize_module(module, tp_mesh, lora_parallel.style_for(module, style))
