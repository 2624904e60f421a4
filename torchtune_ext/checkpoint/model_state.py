"""Loading a checkpoint's state dict into a model: a misfit is one line naming the checkpoint and the first key."""

from typing import Any, Dict, Optional

import torch

from torchtune_ext.config.upstream import ADAPTER_KEYS, first_mismatch
from torchtune_ext.errors import ConfigError


def check_model_fits(model: torch.nn.Module, state_dict: Dict[str, Any], source: Any, model_name: str) -> None:
    """Compare a checkpoint's keys and shapes with the model's before loading it (adapters it lacks excepted).

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) naming the model and
            the first mismatching key (:func:`torchtune_ext.config.upstream.first_mismatch`).
    """
    mismatch = first_mismatch(model.state_dict(), state_dict)
    if mismatch:
        raise ConfigError("checkpointer.checkpoint_dir", f"the checkpoint in '{source}' does not fit the model "
                          f"{model_name}: {mismatch}. Check that `model` and checkpointer.model_type match the "
                          "checkpoint's architecture.")


def load_model_state(model: torch.nn.Module, state_dict: Dict[str, Any], source: str, strict: bool = True,
                     model_name: Optional[str] = None):
    """``model.load_state_dict`` with a config error, not a traceback, on a misfit.

    Args:
        source: where the weights came from, for the message.
        strict: as in ``load_state_dict``.
        model_name: the configured model, e.g. from
            :func:`torchtune_ext.config.upstream.describe_model`; when given, the
            checkpoint is compared with the model first and a misfit names it
            and the first mismatching key (missing adapter weights excepted).

    Returns:
        what ``load_state_dict`` returns (missing and unexpected keys).

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) if a shape or a key
            of the checkpoint does not fit the model.
    """
    if model_name:
        check_model_fits(model, state_dict, source, model_name)
    try:
        return model.load_state_dict(state_dict, strict=strict)
    except RuntimeError as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip())
        raise ConfigError(
            "checkpointer.checkpoint_dir",
            f"the checkpoint in '{source}' does not fit the configured model ({detail or err}). "
            "Check that `model` matches the checkpoint's architecture.",
        ) from err


def check_adapter_fits(model_state: Dict[str, Any], adapter_state: Dict[str, Any], source: Any) -> None:
    """Refuse a saved adapter whose tensors do not match the model's, in one line, before loading it.

    A LoRA resume whose ``lora_rank``, ``lora_attn_modules``, ``apply_lora_to_mlp``,
    ``apply_lora_to_output`` or ``use_dora`` differ from the saved run's builds
    other adapter tensors. :func:`torchtune_ext.run.resume.check_resume` finds that
    from the saved config before anything loads; this check covers checkpoints
    without one (earlier versions). Replaces the recipes' ``load_state_dict``
    size-mismatch list (one line per tensor) and torchtune's
    ``validate_missing_and_unexpected_for_lora`` assertion for the adapter.

    Args:
        model_state: the LoRA model's ``state_dict()`` (only shapes are read:
            tensors, meta tensors or DTensors, whose shape is the full one).
        adapter_state: the saved adapter in torchtune key names
            (``lora_a``, ``lora_b``, DoRA ``magnitude``).
        source: the checkpoint folder, for the message.

    Raises:
        ConfigError: (key ``resume_from_checkpoint``) naming the first
            mismatching tensor and how many of the adapter's differ.
    """
    model_adapter = {k: v for k, v in model_state.items() if any(part in k for part in ADAPTER_KEYS)}
    problems = []
    for key, value in model_adapter.items():
        if key not in adapter_state:
            problems.append(f"'{key}' is in the model but not in the saved adapter")
        elif tuple(adapter_state[key].shape) != tuple(value.shape):
            problems.append(f"'{key}' has shape {list(adapter_state[key].shape)} in the saved adapter, "
                            f"{list(value.shape)} in the model")
    problems += [f"'{key}' is in the saved adapter but not in the model" for key in adapter_state
                 if key not in model_adapter]
    if problems:
        more = f" ({len(problems) - 1} more of {len(set(model_adapter) | set(adapter_state))} adapter tensors " \
               "differ)" if len(problems) > 1 else ""
        raise ConfigError("resume_from_checkpoint", f"the adapter in '{source}' does not fit this model's LoRA "
                          f"settings: {problems[0]}{more}; resume with the LoRA settings (model.lora_rank, "
                          "lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, use_dora) it was trained with")
