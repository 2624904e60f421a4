"""Any model a config names, built, sharded and loaded: torchtune's decoders and transformers models alike.

torchtune's models (:mod:`torchtune_ext.model.builders` or torchtune's own
builders) and transformers models (:mod:`torchtune_ext.model.hf`) take the
same calls here, so the recipes and the loop need not know which they have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchtune import config as tt_config

from torchtune_ext import checkpoint
from torchtune_ext.checkpoint.state_dict import load_full_model_state_dict
from torchtune_ext.config import lora_settings
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.builders import initialize_torchtune_adapters
from torchtune_ext.moved import canonical
from torchtune_ext.parallel import fsdp, hf_plan, tensor_parallel

# torchao's NF4 (torchtune's QLoRA): weights are quantized in blocks of 64 values
# whose scales are quantized again in blocks of 256 (to_nf4's defaults).
NF4_BLOCK = 64 * 256

def quantizes_base(cfg_model) -> bool:
    """Whether a ``model`` config is a QLoRA model (``quantize_base``, or a ``qlora_*`` builder)."""
    try:
        return lora_settings(cfg_model).quantize_base
    except ConfigError:  # not a LoRA model
        return False

def nf4_error(err: BaseException):
    """The config error for torchao's NF4 refusing a weight shape (``AssertionError`` from ``to_nf4``)."""
    return ConfigError("model.quantize_base", f"torchao's NF4 cannot quantize this model's weights ({err}): it "
                       f"needs each weight's size to be a multiple of {NF4_BLOCK:,} values; use quantize_base=false "
                       "(LoRA) for this model")

# ``model`` components under this package are transformers models (torchtune_ext.model.hf); the rest torchtune's.
HF_COMPONENTS = "torchtune_ext.model.hf."

def is_hf_config(cfg_model: Any) -> bool:
    """Whether a ``model`` config builds a transformers model (``torchtune_ext.model.hf.causal_lm`` or
    ``lora_causal_lm``, under any of their paths: :func:`torchtune_ext.moved.canonical`)."""
    return canonical(str(cfg_model.get("_component_", ""))).startswith(HF_COMPONENTS)

