"""Atomic, resumable checkpoints: ``<output_dir>/step_<N>/``.

A checkpoint folder holds the model in the same format as the base checkpoint
(written by the configured torchtune checkpointer: HF safetensors plus the
base folder's config and tokenizer files; for LoRA the adapter, and the merged
model unless turned off), ``recipe_state.pt`` (optimizer, LR scheduler, RNG
states, step counters, data position) and ``checkpoint.json``, a manifest of
every file with its size.

Writes are atomic: the torchtune checkpointer writes into
``<output_dir>/.staging/``; the manifest is written last; then the folder is
renamed to ``step_<N>``. A crash mid-save leaves only the staging folder,
which the next save clears, and the previous checkpoints intact. Old
checkpoints are pruned (``keep_last_n_checkpoints``) only after the new one
is complete. Only ``step_<N>`` folders with a valid manifest are ever resumed
from.

Resuming a full fine-tune loads the model from the step folder. Resuming LoRA
loads the base weights from the base checkpoint again and the adapter from
the step folder's ``adapter_model.pt``: the merged model there already holds
the adapter (and is absent with ``save_adapter_weights_only``).
"""

import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torchtune import config as tt_config
from torchtune import training

from torchtune_ext.config import ConfigError

MANIFEST = "checkpoint.json"
RECIPE_STATE = "recipe_state.pt"
# The adapter in torchtune's key names, as torchtune's checkpointers write it
# (beside it: adapter_model.safetensors in PEFT's names, adapter_config.json).
ADAPTER_WEIGHTS = "adapter_model.pt"
STAGING = ".staging"
_STEP_DIR = re.compile(r"^step_(\d+)$")

log = logging.getLogger(__name__)


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
        seed (int): the run's seed (sampler order depends on it).
        tokens_seen (int): trainable tokens (after the label shift, all ranks)
            of the optimizer steps that updated the model so far.
    """

    step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    samples_in_epoch: int = 0
    skipped_steps: int = 0
    seed: int = 0
    tokens_seen: int = 0

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


def list_checkpoints(output_dir: str) -> List[Path]:
    """Complete checkpoint folders under ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def incomplete_checkpoints(output_dir: str) -> List[Path]:
    """``step_<N>`` folders under ``output_dir`` without a manifest, oldest first.

    A save renames a complete folder into place, so these were not written
    by a save of this project (a copy, a partial delete). They are never
    resumed from, pruned or written into.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), c) for c in root.iterdir()
             if (m := _STEP_DIR.match(c.name)) and c.is_dir() and not (c / MANIFEST).is_file()]
    return [path for _, path in sorted(found)]


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def intact_before(path: Path) -> str:
    """A sentence for errors about checkpoint ``path``: the newest earlier checkpoint that is intact, if any."""
    for earlier in reversed(list_checkpoints(str(path.parent))):
        if _step_of(earlier) >= _step_of(path):
            continue
        if _read_manifest(earlier)[1] is not None:
            continue
        return (f" The previous checkpoint '{earlier}' is intact: move '{path.name}' out of the output_dir to "
                "resume from it.")
    return " No earlier checkpoint of this run is intact."


def verify_checkpoint(path: Path) -> Dict[str, Any]:
    """Check a checkpoint folder against its manifest.

    Returns:
        dict: the manifest.

    Raises:
        ConfigError: (key ``resume_from_checkpoint``) if the manifest is
            missing or unreadable, or a listed file is missing or has another
            size; the message says whether an earlier checkpoint is intact.
    """
    manifest, problem = _read_manifest(path)
    if problem:
        raise ConfigError("resume_from_checkpoint", problem + "." + intact_before(path))
    return manifest


def _read_manifest(path: Path):
    """(manifest, None) if ``path`` matches its manifest, else (None, what is wrong)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"checkpoint '{path}' has no readable {MANIFEST}: {err}"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return None, f"checkpoint '{path}' is missing '{name}'"
        if file.stat().st_size != size:
            return None, (f"checkpoint '{path}': '{name}' has {file.stat().st_size} bytes, manifest says {size} "
                          "(truncated or replaced)")
    return manifest, None


