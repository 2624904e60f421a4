"""Recipe config schema: every default in one place, every error names its key.

A recipe calls :func:`validate` on the parsed OmegaConf config before it
builds anything. ``validate`` fills in defaults, checks types and ranges,
checks that input files exist, and raises :class:`ConfigError` naming the
offending key and what is expected.
:func:`torchtune_ext.control.exits.exit_on_user_error` turns such expected mistakes
into one clear line on stderr and exit status 2, without a traceback and
before anything is written.
"""

import contextlib
import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from torchtune_ext import ranks
from torchtune_ext.errors import DOWNLOAD_COMMAND, ConfigError, UserError  # noqa: F401 (UserError: a public name here)
from torchtune_ext.text import closest
from torchtune_ext.upstream import check_model_type, download_command

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Key:
    """One top-level config key: its default and the check it must pass."""

    default: Any
    check: Callable[[str, Any], None]
    required: bool = False


_NO_DEFAULT = object()


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"expected a positive integer, got {value!r}")


def _optional_positive_int(key: str, value: Any) -> None:
    if value is not None:
        _positive_int(key, value)


def _non_negative_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, f"expected an integer >= 0, got {value!r}")


def _optional_int(key: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(key, f"expected an integer or null, got {value!r}")


def _boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {value!r}")


def _optional_boolean(key: str, value: Any) -> None:
    if value is not None:
        _boolean(key, value)


# Values of the `backward` key (torchtune_ext.step.forward_backward).
BACKWARD_MODES = ("auto", "once_per_step", "per_micro_batch")


# Boolean arguments of torch.optim optimizers (fused and foreach also take null: torch decides).
_OPTIMIZER_FLAGS = ("fused", "foreach", "amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")


def _optional_positive_float(key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(key, f"expected a positive number or null, got {value!r}")


def _string(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"expected a non-empty string, got {value!r}")


def _optional_string(key: str, value: Any) -> None:
    if value is not None:
        _string(key, value)


def _one_of(*choices: str) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if value not in choices:
            raise ConfigError(key, f"expected one of {', '.join(choices)}, got {value!r}")

    return check


def check_output_chunks(key: str, value: Any) -> None:
    """``loss.num_output_chunks``: ``auto`` or a positive integer (:mod:`torchtune_ext.loss`)."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, f"expected auto or a positive integer, got {value!r}")


def _component(key: str, value: Any) -> None:
    if not isinstance(value, (dict, DictConfig)) or not isinstance(value.get("_component_"), str):
        raise ConfigError(key, "expected a mapping with a '_component_' entry naming a class or function")


def _optional_component(key: str, value: Any) -> None:
    if enabled(value) is not None:
        _component(key, value)


def enabled(node: Any) -> Any:
    """``node`` itself, or None if it is null or its ``_component_`` is null.

    ``tune run ... metric_logger=null`` sets ``metric_logger._component_`` to
    null (torchtune's shorthand for the component), which means "off".
    """
    if node is None or (isinstance(node, (dict, DictConfig)) and node.get("_component_") is None):
        return None
    return node


def _dataset(key: str, value: Any) -> None:
    if isinstance(value, (list, ListConfig)):
        if not value:
            raise ConfigError(key, "expected a dataset or a non-empty list of datasets")
        for i, item in enumerate(value):
            _component(f"{key}[{i}]", item)
    else:
        _component(key, value)


def _val_every_n_steps(key: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, f"expected a positive integer (validate every N optimizer steps), or null for "
                          f"no validation, got {value!r}")


def _switched_off(node: Any) -> bool:
    """None, or torchtune's ``key=null`` on the command line (it sets ``key._component_`` to null)."""
    return node is None or (isinstance(node, (dict, DictConfig)) and "_component_" in node
                            and node["_component_"] is None)


def _optional_dataset(key: str, value: Any) -> None:
    if not _switched_off(value):  # `dataset_val=null` on the command line: no validation set
        _dataset(key, value)
def _refused_if_true(why: str) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        _boolean(key, value)
        if value:
            raise ConfigError(key, f"is not supported by this recipe: {why}; set {key}=false")

    return check


def _optional_names(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) and v for v in value)):
        raise ConfigError(key, f"expected a list of module names (e.g. [tok_embeddings, output]) or null, got {value!r}")


def _tensor_parallel_dim(key: str, value: Any) -> None:
    _positive_int(key, value)
    if value > 1:
        raise ConfigError(key, "tensor parallelism is not supported: these recipes shard with FSDP2 over data-parallel "
                          "ranks only; set tensor_parallel_dim=1 (fsdp_cpu_offload or more ranks save memory instead)")


def _fsdp_section(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"cpu_offload"}:
        raise ConfigError(key, f"expected null or {{cpu_offload: <bool>}}, got {value!r}; "
                          "use fsdp_cpu_offload and fsdp_reshard_after_forward")
    _boolean(f"{key}.cpu_offload", value.get("cpu_offload", False))


PROFILER_COMPONENT = "torchtune.training.setup_torch_profiler"


def _profiler(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a mapping (torchtune's profiler section) or null, got {value!r}")
    component = value.get("_component_", PROFILER_COMPONENT)
    if component not in (PROFILER_COMPONENT, None):
        raise ConfigError(f"{key}._component_", f"only {PROFILER_COMPONENT} is supported, got {component!r}")
    _boolean(f"{key}.enabled", value.get("enabled", False))
    for flag in ("cpu", "cuda", "xpu", "profile_memory", "with_stack", "record_shapes", "with_flops"):
        if value.get(flag) is not None:
            _boolean(f"{key}.{flag}", value[flag])
    # torch.profiler.schedule's own bounds (it asserts them when the profiler is set up, after the model load)
    for name, least in (("wait_steps", 0), ("warmup_steps", 0), ("active_steps", 1), ("num_cycles", 0)):
        steps = value.get(name)
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < least):
            raise ConfigError(f"{key}.{name}", f"expected an integer >= {least} or null, got {steps!r}")


# Multimodal model families: their forward takes images (encoder_input) and
# their data a tiled-image collator; these recipes train text decoders only.
MULTIMODAL_FAMILIES = ("torchtune.models.llama3_2_vision", "torchtune.models.llama4")


def _text_model(key: str, value: Any) -> None:
    _component(key, value)
    component = value["_component_"]
    if component.startswith(MULTIMODAL_FAMILIES):
        raise ConfigError(f"{key}._component_", f"{component} is a multimodal (image and text) model, which these "
                          "recipes do not train; use a text-only model (e.g. torchtune.models.llama3_1.llama3_1_8b) "
                          "or torchtune's own recipe for it")


def resolve_component(path: str) -> Any:
    """The object a ``_component_`` dotted path names, importing as needed.

    Raises:
        ValueError: no such module or attribute (the message names the part
            that is missing). Errors raised while importing an existing
            module propagate.
    """
    parts = path.split(".")
    if not path or not all(parts):
        raise ValueError(f"'{path}' is not a dotted path such as torch.optim.AdamW")
    module, found = None, 0
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            module, found = importlib.import_module(name), i
            break
        except ModuleNotFoundError as err:
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise  # an existing module failed to import one of its own dependencies
    if module is None:
        raise ValueError(f"there is no module '{parts[0]}' (is its package installed?)")
    obj = module
    for j in range(found, len(parts)):
        if not hasattr(obj, parts[j]):
            raise ValueError(f"'{'.'.join(parts[:j])}' has no attribute '{parts[j]}'")
        obj = getattr(obj, parts[j])
    return obj


def import_component(key: str, component: str) -> Any:
    """The object a ``_component_`` path names, or a :class:`ConfigError` naming the missing package.

    Raises:
        ConfigError: (key ``key``) if the module or the attribute does not
            exist; a missing package is named with what installs it.
    """
    try:
        return resolve_component(component)
    except ModuleNotFoundError as err:  # an existing module needs a package that is not installed
        package = (err.name or "").split(".")[0]
    except ValueError as err:
        package = component.split(".")[0]
        if f"there is no module '{package}'" not in str(err):
            raise ConfigError(key, f"'{component}' cannot be imported: {err}") from None
    hint = _INSTALL_HINTS.get(package, f"`pip install {package}`")
    raise ConfigError(key, f"{component} cannot be imported: there is no module '{package}' (its Python "
                      f"package is not installed): {hint}")


_INSTALL_HINTS = {
    "bitsandbytes": "`pip install bitsandbytes` (its paged optimizers need a CUDA GPU), "
                    "or use optimizer._component_=torch.optim.AdamW",
    "torchvision": "`pip install torchvision` with the version that matches torch",
}


# Keys every recipe understands, with their defaults. Recipe-specific keys are
# passed to ``validate`` as ``extra_keys``.
COMMON_KEYS: Dict[str, Key] = {
    "output_dir": Key(_NO_DEFAULT, _string, required=True),
    # A Hugging Face model folder: configs/hf/*.yaml interpolate it into model.path, tokenizer.path
    # and checkpointer.checkpoint_dir, so that it is the one key to set (torchtune_ext.hf).
    "model_dir": Key(None, _optional_string),
    "model": Key(_NO_DEFAULT, _text_model, required=True),
    "tokenizer": Key(_NO_DEFAULT, _component, required=True),
    "dataset": Key(_NO_DEFAULT, _dataset, required=True),
    # Samples with no trainable token (an answer cut away at tokenizer.max_seq_len)
    # or with replacement characters (undecodable bytes): report them, or stop
    # before training (torchtune_ext.data_check).
    "data_errors": Key("warn", _one_of("warn", "error")),
    "checkpointer": Key(_NO_DEFAULT, _component, required=True),
    "optimizer": Key(_NO_DEFAULT, _component, required=True),
    "lr_scheduler": Key(None, _optional_component),
    "loss": Key(
        {"_component_": "torchtune_ext.loss.SummedCrossEntropyLoss", "num_output_chunks": "auto"},
        _component,
    ),
    "metric_logger": Key(None, _optional_component),
    "seed": Key(None, _optional_int),
    "shuffle": Key(True, _boolean),
    "batch_size": Key(2, _positive_int),
    "epochs": Key(1, _positive_int),
    "max_steps_per_epoch": Key(None, _optional_positive_int),
    "gradient_accumulation_steps": Key(1, _positive_int),
    # How a step's micro-batches are backpropagated (torchtune_ext.step.forward_backward), with the
    # same gradients: "once_per_step" keeps every micro-batch's graph for one backward on the
    # step's sum; "per_micro_batch" runs a backward after each micro-batch (memory flat in
    # gradient_accumulation_steps); "auto" decides per step: once per step when it fits under
    # once_per_step_memory_limit, else per micro-batch.
    "backward": Key("auto", _one_of(*BACKWARD_MODES)),
    # The older name: true reads as backward=auto, false as backward=per_micro_batch (said once).
    "backward_once_per_step": Key(None, _optional_boolean),
    # What bounds a once-per-step step's memory under backward=auto (torchtune_ext.memory.MemoryGuard):
    # "torchtune" (no more than torchtune's recipe needs for the same samples, and within the
    # device's free memory) or "device" (the free memory only). Otherwise the step runs backward
    # per micro-batch, with the same gradients.
    "once_per_step_memory_limit": Key("torchtune", _one_of("torchtune", "device")),
    # How a step's samples are arranged into micro-batches (torchtune_ext.data.plan_step):
    # the set of samples per optimizer step, and so the loss, does not depend on it.
    "group_by_length": Key(True, _boolean),
    "max_tokens_per_micro_batch": Key(None, _optional_positive_int),
    # true: a micro-batch is one row of the step's samples concatenated, up to
    # max_tokens_per_micro_batch tokens, attention kept inside each sample (no padding).
    "pack_micro_batches": Key(False, _boolean),
    # Validation (torchtune_ext.evaluate), torchtune's keys: on when run_val_every_n_steps
    # (or run_val_at_start) asks for it; then also once at the end of training. The
    # validation loss does not depend on batch_size_val or on the number of ranks.
    "dataset_val": Key(None, _optional_dataset),
    "run_val_every_n_steps": Key(None, _val_every_n_steps),
    "run_val_at_start": Key(False, _boolean),
    "batch_size_val": Key(None, _optional_positive_int),  # null: batch_size
    # the first N samples of dataset_val, in file order, whatever the batching
    "max_val_samples": Key(None, _optional_positive_int),
    "clip_grad_norm": Key(None, _optional_positive_float),
    "dtype": Key("fp32", _one_of("fp32", "bf16")),
    "device": Key("auto", _one_of("auto", "cpu", "cuda")),
    "compile": Key(False, _boolean),
    "enable_activation_checkpointing": Key(False, _boolean),
    # torchtune's activation offloading (CUDA only, with activation checkpointing, as upstream).
    "enable_activation_offloading": Key(False, _boolean),
    "resume_from_checkpoint": Key(False, _boolean),
    # Record the SHA-256 of every checkpoint file in its manifest at save, and check those of the
    # checkpoint a run resumes from (or python -m torchtune_ext.evaluate reads) before anything
    # loads: a file damaged at the same size is refused. Costs a pass over the checkpoint's bytes
    # at each save and resume (about 1.1 s per 1.5 GiB on an idle core); false records and checks
    # sizes only, for very large checkpoints.
    "verify_checkpoint_hashes": Key(True, _boolean),
    "save_every_n_steps": Key(None, _optional_positive_int),
    # false: skip the checkpoint at the end of the last epoch (runs whose
    # metrics are all that matters, e.g. the parity report); periodic and
    # earlier end-of-epoch checkpoints are still written.
    "save_final_checkpoint": Key(True, _boolean),
    # The newest checkpoint (the one a resume starts from) and the one before it,
    # in case the newest turns out bad; null keeps all. See README "Checkpoints".
    "keep_last_n_checkpoints": Key(2, _optional_positive_int),
    "skip_nonfinite_steps": Key(False, _boolean),
    # A step whose loss is this many nats per token above the highest loss of the
    # last 32 healthy steps is a spike; two in a row stop the run (torchtune_ext.health).
    "loss_spike_nats": Key(3.0, _optional_positive_float),
    # One optimizer per parameter, stepped in its gradient hook (torchtune_ext.optim_in_bwd).
    "optimizer_in_bwd": Key(False, _boolean),
    "log_every_n_steps": Key(1, _positive_int),
    # Dense peak TFLOP/s of one device for the mfu metric; null: a table of
    # common GPUs, or a matmul timed at start-up on CPU (torchtune_ext.flops).
    "peak_tflops_per_device": Key(None, _optional_positive_float),
    # false: leave peak_memory_gib out of the step records (upstream's default is false).
    "log_peak_memory_stats": Key(True, _boolean),
    # torchtune.training.setup_torch_profiler; off unless `enabled: true`.
    "profiler": Key(None, _profiler),
    # How unpacked samples become a micro-batch: torchtune's padded_collate_sft or one
    # with the same arguments (batch, padding_idx, ignore_idx) and output keys.
    "collate_fn": Key("torchtune.data.padded_collate_sft", _string),
    # Only the LoRA single-device recipe uses it (torchtune's low-RAM QLoRA state-dict hook).
    "low_cpu_ram": Key(False, _refused_if_true("only the single-device LoRA recipe uses it (QLoRA state dicts)")),
    "log_level": Key("INFO", _one_of("DEBUG", "INFO", "WARNING", "ERROR")),
}


# Keys of the distributed (FSDP2) recipes, on top of COMMON_KEYS.
DISTRIBUTED_KEYS: Dict[str, Key] = {
    # FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer
    # state live in CPU memory; the optimizer step runs on CPU.
    "fsdp_cpu_offload": Key(False, _boolean),
    # FSDP2 reshard_after_forward: false keeps gathered parameters until backward
    # (more memory, less communication).
    "fsdp_reshard_after_forward": Key(True, _boolean),
    # Modules (by name, e.g. [tok_embeddings, output]) that get an FSDP unit of their
    # own besides every transformer block, as in torchtune.
    "custom_sharded_layers": Key(None, _optional_names),
    # Data parallelism only: tensor parallelism would split the sequence's logits over ranks.
    "tensor_parallel_dim": Key(1, _tensor_parallel_dim),
    "tensor_parallel_plan": Key(None, _optional_component),
    # Some torchtune configs carry `fsdp: {cpu_offload: ...}`, which upstream never reads.
    "fsdp": Key(None, _fsdp_section),
    "low_cpu_ram": Key(False, _refused_if_true("the distributed recipes gather state dicts shard by shard "
                                               "already; it applies to the single-device LoRA recipe")),
}


# LoRA recipes: the adapter settings live under ``model`` (torchtune's
# vocabulary, passed to the LoRA builder as they are). Settings the config
# leaves out take the builder's own defaults (read from its signature), so a
# torchtune LoRA config means here what it means upstream.
LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")


@dataclass(frozen=True)
class LoRASettings:
    """The adapter settings of a LoRA ``model`` config, the builder's defaults filled in.

    ``apply_lora_to_output`` is False for builders without that argument
    (their output projection is the tied token embedding).
    """

    lora_attn_modules: Tuple[str, ...]
    apply_lora_to_mlp: bool
    apply_lora_to_output: bool
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    use_dora: bool
    quantize_base: bool


def lora_settings(cfg_model: Any, key: str = "model") -> LoRASettings:
    """Resolve and check the LoRA settings of a ``model`` config.

    Args:
        cfg_model: the ``model`` node (``_component_`` naming a torchtune LoRA
            builder, plus its arguments).
        key: the config key of ``cfg_model``, for messages.

    Returns:
        LoRASettings: explicit values, else the builder's defaults.

    Raises:
        ConfigError: naming ``model.<argument>`` for a missing, mistyped or
            out-of-range setting, or one the builder does not take.
    """
    value = OmegaConf.to_container(cfg_model) if OmegaConf.is_config(cfg_model) else dict(cfg_model)
    _text_model(key, value)
    builder = import_component(f"{key}._component_", value["_component_"])
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):  # no introspectable signature: only what the config says
        params = {}
    merged = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    merged.update({k: v for k, v in value.items() if k != "_component_"})
    for name in ("apply_lora_to_mlp", "apply_lora_to_output", "use_dora", "quantize_base"):
        merged.setdefault(name, False)
        _boolean(f"{key}.{name}", merged[name])
    modules = merged.get("lora_attn_modules")
    if (not isinstance(modules, list) or len(set(modules)) != len(modules)
            or any(m not in LORA_ATTN_MODULES for m in modules)):
        raise ConfigError(f"{key}.lora_attn_modules",
                          f"expected a list of distinct names from {', '.join(LORA_ATTN_MODULES)}, got {modules!r}")
    if not (modules or merged["apply_lora_to_mlp"] or merged["apply_lora_to_output"]):
        raise ConfigError(f"{key}.lora_attn_modules", "no module would get an adapter: name at least one "
                          "attention projection or set apply_lora_to_mlp=true")
    _positive_int(f"{key}.lora_rank", merged.get("lora_rank"))
    alpha = merged.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConfigError(f"{key}.lora_alpha", f"expected a positive number (adapters are scaled by "
                          f"lora_alpha / lora_rank), got {alpha!r}")
    dropout = merged.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"{key}.lora_dropout", f"expected a probability in [0, 1), got {dropout!r}")
    return LoRASettings(tuple(modules), merged["apply_lora_to_mlp"], merged["apply_lora_to_output"],
                        merged["lora_rank"], alpha, dropout, merged["use_dora"], merged["quantize_base"])


