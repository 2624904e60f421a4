"""The distillation recipes' config: what a value may be, and the teacher's keys together.

The keys and their defaults are in the one schema
(:data:`torchtune_ext.config.schema.DISTILLATION_KEYS`); here are their checks
and :func:`check_teacher`, which the distillation recipes run on the config
as given, before anything else: a teacher named twice or not at all, or
whose weights are not downloaded, is one line naming the key and the fix
(for torchtune's packaged KD configs: both ``tune download`` commands).
"""

import os
from typing import Any

from omegaconf import DictConfig, ListConfig

from torchtune_ext.config.upstream import download_command
from torchtune_ext.errors import DOWNLOAD_COMMAND, ConfigError

# The dtypes a teacher may run in besides the student's (torchtune's names).
TEACHER_DTYPES = ("fp32", "bf16", "fp16")


def unit_interval(key: str, value: Any) -> None:
    """A number in [0, 1] (``kd_ratio``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(key, f"expected a number in [0, 1] (the weight of the distillation term; 0 is "
                          f"fine-tuning, 1 distillation alone), got {value!r}")


def on_policy_share(key: str, value: Any) -> None:
    """A number in [0, 1] (``on_policy_ratio``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(key, f"expected a number in [0, 1] (the share of each step's samples the student "
                          f"completes itself; 0 is offline distillation, 1 fully on-policy), got {value!r}")


def sampling_temperature(key: str, value: Any) -> None:
    """A number > 0 (``on_policy_temperature``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(key, f"expected a number > 0 (1 samples the student's own distribution), got {value!r}")


def check_on_policy(cfg: DictConfig, distributed: bool = False) -> None:
    """On-policy distillation's combinations, on the config as given (the values' own checks are the schema's).

    Raises:
        ConfigError: (key ``on_policy_ratio``) > 0 with packed data (a pack's documents have no prompt of
            their own to complete), or in the distributed recipe (not implemented there).
    """
    ratio = cfg.get("on_policy_ratio", 0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
        return  # 0 (offline), or a bad value the schema's check names
    datasets = cfg.get("dataset")
    datasets = list(datasets) if isinstance(datasets, (list, ListConfig)) else [datasets or {}]
    if cfg.get("pack_micro_batches") or any(bool(d.get("packed", False)) for d in datasets):
        raise ConfigError("on_policy_ratio", f"{ratio} needs unpacked samples (each one prompt to complete): set "
                          "dataset.packed=false and pack_micro_batches=false, or on_policy_ratio=0")
    if distributed:
        raise ConfigError("on_policy_ratio", f"{ratio}: on-policy distillation runs in the single-device recipe "
                          "only (recipes/knowledge_distillation_single_device.py); here set on_policy_ratio=0")


def optional_dtype(key: str, value: Any) -> None:
    """null (the student's dtype) or one of :data:`TEACHER_DTYPES`."""
    if value is not None and value not in TEACHER_DTYPES:
        raise ConfigError(key, f"expected null (the student's dtype) or one of {', '.join(TEACHER_DTYPES)}, "
                          f"got {value!r}")


def _download_hint(path: str) -> str:
    norm = os.path.normpath(path)
    if norm == "assets" or norm.startswith("assets" + os.sep):
        return f"`{DOWNLOAD_COMMAND}`"
    command = download_command(path)
    if command:
        return f"`{command}`"
    return f"put the model's files in '{path}' or set the key to the folder that has them"


def check_teacher(cfg: DictConfig) -> None:
    """The teacher's keys of a distillation config, before the config check and before any work.

    Exactly one teacher: ``teacher_model`` with ``teacher_checkpointer``
    (torchtune's builders and checkpointers, as torchtune's KD configs spell
    them) or ``teacher_model_dir`` (a Hugging Face folder). Its folder must
    exist; if the student's is missing too, the line names both downloads.

    Raises:
        ConfigError: naming the key and the fix.
    """
    builder, folder = cfg.get("teacher_model"), cfg.get("teacher_model_dir")
    if builder is None and folder is None:
        raise ConfigError("teacher_model", "is required to distil: a torchtune builder with teacher_checkpointer "
                          "(as torchtune's KD configs), or teacher_model_dir=<Hugging Face folder>")
    if builder is not None and folder is not None:
        raise ConfigError("teacher_model_dir", "and teacher_model both name a teacher: keep one")
    if builder is not None and cfg.get("teacher_checkpointer") is None:
        raise ConfigError("teacher_checkpointer", "is required with teacher_model: the checkpointer that loads "
                          "the teacher's weights (checkpoint_dir, checkpoint_files, model_type)")
    key, path = (("teacher_model_dir", str(folder)) if folder is not None
                 else ("teacher_checkpointer.checkpoint_dir", str(cfg.teacher_checkpointer.get("checkpoint_dir"))))
    if os.path.isdir(path):
        return
    student = cfg.get("checkpointer", {}).get("checkpoint_dir") if cfg.get("checkpointer") is not None else None
    if student is not None and not os.path.isdir(str(student)):
        raise ConfigError(key, f"'{path}' does not exist, nor the student's '{student}'. Download both first: "
                          f"{_download_hint(str(student))} and {_download_hint(path)}")
    raise ConfigError(key, f"'{path}' does not exist. Download the teacher first: {_download_hint(path)}")


def check_teacher_components(cfg: DictConfig) -> None:
    """``teacher_model`` and ``teacher_checkpointer`` each name their ``_component_``, before any work.

    The schema reads a node without ``_component_`` as switched off (torchtune's
    ``key=null``), and :func:`check_teacher` only asks that the node be there; a
    checkpointer written as ``{checkpoint_dir: ...}`` alone would otherwise pass
    both and fail in torchtune's instantiate after the student has loaded.

    Raises:
        ConfigError: (key ``teacher_model`` or ``teacher_checkpointer``) naming the missing ``_component_``.
    """
    if cfg.get("teacher_model") is None:
        return  # teacher_model_dir names the teacher (check_teacher refused neither or both)
    what = {"teacher_model": "the teacher's torchtune builder",
            "teacher_checkpointer": "its checkpointer, e.g. torchtune.training.FullModelHFCheckpointer"}
    for key, names in what.items():
        node = cfg.get(key)
        if not isinstance(node, (dict, DictConfig)) or not isinstance(node.get("_component_"), str):
            raise ConfigError(key, f"needs a _component_ naming {names} (as torchtune's KD configs give it)")


def _teacher_identity(cfg: Any) -> tuple:
    """What names a teacher in a config (a resolved dict or a DictConfig): its folder, builder, checkpoint."""
    builder = cfg.get("teacher_model") or {}
    checkpointer = cfg.get("teacher_checkpointer") or {}
    return (cfg.get("teacher_model_dir"), builder.get("_component_"), checkpointer.get("checkpoint_dir"))


def check_same_teacher(saved_config: Any, cfg: DictConfig) -> None:
    """Refuse to resume a distillation run with another teacher than the one it was saved with.

    Args:
        saved_config: the resolved config the checkpoint holds (None: not known; nothing is checked).
        cfg: this run's config.

    Raises:
        ConfigError: (key ``teacher_model``) naming the saved teacher.
    """
    if saved_config is None:
        return
    saved, now = _teacher_identity(saved_config), _teacher_identity(cfg)
    if saved != now:
        was = saved[0] or f"{saved[1]} from {saved[2]}"
        raise ConfigError("teacher_model", f"the run was saved distilling from {was}; resume it with that teacher "
                          "(another teacher changes the objective mid-run), or start a new run in another output_dir")
