"""What a training run asks of its checkpoints besides writing them: room at start-up, the optimizer
state's loader at a resume, and a save of the run's model and optimizer, gathered or sharded.

The loop (:mod:`torchtune_ext.run.loop`) calls these with its model and
optimizer; which layout a save takes (one process, gathered onto rank 0,
each rank's shards) is decided here, from the config and the run, so the
loop only says when to save and the recipe what its model's state is.
"""

import shutil
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig
from torchtune.utils import get_logger

from torchtune_ext import ranks
from torchtune_ext.checkpoint.discovery import list_checkpoints
from torchtune_ext.checkpoint.files import existing_parent
from torchtune_ext.checkpoint.hf_export import export_hf
from torchtune_ext.checkpoint.progress import Progress
from torchtune_ext.checkpoint.resume_state import ResumeState
from torchtune_ext.checkpoint.sharded import is_adapter_key, load_optimizer_shards
from torchtune_ext.checkpoint.sizing import expected_checkpoint_bytes, planned_save_steps, save_memory_bytes
from torchtune_ext.checkpoint.state_dict import (
    gather_full_optimizer_state_dict,
    gather_rng_states,
    load_full_optimizer_state_dict,
)
from torchtune_ext.checkpoint.writer import CheckpointManager
from torchtune_ext.errors import ConfigError, DiskSpaceError
from torchtune_ext.text import format_bytes

log = get_logger()


def check_room(manager: CheckpointManager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               progress: Progress, loader: Any, cfg: DictConfig, *, lora: bool, distributed: bool,
               available_memory: Callable[..., Optional[int]]) -> None:
    """At start-up: refuse to start without disk space for one checkpoint, or the CPU memory to save it.

    Sizes one checkpoint of ``model`` and ``optimizer`` as this run will
    write it (:func:`expected_checkpoint_bytes`: LoRA's adapter and merged
    model, ``save_adapter_weights_only``, sharded or not) and the CPU memory a
    save holds (:func:`save_memory_bytes`), then :func:`announce`.

    Args:
        available_memory: ``(device, per_process=...) -> bytes or None``
            (:func:`torchtune_ext.train.memory.available_memory_bytes`), asked
            for the CPU's only when a save needs memory of its own: a gathered
            save rank 0's alone, an asynchronous one every rank's at once.

    Raises:
        as :func:`announce`.
    """
    adapter_only = bool(cfg.get("save_adapter_weights_only", False))
    sharded = bool(cfg.get("sharded_checkpoints", False))
    asynchronous = sharded and bool(cfg.get("enable_async_checkpointing", False))
    size = expected_checkpoint_bytes(model, optimizer, lora=lora, adapter_only=adapter_only, sharded=sharded)
    held = save_memory_bytes(model, optimizer, distributed=distributed, sharded=sharded, asynchronous=asynchronous,
                             lora=lora, adapter_only=adapter_only)
    available = available_memory(torch.device("cpu"), per_process=asynchronous) if held else None
    announce(manager, size, progress, loader, cfg, save_memory=(held, available))


def optimizer_state_loader(resumed: ResumeState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           distributed: bool, device: torch.device) -> Optional[Callable[[Dict[str, Any]], None]]:
    """How a resume puts the checkpoint's optimizer state into ``optimizer``; None: ``optimizer.load_state_dict``.

    A sharded checkpoint: each rank reads its own shards, at any world size
    (:func:`torchtune_ext.checkpoint.sharded.load_optimizer_shards`); a
    gathered one under FSDP2: each rank takes its shard of the full state
    (:func:`load_full_optimizer_state_dict`); one process: the state as saved.
    """
    if resumed.sharded:
        return lambda _: load_optimizer_shards(model, optimizer, resumed.path)
    if distributed:
        return partial(load_full_optimizer_state_dict, model, optimizer, device=device)
    return None


