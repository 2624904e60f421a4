"""Whole state dicts of a sharded model: gathered onto rank 0 for a save, split again on load.

Gathered checkpoints are written in the single-device format: every rank
takes part in gathering the full state dicts (``DTensor.full_tensor`` undoes
both the FSDP2 and the tensor-parallel split), rank 0 receives them (on CPU)
and writes; a load splits them again for whatever mesh the resumed run has, so
a tensor-parallel run resumes on data parallelism alone and back. Sharded
checkpoints (each rank its own shards) are :mod:`torchtune_ext.checkpoint.sharded`.
"""

import contextlib
import logging
import re
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torchtune import training

from torchtune_ext import ranks
from torchtune_ext.checkpoint.rng import rng_state
from torchtune_ext.config.upstream import first_mismatch
from torchtune_ext.errors import ConfigError


def load_full_model_state_dict(
    model: nn.Module,
    full_state_dict: Dict[str, torch.Tensor],
    device: torch.device,
    *,
    cpu_offload: bool = False,
    strict: bool = True,
    source: str = "the checkpoint",
    model_name: Optional[str] = None,
) -> Any:
    """Load an unsharded state dict (e.g. from the HF checkpointer) into a sharded model.

    Every rank passes the full state dict (torchtune checkpointers load it on
    every rank); rank 0's values are broadcast and each rank keeps its shard.
    Non-persistent buffers (the RoPE cache) are rebuilt on ``device`` first,
    since a model built on the meta device has none.

    Args:
        strict: False loads a subset (LoRA: base weights, then the adapter);
            the caller checks the returned keys.
        source: where the weights came from, for error messages.
        model_name: the configured model (:func:`torchtune_ext.config.upstream.describe_model`);
            when given, a misfit names it and the first mismatching key
            (:func:`torchtune_ext.config.upstream.first_mismatch`).

    Returns:
        ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict``.

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) if a key (strict)
            or a shape of the state dict does not fit the model.
        RuntimeError: if a parameter or buffer is still on the meta device afterwards.
    """
    model_state = model.state_dict()
    mismatch = first_mismatch(model_state, full_state_dict) if model_name else None
    if mismatch:
        raise ConfigError("checkpointer.checkpoint_dir", f"the weights in '{source}' do not fit the model "
                          f"{model_name}: {mismatch}. Check that `model` and checkpointer.model_type match the "
                          "checkpoint's architecture.")
    expected = set(model_state)
    unexpected = [key for key in full_state_dict if key not in expected]
    try:
        if strict and unexpected:
            raise RuntimeError(f"Unexpected key(s) in state_dict: {', '.join(unexpected[:5])}")
        with device:
            for module in model.modules():
                if hasattr(module, "rope_init"):
                    module.rope_init()
        # torchtune's loader fails on keys the model lacks: report them instead
        known = {k: v for k, v in full_state_dict.items() if k in expected}
        keys = training.load_from_full_model_state_dict(model, known, device, strict=strict, cpu_offload=cpu_offload)
    except RuntimeError as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines()[:4] if line.strip())
        raise ConfigError(
            "checkpointer.checkpoint_dir",
            f"the weights in '{source}' do not fit the configured model ({detail}). "
            "Check that `model` matches the checkpoint's architecture.",
        ) from err
    training.validate_no_params_on_meta_device(model)
    return _IncompatibleKeys(list(keys.missing_keys), list(keys.unexpected_keys) + unexpected)

# What torch's DTensor says, on every rank, when a gathered save makes a parameter sharded by FSDP2 over a
# tensor-parallel split (placements _StridedShard, Shard) whole: the gather takes one all-gather per mesh
# dimension, "This is suboptimal". It is about speed only (once per save, not per step) and the gathered tensor
# is exact, so the line only alarms. torch 2.13 logs it (torch.distributed.tensor._redistribute); a
# warnings.warn of the same text is silenced too.
_STRIDED_GATHER = re.compile(r"(?s).*_StridedShard.*This is suboptimal")

_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"

def _not_strided_gather_remark(record: logging.LogRecord) -> bool:
    return not _STRIDED_GATHER.match(record.getMessage())

@contextlib.contextmanager
def quiet_strided_gather() -> Iterator[None]:
    """Silence exactly torch's "_StridedShard ... This is suboptimal" remark (see above) while gathering."""
    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    logger.addFilter(_not_strided_gather_remark)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_STRIDED_GATHER.pattern)
            yield
    finally:
        logger.removeFilter(_not_strided_gather_remark)

def gather_full_model_state_dict(model: nn.Module, device: torch.device) -> Dict[str, torch.Tensor]:
    """All ranks gather; rank 0 gets the full state dict on CPU, other ranks ``{}``."""
    with quiet_strided_gather():
        return training.gather_cpu_state_dict(model, is_rank_zero=ranks.is_rank_zero(), device=device)

def gather_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """All ranks gather; rank 0 gets the unsharded optimizer state (keyed by parameter name), others ``{}``."""
    with quiet_strided_gather():  # the moments are sharded as their parameters
        return training.get_full_optimizer_state_dict(model, optimizer, is_rank_zero=ranks.is_rank_zero())

def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, full_state_dict: Dict[str, Any], device: torch.device
) -> None:
    """Shard an optimizer state saved by :func:`gather_full_optimizer_state_dict` into ``optimizer``."""
    training.load_from_full_optimizer_state_dict(model, optimizer, full_state_dict, device)

def gather_rng_states() -> Optional[List[Dict[str, Any]]]:
    """Every rank's RNG states (:func:`torchtune_ext.checkpoint.rng_state`) in rank order, on rank 0.

    Ranks draw different random numbers (torchtune seeds rank ``r`` with
    ``seed + r``; dropout), so an exact resume needs each rank's own state,
    not only rank 0's (:class:`torchtune_ext.checkpoint.ResumeState`). Other ranks get None.
    """
    states = [None] * ranks.process_group_size()
    dist.all_gather_object(states, rng_state())
    return states if ranks.is_rank_zero() else None
