"""Which checkpoints a run folder holds, and whether one matches its manifest (sizes and SHA-256).

A checkpoint is a ``<output_dir>/step_<N>/`` folder with a manifest,
``checkpoint.json``, that lists every other file with its size and SHA-256.
Only folders with a manifest count: a save renames a folder into place only
when it is complete (:mod:`torchtune_ext.checkpoint.writer`).
"""

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from torchtune_ext.errors import ConfigError
from torchtune_ext.text import short

MANIFEST = "checkpoint.json"
RECIPE_STATE = "recipe_state.pt"
# A LoRA checkpoint keeps its adapter in a subfolder: the step folder itself
# then loads as the merged model (transformers attaches any adapter_config.json
# it finds beside model weights), and the subfolder as a PEFT adapter.
ADAPTER_DIR = "adapter"
# The adapter in torchtune's key names, read on resume (beside it in adapter/:
# adapter_model.safetensors in PEFT's names, adapter_config.json).
ADAPTER_WEIGHTS = f"{ADAPTER_DIR}/adapter_model.pt"
TORCHTUNE_ADAPTER_FILES = ("adapter_model.pt", "adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")
STAGING = ".staging"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# The manifest's entry of per-file content hashes: name -> SHA-256 hex digest. SHA-256 rather than
# BLAKE2: hashlib's OpenSSL SHA-256 uses the CPU's SHA instructions (x86 SHA-NI, ARMv8), measured
# 1.36 GiB/s against BLAKE2b's 0.44 GiB/s on this project's CPU.
HASHES = "sha256"


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


def step_of(path: Path) -> int:
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
        if step_of(earlier) >= step_of(path):
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


def checkpoint_problem(path: Path, content: bool = False) -> Optional[str]:
    """What is wrong with checkpoint folder ``path`` against its manifest, or None if it matches.

    ``content``: compare the files' SHA-256 too, where the manifest records them (as :func:`verify_checkpoint`).
    For callers that word their own error (the export names no config key).
    """
    return _read_manifest(path, content)[1]


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
