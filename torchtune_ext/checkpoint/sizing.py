"""How many bytes a checkpoint takes, and which steps of the run will save one: the start-up disk check."""

from typing import Any, List

import torch
from omegaconf import DictConfig

from torchtune_ext import ranks
from torchtune_ext.checkpoint.progress import Progress


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) state dict; a DTensor counts its full, unsharded size."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _optimizer_states_per_parameter(optimizer: torch.optim.Optimizer) -> int:
    """Tensors the size of a parameter an optimizer keeps per parameter (Adam: 2 moments)."""
    defaults = optimizer.defaults
    if "betas" in defaults:  # the Adam family: first and second moments (+ max for amsgrad)
        return 2 + int(bool(defaults.get("amsgrad", False)))
    if "momentum" in defaults:  # SGD, RMSprop: a momentum buffer only with momentum
        return int(bool(defaults["momentum"])) + int("alpha" in defaults)
    return 2  # unknown: assume an Adam-like optimizer


def expected_checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                              lora: bool = False, adapter_only: bool = False) -> int:
    """About how many bytes one checkpoint of ``model`` and ``optimizer`` takes on disk.

    Full fine-tune: the model's state dict plus the optimizer state. LoRA: the
    adapter twice (torchtune's ``.pt`` and PEFT's ``.safetensors``), the merged
    model unless ``adapter_only``, and the adapter's optimizer state. The
    optimizer state is estimated before it exists (it is created at the
    first step): parameter-sized tensors per trainable parameter, 2 for the
    Adam family. Sizes are the full, unsharded ones.

    Returns:
        bytes: the tensors, plus the small entries measured on written checkpoints (each
        rank's RNG states, about 15 KiB, kept twice for rank 0; the progress and config;
        the JSON files; a safetensors header entry per tensor), with room to spare. The
        config and tokenizer files copied into each checkpoint are added by
        :meth:`CheckpointManager.announce`.
    """
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = model.state_dict()
    weights = tensor_bytes(state)
    if lora:
        weights = 2 * trainable + (0 if adapter_only else weights - trainable)
    small = 64 * 2**10 + 32 * 2**10 * ranks.process_group_size() + 256 * len(state)
    return weights + _optimizer_states_per_parameter(optimizer) * trainable + small


def planned_save_steps(progress: Progress, loader: Any, cfg: DictConfig) -> List[int]:
    """Optimizer steps after which the rest of the run will save a checkpoint.

    Every ``save_every_n_steps``-th step and every epoch end (the last one
    only with ``save_final_checkpoint``), from ``progress`` on; ``loader`` as
    in :meth:`Progress.plan`.
    """
    total = progress.total_steps
    steps = set(range(progress.step + 1, total + 1))
    periodic = {s for s in steps if cfg.save_every_n_steps and s % cfg.save_every_n_steps == 0}
    ends, step = set(), progress.step
    if progress.epoch < cfg.epochs:
        step += loader.remaining_steps(progress.samples_in_epoch, progress.steps_in_epoch)
        for epoch in range(progress.epoch, cfg.epochs):
            if epoch + 1 < cfg.epochs or cfg.save_final_checkpoint:
                ends.add(step)
            step += loader.steps_per_epoch
    return sorted(periodic | ends)
