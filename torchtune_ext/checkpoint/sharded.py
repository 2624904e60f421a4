"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes and reads its own shards.

A sharded checkpoint keeps the model and optimizer state in ``step_<N>/dcp/``,
written by ``torch.distributed.checkpoint.save``: one ``__<rank>_<i>.distcp``
file per rank holding that rank's FSDP2 shards, and ``.metadata``, where every
tensor's pieces are. Nothing is gathered: no rank ever holds more than its own
shards (and, while an asynchronous save runs, one CPU copy of them). DCP
reshards on load, so a checkpoint written by 4 ranks loads on 2, on 8 or in
one process (:func:`read_full_tensors`).

The state saved is ``{"model": ..., "optimizer": ...}`` as
``torch.distributed.checkpoint.state_dict`` gives it: the model's keys are
its parameter names (torchtune's names for torchtune models), the optimizer's
state is keyed by those names too, so it does not depend on the order in
which a run built its optimizer.

What is here: the state a rank saves (:func:`local_state`), the saved
tensors' names, shapes and dtypes read from ``.metadata`` without reading a
tensor (:class:`ShardedStateDict`, which the loaders of
:mod:`torchtune_ext.model.build` recognize), loading the shards into a (sharded
or plain) model and optimizer, and reading whole tensors for an export.
"""

import re
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchtune_ext import ranks
from torchtune_ext.config.upstream import ADAPTER_KEYS, first_mismatch
from torchtune_ext.errors import ConfigError
from torchtune_ext.text import short

DCP_DIR = "dcp"
DCP_METADATA = ".metadata"
# recipe_state.pt's "format" of a sharded checkpoint (a gathered one has none)
SHARDED_FORMAT = "dcp"
MODEL, OPTIMIZER = "model", "optimizer"
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def is_sharded(folder: Path) -> bool:
    """Whether a checkpoint folder holds a DCP checkpoint (``dcp/.metadata``)."""
    return (Path(folder) / DCP_DIR / DCP_METADATA).is_file()


def is_adapter_key(key: str) -> bool:
    """A LoRA/DoRA adapter tensor (``lora_a``, ``lora_b``, ``magnitude``; PEFT's ``lora_A``, ``lora_B``)."""
    return any(part in key for part in ADAPTER_KEYS)


def file_owner(name: str) -> int:
    """The rank that wrote a file of a ``dcp/`` folder (``__<rank>_<i>.distcp``); 0 for ``.metadata``.

    Each rank hashes the files it wrote, while they are in its page cache.
    """
    match = _RANK_FILE.match(Path(name).name)
    return int(match.group(1)) if match else 0


class ShardedStateDict(dict):
    """The model tensors of a DCP checkpoint, as meta tensors of their full shape and dtype.

    What :meth:`torchtune_ext.checkpoint.CheckpointManager.load` returns for a
    sharded checkpoint in place of a state dict: the shape checks that compare a
    checkpoint with a model (:func:`torchtune_ext.config.upstream.first_mismatch`,
    :func:`torchtune_ext.checkpoint.check_adapter_fits`) read it like one,
    nothing is read from disk, and the loaders load each rank's shards
    from ``folder`` (:func:`load_model_shards`).

    Attributes:
        folder (Path): the step folder (its ``dcp/`` holds the shards).
    """

    def __init__(self, folder: Path, tensors: Dict[str, torch.Tensor]):
        super().__init__(tensors)
        self.folder = Path(folder)


def saved_tensors(folder: Path, part: str = MODEL) -> Dict[str, torch.Tensor]:
    """The tensors of one part (``model`` or ``optimizer``) of a DCP checkpoint, as meta tensors.

    Reads ``dcp/.metadata`` only. Keys without the part's prefix
    (``layers.0.attn.q_proj.weight``).

    Raises:
        ConfigError: (key ``resume_from_checkpoint``) the metadata cannot be read.
    """
    try:
        metadata = dcp.FileSystemReader(str(Path(folder) / DCP_DIR)).read_metadata()
    except Exception as err:
        raise ConfigError("resume_from_checkpoint", f"'{Path(folder) / DCP_DIR / DCP_METADATA}' cannot be read "
                          f"({short(err)})") from err
    prefix = f"{part}."
    return {key[len(prefix):]: torch.empty(item.size, dtype=item.properties.dtype, device="meta")
            for key, item in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}


def sharded_state_dict(folder: Path, keys: Optional[Iterable[str]] = None) -> ShardedStateDict:
    """:class:`ShardedStateDict` of a checkpoint's model tensors; ``keys``: only these (those present)."""
    tensors = saved_tensors(folder)
    if keys is not None:
        wanted = set(keys)
        tensors = {k: v for k, v in tensors.items() if k in wanted}
    return ShardedStateDict(folder, tensors)


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                keys: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """What this rank saves: ``{"model": ..., "optimizer": ...}``, its own shards (DTensors under FSDP2).

    The tensors are the model's and optimizer's own (no copy): write them
    before the next optimizer step, or copy them first (an asynchronous save
    does, :func:`torch.distributed.checkpoint.async_save`).

    Args:
        keys: the model keys to save (LoRA with ``save_adapter_weights_only``: the adapter); None: all.
    """
    model_state = get_model_state_dict(model)
    if keys is not None:
        wanted = set(keys)
        model_state = {k: v for k, v in model_state.items() if k in wanted}
    return {MODEL: model_state, OPTIMIZER: get_optimizer_state_dict(model, optimizer)}


def local_bytes(state: Any) -> int:
    """Bytes of this rank's part of every tensor in a (nested) state: a DTensor's local shard, not its full size."""
    if isinstance(state, DTensor):
        local = state.to_local()
        return local.numel() * local.element_size()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_bytes(v) for v in state)
    return 0


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device storage on ``device`` (values follow from the checkpoint), and
    rebuild the buffers no checkpoint holds (the RoPE cache)."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        # a transformers model built on meta computed its buffers (RoPE frequencies) on CPU already:
        # to_empty would leave them uninitialized
        computed = {name: b for name, b in model.named_buffers() if not b.is_meta}
        model.to_empty(device=device)
        for name, value in computed.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, value.to(device))
        with device:
            for module in model.modules():
                if hasattr(module, "rope_init"):
                    module.rope_init()


