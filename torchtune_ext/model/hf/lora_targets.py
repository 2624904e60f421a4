"""Which modules and parameters of a transformers model get LoRA adapters, from torchtune's LoRA keys.

Every decoder layer is looked at (hybrid models mix layer kinds: LFM2's
convolution and attention layers, Qwen3-Next's Gated DeltaNet and attention
layers, DeepSeek-V3's dense first layers and expert layers). Each module of a
layer is one of:

* **attention**: under a child named ``*attn*`` / ``*attention*`` that is
  softmax attention (not a token mixer of
  :func:`torchtune_ext.model.hf.packing.mixer_kind`);
* **mixer**: inside a token mixer outside attention (short convolution,
  linear attention, Mamba);
* **router**: a linear that scores the experts (``out_features`` equal to
  the number of experts, or a one-output ``*gate`` such as Qwen3-Next's
  ``shared_expert_gate``);
* **convolution**: an ``nn.Conv1d``;
* **MLP**: any other linear (dense MLPs, shared experts), and fused experts:
  3-D parameters outside attention and mixers.

``lora_attn_modules`` names torchtune's projections (``q_proj``, ``k_proj``,
``v_proj``, ``output_proj``: found in the attention modules, ``output_proj``
as ``o_proj`` or ``out_proj``) or any other module name of the layers
(``q_a_proj``, ``kv_b_proj`` for MLA; ``in_proj_qkvz`` of a Gated DeltaNet; a
convolution), adapted wherever it exists; a name no layer has is refused with
the names that exist. ``apply_lora_to_mlp`` adapts the MLP kind; routers,
convolutions and mixers' projections stay frozen unless named.
"""

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf.packing import mixer_kind

log = logging.getLogger(__name__)

# torchtune's attention projection names -> the names transformers' families give them
TORCHTUNE_NAMES: Dict[str, Tuple[str, ...]] = {"q_proj": ("q_proj",), "k_proj": ("k_proj",), "v_proj": ("v_proj",),
                                               "output_proj": ("o_proj", "out_proj")}
_ADAPTABLE = (nn.Linear, nn.Conv1d)


