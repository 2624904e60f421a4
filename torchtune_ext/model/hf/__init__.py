"""Hugging Face models in the recipes: transformers builds the model, reads and writes the folders.

What a recipe calls (see docs/models.md): :func:`causal_lm` (the ``model``
component), :class:`HFCheckpointer` (the ``checkpointer`` component),
:func:`check_model_folder` (config validation, before anything loads),
:func:`load_state` (weights into an unsharded model), :func:`set_activation_checkpointing`
and :func:`shard_model` (per decoder layer, from the model's ``_no_split_modules``);
LoRA through PEFT: :func:`lora_causal_lm` and the functions of :mod:`torchtune_ext.model.hf.lora`;
:func:`packing_refusal` (whether packed rows keep the model's documents apart).
"""

from torchtune_ext.model.hf.build import (
    causal_lm,
    decoder_layer_classes,
    load_state,
    set_activation_checkpointing,
    shard_model,
)
from torchtune_ext.model.hf.checkpointer import HFCheckpointer
from torchtune_ext.model.hf.folder import check_model_folder
from torchtune_ext.model.hf.lora import (
    adapter_params,
    initialize_adapters,
    initialize_dora_magnitude,
    lora_causal_lm,
    lora_checkpoint_state,
    lora_config,
    model_keys,
)
from torchtune_ext.model.hf.packing import packing_refusal

__all__ = ["HFCheckpointer", "adapter_params", "causal_lm", "check_model_folder", "decoder_layer_classes",
           "initialize_adapters", "initialize_dora_magnitude", "load_state", "lora_causal_lm",
           "lora_checkpoint_state", "lora_config", "model_keys", "packing_refusal", "set_activation_checkpointing",
           "shard_model"]
