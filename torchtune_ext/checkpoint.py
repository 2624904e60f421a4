"""Atomic, resumable checkpoints: ``<output_dir>/step_<N>/``.

A checkpoint folder holds the model in the same format as the base checkpoint
(written by the configured torchtune checkpointer: HF safetensors plus the
base folder's config and tokenizer files; for LoRA the merged model unless
turned off, and the adapter in ``adapter/``, see :func:`arrange_lora_folder`),
``recipe_state.pt`` (what :class:`ResumeState`
describes: step counters and data position, the full optimizer state, every
rank's RNG states, the world size and the config of the run that wrote it)
and ``checkpoint.json``, a manifest of every other file with its size and
its SHA-256, computed right after the files are written (while they are
still in the page cache: about 1.4 GiB/s on a CPU with SHA extensions).
A resume checks sizes always and the SHA-256 of every file unless
``verify_checkpoint_hashes: false`` (:func:`verify_checkpoint`), so a file
damaged at the same size (a bad sector, a partial copy over it) is refused
before anything loads; checkpoints of earlier versions, without hashes, are
checked by size only.

Writes are atomic: the torchtune checkpointer writes into
``<output_dir>/.staging/``; the manifest is written last; then the folder is
renamed to ``step_<N>``. Free space is checked against the checkpoint's size
first; a save that fails (a full disk included, and the steps before and
after the write: clearing an old staging folder, the rename, syncing the
folder) removes its staging folder and leaves the previous checkpoints intact.
Old checkpoints are pruned (``keep_last_n_checkpoints``) only after the new one
is complete (one that cannot be deleted is a warning), and the newest is never
pruned. Only ``step_<N>`` folders with a valid manifest are
ever resumed from.

Resuming a full fine-tune loads the model from the step folder. Resuming LoRA
loads the base weights from the base checkpoint again and the adapter from
the step folder's ``adapter/adapter_model.pt``: the merged model there already holds
the adapter (and is absent with ``save_adapter_weights_only``).
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config
from torchtune import training
from torchtune.utils import get_logger

from torchtune_ext import ranks
from torchtune_ext.config import lora_settings
from torchtune_ext.errors import CheckpointSaveError, ConfigError, DiskSpaceError, OutputWriteError
from torchtune_ext.text import format_bytes, short
from torchtune_ext.tokenizer import training_chat_template, write_chat_template
from torchtune_ext.upstream import ADAPTER_KEYS, first_mismatch

log = get_logger()  # torchtune's logger, which the recipes' lines go through too

MANIFEST = "checkpoint.json"
RECIPE_STATE = "recipe_state.pt"
# A LoRA checkpoint keeps its adapter in a subfolder: the step folder itself
# then loads as the merged model (transformers attaches any adapter_config.json
# it finds beside model weights), and the subfolder as a PEFT adapter.
ADAPTER_DIR = "adapter"
# The adapter in torchtune's key names, read on resume (beside it in adapter/:
# adapter_model.safetensors in PEFT's names, adapter_config.json).
ADAPTER_WEIGHTS = f"{ADAPTER_DIR}/adapter_model.pt"
_TORCHTUNE_ADAPTER_FILES = ("adapter_model.pt", "adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")
STAGING = ".staging"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# The manifest's entry of per-file content hashes: name -> SHA-256 hex digest. SHA-256 rather than
# BLAKE2: hashlib's OpenSSL SHA-256 uses the CPU's SHA instructions (x86 SHA-NI, ARMv8), measured
# 1.36 GiB/s against BLAKE2b's 0.44 GiB/s on this project's CPU.
HASHES = "sha256"


@dataclass
class Progress:
    """Where training stands, saved with every checkpoint.

    Attributes:
        step (int): optimizer steps completed (global, 1-based count).
        epoch (int): current epoch, 0-based.
        steps_in_epoch (int): optimizer steps completed within ``epoch`` (for
            ``max_steps_per_epoch``).
        samples_in_epoch (int): samples of ``epoch``'s order trained on so far,
            all ranks: the data position, independent of batch size,
            accumulation and world size.
        skipped_steps (int): optimizer steps skipped so far (empty/non-finite).
        seed (int): the run's seed (model initialization, LoRA adapters, dropout).
        data_seed (int): the seed of the epochs' sample order: 0, whatever ``seed`` is, as
            torchtune's recipes give their ``DistributedSampler``; a checkpoint of an
            earlier version, whose order followed ``seed``, keeps its order on resume.
        tokens_seen (int): trainable tokens (after the label shift, all ranks)
            of the optimizer steps that updated the model so far.
        total_steps (int): optimizer steps of the whole run, the length the
            LR schedule is built for (0: not known yet).
    """

    step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    samples_in_epoch: int = 0
    skipped_steps: int = 0
    seed: int = 0
    data_seed: int = 0
    tokens_seen: int = 0
    total_steps: int = 0

    def complete_step(self, skipped: bool, end_sample: int, num_tokens: int = 0) -> None:
        """Count a finished optimizer step (``skipped``: it did not update) that
        ended at sample ``end_sample`` of the epoch's order and trained on
        ``num_tokens`` trainable tokens."""
        self.step += 1
        self.steps_in_epoch += 1
        self.samples_in_epoch = end_sample
        self.skipped_steps += bool(skipped)
        if not skipped:
            self.tokens_seen += num_tokens

    def complete_epoch(self) -> None:
        self.epoch += 1
        self.steps_in_epoch = 0
        self.samples_in_epoch = 0

    def plan(self, loader: Any, epochs: int) -> int:
        """Set and return :attr:`total_steps`: the steps done plus those ``loader`` will run.

        Args:
            loader: a :class:`torchtune_ext.data.StepLoader` (``steps_per_epoch``,
                ``remaining_steps``) with this run's batch size, accumulation
                and world size.
            epochs: the run's ``epochs``.

        With the settings the run started with this is ``epochs *
        steps_per_epoch``; after a resume with another global batch size, the
        steps already done keep their count and the rest is counted anew.
        """
        left = 0
        if self.epoch < epochs:
            left = loader.remaining_steps(self.samples_in_epoch, self.steps_in_epoch)
            left += (epochs - self.epoch - 1) * loader.steps_per_epoch
        self.total_steps = self.step + left
        return self.total_steps


def rng_state() -> Dict[str, Any]:
    """RNG states of Python, NumPy, torch CPU and (if present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _unreadable_folder(folder: Path, err: OSError) -> ConfigError:
    """The error for a folder of ``output_dir`` whose entries cannot be read (permissions, a failing disk)."""
    return ConfigError("output_dir", f"'{folder}' cannot be read ({short(err)}), so the checkpoints in it cannot "
                       f"be listed or checked; give this user read access to it (e.g. chmod u+rwx '{folder}') or "
                       "move it out of the output_dir")


def _step_folders(output_dir: str) -> List[tuple]:
    """``(step, folder, complete)`` of every ``step_<N>`` folder under ``output_dir``, by step.

    ``complete``: the folder holds a manifest (a save renames only complete folders into place).

    Raises:
        ConfigError: (key ``output_dir``) if ``output_dir`` or a step folder cannot be read: a
            folder that cannot be looked into may be the newest checkpoint, so no resume can be
            trusted to start from the right one.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    try:
        children = sorted(root.iterdir())
    except OSError as err:
        raise _unreadable_folder(root, err) from None
    found = []
    for child in children:
        match = _STEP_DIR.match(child.name)
        if not match:
            continue
        try:
            if child.is_dir():
                found.append((int(match.group(1)), child, (child / MANIFEST).is_file()))
        except OSError as err:  # is_file raises for EACCES (pathlib ignores only "not found" errors)
            raise _unreadable_folder(child, err) from None
    return sorted(found, key=lambda item: item[0])


def list_checkpoints(output_dir: str) -> List[Path]:
    """Complete checkpoint folders under ``output_dir``, oldest first.

    Raises:
        ConfigError: (key ``output_dir``) if a folder cannot be read (:func:`_step_folders`).
    """
    return [path for _, path, complete in _step_folders(output_dir) if complete]


def incomplete_checkpoints(output_dir: str) -> List[Path]:
    """``step_<N>`` folders under ``output_dir`` without a manifest, oldest first.

    A save renames a complete folder into place, so these were not written
    by a save of this project (a copy, a partial delete). They are never
    resumed from, pruned or written into.

    Raises:
        ConfigError: (key ``output_dir``) if a folder cannot be read.
    """
    return [path for _, path, complete in _step_folders(output_dir) if not complete]


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def intact_before(path: Path, content: bool = False) -> str:
    """A sentence for errors about checkpoint ``path``: the newest earlier checkpoint that is intact, if any.

    ``content``: "intact" includes the files' SHA-256 (as :func:`verify_checkpoint`).
    """
    try:
        earlier_ones = list_checkpoints(str(path.parent))
    except ConfigError:  # this sentence only completes another error
        return " The earlier checkpoints of this run cannot be listed."
    for earlier in reversed(earlier_ones):
        if _step_of(earlier) >= _step_of(path):
            continue
        if _read_manifest(earlier, content)[1] is not None:
            continue
        return (f" The previous checkpoint '{earlier}' is intact: move '{path.name}' out of the output_dir to "
                "resume from it.")
    return " No earlier checkpoint of this run is intact."


def verify_checkpoint(path: Path, content: bool = False, key: str = "resume_from_checkpoint") -> Dict[str, Any]:
    """Check a checkpoint folder against its manifest.

    Args:
        path: the checkpoint folder.
        content: also compare every file's SHA-256 with the one recorded at
            save (reads every byte: about 1 s per 1.4 GiB from the page cache,
            disk speed otherwise). Manifests of earlier versions hold no
            hashes; their files are checked by size only.
        key: the config key the error names (evaluating a folder: ``checkpointer.checkpoint_dir``).

    Returns:
        dict: the manifest.

    Raises:
        ConfigError: (key ``key``) if the manifest is missing or unreadable,
            or a listed file is missing, has another size, cannot be read or
            (``content``) has another SHA-256; the message names the file and
            says whether an earlier checkpoint is intact.
    """
    manifest, problem = _read_manifest(path, content)
    if problem:
        raise ConfigError(key, problem + "." + intact_before(path, content))
    return manifest


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of a file's bytes, read in blocks (constant memory).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_manifest(path: Path, content: bool = False):
    """(manifest, None) if ``path`` matches its manifest, else (None, what is wrong).

    ``content``: compare the SHA-256 of the files too, where the manifest records them.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = dict(manifest["files"])
        hashes = dict(manifest.get(HASHES) or {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"checkpoint '{path}' has no readable {MANIFEST}: {err}"
    for name, size in files.items():
        if name == MANIFEST:
            continue  # listed (with a stale size) by checkpoints that resumed runs of earlier versions wrote
        file = path / name
        try:
            if not file.is_file():
                return None, f"checkpoint '{path}' is missing '{name}'"
            actual = file.stat().st_size
        except OSError as err:
            return None, f"checkpoint '{path}': '{name}' cannot be read ({short(err)})"
        if actual != size:
            return None, (f"checkpoint '{path}': '{name}' has {actual} bytes, manifest says {size} "
                          "(truncated or replaced)")
    if content:
        for name, digest in hashes.items():
            if name not in files:
                continue  # the files listed are the checkpoint; a hash alone names nothing to check
            try:
                actual_digest = file_sha256(path / name)
            except OSError as err:
                return None, f"checkpoint '{path}': '{name}' cannot be read ({short(err)})"
            if actual_digest != digest:
                return None, (f"checkpoint '{path}': '{name}' is damaged: its content differs from what was "
                              "saved (SHA-256 mismatch, same size)")
    return manifest, None


def latest_checkpoint(output_dir: str) -> Optional[Path]:
    """The newest complete checkpoint under ``output_dir``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not ranks.several_processes():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_failed(what: str, output_dir: Any, err: OSError, step: Optional[int] = None,
                 finished: bool = False) -> OutputWriteError:
    """The error for a failed write of ``what`` during training, naming the checkpoint to resume from.

    Args:
        what: the file, e.g. ``"the metrics of step 7 to 'out/logs/metrics.jsonl'"``.
        output_dir: the run's output folder.
        err: the write's error (``errno.ENOSPC``: the disk is full).
        step: the last optimizer step trained.
        finished: the write came after the last step (the metric logger's closing
            writes): nothing is to be resumed, the newest checkpoint is the result.
    """
    full = _is_disk_full(err)
    fix = "free some space" if full else "fix the cause"
    try:
        latest = latest_checkpoint(str(output_dir))
    except ConfigError:
        latest = None
    cause = "the disk is full" if full else short(err)
    if finished:
        kept = f"{latest} is complete" if latest is not None else "no checkpoint was saved"
        return OutputWriteError(f"writing {what} failed ({cause}) after training finished: {kept}, and every "
                                f"step's metrics are in {Path(output_dir) / 'logs' / 'metrics.jsonl'}; {fix}")
    after = f" after step {step}" if step is not None else ""
    if latest is None:
        then = f"no checkpoint of this run exists yet: {fix}, then start the run again"
    else:
        first = _step_of(latest) + 1
        lost = ("" if step is None or first > step else f" (step {step} is trained again)" if first == step
                else f" (steps {first}-{step} are trained again)")
        then = f"resume from {latest}: {fix}, then continue with resume_from_checkpoint=true{lost}"
    return OutputWriteError(f"writing {what} failed ({cause}): training stopped{after}; {then}")


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


@dataclass
class ResumeState:
    """What a checkpoint holds besides the model: all a run needs to continue exactly.

    The one definition of ``recipe_state.pt``: :meth:`CheckpointManager.save`
    writes it, :func:`load_recipe_state` reads it back.

    Attributes:
        progress (Progress): step counters and data position.
        optimizer (dict): the full (unsharded) optimizer state dict.
        rng_by_rank (list): :func:`rng_state` of every rank, in rank order.
        dp_world_size (int): data-parallel ranks of the run that wrote it.
        config (dict or None): the resolved config of the run that wrote it
            (None in checkpoints of earlier versions).
        path (Path or None): the checkpoint folder it was read from, for messages.

    The LR scheduler is not saved: a resumed run builds it from its config
    and advances it to ``progress.step`` (:mod:`torchtune_ext.resume`).
    """

    progress: Progress
    optimizer: Dict[str, Any]
    rng_by_rank: List[Dict[str, Any]]
    dp_world_size: int = 1
    config: Optional[Dict[str, Any]] = None
    path: Optional[Path] = None

    @property
    def saved_total_steps(self) -> int:
        """The run's total optimizer steps when it was saved (its LR schedule length; 0: unknown)."""
        return self._saved_total_steps

    def __post_init__(self) -> None:
        self._saved_total_steps = self.progress.total_steps  # the recipe plans the progress anew

    def rng_for(self, rank: int, world_size: int) -> Dict[str, Any]:
        """The RNG states rank ``rank`` of a ``world_size``-rank run continues with.

        Its own when the checkpoint was written by as many ranks; otherwise
        rank 0's, so the run continues, though random draws such as dropout
        masks then differ from an uninterrupted run.
        """
        if len(self.rng_by_rank) == world_size:
            return self.rng_by_rank[rank]
        return self.rng_by_rank[0]


@contextlib.contextmanager
def _quiet_torchtune_checkpointer() -> Iterator[None]:
    """Hide the INFO lines of torchtune's checkpointer while it writes into staging.

    They name the staging folder (``.staging/epoch_6``) instead of the
    checkpoint (``step_6``) and call every save "final"; the manager logs one
    accurate line instead. Warnings still pass.
    """

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.endswith("_checkpointer.py")

    tt_logger = logging.getLogger("torchtune.utils._logging")  # what torchtune's get_logger returns
    tt_logger.addFilter(keep)
    try:
        yield
    finally:
        tt_logger.removeFilter(keep)


def _is_disk_full(err: BaseException) -> bool:
    """A full disk or quota, in ``err`` or what it was raised from (``__cause__``)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "StorageFull" in str(err):
            return True
        err = err.__cause__
    return False


# How writers that are not Python's file objects report a failed write: torch.save's
# PyTorchStreamWriter ("unexpected pos 576 vs 534", "basic_ios::clear: iostream error",
# "file write failed", "File ... cannot be opened.") and safetensors ("I/O error: File too
# large (os error 27)"; older versions "IoError(Os { ... })").
_WRITE_FAILURES = ("unexpected pos", "iostream error", "PytorchStreamWriter failed", "file write failed",
                   "cannot be opened", "I/O error", "IoError(Os")


# torch.save and safetensors name no cause when a write stops short with room on the disk
_WRITE_ADVICE = "find why a write stopped short (a file size limit such as ulimit -f, a failing device)"


def _is_write_failure(err: BaseException) -> bool:
    """Did writing a file fail (a full disk, any ``OSError``: a file size limit, a read-only disk...)?

    Looks at ``err`` and what it was raised from (``__cause__``), not at an
    error it was raised while handling: anything else raised during a save is
    a bug and keeps its traceback.
    """
    if _is_disk_full(err):
        return True
    while err is not None:
        if isinstance(err, OSError) or any(text in str(err) for text in _WRITE_FAILURES):
            return True
        err = err.__cause__
    return False


class CheckpointManager:
    """Saves and finds atomic step checkpoints for one run.

    Args:
        cfg_checkpointer (DictConfig): the recipe's ``checkpointer`` config; it
            is instantiated once here with its ``output_dir`` redirected to the
            staging folder.
        output_dir (str): the run's output folder.
        keep_last_n (int, optional): keep this many newest checkpoints; None keeps all.
        run_config (DictConfig, optional): the run's config, saved (resolved)
            with every checkpoint so that a resume can tell what changed.
        dp_world_size (int): data-parallel ranks of this run.
        hash_files (bool): record each file's SHA-256 in the manifest (the
            ``verify_checkpoint_hashes`` key): a pass over the checkpoint's bytes
            right after writing them, about 1.1 s per 1.5 GiB on an idle core.
    """

    def __init__(self, cfg_checkpointer: DictConfig, output_dir: str, keep_last_n: Optional[int] = None, *,
                 run_config: Optional[DictConfig] = None, dp_world_size: int = 1, hash_files: bool = True):
        self.output_dir = Path(output_dir)
        self.staging = self.output_dir / STAGING
        self.keep_last_n = keep_last_n
        self._cfg = cfg_checkpointer
        self._checkpointer = None
        self._run_config = OmegaConf.to_container(run_config, resolve=True) if run_config is not None else None
        self._dp_world_size = dp_world_size
        self._hash_files = hash_files
        self._chat_template: Optional[str] = None  # what training's tokenizer writes; "" if nothing to save

    @classmethod
    def from_config(cls, cfg: DictConfig, dp_world_size: int = 1) -> "CheckpointManager":
        """The manager of a validated recipe config (``checkpointer``, ``output_dir``,
        ``keep_last_n_checkpoints``, ``verify_checkpoint_hashes``)."""
        return cls(cfg.checkpointer, cfg.output_dir, cfg.keep_last_n_checkpoints, run_config=cfg,
                   dp_world_size=dp_world_size, hash_files=cfg.get("verify_checkpoint_hashes", True))

    def load(self, resume_from: Optional[Path] = None, adapter: bool = False) -> Dict[str, Any]:
        """Load the model through the configured torchtune checkpointer.

        Args:
            resume_from: a checkpoint folder of this run; None loads the base
                checkpoint named in the config.
            adapter: LoRA: the model always comes from the base checkpoint,
                and with ``resume_from`` the adapter from that folder.

        Returns:
            what ``checkpointer.load_checkpoint()`` returns: ``model`` (key
            ``training.MODEL_KEY``), and for ``adapter`` with ``resume_from``
            also the adapter state dict in torchtune key names
            (``training.ADAPTER_KEY``).

        Raises:
            ConfigError: (key ``resume_from_checkpoint``) if ``resume_from``
                fails :func:`verify_checkpoint`, or holds no adapter when one
                is asked for; (key ``output_dir``) if a file is where the
                staging folder goes.

        The same checkpointer instance later writes the checkpoints (it needs
        the base checkpoint's weight map), into the staging folder.
        """
        if self.staging.exists() and not self.staging.is_dir():
            raise ConfigError("output_dir", f"{self._staging_is_a_file()}: move or delete the file")
        overrides: Dict[str, Any] = {"output_dir": str(self.staging)}
        if resume_from is not None:
            manifest = verify_checkpoint(resume_from)
            adapter_file = next((n for n in (ADAPTER_WEIGHTS, "adapter_model.pt")  # earlier layout: top level
                                 if n in manifest["files"]), None)
            if adapter and adapter_file is None:
                raise ConfigError("resume_from_checkpoint", f"checkpoint '{resume_from}' holds no "
                                  f"{ADAPTER_WEIGHTS}; it was not written by a LoRA recipe")
            if not adapter and adapter_file is not None:
                raise ConfigError("resume_from_checkpoint", f"'{resume_from}' was written by a LoRA recipe (it "
                                  f"holds {adapter_file}): its optimizer state is the adapter's, which a full "
                                  "fine-tune cannot continue; resume it with a LoRA recipe")
            if not adapter:
                overrides["checkpoint_dir"] = str(resume_from)
                overrides["checkpoint_files"] = sorted(  # HF safetensors, or Meta's .bin / .pth
                    n for n in manifest["files"]
                    if "/" not in n and n.endswith((".safetensors", ".bin", ".pth")) and not n.startswith("adapter")
                )
        source = Path(overrides.get("checkpoint_dir", self._cfg.get("checkpoint_dir", "")))
        try:
            self._checkpointer = tt_config.instantiate(self._cfg, **overrides)
            state = self._checkpointer.load_checkpoint()
        except Exception as err:
            raise _unreadable(source, err, resume_from is not None and not adapter) from err
        if adapter and resume_from is not None:
            try:
                state[training.ADAPTER_KEY] = torch.load(
                    resume_from / adapter_file, map_location="cpu", weights_only=True
                )
            except Exception as err:
                raise ConfigError("resume_from_checkpoint", f"'{resume_from / adapter_file}' cannot be read "
                                  f"({short(err)}).{intact_before(resume_from)}") from err
        return state

    def announce(self, checkpoint_bytes: int, progress: Progress, loader: Any, cfg: DictConfig) -> None:
        """Log the disk use to expect at start-up; refuse to start without room for one checkpoint.

        Call it on every rank (one collective), after :meth:`load`. Removes the
        empty staging folder that building the checkpointer made.

        Args:
            checkpoint_bytes: one checkpoint's tensors (:func:`expected_checkpoint_bytes`); the
                copied config and tokenizer files are added here.
            progress: where the run starts (``total_steps`` already planned).
            loader: the run's :class:`torchtune_ext.data.StepLoader`.
            cfg: the recipe config (``epochs``, ``save_every_n_steps``, ``save_final_checkpoint``).

        Raises:
            DiskSpaceError: if ``output_dir`` has less free space than one checkpoint.
        """
        checkpoint_bytes += self._copied_bytes()
        saves = len(planned_save_steps(progress, loader, cfg))
        existing = len(list_checkpoints(str(self.output_dir)))
        on_disk = existing + saves
        if self.keep_last_n is not None:  # a new checkpoint is complete before the oldest goes
            on_disk = min(on_disk, self.keep_last_n + 1)
        to_come = max(on_disk - existing, 0)  # the free space already excludes the existing ones
        # Rank 0's figure on every rank, so that all ranks refuse together. By then every rank
        # has built its checkpointer (load), which makes the staging folder; see below.
        free = _from_rank_zero(shutil.disk_usage(_existing_parent(self.output_dir)).free)
        if free < checkpoint_bytes:
            raise DiskSpaceError("output_dir", f"not enough free disk space for one checkpoint in "
                                 f"'{self.output_dir}': it needs about {format_bytes(checkpoint_bytes)}, "
                                 f"{format_bytes(free)} are free. Free some space or choose another output_dir")
        kept = (f"the newest {self.keep_last_n} kept" if self.keep_last_n is not None else "none deleted")
        line = (f"Checkpoints: about {format_bytes(checkpoint_bytes)} each, {saves} to write, {kept} "
                f"(keep_last_n_checkpoints={self.keep_last_n if self.keep_last_n is not None else 'null'}): "
                f"up to {format_bytes(on_disk * checkpoint_bytes)} in '{self.output_dir}', "
                f"{format_bytes(free)} free")
        if not ranks.is_rank_zero():
            return
        try:  # each save makes it again: a run that saves nothing leaves no empty staging folder
            self.staging.rmdir()
        except OSError:
            pass  # not empty: an interrupted save's, which the next save clears
        if free < to_come * checkpoint_bytes:
            # a new checkpoint is complete before the oldest goes: with 1 kept, 2 are on disk at times
            lower = "lower keep_last_n_checkpoints or " if self.keep_last_n is None or self.keep_last_n > 1 else ""
            log.warning(f"{line}: not enough for all of them; {lower}free some space")
        else:
            log.info(line)

    def save(self, state_dict: Dict[str, Any], progress: Progress, optimizer_state: Dict[str, Any], *,
             rng_by_rank: Optional[List[Dict[str, Any]]] = None, adapter_only: bool = False,
             suspect_from: Optional[int] = None) -> Path:
        """Write ``step_<progress.step>`` atomically (rank 0 writes; every rank gets the outcome).

        Args:
            state_dict: what the torchtune checkpointer saves: ``model`` (full
                state dict on CPU; may be empty on ranks other than 0) and for
                LoRA ``adapter`` and ``adapter_config``.
            progress: step counters and data position.
            optimizer_state: the full optimizer state dict (may be empty on
                ranks other than 0).
            rng_by_rank: every rank's :func:`rng_state`, in rank order; None:
                this process's (one rank).
            adapter_only: LoRA: save only the adapter (no merged model).
            suspect_from: the first optimizer step whose parameters the health
                checks distrust (``StepHealth.suspect_from``); pruning then also
                keeps the newest checkpoint from before it, the one to resume from.

        Returns:
            Path of the checkpoint folder. A step saved already (the end of an
            epoch right after a periodic save) is not written again.

        Raises:
            CheckpointSaveError: if the checkpoint does not fit in the free
                space (checked before writing), the disk filled up while
                writing, or a write failed (an ``OSError``, or torch.save's or
                safetensors' report of one; also from clearing the staging
                folder, a file in its place, the rename into ``step_<N>`` and
                syncing ``output_dir``); the staging folder is removed and
                earlier checkpoints are intact.
            Any other error (a bug), after removing the staging folder.
            All ranks raise (ranks other than 0 a ``RuntimeError`` with rank 0's message).
        """
        final = self.output_dir / f"step_{progress.step}"
        outcome: Any = None
        if ranks.is_rank_zero():
            try:
                outcome = self._write(final, state_dict, progress, optimizer_state, rng_by_rank, adapter_only,
                                      suspect_from)
            except BaseException as err:
                # exceptions do not all pickle: send what the other ranks raise
                if isinstance(err, ConfigError):
                    _from_rank_zero((type(err), err.key, str(err).split(": ", 1)[1]))
                elif isinstance(err, CheckpointSaveError):
                    _from_rank_zero((CheckpointSaveError, None, str(err)))
                else:
                    _from_rank_zero((RuntimeError, None, f"saving {final} failed on rank 0: {type(err).__name__}: {err}"))
                raise
        outcome = _from_rank_zero(outcome)
        if outcome is not None:
            error_type, key, message = outcome
            raise error_type(key, message) if key is not None else error_type(message)
        return final

    def _write(self, final: Path, state_dict: Dict[str, Any], progress: Progress, optimizer_state: Dict[str, Any],
               rng_by_rank: Optional[List[Dict[str, Any]]], adapter_only: bool,
               suspect_from: Optional[int] = None) -> None:
        if (final / MANIFEST).is_file():
            return  # this step is saved already
        try:  # a failure here is a failed save too, only with nothing written yet
            if final.exists():  # not written by a save (no manifest): keep it, under another name
                aside = final.with_name(f"{final.name}.incomplete")
                while aside.exists():
                    aside = aside.with_name(aside.name + "+")
                os.replace(final, aside)
                log.warning("'%s' was not a complete checkpoint (no %s); it is kept as '%s'.", final, MANIFEST, aside)
            if self.staging.is_dir():
                shutil.rmtree(self.staging)  # left by an interrupted save
            elif self.staging.exists():  # made since start-up, where load() refuses it
                raise CheckpointSaveError(f"saving {final.name} failed before writing: {self._staging_is_a_file()}: "
                                          f"{self._after_failure('move or delete the file', written=False)}")
            free = shutil.disk_usage(self.output_dir).free
        except OSError as err:
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed before "
                                      f"writing ({short(err)}): {self._after_failure(written=False)}") from err
        needed = self._needed_bytes(state_dict, optimizer_state)
        if free < needed:
            raise self._disk_space_error(final, needed, free)
        recipe_state = {
            "progress": asdict(progress),
            training.OPT_KEY: optimizer_state,
            "rng": rng_state() if rng_by_rank is None else rng_by_rank[0],
            "rng_by_rank": [rng_state()] if rng_by_rank is None else rng_by_rank,
            "dp_world_size": self._dp_world_size,
            "config": self._run_config,
        }
        start = time.perf_counter()
        written = self.staging / f"epoch_{progress.step}"  # torchtune's checkpointer names it after "epoch"
        try:
            with _quiet_torchtune_checkpointer():
                self._checkpointer.save_checkpoint(state_dict, epoch=progress.step, adapter_only=adapter_only)
            if (written / "adapter_model.pt").is_file():
                arrange_lora_folder(written, self._cfg)
            self._save_chat_template(written)
            torch.save(recipe_state, written / RECIPE_STATE)
            # torchtune copies the non-weight files of the folder it loaded from, so a resumed
            # run's staging folder holds the previous manifest: never list the manifest itself
            (written / MANIFEST).unlink(missing_ok=True)
            make_readable(written)
            files = {p.relative_to(written).as_posix(): p.stat().st_size
                     for p in sorted(written.rglob("*")) if p.is_file()}
            # Read back right after writing: the bytes are still in the page cache, so this costs a pass
            # of SHA-256 over memory, not a read from disk (README "Checkpoints" has the measured cost).
            hashed = time.perf_counter()
            manifest = {"step": progress.step, "files": files}
            if self._hash_files:
                manifest[HASHES] = {name: file_sha256(written / name) for name in files}
            hash_seconds = time.perf_counter() - hashed
            _write_synced(written / MANIFEST, json.dumps(manifest, indent=1))
        except BaseException as err:
            try:  # the folder may be gone or unreadable too: that must not hide the error
                staged = [p for p in self.staging.rglob("*") if p.is_file()]
                partial, wrote = sum(p.stat().st_size for p in staged), bool(staged)
                free_now: Optional[int] = shutil.disk_usage(self.output_dir).free
            except OSError:
                partial, wrote, free_now = 0, True, None
            shutil.rmtree(self.staging, ignore_errors=True)
            if not (isinstance(err, Exception) and _is_write_failure(err)):
                raise
            # torch.save reports a full disk as a bare RuntimeError: the free space tells
            if _is_disk_full(err) or (free_now is not None and free_now < needed - partial):
                raise self._disk_space_error(final, needed, (free_now or 0) + partial, cause=err) from err
            fix = "fix the cause" if isinstance(err, OSError) else _WRITE_ADVICE
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed "
                                      f"({short(err)}): {self._after_failure(fix, written=wrote)}") from err
        try:
            os.replace(written, final)
        except OSError as err:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed when moving "
                                      f"it into place ({short(err)}): {self._after_failure()}") from err
        shutil.rmtree(self.staging, ignore_errors=True)
        try:
            _fsync_dir(self.output_dir)
        except OSError as err:
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed: the folder "
                                      f"could not be synced to disk ({short(err)}); {final} is complete but may "
                                      f"not survive a crash of the machine: fix the cause, then continue with "
                                      f"resume_from_checkpoint=true") from err
        hashing = f", of which {hash_seconds:.1f} s for the SHA-256 of its files" if self._hash_files else ""
        log.info(f"Checkpoint saved: {final} ({format_bytes(sum(files.values()))} in "
                 f"{time.perf_counter() - start:.1f} s{hashing})")
        self._prune(keep=final, suspect_from=suspect_from)

    def _save_chat_template(self, folder: Path) -> None:
        """torchtune copies the base folder's tokenizer files, whose chat template may not be the format
        training wrote (SmolLM2's adds a default system prompt): save the training tokenizer's instead."""
        if self._run_config is None:
            return
        if self._chat_template is None:  # built once, at the first save
            self._chat_template = training_chat_template(self._run_config) or ""
        if self._chat_template:
            write_chat_template(folder, self._chat_template)

    def _staging_is_a_file(self) -> str:
        return f"'{self.staging}' is a file, but saves stage each checkpoint in a folder of that name"

    def _copied_bytes(self) -> int:
        """The small files torchtune copies from the folder it loaded from (config, tokenizer)."""
        source = getattr(self._checkpointer, "_checkpoint_dir", None)
        if source is None or not Path(source).is_dir():
            return 0
        return sum(p.stat().st_size for p in Path(source).iterdir()
                   if p.is_file() and p.suffix not in (".safetensors", ".bin", ".pt", ".pth"))

    def _needed_bytes(self, state_dict: Dict[str, Any], optimizer_state: Dict[str, Any]) -> int:
        # torchtune writes the adapter twice (.pt and PEFT .safetensors)
        return (tensor_bytes(state_dict) + tensor_bytes(state_dict.get(training.ADAPTER_KEY))
                + tensor_bytes(optimizer_state) + self._copied_bytes() + 2**20)

    def _disk_space_error(self, final: Path, needed: int, free: int,
                          cause: Optional[BaseException] = None) -> CheckpointSaveError:
        if cause is None:
            what = f"not enough free disk space to save {final.name} in output_dir '{self.output_dir}'"
            now = ""
        else:
            what = f"the disk filled up while saving {final.name} in output_dir '{self.output_dir}' ({cause})"
            now = " now"
        return CheckpointSaveError(f"{what}: it needs about {format_bytes(needed)}, {format_bytes(free)} are "
                                   f"free{now}; {self._after_failure(self._free_space_advice(), written=cause is not None)}")

    def _free_space_advice(self) -> str:
        """How to make room for the next save. Old checkpoints go only after a new one is complete,
        so keep_last_n_checkpoints cannot make room for this one; older checkpoints on disk can."""
        try:
            older = list_checkpoints(str(self.output_dir))[:-1]
        except (OSError, ConfigError):
            older = []
        if not older:
            return "free some space"
        names = ", ".join(p.name for p in older[:3]) + (", ..." if len(older) > 3 else "")
        which = "the older one" if len(older) == 1 else f"the {len(older)} older ones"
        return (f"free some space (resuming needs only the newest checkpoint: {which}, {names}, "
                f"can be deleted; a lower keep_last_n_checkpoints keeps fewer from then on)")

    def _after_failure(self, fix: str = "fix the cause", written: bool = True) -> str:
        """What is left after a failed save and how to go on (the end of the error's message)."""
        if not written:
            done = "nothing was written"
        elif self.staging.exists():
            done = f"the partial checkpoint in '{self.staging}' could not be removed (delete it)"
        else:
            done = "the partial checkpoint was removed"
        try:
            previous = latest_checkpoint(str(self.output_dir))
        except (OSError, ConfigError) as err:
            return f"{done}; the earlier checkpoints could not be listed ({short(err)}): {fix}, then resume"
        if previous is None:
            return f"{done} and no checkpoint of this run exists yet: {fix}, then start the run again"
        return f"{done} and {previous} is intact: {fix}, then continue with resume_from_checkpoint=true"

    def _prune(self, keep: Path, suspect_from: Optional[int] = None) -> None:
        if self.keep_last_n is None:
            return
        try:
            found = list_checkpoints(str(self.output_dir))
        except ConfigError as err:  # the new checkpoint is complete: training can go on
            log.warning(f"keep_last_n_checkpoints={self.keep_last_n}: old checkpoints were not pruned: {err}")
            return
        protected = {keep}  # the checkpoint a resume would start from stays, whatever the numbering
        if suspect_from is not None:  # and the last one saved before the health checks' first bad sign
            protected.update([p for p in found if int(p.name.split("_")[1]) < suspect_from][-1:])
        for old in found[: -self.keep_last_n]:
            if old in protected:
                continue
            try:
                shutil.rmtree(old)
            except OSError as err:  # the new checkpoint is complete: training can go on
                what = ("could not be deleted" if (old / MANIFEST).is_file() else
                        f"was deleted only in part (its {MANIFEST} is gone: what is left is not a checkpoint)")
                log.warning(f"keep_last_n_checkpoints={self.keep_last_n}: the old checkpoint '{old}' {what} "
                            f"({short(err)}); delete it by hand")


def _unreadable(folder: Path, err: BaseException, resuming: bool) -> ConfigError:
    """The error for a checkpoint folder the torchtune checkpointer could not load."""
    detail = short(err)
    if isinstance(err, RuntimeError) and "shape" in str(err) and "is invalid for input of size" in str(err):
        # convert_weights reshapes q/k by the head counts of config.json
        try:
            hf = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            hf = {}
        dims = ", ".join(f"{k}={hf[k]}" for k in ("num_attention_heads", "num_key_value_heads", "hidden_size",
                                                    "head_dim") if k in hf)
        detail = (f"the weights do not fit '{folder / 'config.json'}' ({dims}): {detail}. config.json must "
                  "describe the checkpoint's architecture")
    elif resuming:
        return ConfigError("resume_from_checkpoint", f"checkpoint '{folder}' cannot be loaded: {detail}."
                           + intact_before(folder))
    return ConfigError("checkpointer.checkpoint_dir", f"cannot load the checkpoint in '{folder}': {detail}")


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


def load_recipe_state(path: Path) -> ResumeState:
    """Verify a checkpoint folder and load its ``recipe_state.pt``.

    Args:
        path: the checkpoint folder.

    Returns:
        :class:`ResumeState`. Restore its RNG states (:meth:`ResumeState.rng_for`,
        :func:`set_rng_state`) once setup is done: building a model draws
        random numbers for weight init, and dropout draws more in training.

    Raises:
        ConfigError: if the folder does not match its manifest.
    """
    verify_checkpoint(path)
    try:
        state = torch.load(path / RECIPE_STATE, map_location="cpu", weights_only=False)
        return ResumeState(
            # before data_seed was saved, the order followed the run's seed
            progress=Progress(**{"data_seed": state["progress"]["seed"], **state["progress"]}),
            optimizer=state[training.OPT_KEY],
            rng_by_rank=state.get("rng_by_rank") or [state["rng"]],
            dp_world_size=state.get("dp_world_size", 1),
            config=state.get("config"),
            path=path,
        )
    except Exception as err:
        raise ConfigError("resume_from_checkpoint", f"'{path / RECIPE_STATE}' cannot be read ({short(err)})."
                          + intact_before(path)) from err


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def make_readable(folder: Path) -> None:
    """Give every file under ``folder`` the permissions of a newly created file (0666 less the umask).

    Some writers (safetensors, temporary files) create files readable only by
    their owner; a checkpoint is for others to load too.
    """
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_model_fits(model: torch.nn.Module, state_dict: Dict[str, Any], source: Any, model_name: str) -> None:
    """Compare a checkpoint's keys and shapes with the model's before loading it (adapters it lacks excepted).

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) naming the model and
            the first mismatching key (:func:`torchtune_ext.upstream.first_mismatch`).
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
            :func:`torchtune_ext.upstream.describe_model`; when given, the
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
    other adapter tensors. :func:`torchtune_ext.resume.check_resume` finds that
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


def lora_checkpoint_state(model_state: Dict[str, Any], cfg_model: DictConfig, adapter_only: bool) -> Dict[str, Any]:
    """What a LoRA recipe hands to :meth:`CheckpointManager.save`.

    Args:
        model_state: the full model state dict (base and adapter), on CPU;
            may be empty (ranks other than 0 after a gather).
        cfg_model: the LoRA ``model`` config (settings it leaves out take the
            builder's defaults, :func:`torchtune_ext.config.lora_settings`).
        adapter_only: skip the merged model.

    Returns:
        ``adapter`` (the adapter weights), ``adapter_config`` (for PEFT's
        ``adapter_config.json``) and, unless ``adapter_only``, ``model``: the
        merged weights W + (alpha / rank) B A, computed on copies so the
        model's own frozen weights never change.
    """
    from torchtune.modules.peft import get_adapter_state_dict, get_lora_module_names, get_merged_lora_ckpt

    settings = lora_settings(cfg_model)
    state: Dict[str, Any] = {
        training.ADAPTER_KEY: get_adapter_state_dict(model_state),
        training.ADAPTER_CONFIG: {
            "r": settings.lora_rank,
            "lora_alpha": settings.lora_alpha,
            "target_modules": get_lora_module_names(
                list(settings.lora_attn_modules), settings.apply_lora_to_mlp, settings.apply_lora_to_output
            ),
            "peft_type": "LORA",
            "use_dora": settings.use_dora,
        },
    }
    if not adapter_only:
        # The merge adds into the tensors it is given; on CPU those can be the model's own weights.
        merged = {k: v.detach().to("cpu", copy=True) for k, v in model_state.items()}
        state[training.MODEL_KEY] = get_merged_lora_ckpt(merged, rank=settings.lora_rank, alpha=settings.lora_alpha)
    return state


def _permute_rows(t: torch.Tensor, n_heads: int, head_dim: int, inverse: bool = False) -> torch.Tensor:
    """torchtune's interleaved-RoPE row order of a q/k projection <-> HF's half-split order
    (the permutation ``convert_weights.tune_to_hf`` applies to q/k weights), on rows of ``t``."""
    rest = t.shape[1:]
    if inverse:
        return t.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)
    return t.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)


def peft_adapter_weights(adapter: Dict[str, torch.Tensor], model_type: str, hf_config: Dict[str, Any]):
    """A torchtune adapter state dict in PEFT's names and the base model's HF layout.

    Key names come from torchtune's ``tune_to_peft_adapter_weights``. Rows of
    q/k adapters follow what the family's HF converter does to the q/k
    weights: permuted from torchtune's interleaved RoPE order for Llama-like
    families (lora_B and, for DoRA, the magnitude), left as they are for
    QWEN2, whose converter does not permute (torchtune 0.6.1 permutes Qwen's
    lora_B anyway, so its PEFT adapters would not match the merged model).

    Args:
        adapter: ``lora_a`` / ``lora_b`` / ``magnitude`` tensors in torchtune names.
        model_type: ``checkpointer.model_type``.
        hf_config: the base model's ``config.json``.

    Returns:
        dict in PEFT names (``base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight``, ...).
    """
    from torchtune.models.convert_weights import tune_to_peft_adapter_weights

    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    dim = hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or dim // heads
    out = tune_to_peft_adapter_weights(dict(adapter), num_heads=heads, num_kv_heads=kv_heads, dim=dim,
                                       head_dim=head_dim)
    for key, value in out.items():
        n_heads = heads if ".q_proj." in key else kv_heads if ".k_proj." in key else None
        if n_heads is None:
            continue
        if model_type == "QWEN2" and "lora_B" in key:  # undo torchtune's permutation
            out[key] = _permute_rows(value, n_heads, head_dim, inverse=True)
        elif model_type != "QWEN2" and "lora_magnitude_vector" in key:  # rows of W, as lora_B's
            out[key] = _permute_rows(value, n_heads, head_dim)
    return out


def arrange_lora_folder(folder: Path, cfg_checkpointer: DictConfig) -> None:
    """Lay out a LoRA checkpoint written by torchtune's checkpointer so that each part loads as what it is.

    torchtune writes the adapter beside the merged model; transformers'
    ``AutoModelForCausalLM.from_pretrained(folder)`` would then attach it to the
    merged weights (the adapter counted twice). Here the adapter moves to
    ``folder/adapter/``: ``adapter_model.pt`` (torchtune names, read on resume)
    and, for HF checkpoints of families PEFT can address (not Phi-3/4, whose
    HF q/k/v and gate/up projections are fused), ``adapter_model.safetensors``
    (:func:`peft_adapter_weights`) and ``adapter_config.json`` with
    ``base_model_name_or_path`` (the base checkpoint folder) and ``task_type``,
    so ``PeftModel.from_pretrained(base, folder / "adapter")`` and
    ``AutoPeftModelForCausalLM.from_pretrained(folder / "adapter")`` work.

    Args:
        folder: the step folder as the torchtune checkpointer wrote it.
        cfg_checkpointer: the ``checkpointer`` config (base folder, model_type).
    """
    from safetensors.torch import save_file

    target = folder / ADAPTER_DIR
    target.mkdir(exist_ok=True)
    adapter = torch.load(folder / "adapter_model.pt", map_location="cpu", weights_only=True)
    os.replace(folder / "adapter_model.pt", target / "adapter_model.pt")
    peft_config = None
    if (folder / "adapter_config.json").is_file():
        peft_config = json.loads((folder / "adapter_config.json").read_text())
    for name in _TORCHTUNE_ADAPTER_FILES:
        (folder / name).unlink(missing_ok=True)
    base_dir = Path(str(cfg_checkpointer.checkpoint_dir)).resolve()
    model_type = str(cfg_checkpointer.get("model_type", "")).upper()
    hf_config_file = base_dir / "config.json"
    if peft_config is None or not hf_config_file.is_file() or model_type in ("PHI3_MINI", "PHI4"):
        return  # no PEFT form: Meta checkpoints, Phi's fused projections
    weights = peft_adapter_weights(adapter, model_type, json.loads(hf_config_file.read_text()))
    save_file({k: v.contiguous() for k, v in weights.items()}, target / "adapter_model.safetensors",
              metadata={"format": "pt"})
    peft_config.update(base_model_name_or_path=str(base_dir), task_type="CAUSAL_LM")
    (target / "adapter_config.json").write_text(json.dumps(peft_config, indent=2))