def save_gathered(manager: CheckpointManager, state: Dict[str, Any], model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, progress: Progress, *, distributed: bool,
                  adapter_only: bool = False, suspect_from: Optional[int] = None) -> Path:
    """Save ``state`` (the recipe's model or adapter weights, gathered) with the optimizer, progress and RNG states.

    Under FSDP2 every rank takes part in gathering the optimizer state and
    the RNG states, and rank 0 writes (:meth:`CheckpointManager.save`).
    Returns the step folder.
    """
    if distributed:
        optimizer_state = gather_full_optimizer_state_dict(model, optimizer)
        rng_by_rank = gather_rng_states()
    else:
        optimizer_state, rng_by_rank = optimizer.state_dict(), None
    return manager.save(state, progress, optimizer_state, rng_by_rank=rng_by_rank, adapter_only=adapter_only,
                        suspect_from=suspect_from)


def save_sharded(manager: CheckpointManager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 progress: Progress, cfg: DictConfig, *, lora: bool, distributed: bool,
                 suspect_from: Optional[int] = None) -> Path:
    """Save a sharded checkpoint (``sharded_checkpoints``): every rank writes its own shards, nothing is gathered.

    What it holds: the model's state (LoRA with ``save_adapter_weights_only``:
    the adapter alone; otherwise the base weights too, so that the last
    checkpoint can be merged), the optimizer's, and as :func:`save_gathered`
    the progress and every rank's RNG states. The run's last checkpoint also
    becomes a Hugging Face folder, written from the shards file by file
    (:func:`torchtune_ext.checkpoint.hf_export.export_hf`). With
    ``enable_async_checkpointing`` every other save returns once the shards
    are copied, and training goes on while they are written
    (:meth:`CheckpointManager.save_sharded`). Returns the step folder.
    """
    adapter_only = lora and bool(cfg.get("save_adapter_weights_only", False))
    keys = [name for name, p in model.named_parameters() if p.requires_grad] if adapter_only else None
    final = progress.epoch >= cfg.epochs  # the end of training (a stop's save is not)
    export = export_bytes = None
    if final:
        export = partial(_export_step, cfg=cfg, adapter_only=adapter_only)
        export_bytes = 0 if adapter_only else sum(
            p.numel() * p.element_size() for name, p in model.state_dict().items() if not is_adapter_key(name))
    rng_by_rank = gather_rng_states() if distributed else None
    return manager.save_sharded(model, optimizer, progress, rng_by_rank=rng_by_rank, keys=keys, export=export,
                                export_bytes=export_bytes or 0,
                                asynchronous=bool(cfg.enable_async_checkpointing) and not final,
                                suspect_from=suspect_from)


def _export_step(folder: Path, rank: int, world_size: int, *, cfg: DictConfig, adapter_only: bool) -> list:
    """Rank ``rank``'s share of the Hugging Face folder of the sharded checkpoint in ``folder`` (its staging folder)."""
    return export_hf(folder, folder, cfg.checkpointer, cfg.model, adapter_only=adapter_only, rank=rank,
                     world_size=world_size)