def load_model_shards(model: torch.nn.Module, state: ShardedStateDict, device: torch.device, *,
                      cpu_offload: bool = False, strict: bool = True,
                      model_name: Optional[str] = None) -> Tuple[List[str], List[str]]:
    """Load the tensors ``state`` names from its checkpoint into ``model``: each rank reads its own shards.

    Works on an FSDP2 model (every rank calls it: DCP plans the reads
    together) and on a plain one in one process. The names and shapes are
    compared first, before anything is read or allocated: a checkpoint of
    another model is one config error. Then a model on the meta device is
    given storage on ``device`` (CPU with ``cpu_offload``).

    Args:
        state: from :func:`sharded_state_dict`; its keys are what is loaded.
        strict: every key of the model must be in ``state``.
        model_name: the configured model, for the message of a misfit
            (:func:`torchtune_ext.config.upstream.describe_model`).

    Returns:
        ``(missing_keys, unexpected_keys)``: the model's keys ``state`` lacks; ``state``'s keys the model lacks.

    Raises:
        ConfigError: (key ``resume_from_checkpoint``) another model's checkpoint
            (a tensor missing with ``strict``, or of another shape), or one that cannot be read.
    """
    own = model.state_dict()  # names and shapes only (meta tensors or DTensors of the full shape)
    mismatch = first_mismatch(own, state) if strict else next(
        (f"'{k}' has shape {list(state[k].shape)} in the checkpoint, {list(own[k].shape)} in the model"
         for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)), None)
    if mismatch:
        raise ConfigError("resume_from_checkpoint", f"'{state.folder}' was saved from another model than "
                          f"{model_name or 'the configured one'}: {mismatch}. Resume with the model it was trained "
                          "with, or start the new model in another output_dir")
    _materialize(model, torch.device("cpu") if cpu_offload else device)
    own = get_model_state_dict(model)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wanted = {k: v for k, v in own.items() if k in state}
    try:
        dcp.load({MODEL: wanted}, checkpoint_id=str(state.folder / DCP_DIR), no_dist=not ranks.in_process_group())
    except BaseException as err:  # DCP reports a failed read as CheckpointException, a BaseException
        if not isinstance(err, Exception) and type(err).__name__ != "CheckpointException":
            raise
        raise ConfigError("resume_from_checkpoint", f"the shards in '{state.folder / DCP_DIR}' cannot be read "
                          f"({_first_failure(err)})") from None
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return missing, unexpected


def load_optimizer_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load a DCP checkpoint's optimizer state into ``optimizer`` (each rank its shards; any world size).

    The optimizer's state is created first if it has none (a step with zero
    gradients and learning rate 0, which leaves the parameters as they are:
    ``torch.distributed.checkpoint.state_dict``), then overwritten by the
    saved one; its hyper-parameters are the saved ones until the caller
    puts the config's back (:func:`torchtune_ext.run.resume.restore_training`).

    Raises:
        KeyError, RuntimeError, ValueError: the saved state does not fit the
            optimizer's parameters (another model or recipe).
        ConfigError: (key ``resume_from_checkpoint``) the shards cannot be read.
    """
    state = get_optimizer_state_dict(model, optimizer)
    try:
        with warnings.catch_warnings():  # in one process: "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({OPTIMIZER: state}, checkpoint_id=str(Path(folder) / DCP_DIR),
                     no_dist=not ranks.in_process_group())
    except BaseException as err:
        if not isinstance(err, Exception) and type(err).__name__ != "CheckpointException":
            raise
        failure = _unwrap(err)
        if isinstance(failure, (KeyError, RuntimeError, ValueError)):
            raise failure from None  # a misfit: the caller's message says which checkpoint
        raise ConfigError("resume_from_checkpoint", f"the optimizer shards in '{Path(folder) / DCP_DIR}' cannot "
                          f"be read ({_first_failure(err)})") from None
    set_optimizer_state_dict(model, optimizer, state)


def read_full_tensors(folder: Path, tensors: Dict[str, torch.Tensor], part: str = MODEL) -> Dict[str, torch.Tensor]:
    """Whole tensors of a DCP checkpoint on CPU, read in this process alone (no collective).

    Args:
        folder: the step folder.
        tensors: name -> a tensor of the saved shape and dtype (meta tensors
            from :func:`saved_tensors`); only these are read.

    Returns:
        name -> the tensor, assembled from every rank's shard.
    """
    out = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in tensors.items()}
    if out:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({part: out}, checkpoint_id=str(Path(folder) / DCP_DIR), no_dist=True)
    return out


def _unwrap(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` (``err`` itself otherwise)."""
    failures = getattr(err, "failures", None)
    if failures:
        return failures[min(failures)][0]
    return err


def failed_ranks(err: BaseException) -> Dict[int, BaseException]:
    """Rank -> exception of a DCP ``CheckpointException`` (``{this rank: err}`` for any other error)."""
    failures = getattr(err, "failures", None)
    if failures:
        return {rank: pair[0] for rank, pair in failures.items()}
    return {ranks.rank(): err}


def _first_failure(err: BaseException) -> str:
    return short(_unwrap(err))
