"""The config's input files exist and can be read; its output folders can be written.

Checked by :func:`torchtune_ext.config.validate` before anything is built:
weights not downloaded yet, a misspelt data file or an unwritable
``output_dir`` are one line naming the key (and, for the bundled assets, the
command that downloads them), not a traceback minutes later.
"""

import json
import os
from typing import Any, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_ext.config.checkers import validation_enabled
from torchtune_ext.config.upstream import download_command
from torchtune_ext.errors import DOWNLOAD_COMMAND, ConfigError


def _paths(value: Any) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, ListConfig)):
        return tuple(str(v) for v in value)
    return (str(value),)


def _missing_input(key: str, path: str, model_files: bool = False, folder: bool = False) -> ConfigError:
    """The error for a missing input path; for model files, the command that downloads them.

    ``folder``: ``path`` must be a folder (a file there is said as such)."""
    hint = ""
    norm = os.path.normpath(path)
    if norm == "assets" or norm.startswith("assets" + os.sep):
        hint = f" The bundled model and data are created by `{DOWNLOAD_COMMAND}` (run it from the repository root)."
    elif model_files:
        command = download_command(path)
        example = ("hf download <org>/<model> --local-dir <folder>" if key == "model_dir" else
                   "tune download <org>/<model> --output-dir <folder>")
        hint = (f" Download the model first: `{command}`" if command else
                f" Download the model into it first, e.g. `{example}`, or point {key} at your copy")
    what = "is a file, not a folder" if folder and os.path.exists(path) else "does not exist"
    return ConfigError(key, f"'{path}' {what}.{hint}")


def _checkpoint_files(files: Any) -> Tuple[str, ...]:
    """File names of ``checkpointer.checkpoint_files``: a list, or torchtune's
    ``{filename_format: model-{}-of-{}.safetensors, max_filename: "00004"}``."""
    if isinstance(files, (list, ListConfig)):
        return tuple(str(name) for name in files)
    if isinstance(files, (dict, DictConfig)):
        from torchtune.training.checkpointing._utils import FormattedCheckpointFiles

        try:
            return tuple(FormattedCheckpointFiles.from_dict(dict(files)).build_checkpoint_filenames())
        except ValueError as err:
            raise ConfigError("checkpointer.checkpoint_files", str(err)) from None
    return ()


def check_input_files(cfg: DictConfig, dataset_keys: Optional[Tuple[str, ...]] = None) -> None:
    """Check that the checkpoint, tokenizer and local dataset files exist.

    ``dataset_keys``: the datasets to check; default ``dataset``, and
    ``dataset_val`` when validation is on.

    Raises:
        ConfigError: naming the key and the missing path, and the download
            command when the path is one of the bundled assets.
    """
    ckpt = cfg.checkpointer
    ckpt_dir = ckpt.get("checkpoint_dir")
    if ckpt_dir is not None:
        if not os.path.isdir(ckpt_dir):
            # the transformers configs set the folder once, as model_dir: name the key the user wrote
            raw = OmegaConf.to_container(ckpt, resolve=False).get("checkpoint_dir")
            key = "model_dir" if raw == "${model_dir}" else "checkpointer.checkpoint_dir"
            raise _missing_input(key, str(ckpt_dir), model_files=True, folder=True)
        for name in _checkpoint_files(ckpt.get("checkpoint_files")):
            if not os.path.isfile(os.path.join(ckpt_dir, name)):
                raise _missing_input("checkpointer.checkpoint_files", os.path.join(ckpt_dir, name), model_files=True)
        for name in sorted(os.listdir(ckpt_dir)):
            if name.endswith(".safetensors"):
                check_safetensors_file(os.path.join(ckpt_dir, name), "checkpointer.checkpoint_dir")
    # tokenizer files: llama3/gemma/mistral/phi `path`, qwen `merges_file`, phi4 `vocab_path`/`merges_path`
    for key in ("path", "tokenizer_json_path", "merges_file", "vocab_path", "merges_path", "special_tokens_path"):
        if cfg.tokenizer.get(key) is not None and not os.path.exists(cfg.tokenizer[key]):
            raise _missing_input(f"tokenizer.{key}", str(cfg.tokenizer[key]), model_files=True)
    if dataset_keys is None:
        dataset_keys = ("dataset", "dataset_val") if validation_enabled(cfg) else ("dataset",)
    for key in dataset_keys:
        datasets = cfg[key] if isinstance(cfg[key], (list, ListConfig)) else [cfg[key]]
        for i, ds in enumerate(datasets):
            prefix = key if len(datasets) == 1 else f"{key}[{i}]"
            for path in _paths(ds.get("data_files")):
                if "://" not in path:
                    _check_data_file(f"{prefix}.data_files", path)


def check_safetensors_file(path: str, key: str) -> None:
    """A ``.safetensors`` file is whole: its header reads and the file holds every byte it lists.

    Reads the header only (8 bytes of length, then JSON whose tensors give
    ``data_offsets`` into the data after it: the safetensors format,
    https://github.com/huggingface/safetensors#format), so a download cut
    short is found before any work, not when the weights load.

    Raises:
        ConfigError: (``key``) naming the file, its size and the size it needs.
    """
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if not 0 < header_len <= size - 8:
                raise ValueError("no header")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for n, t in header.items() if n != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, OSError) as err:
        raise ConfigError(key, f"'{path}' is not a safetensors file ({type(err).__name__}: its header cannot be "
                          "read); download it again") from None
    if size < 8 + header_len + end:
        raise ConfigError(key, f"'{path}' is cut short: {size} bytes, its header lists {8 + header_len + end}; "
                          "the download did not finish: download it again")


def _check_data_file(key: str, path: str) -> None:
    """A local data file exists, can be read and is not empty (the datasets library
    reports an empty file as a bare StopIteration, an unreadable one as missing)."""
    if os.path.isdir(path):
        return  # a folder: the datasets library lists and reads its files
    try:
        with open(path, "rb"):
            pass
    except PermissionError:  # the file, or a folder above it (which makes it look missing)
        raise ConfigError(key, f"'{path}' cannot be read (permission denied); make it readable (chmod a+r) or "
                          f"point {key} at a copy") from None
    except FileNotFoundError:
        raise _missing_input(key, path) from None
    if os.path.getsize(path) == 0:
        raise ConfigError(key, f"'{path}' is empty (0 bytes); point {key} at the file with the records")


def check_output_dir(path: str, key: str = "output_dir") -> None:
    """``path`` (the value of config key ``key``) must be a directory we can write to (created if absent).

    Raises:
        ConfigError: naming ``key``, if it is a file, lies under a file, or is not writable.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(key, f"'{path}' exists and is not a directory: choose a folder path for {key} "
                               "(a new one, or a run's folder)")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(os.path.abspath(probe))
        if parent == probe:
            break
        probe = parent
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise ConfigError(key, f"'{path}' cannot be created: '{probe}' is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(key, f"'{path}' is not writable (checked '{probe}')")