def announce(manager: CheckpointManager, checkpoint_bytes: int, progress: Progress, loader: Any,
             cfg: DictConfig, save_memory: Tuple[int, Optional[int]] = (0, None)) -> None:
    """Log the disk use to expect at start-up; refuse to start without room for one checkpoint.

    Call it on every rank (one collective), after the manager's ``load``. Removes the
    empty staging folder that building the checkpointer made.

    Args:
        checkpoint_bytes: one checkpoint's tensors (:func:`expected_checkpoint_bytes`); the
            copied config and tokenizer files are added here.
        progress: where the run starts (``total_steps`` already planned).
        loader: the run's :class:`torchtune_ext.data.step_loader.StepLoader`.
        cfg: the recipe config (``epochs``, ``save_every_n_steps``, ``save_final_checkpoint``).
        save_memory: this rank's ``(bytes, available)``: the CPU memory a
            save needs on top of training (:func:`save_memory_bytes`) and
            the memory available (None: unknown).

    Raises:
        DiskSpaceError: if ``output_dir`` has less free space than one checkpoint.
        ConfigError: (key ``sharded_checkpoints``) rank 0 has not the CPU
            memory to gather a checkpoint; (``enable_async_checkpointing``)
            a rank has not the memory to copy its shards; on every rank.
    """
    checkpoint_bytes += manager.copied_bytes()
    saves = len(planned_save_steps(progress, loader, cfg))
    existing = len(list_checkpoints(str(manager.output_dir)))
    on_disk = existing + saves
    if manager.keep_last_n is not None:  # a new checkpoint is complete before the oldest goes
        on_disk = min(on_disk, manager.keep_last_n + 1)
    to_come = max(on_disk - existing, 0)  # the free space already excludes the existing ones
    # Rank 0's figure on every rank, so that all ranks refuse together. By then every rank
    # has built its checkpointer (load), which makes the staging folder; see below.
    free = ranks.from_rank_zero(shutil.disk_usage(existing_parent(manager.output_dir)).free)
    if free < checkpoint_bytes:
        raise DiskSpaceError("output_dir", f"not enough free disk space for one checkpoint in "
                             f"'{manager.output_dir}': it needs about {format_bytes(checkpoint_bytes)}, "
                             f"{format_bytes(free)} are free. Free some space or choose another output_dir")
    _check_save_memory(manager, save_memory, saves)
    kept = (f"the newest {manager.keep_last_n} kept" if manager.keep_last_n is not None else "none deleted")
    line = (f"Checkpoints: about {format_bytes(checkpoint_bytes)} each, {saves} to write, {kept} "
            f"(keep_last_n_checkpoints={manager.keep_last_n if manager.keep_last_n is not None else 'null'}): "
            f"up to {format_bytes(on_disk * checkpoint_bytes)} in '{manager.output_dir}', "
            f"{format_bytes(free)} free")
    if not ranks.is_rank_zero():
        return
    try:  # each save makes it again: a run that saves nothing leaves no empty staging folder
        manager.staging.rmdir()
    except OSError:
        pass  # not empty: an interrupted save's, which the next save clears
    if free < to_come * checkpoint_bytes:
        # a new checkpoint is complete before the oldest goes: with 1 kept, 2 are on disk at times
        lower = "lower keep_last_n_checkpoints or " if manager.keep_last_n is None or manager.keep_last_n > 1 else ""
        log.warning(f"{line}: not enough for all of them; {lower}free some space")
    else:
        log.info(line)

def _check_save_memory(manager: CheckpointManager, save_memory: Tuple[int, Optional[int]], saves: int) -> None:
    """Refuse on every rank when some rank has not the CPU memory one save needs (see :func:`check_room`)."""
    every = ranks.from_every_rank(tuple(save_memory))
    short = [(rank, need, free) for rank, (need, free) in enumerate(every) if free is not None and need > free]
    if saves and short:
        rank, need, free = short[0]
        if manager.sharded_saves:
            raise ConfigError("enable_async_checkpointing", f"rank {rank} copies its shards to CPU memory to "
                              f"save in the background: about {format_bytes(need)}, {format_bytes(free)} "
                              "available. Set enable_async_checkpointing=false (the shards are written from "
                              "where they are)")
        raise ConfigError("sharded_checkpoints", f"a gathered checkpoint puts the whole model and optimizer "
                          f"state in rank 0's CPU memory: about {format_bytes(need)}, {format_bytes(free)} "
                          "available. Set sharded_checkpoints=true (each rank writes its own shards)")
    if ranks.is_rank_zero() and save_memory[0]:
        where = "each rank's shards copied" if manager.sharded_saves else "gathered on rank 0"
        log.info(f"Each save holds about {format_bytes(save_memory[0])} of CPU memory ({where}); "
                 f"{format_bytes(save_memory[1]) if save_memory[1] is not None else 'unknown'} available")
