"""Tensor-parallel styles for LoRA linears: torch's column and row splits, with the adapter split to match.

torch's ``ColwiseParallel`` and ``RowwiseParallel`` split an ``nn.Linear``
only. A LoRA linear computes ``W x + s B (A x)`` (torchtune's ``LoRALinear``:
``weight``, ``lora_a``, ``lora_b``; PEFT's ``lora.Linear``: ``base_layer``,
``lora_A.<adapter>``, ``lora_B.<adapter>``). Split so that every product stays
local, as Megatron-LM splits a pair of linears (Shoeybi et al., 2019):

* by columns (output features): ``W`` and ``B`` by rows, ``A`` whole on every
  rank. Each rank computes ``A x`` in full and its slice of ``B (A x)``; ``A``'s
  gradient is the sum of the ranks' parts, which DTensor sums in backward
  (``A`` is a replicated DTensor);
* by rows (input features): ``W`` and ``A`` by columns, ``B`` whole. Each
  rank's ``A x`` is a partial sum; ``B`` is linear, so ``B`` of the partial sums
  adds up to ``B (A x)``, and the output's all-reduce (the plain layer's own)
  sums the adapter's part with the base's.

The input and output layouts are the style's own (torch's hooks), so a LoRA
layer is a drop-in for the plain one in any plan. DoRA (its magnitude
normalizes each output row by a norm over the input features), a quantized
base (NF4) and adapter biases are not split: :func:`refusal` says why.
"""

from functools import partial
from typing import Dict, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def is_lora_linear(module: nn.Module) -> bool:
    """torchtune's ``LoRALinear`` / ``DoRALinear`` (``adapter_params``) or a PEFT LoRA layer (``base_layer``)."""
    return hasattr(module, "adapter_params") or hasattr(module, "base_layer")


def _part(qualified_name: str) -> str:
    """``a``, ``b`` (the adapter's matrices) or ``base`` for a parameter named as in the LoRA linear."""
    parts = qualified_name.split(".")
    if "lora_a" in parts or "lora_A" in parts:
        return "a"
    if "lora_b" in parts or "lora_B" in parts:
        return "b"
    return "base"


def refusal(module: nn.Module) -> Optional[str]:
    """Why the LoRA linear ``module`` cannot be split (None: it can)."""
    names = [name for name, _ in module.named_parameters()]
    if any("magnitude" in name for name in names):
        return "DoRA's magnitude normalizes each output row over all input features"
    if getattr(module, "_quantize_base", False):
        return "its base weight is quantized (NF4)"
    if any(_part(name) != "base" and name.endswith("bias") for name in names):
        return "its adapter has a bias"
    return None


def _partition(placements: Dict[str, Placement], name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Replace ``module``'s own parameters by DTensors placed by their part (:func:`_part`) of the LoRA linear."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        part = _part(f"{name}.{param_name}" if name else param_name)
        placement = placements["bias" if part == "base" and param_name == "bias" else part]
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                           requires_grad=param.requires_grad))


def _distribute(style: ParallelStyle, placements: Dict[str, Placement], module: nn.Module,
                device_mesh: DeviceMesh) -> nn.Module:
    """torch's own input and output hooks of ``style`` around ``module``, its parameters placed by part."""
    return distribute_module(module, device_mesh, partial(_partition, placements),
                             partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
                             partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


class LoRAColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a LoRA linear: base weight, bias and ``B`` split by rows, ``A`` whole."""

    PLACEMENTS = {"base": Shard(0), "bias": Shard(0), "a": Replicate(), "b": Shard(0)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute(self, self.PLACEMENTS, module, device_mesh)


class LoRARowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a LoRA linear: base weight and ``A`` split by columns, bias and ``B`` whole."""

    PLACEMENTS = {"base": Shard(1), "bias": Replicate(), "a": Shard(1), "b": Replicate()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # as torch's own for a linear: the input split by features
        return _distribute(self, self.PLACEMENTS, module, device_mesh)


def style_for(module: nn.Module, style: ParallelStyle) -> ParallelStyle:
    """``style`` itself, or for a LoRA linear its LoRA counterpart with the same layouts.

    Raises:
        ValueError: a LoRA linear with a style other than a column or row
            split (check with :func:`refusal` and the plan first).
    """
    if not is_lora_linear(module):
        return style
    for plain, lora in ((ColwiseParallel, LoRAColwiseParallel), (RowwiseParallel, LoRARowwiseParallel)):
        if type(style) is plain:
            return lora(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                        use_local_output=style.use_local_output)
    raise ValueError(f"a LoRA linear can be split by ColwiseParallel or RowwiseParallel, not {type(style).__name__}")