def _lora_model(key: str, value: Any) -> None:
    lora_settings(value, key)


LORA_KEYS: Dict[str, Key] = {
    "model": Key(_NO_DEFAULT, _lora_model, required=True),
    # Checkpoints hold the adapter; false also writes the merged full model.
    "save_adapter_weights_only": Key(False, _boolean),
    # QLoRA: torchtune's state-dict hook that dequantizes NF4 weights through a
    # memory-mapped file instead of RAM (Linux).
    "low_cpu_ram": Key(False, _boolean),
}


# Names other tools use for our keys, which spelling similarity would not find.
_OTHER_NAMES = {"val_batch_size": "batch_size_val", "eval_batch_size": "batch_size_val",
                "val_dataset": "dataset_val", "eval_dataset": "dataset_val",
                "max_validation_steps": "max_val_samples", "max_val_batches": "max_val_samples",
                "max_eval_samples": "max_val_samples", "eval_steps": "run_val_every_n_steps"}


# The keys of this process's command-line overrides (``key=value``), while the recipe's entry point runs
# (torchtune_ext.control.exits.exit_on_user_error sets them before torchtune merges them into the YAML): validate
# refuses one whose top-level key the recipe does not have; the same key in the YAML file is a warning only.
_command_line_keys: Tuple[str, ...] = ()