@dataclass
class Targets:
    """What :func:`lora_targets` found.

    Attributes:
        modules: PEFT ``target_modules`` (a leaf name where it selects exactly the
            intended modules, else full module names).
        parameters: PEFT ``target_parameters`` (fused experts).
        counts: adapted modules or parameters per name, for the log line.
        frozen: routers and convolutions left alone, per name.
    """

    modules: List[str] = field(default_factory=list)
    parameters: List[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    frozen: Counter = field(default_factory=Counter)

    def describe(self) -> str:
        """One line: ``LoRA adapters on 2 q_proj, 2 v_proj, 1 mlp.experts.gate_up_proj; frozen: 1 gate (router)``."""
        adapted = ", ".join(f"{n} {name}" for name, n in sorted(self.counts.items()))
        frozen = ", ".join(f"{n} {name}" for name, n in sorted(self.frozen.items()))
        return f"LoRA adapters on {adapted}" + (f"; left frozen: {frozen}" if frozen else "")


def _num_experts(config) -> Optional[int]:
    config = config.get_text_config()
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def _kind(layer: nn.Module, rel: str, module: nn.Module, experts: Optional[int]) -> str:
    """attention, mixer, router, convolution or mlp (see the module docstring)."""
    path, owner = [], layer
    for part in rel.split("."):
        owner = getattr(owner, part)
        path.append(owner)
    if any(mixer_kind(type(m)) for m in path) or any(isinstance(m, nn.Conv1d) for m in path[:-1]):
        return "mixer"
    if isinstance(module, nn.Conv1d):
        return "convolution"
    if any(("attn" in part or "attention" in part) for part in rel.split(".")[:-1]):
        return "attention"
    leaf = rel.rsplit(".", 1)[-1]
    if isinstance(module, nn.Linear) and not leaf.endswith("_proj") and (
            module.out_features == experts or (module.out_features == 1 and "gate" in leaf)):
        return "router"
    return "mlp"


def _layers(model: nn.Module, classes: tuple) -> List[Tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]


def lora_targets(model: nn.Module, layer_classes: tuple, *, lora_attn_modules: Sequence[str],
                 apply_lora_to_mlp: bool, apply_lora_to_output: bool) -> Targets:
    """The modules and parameters of ``model`` to adapt (see the module docstring).

    Args:
        layer_classes: the classes of its decoder layers.

    Raises:
        ConfigError: (``model.lora_attn_modules``) a name no layer has (the
            message lists the names that exist), or nothing to adapt;
            (``model.apply_lora_to_output``) a tied output projection.
    """
    experts = _num_experts(model.config)
    found: List[Tuple[str, str, str, nn.Module]] = []  # (full name, leaf, kind, module)
    expert_params: List[Tuple[str, str]] = []  # (full name, name in the layer)
    for layer_name, layer in _layers(model, layer_classes):
        for rel, module in layer.named_modules():
            if not rel:
                continue
            if isinstance(module, _ADAPTABLE):
                found.append((f"{layer_name}.{rel}", rel.rsplit(".", 1)[-1], _kind(layer, rel, module, experts),
                              module))
            elif apply_lora_to_mlp and not isinstance(module, nn.modules.conv._ConvNd):
                kind = _kind(layer, rel, module, experts)
                if kind == "mlp":
                    expert_params += [(f"{layer_name}.{rel}.{p}", f"{rel}.{p}")
                                      for p, t in module.named_parameters(recurse=False) if t.dim() == 3]
    chosen: Dict[str, str] = {}  # full name -> the name counted
    for name in lora_attn_modules:
        leaves = TORCHTUNE_NAMES.get(name)
        if leaves is not None:
            hits = [(full, leaf) for full, leaf, kind, _ in found if kind == "attention" and leaf in leaves]
        else:
            hits = [(full, leaf) for full, leaf, _, _ in found if leaf == name]
        if not hits:
            attention = sorted({leaf for _, leaf, kind, _ in found if kind == "attention"})
            other = sorted({leaf for _, leaf, kind, _ in found if kind != "attention"} - set(attention))
            raise ConfigError("model.lora_attn_modules", f"{type(model).__name__} has no {name} in any decoder layer "
                              f"(its attention has {', '.join(attention) or 'no projections'}; its other modules: "
                              f"{', '.join(other) or 'none'}); name those")
        chosen.update({full: leaf for full, leaf in hits})
    targets = Targets()
    if apply_lora_to_mlp:
        chosen.update({full: leaf for full, leaf, kind, _ in found if kind == "mlp"})
    for full, leaf, kind, _ in found:
        if full not in chosen and kind in ("router", "convolution", "mixer"):
            targets.frozen[f"{leaf} ({kind})"] += 1
    if apply_lora_to_output:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head is None or head.weight is embedding.weight:
            raise ConfigError("model.apply_lora_to_output", "the output projection of this model is its token "
                              "embedding (tied weights); set model.apply_lora_to_output=false")
        head_name = next(n for n, m in model.named_modules() if m is head)
        chosen[head_name] = head_name.rsplit(".", 1)[-1]
    targets.counts.update(chosen.values())
    targets.modules = _names(model, set(chosen), lambda n: n.rsplit(".", 1)[-1], dict(model.named_modules()))
    params = {full: rel for full, rel in expert_params}
    targets.counts.update(params.values())
    all_params = {f"{n}": None for n, _ in model.named_parameters()}
    targets.parameters = _names(model, set(params), lambda n: params[n], all_params)
    if not targets.modules and not targets.parameters:
        raise ConfigError("model.lora_attn_modules", "no module to adapt: name attention projections or set "
                          "model.apply_lora_to_mlp=true")
    return targets


def _names(model: nn.Module, chosen: set, short, every: dict) -> List[str]:
    """PEFT names selecting exactly ``chosen``: each short name where every module (or parameter) whose name
    ends with it is chosen, else the full names."""
    out = set()
    for full in chosen:
        name = short(full)
        matching = {n for n in every if n == name or n.endswith("." + name)}
        out |= {name} if matching <= chosen else {full}
    return sorted(out)
