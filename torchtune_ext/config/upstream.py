"""torchtune 0.6.1's packaged configs and model families, as these recipes see them.

``tune run recipes/<recipe>.py --config <name>`` looks ``<name>`` up among the
configs torchtune ships (for a recipe file that is not one of torchtune's own,
it searches every recipe's configs) and passes the packaged YAML's path to
our recipe; a name that is not packaged is read as a file path. So
``--config qwen2_5/0.5B_lora_single_device`` reaches our LoRA recipe unchanged.

This module answers three questions about such configs:

* :func:`packaged_configs`: which configs torchtune ships for a recipe name;
* :func:`download_command`: which ``tune download`` line fills a checkpoint
  folder, read from the headers of torchtune's configs and of ours;
* :func:`check_model_type`: whether ``checkpointer.model_type`` converts the
  HF weights for the architecture that ``model`` builds.
"""

import functools
import os
import re
import shlex
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from torchtune_ext.moved import canonical

# The recipes of this repository, by the name torchtune gives its own.
RECIPES = ("full_finetune_single_device", "full_finetune_distributed",
           "lora_finetune_single_device", "lora_finetune_distributed",
           "knowledge_distillation_single_device", "knowledge_distillation_distributed",
           # preference tuning (docs/preference.md); torchtune has no full_dpo_single_device
           "full_dpo_single_device", "full_dpo_distributed", "lora_dpo_single_device", "lora_dpo_distributed")

_OUR_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def torchtune_configs_dir() -> Path:
    """The folder of torchtune's packaged YAML configs (``recipes/configs`` in site-packages)."""
    import torchtune

    return Path(torchtune.__file__).resolve().parent.parent / "recipes" / "configs"


def packaged_configs(recipe: str) -> List[Tuple[str, Path]]:
    """torchtune's packaged configs for ``recipe``, as ``(name, path)``.

    Args:
        recipe: a torchtune recipe name, e.g. ``"lora_finetune_single_device"``.

    Returns:
        ``[("qwen2_5/0.5B_lora_single_device", Path(".../qwen2_5/0.5B_lora_single_device.yaml")), ...]``
        in torchtune's registry order; empty for an unknown recipe.
    """
    from torchtune._recipe_registry import get_all_recipes

    root = torchtune_configs_dir()
    for entry in get_all_recipes():
        if entry.name == recipe:
            return [(config.name, root / config.file_path) for config in entry.configs]
    return []


# torchtune's `tune download <repo> --output-dir DIR` and Hugging Face's `hf download <repo> --local-dir DIR`
_DOWNLOAD_LINE = re.compile(r"\b((?:tune|hf) download)\s+(.+)$")


def _download_target(args: List[str]) -> Tuple[Optional[str], Optional[str]]:
    """(repo id, output folder) of a ``tune download`` or ``hf download`` argument list; the
    folder defaults to ``/tmp/<model name>`` as in ``tune download`` (``hf download`` without
    ``--local-dir`` fills its cache, no folder of the config's)."""
    repo = next((a for a in args if not a.startswith("-")), None)
    if repo is None:
        return None, None
    for flag in ("--output-dir", "--local-dir"):
        if flag in args and args.index(flag) + 1 < len(args):
            return repo, args[args.index(flag) + 1]
    return repo, f"/tmp/{repo.split('/')[-1]}"


@functools.lru_cache(maxsize=1)
def _download_index() -> Tuple[Dict[str, str], Dict[str, List[str]]]:
    """From config headers: (checkpoint_dir of a config -> its command, output folder -> commands)."""
    from omegaconf import OmegaConf

    by_checkpoint_dir: Dict[str, str] = {}
    by_folder: Dict[str, List[str]] = {}
    for folder in (_OUR_CONFIGS, torchtune_configs_dir()):  # ours first: our headers match our configs
        for path in sorted(folder.rglob("*.yaml")) if folder.is_dir() else []:
            text = path.read_text()
            commands = []
            for line in text.splitlines():
                if not line.lstrip().startswith("#"):
                    break  # the header is over
                match = _DOWNLOAD_LINE.search(line)
                if match:
                    commands.append((match.group(1), re.sub(r"\s+#.*$", "", match.group(2)).strip()))
            for tool, args in commands:
                try:
                    words = shlex.split(args)
                except ValueError:
                    continue
                repo, target = _download_target(words)
                if repo is not None:
                    by_folder.setdefault(os.path.normpath(target), []).append(f"{tool} {args}")
            if commands:
                try:
                    checkpoint_dir = OmegaConf.create(text).get("checkpointer", {}).get("checkpoint_dir")
                except Exception:  # an interpolation of a mandatory key (`model_dir: ???`): no folder of its own
                    checkpoint_dir = None
                if isinstance(checkpoint_dir, str):
                    by_checkpoint_dir.setdefault(os.path.normpath(checkpoint_dir), " ".join(commands[0]))
    return by_checkpoint_dir, by_folder