@contextlib.contextmanager
def command_line_keys(keys: Iterable[str]) -> Iterator[None]:
    """Within the block, :func:`validate` refuses an override key in ``keys`` that names no key of the recipe.

    Args:
        keys: dotted keys of the ``key=value`` overrides typed on the command
            line (``optimizer.lr``), as :func:`torchtune_ext.control.command_line.check_command_line` returns them.
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
        if top in schema:
            continue  # a component's arguments are checked against its signature (torchtune_ext.preflight)
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


def _paths(value: Any) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, ListConfig)):
        return tuple(str(v) for v in value)
    return (str(value),)


def _missing_input(key: str, path: str, model_files: bool = False) -> ConfigError:
    """The error for a missing input path; for model files, the command that downloads them."""
    hint = ""
    norm = os.path.normpath(path)
    if norm == "assets" or norm.startswith("assets" + os.sep):
        hint = f" The bundled model and data are created by `{DOWNLOAD_COMMAND}` (run it from the repository root)."
    elif model_files:
        command = download_command(path)
        hint = (f" Download the model first: `{command}`" if command else
                " Download the model into it first, e.g. `tune download <org>/<model> --output-dir <folder>`, "
                "or point checkpointer.checkpoint_dir at your copy")
    return ConfigError(key, f"'{path}' does not exist.{hint}")


def validation_enabled(cfg: DictConfig) -> bool:
    """Whether a recipe validates during training: ``run_val_every_n_steps`` or
    ``run_val_at_start`` asks for it (torchtune's convention: a ``dataset_val``
    alone, as in torchtune's shipped configs, does not turn validation on)."""
    return bool(cfg.get("run_val_every_n_steps") or cfg.get("run_val_at_start"))


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
            raise _missing_input("checkpointer.checkpoint_dir", str(ckpt_dir), model_files=True)
        for name in _checkpoint_files(ckpt.get("checkpoint_files")):
            if not os.path.isfile(os.path.join(ckpt_dir, name)):
                raise _missing_input("checkpointer.checkpoint_files", os.path.join(ckpt_dir, name), model_files=True)
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
        raise ConfigError(key, f"'{path}' exists and is not a directory")
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


def _check_validation(cfg: DictConfig, training: bool) -> None:
    if _switched_off(cfg.dataset_val):
        cfg.dataset_val = None
    if cfg.batch_size_val is None:
        cfg.batch_size_val = cfg.batch_size
    if not training:
        return
    if validation_enabled(cfg) and cfg.dataset_val is None:
        asked = ("run_val_every_n_steps" if cfg.run_val_every_n_steps else "run_val_at_start")
        raise ConfigError("dataset_val", f"is required by {asked}: add a dataset_val (a dataset config, as "
                          "`dataset`), or set run_val_every_n_steps=null run_val_at_start=false")
    if cfg.dataset_val is not None and not validation_enabled(cfg) and ranks.is_rank_zero():
        from torchtune import utils

        # torchtune's logger (this module's INFO lines are not shown), at the run's log_level already: the
        # recipe applies it after this check
        utils.get_logger(cfg.get("log_level")).info(
            "dataset_val is set but run_val_every_n_steps is null: no validation during training "
            "(set run_val_every_n_steps=N to validate every N optimizer steps and at the end)")


def _resolve_backward(cfg: DictConfig, backward_given: bool) -> None:
    """Map the older ``backward_once_per_step`` onto ``backward`` (one line from rank 0 when it decides).

    true reads as ``auto`` (it always meant "once per step where it fits"), or
    agrees with an explicit ``once_per_step``; false reads as
    ``per_micro_batch``, also over a ``backward: auto`` (as in the shipped
    configs, with the older key on the command line). A given ``backward``
    that contradicts it is an error; one it agrees with is not mentioned.
    Afterwards ``backward_once_per_step`` holds ``backward != per_micro_batch``,
    for callers of ``train_step`` that still pass it (``backward`` wins there),
    so a saved config, validated again, says nothing.
    """
    old = cfg.backward_once_per_step
    if old is not None:
        mapped = "auto" if old else "per_micro_batch"
        compatible = ("auto", "once_per_step") if old else ("auto", "per_micro_batch")
        text = str(old).lower()
        if backward_given and cfg.backward not in compatible:
            raise ConfigError("backward_once_per_step", f"{text} contradicts backward={cfg.backward}; remove "
                              "backward_once_per_step, the older name of backward")
        if not backward_given or (cfg.backward == "auto" and mapped != "auto"):
            cfg.backward = mapped
            said = f"runs as backward={mapped}" + (
                " (backward once per optimizer step where it fits under once_per_step_memory_limit, else per "
                "micro-batch; backward=once_per_step always runs it once per step)" if old else "")
            if ranks.is_rank_zero():
                _run_logger(cfg).warning(f"Config key 'backward_once_per_step' is the older name of 'backward': "
                                         f"backward_once_per_step={text} {said}.")
    if cfg.optimizer_in_bwd and cfg.backward == "per_micro_batch" and cfg.max_tokens_per_micro_batch and ranks.is_rank_zero():
        # several micro-batches per step only come from the token budget (optimizer_in_bwd needs GA 1)
        _run_logger(cfg).warning("backward=per_micro_batch does not apply with optimizer_in_bwd=true: each "
                                 "parameter is updated in its gradient hook, so a step's micro-batches run one "
                                 "backward together (backward=once_per_step).")
    with open_dict(cfg):
        # for callers of train_step that still pass the older argument; train_step prefers `backward`
        cfg.backward_once_per_step = cfg.backward != "per_micro_batch"


def _run_logger(cfg: DictConfig) -> logging.Logger:
    """torchtune's logger (this module's INFO lines are not shown), at the run's log_level already: the
    recipe applies it after the config check."""
    from torchtune import utils

    return utils.get_logger(cfg.get("log_level"))


def _on_cuda(cfg: DictConfig) -> bool:
    import torch

    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _check_combinations(cfg: DictConfig, training: bool = True) -> None:
    if training and cfg.optimizer_in_bwd:
        if cfg.gradient_accumulation_steps > 1 or cfg.clip_grad_norm is not None:
            raise ConfigError(
                "optimizer_in_bwd",
                f"cannot be combined with gradient_accumulation_steps={cfg.gradient_accumulation_steps} or "
                f"clip_grad_norm={cfg.clip_grad_norm}: it updates each parameter as soon as its gradient exists, "
                "before the other micro-batches' gradients (and the step's gradient norm) do; set "
                "gradient_accumulation_steps=1 and clip_grad_norm=null, or optimizer_in_bwd=false",
            )
        if cfg.skip_nonfinite_steps:
            raise ConfigError("optimizer_in_bwd", "cannot be combined with skip_nonfinite_steps=true: a step whose "
                              "parameters were updated during backward cannot be skipped afterwards")
    if cfg.enable_activation_offloading:
        if not _on_cuda(cfg):
            raise ConfigError("enable_activation_offloading", "needs a CUDA device (it moves activations to CPU "
                              "memory and back on CUDA streams); set enable_activation_offloading=false")
        if not cfg.enable_activation_checkpointing:
            raise ConfigError("enable_activation_offloading", "needs enable_activation_checkpointing=true (it "
                              "offloads the checkpointed layer inputs), as in torchtune")
    ckpt_dir = cfg.checkpointer.get("output_dir")
    if ckpt_dir is not None and os.path.abspath(str(ckpt_dir)) != os.path.abspath(str(cfg.output_dir)):
        # torchtune saves where this says; every save, resume and disk check here works in output_dir
        raise ConfigError("checkpointer.output_dir", f"'{ckpt_dir}' differs from output_dir '{cfg.output_dir}': "
                          "checkpoints are saved as output_dir/step_<N>, next to the run's logs, and resumed from "
                          "there; set output_dir to where checkpoints should go (checkpointer.output_dir: "
                          "${output_dir}, as in torchtune's configs)")
    for name in ("recipe_checkpoint", "adapter_checkpoint"):
        if cfg.checkpointer.get(name) is not None:
            raise ConfigError(f"checkpointer.{name}", "is not used: resume_from_checkpoint=true continues from the "
                              "newest complete step_<N> folder in output_dir (its recipe_state.pt and adapter); "
                              f"set checkpointer.{name}=null")
    fsdp = cfg.get("fsdp")
    if fsdp is not None and bool(fsdp.get("cpu_offload", False)) != bool(cfg.get("fsdp_cpu_offload", False)):
        # torchtune's recipes never read fsdp.cpu_offload either; say which one applies
        log.warning("Config key 'fsdp.cpu_offload' is not read (as in torchtune): fsdp_cpu_offload=%s applies.",
                    str(bool(cfg.get("fsdp_cpu_offload", False))).lower())
    if cfg.collate_fn == "torchtune.data.padded_collate_tiled_images_and_mask":
        raise ConfigError("collate_fn", "tiles images for multimodal models, which these recipes do not train; "
                          "remove it (the default is torchtune.data.padded_collate_sft)")
    import_component("collate_fn", cfg.collate_fn)
    mismatch = check_model_type(cfg.model._component_, cfg.checkpointer.get("model_type"))
    if mismatch:
        raise ConfigError("checkpointer.model_type", mismatch)
    for key in ("tokenizer", "optimizer", "lr_scheduler", "metric_logger", "checkpointer"):
        if enabled(cfg.get(key)) is not None:
            import_component(f"{key}._component_", cfg[key]._component_)
    check_output_chunks("loss.num_output_chunks", cfg.loss.get("num_output_chunks", "auto"))
    if "token_metrics" in cfg.loss:
        _boolean("loss.token_metrics", cfg.loss.token_metrics)
    # torch's optimizers take any truthy value for these: "false" or "maybe" would run fused
    optimizer = enabled(cfg.get("optimizer")) or {}
    for flag in _OPTIMIZER_FLAGS:
        if optimizer.get(flag) is not None:
            _boolean(f"optimizer.{flag}", optimizer[flag])
    max_seq_len = cfg.tokenizer.get("max_seq_len")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2):
        raise ConfigError("tokenizer.max_seq_len", f"expected an integer >= 2 (one input and one label), got {max_seq_len!r}")
    budget = cfg.max_tokens_per_micro_batch
    if budget is not None and max_seq_len is not None and budget < max_seq_len:
        raise ConfigError("max_tokens_per_micro_batch", f"{budget} is smaller than tokenizer.max_seq_len={max_seq_len}: "
                          "a sample of that length would not fit; raise the budget or lower tokenizer.max_seq_len")
    if cfg.pack_micro_batches:
        if budget is None:
            raise ConfigError("pack_micro_batches", "needs max_tokens_per_micro_batch, the length of a packed "
                              "row (e.g. 4 x tokenizer.max_seq_len)")
        datasets = cfg.dataset if isinstance(cfg.dataset, (list, ListConfig)) else [cfg.dataset]
        if any(bool(d.get("packed", False)) for d in datasets):
            raise ConfigError("pack_micro_batches", "the dataset is packed already (dataset.packed=true); "
                              "set one of the two to false")
        if cfg.collate_fn != COMMON_KEYS["collate_fn"].default:
            raise ConfigError("pack_micro_batches", f"packs the step's samples itself and cannot use "
                              f"collate_fn={cfg.collate_fn}; drop one of the two keys")
    if cfg.dtype == "bf16" and _on_cuda(cfg):
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():  # no CUDA: said by the device check
            raise ConfigError("dtype", "bf16 is not supported by this CUDA device; use dtype=fp32")


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
            checked, nor is anything about resuming.

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
        if key not in schema:
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

    _resolve_backward(cfg, backward_given)
    _check_validation(cfg, training)
    _check_combinations(cfg, training)
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
