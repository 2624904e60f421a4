"""How many bytes a checkpoint takes on disk and in CPU memory while it is saved, and which steps of the run
will save one: the start-up disk and memory checks."""

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
                              lora: bool = False, adapter_only: bool = False, sharded: bool = False) -> int:
    """About how many bytes one checkpoint of ``model`` and ``optimizer`` takes on disk.

    Full fine-tune: the model's state dict plus the optimizer state. LoRA: the
    adapter twice (torchtune's ``.pt`` and PEFT's ``.safetensors``), the merged
    model unless ``adapter_only``, and the adapter's optimizer state. The
    optimizer state is estimated before it exists (it is created at the
    first step): parameter-sized tensors per trainable parameter, 2 for the
    Adam family. Sizes are the full, unsharded ones.

    ``sharded`` (:mod:`torchtune_ext.checkpoint.sharded`): the shards of all
    ranks add up to the same tensors once (a LoRA model's base weights
    included unless ``adapter_only``), plus the optimizer state; the last
    checkpoint also holds the Hugging Face folder exported from them (the
    model, or the merged model and the adapter twice), which is counted
    here so that the start-up check leaves room for it; DCP's entries cost
    ~2.5 KiB per tensor and rank on top.

    A weight tied to another (an output projection that is the token embedding) counts once in a
    Hugging Face folder, as it is written.

    Returns:
        bytes: the tensors, plus the small entries measured on written checkpoints (each
        rank's RNG states, about 15 KiB, kept twice for rank 0; the progress and config;
        the JSON files; a safetensors header entry per tensor), with room to spare. The
        config and tokenizer files copied into each checkpoint are added by
        :meth:`CheckpointManager.announce`.
    """
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = model.state_dict(keep_vars=True)  # the parameters themselves: a tied weight is one object under two keys
    # A tied embedding (transformers' lm_head.weight is embed_tokens.weight) is written once to a Hugging
    # Face folder (save_pretrained and safetensors drop the alias); DCP's shards hold every key
    weights = tensor_bytes(list({id(t): t for t in state.values()}.values()))
    if sharded:
        shards = trainable if lora and adapter_only else tensor_bytes(state)
        weights = shards + (2 * trainable + (0 if adapter_only else weights - trainable) if lora else weights)
    elif lora:
        weights = 2 * trainable + (0 if adapter_only else weights - trainable)
    small = 64 * 2**10 + 32 * 2**10 * ranks.process_group_size() + 256 * len(state)
    states_per_parameter = _optimizer_states_per_parameter(optimizer)
    if sharded:
        # DCP writes each saved tensor as an entry of its own in every rank's file (measured: ~1.8 KiB of
        # header per entry and rank) and lists every rank's piece in .metadata (~250 B): the model's
        # tensors, and per trainable parameter its optimizer states and Adam's step count
        trained = sum(1 for p in model.parameters() if p.requires_grad)
        entries = (trained if lora and adapter_only else len(state)) + (states_per_parameter + 1) * trained
        small += entries * (2 * 2**10 + 512) * ranks.process_group_size()
    return weights + states_per_parameter * trainable + small


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part: a DTensor's local shard, a plain tensor whole."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def save_memory_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, distributed: bool,
                      sharded: bool = False, asynchronous: bool = False, lora: bool = False,
                      adapter_only: bool = False) -> int:
    """CPU memory this rank needs, on top of training, while it saves a checkpoint (bytes).

    * a distributed recipe's gathered save: rank 0 receives the whole model
      and optimizer state in CPU memory before writing it, about the
      checkpoint's size (:func:`expected_checkpoint_bytes`; measured on 4
      ranks, SmolLM2-135M with AdamW: +1,573 MiB on rank 0 for a 1.6 GB
      checkpoint, ``python -m bench.sharded_save``); other ranks 0;
    * an asynchronous sharded save: each rank copies its own shards of the
      model and optimizer state to CPU memory and writes them from there
      while training goes on;
    * a synchronous sharded save, or one process's save (its tensors are
      written from where they are): 0.

    The optimizer state is estimated before it exists, as in :func:`expected_checkpoint_bytes`.
    """
    if not distributed or (sharded and not asynchronous):
        return 0
    if not sharded:
        if not ranks.is_rank_zero():
            return 0
        return expected_checkpoint_bytes(model, optimizer, lora=lora, adapter_only=adapter_only)
    trainable = sum(_local_bytes(p) for p in model.parameters() if p.requires_grad)
    weights = trainable if lora and adapter_only else sum(_local_bytes(t) for t in model.state_dict().values())
    return weights + _optimizer_states_per_parameter(optimizer) * trainable


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
