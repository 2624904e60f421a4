"""Fill in the defaults and check a recipe config before any work starts: :func:`validate`.

Every key of the schema is given its default and checked
(:mod:`torchtune_ext.config.schema`), then the keys together
(:mod:`torchtune_ext.config.combinations`) and the files they name
(:mod:`torchtune_ext.config.files`). Keys the recipe does not read are a
warning in the YAML file and an error on the command line, with a
did-you-mean.
"""

import contextlib
import logging
from typing import Dict, Iterable, Iterator, Optional, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict

from torchtune_ext import ranks
from torchtune_ext.config.combinations import check_combinations, check_validation, resolve_backward
from torchtune_ext.config.files import check_input_files, check_output_dir
from torchtune_ext.config.schema import COMMON_KEYS, DISTRIBUTED_KEYS, LORA_KEYS, REMOVED_KEYS, Key
from torchtune_ext.errors import ConfigError
from torchtune_ext.text import closest

log = logging.getLogger(__name__)


# Names other tools use for our keys, which spelling similarity would not find.
_OTHER_NAMES = {"val_batch_size": "batch_size_val", "eval_batch_size": "batch_size_val",
                "val_dataset": "dataset_val", "eval_dataset": "dataset_val",
                "max_validation_steps": "max_val_samples", "max_val_batches": "max_val_samples",
                "max_eval_samples": "max_val_samples", "eval_steps": "run_val_every_n_steps"}


# The keys of this process's command-line overrides (``key=value``), while the recipe's entry point runs
# (torchtune_ext.run.control.exits.exit_on_user_error sets them before torchtune merges them into the YAML): validate
# refuses one whose top-level key the recipe does not have; the same key in the YAML file is a warning only.
_command_line_keys: Tuple[str, ...] = ()


@contextlib.contextmanager
def command_line_keys(keys: Iterable[str]) -> Iterator[None]:
    """Within the block, :func:`validate` refuses an override key in ``keys`` that names no key of the recipe.

    Args:
        keys: dotted keys of the ``key=value`` overrides typed on the command
            line (``optimizer.lr``), as :func:`torchtune_ext.run.control.command_line.check_command_line` returns them.
    """
    global _command_line_keys
    outer, _command_line_keys = _command_line_keys, tuple(keys)
    try:
        yield
    finally:
        _command_line_keys = outer


def _check_command_line_keys(schema: Dict[str, Key]) -> None:
    for key in _command_line_keys:
        top = key.split(".")[0].split("[")[0]
        if top in schema or top in REMOVED_KEYS:  # a removed key: resolve_backward says what replaces it
            continue  # a component's arguments are checked against its signature (torchtune_ext.run.preflight)
        readers = [name for name, keys in (("distributed", DISTRIBUTED_KEYS), ("LoRA", LORA_KEYS)) if top in keys]
        hint = _closest(top, schema) or (f" (only the {readers[0]} recipes read it)" if readers else "")
        raise ConfigError(key, f"typed on the command line, but this recipe has no key '{top}', so the value "
                          f"would be ignored{'.' if hint.startswith(' Did') else ''}{hint}")


def ignored_keys(cfg: DictConfig, extra_keys: Optional[Dict[str, Key]] = None) -> Tuple[str, ...]:
    """The top-level keys of ``cfg`` that the recipe does not read (those :func:`validate` warns about)."""
    schema = {**COMMON_KEYS, **(extra_keys or {})}
    return tuple(key for key in cfg.keys() if key not in schema)


def remind_ignored_keys(cfg: DictConfig, extra_keys: Optional[Dict[str, Key]] = None) -> None:
    """At the end of a run, say once more (rank 0, a warning) which config keys were ignored, if any.

    The warnings of :func:`validate` come first thing, where the lines of
    the run push them out of sight; a key a user meant to set (misspelt in
    the YAML file) is worth a second look.

    Args:
        cfg: the config as :func:`validate` returned it.
        extra_keys: the recipe's keys beyond :data:`COMMON_KEYS`, as given to ``validate``.
    """
    ignored = ignored_keys(cfg, extra_keys)
    if ignored and ranks.is_rank_zero():
        log.warning("Config keys this recipe ignored (not read, as said at the start): %s", ", ".join(ignored))


def _closest(key: str, known: Iterable[str]) -> str:
    match = closest(key, known, _OTHER_NAMES)
    return f" Did you mean '{match}'?" if match else ""


_MISSING_HINTS = {"model_dir": ": the folder of a Hugging Face model as `huggingface-cli download` leaves it "
                               "(config.json, *.safetensors, tokenizer files), e.g. model_dir=/models/Qwen3-0.6B"}

# Keys a training config must have that evaluating a checkpoint does not read.
_TRAINING_ONLY = ("output_dir", "optimizer")


def validate(cfg: DictConfig, extra_keys: Optional[Dict[str, Key]] = None,
             evaluate_on: Optional[str] = None) -> DictConfig:
    """Fill defaults and check a recipe config before any work starts.

    Args:
        cfg (DictConfig): the parsed config (YAML plus command-line overrides).
        extra_keys (dict, optional): recipe-specific keys beyond :data:`COMMON_KEYS`.
        evaluate_on (str, optional): check the config for evaluating a checkpoint
            on this dataset key (``dataset`` or ``dataset_val``) instead of for
            training: ``output_dir`` and ``optimizer`` may be absent and are not
            checked.

    What ``output_dir`` holds is not looked at here: whether another run
    holds it (:func:`torchtune_ext.run.control.run_lock.check_not_in_use`) and
    where a run starts (:func:`torchtune_ext.run.resume.check_resume_point`) are
    checked next, by :func:`torchtune_ext.run.loop.run_recipe`.

    Returns:
        DictConfig: a new config with every known key present.

    Raises:
        ConfigError: the first problem found, naming its key; also a key typed
            on the command line that the recipe does not have (see
            :func:`command_line_keys`), where one in the YAML file is a warning.
    """
    schema = {**COMMON_KEYS, **(extra_keys or {})}
    _check_command_line_keys(schema)
    cfg = cfg.copy()
    for key in cfg:  # `???`: a value the config leaves to the command line (configs/hf: model_dir)
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(key, f"is required: give it on the command line ({key}=...){_MISSING_HINTS.get(key, '')}")
    backward_given = "backward" in cfg
    for key in list(cfg.keys()):
        if key not in schema and key not in REMOVED_KEYS:
            log.warning("Unknown config key '%s' is ignored.%s", key, _closest(key, schema))
    training = evaluate_on is None
    for key, spec in schema.items():
        if not training and key in _TRAINING_ONLY:
            continue
        if key not in cfg:
            if spec.required:
                raise ConfigError(key, "is required but missing")
            with open_dict(cfg):
                cfg[key] = spec.default
        spec.check(key, OmegaConf.to_object(cfg[key]) if OmegaConf.is_config(cfg[key]) else cfg[key])

    resolve_backward(cfg, backward_given)
    check_validation(cfg, training)
    check_combinations(cfg, training)
    if training:
        check_output_dir(cfg.output_dir)
        profiler = cfg.get("profiler")
        if profiler is not None and profiler.get("enabled", False) is True and profiler.get("output_dir"):
            check_output_dir(str(profiler.output_dir), "profiler.output_dir")  # torchtune creates it at setup
        check_input_files(cfg)
    else:
        if cfg.get(evaluate_on) is None:
            raise ConfigError(evaluate_on, "is required to evaluate on it")
        check_input_files(cfg, (evaluate_on,))
    # After the files: weights not downloaded yet is the first thing to fix, on any machine.
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device", "cuda requested but no CUDA device is available; use device=cpu")
    return cfg