def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` was built by :func:`torchtune_ext.model.hf.causal_lm` (a transformers model, our call
    convention)."""
    return getattr(model, "_ext_hf_class", None) is not None

def _hf():
    # transformers and PEFT take 1.6 s to import: only runs of transformers models pay for it
    from torchtune_ext.model import hf

    return hf

def build_model(cfg_model: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the ``model`` config with ``dtype`` as default dtype, on ``device``, ready for its weights.

    torchtune's models are built on ``device`` (random values until
    :func:`torchtune_ext.checkpoint.load_model_state`). transformers models
    are always built on the meta device: their weights, buffers and
    adapters reach ``device`` when loaded, with no random initialization
    drawn on the way (:func:`torchtune_ext.model.hf.load_state`).

    Raises:
        ConfigError: (key ``model.quantize_base``) if QLoRA cannot quantize a
            weight of this architecture: torchao's NF4 needs every quantized
            weight to hold a multiple of 64 * 256 = 16,384 values (SmolLM2's
            576 x 576 attention projections hold 331,776 = 20.25 x 16,384).
    """
    from torchtune import training

    if is_hf_config(cfg_model):
        device = torch.device("meta")
    with training.set_default_dtype(dtype), device:
        try:
            return tt_config.instantiate(cfg_model)
        except AssertionError as err:
            if quantizes_base(cfg_model):
                raise nf4_error(err) from None
            raise

def instantiate_lora_model(cfg_model, dtype, device) -> nn.Module:
    """:func:`build_model` for a LoRA ``model`` config (kept for its callers)."""
    return build_model(cfg_model, dtype, device)

def decoder_layer_classes(model: nn.Module) -> tuple:
    """The classes of the model's repeated decoder layers, the units of activation checkpointing and FSDP2.

    torchtune's ``TransformerSelfAttentionLayer``; for a transformers model
    the classes its ``_no_split_modules`` names (:func:`torchtune_ext.model.hf.decoder_layer_classes`).
    """
    if is_hf_model(model):
        return _hf().decoder_layer_classes(model)
    from torchtune.modules import TransformerSelfAttentionLayer

    return (TransformerSelfAttentionLayer,)

def initialize_adapters(model: nn.Module, seed: int) -> None:
    """Initialize every LoRA/DoRA adapter of ``model`` from ``seed`` alone, on CPU.

    torchtune's models: :func:`initialize_torchtune_adapters`; transformers
    models (PEFT's adapters): :func:`torchtune_ext.model.hf.initialize_adapters`.
    Either way every recipe, device and world size starts from the same adapter.
    """
    if is_hf_model(model):
        _hf().initialize_adapters(model, seed)
    else:
        initialize_torchtune_adapters(model, seed)

def shard_model(model: nn.Module, device: torch.device, **kwargs) -> list:
    """FSDP2 over the model's decoder layers, then the root, gradients summed over ranks.

    :func:`torchtune_ext.parallel.fsdp.shard_model` (torchtune's ``layers.<i>``)
    or :func:`torchtune_ext.model.hf.shard_model` (the ``_no_split_modules`` layers);
    the keyword arguments are theirs.
    """
    if is_hf_model(model):
        return _hf().shard_model(model, device, **kwargs)
    return fsdp.shard_model(model, device, **kwargs)

def check_tensor_parallel(model: nn.Module, plan: Any, tensor_parallel_dim: int, model_component: str,
                          world_size: Any = None) -> None:
    """Whether ``plan`` splits ``model`` (on meta) over ``tensor_parallel_dim`` ranks; None: a transformers
    model's own ``tp_plan``.

    :func:`torchtune_ext.parallel.tensor_parallel.check_tensor_parallel` or
    :func:`torchtune_ext.parallel.hf_plan.check_tensor_parallel`; the
    arguments and errors are theirs.
    """
    if is_hf_model(model):
        return hf_plan.check_tensor_parallel(model, plan, tensor_parallel_dim, model_component,
                                                           world_size)
    return tensor_parallel.check_tensor_parallel(model, plan, tensor_parallel_dim, model_component, world_size)

def load_model_state(model: nn.Module, state_dict: dict, device: torch.device, source: Any, *,
                     strict: bool = True, model_name: Any = None):
    """Load a full state dict into an unsharded model; a misfit is one config line naming the checkpoint.

    torchtune's models: :func:`torchtune_ext.checkpoint.load_model_state` (the
    model is on ``device`` already); transformers models, built on meta:
    :func:`torchtune_ext.model.hf.load_state`, which moves them to ``device``.

    Returns:
        ``(missing_keys, unexpected_keys)``.

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) a key or shape that does not fit.
    """
    if is_hf_model(model):
        if model_name:
            checkpoint.check_model_fits(model, state_dict, source, model_name)
        return _hf().load_state(model, state_dict, device, strict=strict, source=str(source))
    return checkpoint.load_model_state(model, state_dict, source, strict=strict, model_name=model_name)

def load_sharded_model_state(model: nn.Module, state_dict: dict, device: torch.device, **kwargs):
    """:func:`torchtune_ext.checkpoint.state_dict.load_full_model_state_dict` (the keyword arguments are its own), then
    a transformers model's tied weights tied again.

    The loader gives every key a new sharded parameter, so a tied ``lm_head``
    would become a parameter of its own, trained apart from the token
    embedding (and unknown to the optimizer's view of the model).

    A sharded checkpoint's :class:`torchtune_ext.checkpoint.ShardedStateDict`
    is loaded shard by shard instead (:func:`torchtune_ext.checkpoint.load_model_shards`):
    each rank reads only its own part, at any world size.

    Returns:
        ``(missing_keys, unexpected_keys)``.
    """
    if isinstance(state_dict, checkpoint.ShardedStateDict):
        keys = checkpoint.load_model_shards(model, state_dict, device, cpu_offload=kwargs.get("cpu_offload", False),
                                            strict=kwargs.get("strict", True), model_name=kwargs.get("model_name"))
    else:
        keys = load_full_model_state_dict(model, state_dict, device, **kwargs)
    if is_hf_model(model):
        model.tie_weights()  # a no-op for untied models
    return keys

def packing_refusal(model: nn.Module):
    """Why packed rows would train ``model`` differently from its samples unpacked (one sentence), or None.

    torchtune's decoders keep a pack's documents apart with the collator's
    block-causal mask: None. transformers models:
    :func:`torchtune_ext.model.hf.packing.packing_refusal` (token mixers
    outside attention, a mask built without the positions).
    """
    if is_hf_model(model):
        return _hf().packing_refusal(model, getattr(model, model._ext_body))
    return None

def adapter_params(model: nn.Module) -> dict:
    """The adapter parameters by name (LoRA A/B, DoRA magnitudes): what a LoRA recipe trains."""
    if is_hf_model(model):
        return _hf().adapter_params(model)
    from torchtune.modules.peft import get_adapter_params

    return get_adapter_params(model)