def download_command(path: str) -> Optional[str]:
    """The ``tune download`` (or ``hf download``) command that fills the folder holding ``path``.

    Read from the header comments of torchtune's packaged configs and of this
    repository's configs (``tune download <repo> [--output-dir DIR] ...``;
    without ``--output-dir`` the folder is ``/tmp/<model name>``; or
    ``hf download <repo> --local-dir DIR``). A config
    whose ``checkpointer.checkpoint_dir`` is ``path`` gives its own command
    (the right file patterns for its checkpointer); otherwise the first
    command whose output folder contains ``path`` (one that keeps the
    safetensors files unless ``path`` is Meta's ``original/`` folder).

    Args:
        path: a checkpoint folder or a file in it, e.g.
            ``/tmp/Meta-Llama-3-8B-Instruct/original/``.

    Returns:
        the command as written in the header, or None if no header names a
        folder that contains ``path``.
    """
    by_checkpoint_dir, by_folder = _download_index()
    target = os.path.normpath(path)
    if target in by_checkpoint_dir:
        return by_checkpoint_dir[target]
    wants_safetensors = "original" not in Path(target).parts
    while True:
        if target in by_folder:
            commands = by_folder[target]
            keeps = [c for c in commands if ("*.safetensors" in c) != wants_safetensors]
            return (keeps or commands)[0]
        parent = os.path.dirname(target)
        if parent == target:
            return None
        target = parent


# How torchtune's HF checkpointer converts weights for each model_type. Types
# in one group convert alike (the default group permutes the q/k projections
# for torchtune's interleaved RoPE); across groups the same file gives another
# architecture, or silently wrong weights (QWEN2 does not permute).
_CONVERSION_GROUPS = (
    frozenset({"LLAMA2", "LLAMA3", "LLAMA3_2", "MISTRAL", "GEMMA"}),
    frozenset({"QWEN2"}),
    frozenset({"GEMMA2"}),
    frozenset({"PHI3_MINI", "PHI4"}),
    frozenset({"LLAMA3_VISION"}),
)

# model family (the torchtune.models subpackage of the model builder) -> the
# checkpointer.model_type torchtune's configs use with it (tests check this
# table against every packaged config).
FAMILY_MODEL_TYPES: Dict[str, str] = {
    "llama2": "LLAMA2", "code_llama2": "LLAMA2", "llama3": "LLAMA3", "llama3_1": "LLAMA3",
    "llama3_2": "LLAMA3_2", "llama3_3": "LLAMA3", "mistral": "MISTRAL", "gemma": "GEMMA",
    "gemma2": "GEMMA2", "phi3": "PHI3_MINI", "phi4": "PHI4", "qwen2": "QWEN2", "qwen2_5": "QWEN2",
    "llama3_2_vision": "LLAMA3_VISION",
}


def model_family(component: str) -> Optional[str]:
    """The family of a model builder path: ``torchtune.models.qwen2_5.lora_qwen2_5_7b_instruct`` -> ``qwen2_5``.

    This repository's SmolLM2 builders (``torchtune_ext.model.builders``) are ``llama3_2``
    models. None for other builders.
    """
    component = canonical(component)
    parts = component.split(".")
    if parts[:2] == ["torchtune", "models"] and len(parts) > 3:
        return parts[2]
    if component.startswith("torchtune_ext.model.") and not component.startswith("torchtune_ext.model.hf."):
        return "llama3_2"
    return None


def check_model_type(model_component: str, model_type: Optional[str]) -> Optional[str]:
    """Why ``model_type`` cannot load weights for ``model_component``, or None if it can.

    Returns:
        a message naming the family and the model type it needs, when the
        family is known and ``model_type`` converts HF weights differently.
    """
    family = model_family(model_component)
    expected = FAMILY_MODEL_TYPES.get(family or "")
    if expected is None or model_type is None:
        return None
    group = next((g for g in _CONVERSION_GROUPS if expected in g), frozenset({expected}))
    if str(model_type).upper() in group:
        return None
    return (f"{model_type} does not fit the {family} model {model_component}: torchtune's checkpointer would "
            f"convert the weights for another architecture; use model_type: {expected}")


def describe_model(cfg) -> str:
    """``model._component_`` with its family and ``checkpointer.model_type``, for messages."""
    component = cfg.model._component_
    family = model_family(component)
    model_type = cfg.checkpointer.get("model_type")
    details = ", ".join(x for x in (f"family {family}" if family else "",
                                    f"checkpointer.model_type {model_type}" if model_type else "") if x)
    return f"{component} ({details})" if details else component


# Parts of the state-dict keys of LoRA and DoRA adapter tensors: torchtune's models (lora_a, lora_b,
# magnitude) and PEFT's on transformers models (lora_A, lora_B, lora_magnitude_vector).
ADAPTER_KEYS = ("lora_a", "lora_b", "magnitude", "lora_A", "lora_B")


def first_mismatch(model_state, checkpoint_state) -> Optional[str]:
    """The first key (in the model's order) where a checkpoint does not fit a model, described; None if it fits.

    Adapter weights (``lora_a``, ``lora_b``, DoRA ``magnitude``) the checkpoint
    lacks are not a mismatch: a LoRA model loads its base from a plain checkpoint.

    Args:
        model_state: the model's ``state_dict()`` (tensors, meta or DTensor: only shapes are read).
        checkpoint_state: the state dict loaded from the checkpoint, in torchtune key names.
    """
    for key, value in model_state.items():
        if key not in checkpoint_state:
            if not any(part in key for part in ADAPTER_KEYS):
                return f"'{key}' is missing from the checkpoint"
        elif tuple(checkpoint_state[key].shape) != tuple(value.shape):
            return (f"'{key}' has shape {list(checkpoint_state[key].shape)} in the checkpoint, "
                    f"{list(value.shape)} in the model")
    for key in checkpoint_state:
        if key not in model_state:
            return f"'{key}' is in the checkpoint but not in the model"
    return None
