"""Hugging Face models in the recipes: transformers builds the model, reads and writes the folders.

What a recipe calls (see docs/models.md): :func:`causal_lm` (the ``model``
component), :class:`HFCheckpointer` (the ``checkpointer`` component),
:func:`check_model_folder` (config validation, before anything loads),
:func:`load_state` (weights into an unsharded model), :func:`set_activation_checkpointing`
and :func:`shard_model` (per decoder layer, from the model's ``_no_split_modules``).
"""

from torchtune_ext.hf.checkpointer import HFCheckpointer
from torchtune_ext.hf.model import (
    causal_lm,
    check_model_folder,
    decoder_layer_classes,
    load_state,
    set_activation_checkpointing,
    shard_model,
)

__all__ = ["HFCheckpointer", "causal_lm", "check_model_folder", "decoder_layer_classes", "load_state",
           "set_activation_checkpointing", "shard_model"]
