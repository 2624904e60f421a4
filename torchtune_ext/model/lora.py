"""A LoRA model's weights: loading the frozen base, DoRA's magnitudes and a resumed adapter; what a checkpoint holds.

Shared by both LoRA recipes, which differ only in how a state dict reaches the
parameters (``load_state_dict`` on one device; shard by shard under FSDP2),
and by both kinds of model: torchtune's LoRA builders, and transformers
models with PEFT's adapters (:mod:`torchtune_ext.model.hf.lora`).
"""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from torch import nn
from torchtune.modules.peft import disable_adapter, validate_missing_and_unexpected_for_lora

from torchtune_ext import checkpoint
from torchtune_ext.checkpoint import check_adapter_fits
from torchtune_ext.config import lora_settings
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.build import is_hf_model

# load(state_dict) -> (missing keys, unexpected keys), as nn.Module.load_state_dict(strict=False) returns them
LoadStateDict = Callable[[Dict[str, Any]], Tuple[List[str], List[str]]]


def _hf_lora():
    # transformers and PEFT take 1.6 s to import: only runs of transformers models pay for it
    from torchtune_ext.model.hf import lora

    return lora


def load_lora_weights(model: nn.Module, cfg_model: Any, base_state: Dict[str, Any], load_base: LoadStateDict,
                      adapter_state: Optional[Dict[str, Any]] = None,
                      load_adapter: Optional[LoadStateDict] = None, adapter_source: Any = None) -> None:
    """Load the base weights, then (when resuming) the adapter, and check that every key is accounted for.

    DoRA magnitudes are initialized between the two, from the norms of the
    loaded base weights (a resumed adapter then overwrites them with the
    trained ones). A transformers model's base checkpoint is renamed to its
    PEFT keys first (``q_proj.weight`` -> ``q_proj.base_layer.weight``).

    Args:
        model: a LoRA model built from ``cfg_model``.
        cfg_model: the ``model`` config (its LoRA settings say which keys must exist).
        base_state: the base checkpoint's state dict; ``load_base`` loads it non-strictly.
        adapter_state: a resumed adapter, or None; ``load_adapter`` loads it non-strictly.
        adapter_source: the checkpoint folder it comes from, for messages.

    Raises:
        ConfigError: (key ``resume_from_checkpoint``) when the saved adapter
            does not fit the model (:func:`torchtune_ext.checkpoint.check_adapter_fits`:
            the first mismatching tensor and how many differ); (key
            ``checkpointer.checkpoint_dir``) a transformers base checkpoint
            without a weight the model has.
        AssertionError: torchtune's check, when keys are missing or unexpected.
    """
    hf = is_hf_model(model)
    if hf:
        base_state = _hf_lora().model_keys(model, base_state)
    base_missing, base_unexpected = load_base(base_state)
    if hf:
        not_adapter = [key for key in base_missing if ".lora_" not in key]
        if not_adapter or base_unexpected:
            raise ConfigError("checkpointer.checkpoint_dir", f"the base checkpoint does not fit the model: "
                              f"{(not_adapter + list(base_unexpected))[0]} is "
                              f"{'missing' if not_adapter else 'not in the model'}")
        _hf_lora().initialize_dora_magnitude(model)  # from the loaded base weights
    else:
        for module in model.modules():
            if hasattr(module, "initialize_dora_magnitude"):
                module.initialize_dora_magnitude()  # DoRA starts from the norms of the loaded base weights
    adapter_missing = adapter_unexpected = None
    if adapter_state is not None:
        check_adapter_fits(model.state_dict(), adapter_state, adapter_source)
        try:
            adapter_missing, adapter_unexpected = load_adapter(adapter_state)
        except (RuntimeError, ConfigError) as err:  # shape mismatch: lora_rank changed since the checkpoint
            raise ConfigError(
                "resume_from_checkpoint", f"the saved adapter does not fit model.lora_rank: resume with the "
                f"LoRA settings it was trained with ({err})") from None
    if hf:
        return  # the base's keys are checked above, the adapter's by check_adapter_fits
    settings = lora_settings(cfg_model)
    validate_missing_and_unexpected_for_lora(
        lora_attn_modules=list(settings.lora_attn_modules), apply_lora_to_mlp=settings.apply_lora_to_mlp,
        apply_lora_to_output=settings.apply_lora_to_output, base_missing=base_missing,
        base_unexpected=base_unexpected, lora_missing=adapter_missing, lora_unexpected=adapter_unexpected,
    )


def lora_checkpoint_state(model: nn.Module, model_state: Dict[str, Any], cfg_model: Any,
                          adapter_only: bool) -> Dict[str, Any]:
    """What a LoRA recipe's checkpoint holds, given the model's full state dict (empty on ranks other than 0).

    torchtune's models: :func:`torchtune_ext.checkpoint.lora_checkpoint_state`
    (the adapter, and unless ``adapter_only`` the merged model in the base's
    format); transformers models: :func:`torchtune_ext.model.hf.lora.lora_checkpoint_state`
    (the adapter in PEFT's format, and the merged model as a Hugging Face folder).
    """
    if is_hf_model(model):
        return _hf_lora().lora_checkpoint_state(model, model_state, adapter_only)
    return checkpoint.lora_checkpoint_state(model_state, cfg_model, adapter_only)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block: every LoRA/DoRA adapter of ``model`` off, back on afterwards.

    What the LoRA preference recipes use as their reference model: the frozen
    base without a second copy in memory. torchtune's models: its
    ``disable_adapter`` (each adapter module's ``disabled`` flag); transformers
    models with PEFT's adapters injected: each PEFT layer's ``enable_adapters``.
    """
    if is_hf_model(model):  # PEFT's layers injected in place: each switches its own adapters
        from peft.tuners.tuners_utils import BaseTunerLayer  # imported with the transformers model already

        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)
        return
    with disable_adapter(model):
        yield