def latest_checkpoint(output_dir: str) -> Optional[Path]:
    """The newest complete checkpoint under ``output_dir``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Saves and finds atomic step checkpoints for one run.

    Args:
        cfg_checkpointer (DictConfig): the recipe's ``checkpointer`` config; it
            is instantiated once here with its ``output_dir`` redirected to the
            staging folder.
        output_dir (str): the run's output folder.
        keep_last_n (int, optional): keep this many newest checkpoints; None keeps all.
    """

    def __init__(self, cfg_checkpointer: DictConfig, output_dir: str, keep_last_n: Optional[int] = None):
        self.output_dir = Path(output_dir)
        self.staging = self.output_dir / STAGING
        self.keep_last_n = keep_last_n
        self._cfg = cfg_checkpointer
        self._checkpointer = None

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
                is asked for.

        The same checkpointer instance later writes the checkpoints (it needs
        the base checkpoint's weight map), into the staging folder.
        """
        overrides: Dict[str, Any] = {"output_dir": str(self.staging)}
        if resume_from is not None:
            manifest = verify_checkpoint(resume_from)
            if adapter and ADAPTER_WEIGHTS not in manifest["files"]:
                raise ConfigError("resume_from_checkpoint", f"checkpoint '{resume_from}' holds no "
                                  f"{ADAPTER_WEIGHTS}; it was not written by a LoRA recipe")
            if not adapter:
                overrides["checkpoint_dir"] = str(resume_from)
                overrides["checkpoint_files"] = sorted(
                    n for n in manifest["files"] if n.endswith(".safetensors") and not n.startswith("adapter")
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
                    resume_from / ADAPTER_WEIGHTS, map_location="cpu", weights_only=True
                )
            except Exception as err:
                raise ConfigError("resume_from_checkpoint", f"'{resume_from / ADAPTER_WEIGHTS}' cannot be read "
                                  f"({_short(err)}).{intact_before(resume_from)}") from err
        return state

    def save(self, state_dict: Dict[str, Any], progress: Progress, recipe_state: Dict[str, Any],
             adapter_only: bool = False) -> Path:
        """Write ``step_<progress.step>`` atomically (rank 0 writes; all ranks wait).

        Args:
            state_dict: what the torchtune checkpointer saves: ``model`` (full
                state dict on CPU; may be empty on ranks other than 0) and for
                LoRA ``adapter`` and ``adapter_config``.
            progress: step counters and data position.
            recipe_state: optimizer / LR scheduler state dicts and anything
                else the recipe needs to resume (saved with torch.save).
            adapter_only: LoRA: save only the adapter (no merged model).

        Returns:
            Path of the new checkpoint folder.
        """
        final = self.output_dir / f"step_{progress.step}"
        if (final / MANIFEST).is_file():
            return final  # this step is saved already (end of epoch right after a periodic save)
        if _is_rank_zero():
            if final.exists():  # not written by a save (no manifest): keep it, under another name
                aside = final.with_name(f"{final.name}.incomplete")
                while aside.exists():
                    aside = aside.with_name(aside.name + "+")
                os.replace(final, aside)
                log.warning("'%s' was not a complete checkpoint (no %s); it is kept as '%s'.", final, MANIFEST, aside)
            if self.staging.exists():
                shutil.rmtree(self.staging)  # left by an interrupted save
            # torchtune's checkpointer names its folder after the epoch argument
            self._checkpointer.save_checkpoint(state_dict, epoch=progress.step, adapter_only=adapter_only)
            written = self.staging / f"epoch_{progress.step}"
            torch.save({"progress": asdict(progress), "rng": rng_state(), **recipe_state},
                       written / RECIPE_STATE)
            files = {p.relative_to(written).as_posix(): p.stat().st_size
                     for p in sorted(written.rglob("*")) if p.is_file()}
            _write_synced(written / MANIFEST, json.dumps({"step": progress.step, "files": files}, indent=1))
            os.replace(written, final)
            _fsync_dir(self.output_dir)
            shutil.rmtree(self.staging, ignore_errors=True)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last_n is None:
            return
        for old in list_checkpoints(str(self.output_dir))[: -self.keep_last_n]:
            shutil.rmtree(old)


def _short(err: BaseException) -> str:
    """``Type: message`` on one line, with the cause's message (torchtune wraps the reader's error)."""
    text = f"{type(err).__name__}: {' '.join(str(err).split())}"
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({type(cause).__name__}: {' '.join(str(cause).split())})"
    return text


def _unreadable(folder: Path, err: BaseException, resuming: bool) -> ConfigError:
    """The error for a checkpoint folder the torchtune checkpointer could not load."""
    detail = _short(err)
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


def load_recipe_state(path: Path) -> Dict[str, Any]:
    """Verify a checkpoint folder and load its ``recipe_state.pt``.

    Args:
        path: the checkpoint folder.

    Returns:
        dict with ``progress`` (a :class:`Progress`), ``rng`` (pass it to
        :func:`set_rng_state` once setup is done: building a model draws
        random numbers for weight init, and dropout draws more in training)
        and the recipe's own entries.

    Raises:
        ConfigError: if the folder does not match its manifest.
    """
    verify_checkpoint(path)
    try:
        state = torch.load(path / RECIPE_STATE, map_location="cpu", weights_only=False)
        state["progress"] = Progress(**state["progress"])
    except Exception as err:
        raise ConfigError("resume_from_checkpoint", f"'{path / RECIPE_STATE}' cannot be read ({_short(err)})."
                          + intact_before(path)) from err
    return state


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


def load_model_state(model: torch.nn.Module, state_dict: Dict[str, Any], source: str, strict: bool = True):
    """``model.load_state_dict`` with a config error, not a traceback, on a misfit.

    Args:
        source: where the weights came from, for the message.
        strict: as in ``load_state_dict``.

    Returns:
        what ``load_state_dict`` returns (missing and unexpected keys).

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) if a shape or a key
            of the checkpoint does not fit the model.
    """
    try:
        return model.load_state_dict(state_dict, strict=strict)
    except RuntimeError as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip())
        raise ConfigError(
            "checkpointer.checkpoint_dir",
            f"the checkpoint in '{source}' does not fit the configured model ({detail or err}). "
            "Check that `model` matches the checkpoint's architecture.",
        ) from err


def lora_checkpoint_state(model_state: Dict[str, Any], cfg_model: DictConfig, adapter_only: bool) -> Dict[str, Any]:
    """What a LoRA recipe hands to :meth:`CheckpointManager.save`.

    Args:
        model_state: the full model state dict (base and adapter), on CPU;
            may be empty (ranks other than 0 after a gather).
        cfg_model: the ``model`` config with ``lora_rank``, ``lora_alpha``,
            ``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``.
        adapter_only: skip the merged model.

    Returns:
        ``adapter`` (the adapter weights), ``adapter_config`` (for PEFT's
        ``adapter_config.json``) and, unless ``adapter_only``, ``model``: the
        merged weights W + (alpha / rank) B A, computed on copies so the
        model's own frozen weights never change.
    """
    from torchtune.modules.peft import get_adapter_state_dict, get_lora_module_names, get_merged_lora_ckpt

    state: Dict[str, Any] = {
        training.ADAPTER_KEY: get_adapter_state_dict(model_state),
        training.ADAPTER_CONFIG: {
            "r": cfg_model.lora_rank,
            "lora_alpha": cfg_model.lora_alpha,
            "target_modules": get_lora_module_names(
                list(cfg_model.lora_attn_modules), cfg_model.apply_lora_to_mlp, cfg_model.apply_lora_to_output
            ),
            "peft_type": "LORA",
            "use_dora": bool(cfg_model.get("use_dora", False)),
        },
    }
    if not adapter_only:
        # The merge adds into the tensors it is given; on CPU those can be the model's own weights.
        merged = {k: v.detach().to("cpu", copy=True) for k, v in model_state.items()}
        state[training.MODEL_KEY] = get_merged_lora_ckpt(merged, rank=cfg_model.lora_rank, alpha=cfg_model.lora_alpha)
    return state
