"""Checks of the config's components, before any data, weights or output is touched.

:func:`torchtune_ext.config.validate` checks values it knows. The components
(``_component_`` entries: model, optimizer, scheduler, tokenizer, dataset,
checkpointer, loss, metric logger) are arbitrary callables whose mistakes
otherwise surface as raw ``ImportError``/``TypeError``/``ValueError``
tracebacks minutes later, after the model has loaded and the checkpointer
has created its staging folder. :func:`check_components` finds them first,
cheaply:

1. every ``_component_`` imports;
2. every argument given in the config is one the callable accepts, and a
   string is not given where the signature wants a number;
3. the model builds on the meta device (no memory, no weights): builder
   errors, an adapter on a tied output projection, and sequences longer than
   the model takes (``tokenizer.max_seq_len``, a packed row's budget: torchtune's
   decoder would refuse them only at the first forward); with
   ``tensor_parallel_dim > 1``, a tensor-parallel plan for it that splits
   whole heads (:func:`torchtune_ext.parallel.tensor_parallel.check_tensor_parallel`);
4. the optimizer and the LR scheduler are built around one dummy parameter
   (on the training device): their own value checks (``lr=-1``) run;
5. the metric logger's ``log_dir`` can be created, and a W&B logger's run
   settings (``mode``, ``project``, ...) pass W&B's own validation
   (``wandb.Settings``): both otherwise fail only when the logger starts,
   after the model has loaded; ``metric_logger.log_model`` only with W&B's
   logger (another would take it as an argument and ignore it);
6. the ``profiler`` section's arguments are ones ``setup_torch_profiler``
   takes (it is called only after the model has loaded);
7. the tokenizer builds from its files, and formats a chat where the
   datasets give it messages (:func:`torchtune_ext.data.tokenizer.check_tokenizer`).

Every problem is a :class:`~torchtune_ext.errors.ConfigError` naming the key.
"""

import inspect
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config as tt_config

from torchtune_ext import ranks
from torchtune_ext.config import PROFILER_COMPONENT, check_output_dir, enabled, log_model_mode, resolve_component
from torchtune_ext.config.preference import PREFERENCE_LOSSES
from torchtune_ext.data.tokenizer import check_tokenizer
from torchtune_ext.errors import ConfigError, UserError
from torchtune_ext.model.build import check_tensor_parallel, nf4_error, packing_refusal, quantizes_base
from torchtune_ext.parallel.tensor_parallel import tensor_parallel_plan
from torchtune_ext.text import closest, short
from torchtune_ext.train.loss import SummedCrossEntropyLoss, build_loss


def _components(node: Any, key: str = "") -> Iterator[Tuple[str, DictConfig]]:
    """(dotted key, node) of every enabled component in ``node``, outermost first."""
    if isinstance(node, DictConfig):
        if isinstance(node.get("_component_"), str):
            yield key, node
        for name in node:
            if name != "_component_":
                yield from _components(node._get_node(name), f"{key}.{name}" if key else str(name))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _components(item, f"{key}[{i}]")


def _number_expected(param: inspect.Parameter) -> bool:
    kinds = (int, float)
    annotation = param.annotation
    if annotation in kinds or annotation in ("int", "float"):
        return True
    default = param.default
    return isinstance(default, kinds) and not isinstance(default, bool)


def _check_arguments(key: str, target: Any, node: DictConfig, path: Optional[str] = None) -> None:
    """``path``: the name of ``target`` in messages; ``node._component_`` by default."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its own call will check
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    path = path or node._component_
    for name in node:
        if name == "_component_":
            continue
        if name not in params:
            if not takes_any:
                match = closest(str(name), params)
                hint = f"; did you mean '{match}'?" if match else ""
                raise ConfigError(f"{key}.{name}", f"is not an argument of {path}{hint}")
            continue
        value = OmegaConf.to_object(node[name]) if OmegaConf.is_config(node[name]) else node[name]
        if isinstance(value, str) and _number_expected(params[name]):
            raise ConfigError(f"{key}.{name}", f"{path} expects a number, got {value!r}")


def check_components(cfg: DictConfig, device: torch.device) -> None:
    """Check the config's components before anything is loaded (see the module docstring).

    Args:
        cfg: a config already checked by :func:`torchtune_ext.config.validate`.
        device: the training device (the dummy optimizer parameter lives there).

    Raises:
        ConfigError: naming the key of the first problem found.
    """
    for key, node in _components(cfg):
        if key == "profiler":
            continue  # checked by _check_profiler, also when it leaves out _component_
        path = node._component_
        if key == "loss" and path in PREFERENCE_LOSSES:
            continue  # a preference recipe's: checked with its arguments by its schema (config.preference)
        try:
            target = resolve_component(path)
        except Exception as err:
            raise ConfigError(f"{key}._component_", f"'{path}' cannot be imported: {err}") from None
        if key == "loss" and not (isinstance(target, type) and issubclass(target, SummedCrossEntropyLoss)):
            # torchtune's cross-entropy is replaced by ours, which takes num_output_chunks=auto: check what runs
            build_loss(node, log_replacement=False)
        elif callable(target):
            _check_arguments(key, target, node)
    model = _check_model(cfg.model, cfg.get("max_tokens_per_micro_batch") if cfg.get("pack_micro_batches") else None,
                         cfg.tokenizer.get("max_seq_len"))
    _check_tensor_parallel(cfg, model)
    _check_packing(cfg, model)
    _check_optimizer(cfg, device)
    _check_metric_logger(cfg)
    _check_profiler(cfg)
    check_tokenizer(cfg)


# WandBLogger passes these to wandb.init, which stores them as these wandb.Settings fields
_WANDB_SETTINGS = {"mode": "mode", "project": "project", "entity": "entity", "group": "run_group",
                   "name": "run_name", "notes": "run_notes", "tags": "run_tags", "job_type": "run_job_type"}


def _check_metric_logger(cfg: DictConfig) -> None:
    logger = enabled(cfg.get("metric_logger"))
    if logger is None:
        return
    if isinstance(logger.get("log_dir"), str):
        check_output_dir(logger.log_dir, "metric_logger.log_dir")  # the logger creates it when it starts
    from torchtune.training.metric_logging import WandBLogger

    target = resolve_component(logger._component_)
    if not (isinstance(target, type) and issubclass(target, WandBLogger)):
        if log_model_mode(logger) != "false":  # another logger would take the key as an argument and ignore it
            raise ConfigError("metric_logger.log_model", f"only W&B's logger logs checkpoints as artifacts, not "
                              f"{logger._component_}: use torchtune.training.metric_logging.WandBLogger, or "
                              f"remove metric_logger.log_model")
        return
    import pydantic
    import wandb

    for key, field in _WANDB_SETTINGS.items():
        if logger.get(key) is None:
            continue
        value = OmegaConf.to_object(logger[key]) if OmegaConf.is_config(logger[key]) else logger[key]
        try:
            wandb.Settings(**{field: tuple(value) if isinstance(value, list) else value})
        except pydantic.ValidationError as err:
            reason = err.errors()[0]["msg"] if err.errors() else short(err, with_cause=False)
            raise ConfigError(f"metric_logger.{key}", f"W&B rejects {value!r}: {reason}") from None
        except wandb.errors.UsageError as err:  # W&B's own validators (a project name with '/' or '#')
            raise ConfigError(f"metric_logger.{key}", f"W&B rejects {value!r}: {err}") from None


def _check_profiler(cfg: DictConfig) -> None:
    profiler = cfg.get("profiler")
    if not isinstance(profiler, DictConfig):
        return
    # torchtune_ext.run.diagnostics.build_profiler passes every key but _component_ (which may be left out) to it
    _check_arguments("profiler", resolve_component(PROFILER_COMPONENT), profiler, PROFILER_COMPONENT)


def _meta_model(cfg_model: DictConfig) -> torch.nn.Module:
    """The model a ``model`` config builds, on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        return tt_config.instantiate(cfg_model)


_MODEL_LIMITS: Dict[str, Optional[int]] = {}
_MODEL_VOCAB: Dict[str, Optional[int]] = {}


def model_max_seq_len(cfg_model: DictConfig) -> Optional[int]:
    """The longest input, in tokens, the model of a ``model`` config takes (its ``max_seq_len``).

    Read off the model built on the meta device, so a builder's own default
    counts when the config leaves the argument out; remembered per config.

    Returns:
        int, or None if the model does not say (or cannot be built: the
        component check reports that).
    """
    key = OmegaConf.to_yaml(cfg_model, resolve=True)
    if key not in _MODEL_LIMITS:
        try:
            _remember_limit(cfg_model, _meta_model(cfg_model))
        except Exception:  # noqa: BLE001 -- check_components names the builder's error
            _MODEL_LIMITS[key] = None
    return _MODEL_LIMITS[key]


def model_vocab_size(cfg_model: DictConfig) -> Optional[int]:
    """The rows of the token embedding of the model a ``model`` config builds (its vocabulary size).

    Read off the model built on the meta device (a builder's default counts), remembered per config.

    Returns:
        int, or None if the model has no embedding it names (or cannot be built).
    """
    model_max_seq_len(cfg_model)  # builds it once, for both
    return _MODEL_VOCAB.get(OmegaConf.to_yaml(cfg_model, resolve=True))


def warm_up_outlasts_the_run(cfg_lr_scheduler: Any, total_steps: int) -> Optional[str]:
    """A warning when every optimizer step of the run falls inside the LR warm-up, else None.

    torchtune's warm-up schedules (``num_warmup_steps``) rise linearly from 0: step ``s`` (1-based) trains
    at ``(s - 1) / num_warmup_steps`` of ``optimizer.lr``. A run of no more steps than that never trains at
    its configured rate (the shipped LoRA config on 12 chat records: one step, at lr 0) and still ends well.
    """
    warmup = cfg_lr_scheduler.get("num_warmup_steps") if cfg_lr_scheduler is not None else None
    if not isinstance(warmup, int) or isinstance(warmup, bool) or total_steps <= 0 or total_steps > warmup:
        return None
    steps = f"{total_steps} optimizer step{'s' if total_steps > 1 else ''}"
    return (f"this run makes {steps} in all, and lr_scheduler.num_warmup_steps={warmup}: the learning rate never "
            f"leaves warm-up (its last step trains at {(total_steps - 1) / warmup:.0%} of optimizer.lr). Lower "
            "num_warmup_steps, or train for more steps (epochs, more data, a smaller global batch)")


def _embedding_rows(model: torch.nn.Module) -> Optional[int]:
    """torchtune's ``tok_embeddings``, or a transformers model's input embeddings: its rows."""
    embedding = getattr(model, "tok_embeddings", None)
    for owner in (model, getattr(model, "model", None)):
        if embedding is None and callable(getattr(owner, "get_input_embeddings", None)):
            embedding = owner.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _remember_limit(cfg_model: DictConfig, model: torch.nn.Module) -> Optional[int]:
    limit = getattr(model, "max_seq_len", None)
    if limit is None:  # a transformers model: its config's position limit
        config = getattr(model, "config", None)
        limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    _MODEL_LIMITS[OmegaConf.to_yaml(cfg_model, resolve=True)] = limit
    _MODEL_VOCAB[OmegaConf.to_yaml(cfg_model, resolve=True)] = _embedding_rows(model)
    return limit


def _check_model(cfg_model: DictConfig, packed_row_tokens: Optional[int] = None,
                 tokenizer_max_seq_len: Optional[int] = None) -> torch.nn.Module:
    """``packed_row_tokens``: the longest row ``pack_micro_batches`` may build (its budget);
    ``tokenizer_max_seq_len``: the length samples (and packs) are cut at. Returns the model, on meta."""
    path = cfg_model._component_
    adapter_on_output = bool(cfg_model.get("apply_lora_to_output", False))
    tied = f"an adapter on the output projection is not possible: in {path} it is the token embedding " \
           "(tied weights). Set model.apply_lora_to_output=false"
    try:
        model = _meta_model(cfg_model)
    except UserError:
        raise  # the builder's own line names its key (torchtune_ext.model.hf: model.path, model.attn_implementation)
    except Exception as err:
        if isinstance(err, AssertionError) and quantizes_base(cfg_model):
            raise nf4_error(err) from None
        if adapter_on_output and "apply_lora_to_output" in str(err):
            if cfg_model.get("tie_word_embeddings", True):
                raise ConfigError("model.apply_lora_to_output", tied) from None
            raise ConfigError("model.apply_lora_to_output",
                              f"{path} does not support it ({short(err, with_cause=False)}); "
                              "set model.apply_lora_to_output=false") from None
        raise ConfigError("model", f"{path} cannot build this model: {short(err, with_cause=False)}") from None
    limit = _remember_limit(cfg_model, model)
    if limit is not None and isinstance(tokenizer_max_seq_len, int) and tokenizer_max_seq_len > limit:
        # torchtune's decoder refuses a longer input at the first forward, after the logs and W&B started
        raise ConfigError("tokenizer.max_seq_len", f"{tokenizer_max_seq_len} is more than the model's "
                          f"max_seq_len={limit} ({path}): samples and packs that long would not fit the model; "
                          f"set tokenizer.max_seq_len={limit} or less")
    if packed_row_tokens and limit is not None and packed_row_tokens > limit:
        # torchtune's decoder refuses longer inputs at the first forward
        raise ConfigError("max_tokens_per_micro_batch", f"{packed_row_tokens} tokens per packed row "
                          f"(pack_micro_batches=true) is more than the model's max_seq_len={limit}; "
                          f"use at most {limit}")
    if adapter_on_output:
        from torchtune.modules import TiedLinear

        if isinstance(getattr(model, "output", None), TiedLinear):
            raise ConfigError("model.apply_lora_to_output", tied)
    return model


def _check_tensor_parallel(cfg: DictConfig, model: torch.nn.Module) -> None:
    """A plan that splits ``model`` (on meta) into whole heads over ``tensor_parallel_dim`` ranks, when asked for."""
    tensor_parallel_dim = cfg.get("tensor_parallel_dim", 1)
    if tensor_parallel_dim == 1:
        return
    plan = tensor_parallel_plan(cfg.get("tensor_parallel_plan"), cfg.model._component_)
    check_tensor_parallel(model, plan, tensor_parallel_dim, cfg.model._component_, ranks.world_size())


def _check_packing(cfg: DictConfig, model: torch.nn.Module) -> None:
    """Packed rows (``pack_micro_batches`` or a dataset's ``packed``) only for a model that keeps their
    documents apart (:func:`torchtune_ext.model.build.packing_refusal`)."""
    datasets = cfg.dataset if isinstance(cfg.dataset, ListConfig) else [cfg.dataset]
    keys = ["pack_micro_batches"] if cfg.get("pack_micro_batches") else []
    keys += [f"dataset{f'[{i}]' if isinstance(cfg.dataset, ListConfig) else ''}.packed"
             for i, d in enumerate(datasets) if isinstance(d, DictConfig) and d.get("packed")]
    why = packing_refusal(model) if keys else None
    if why:
        raise ConfigError(keys[0], f"packing is not possible for this model: {why}; set {keys[0]}=false")


def _check_optimizer(cfg: DictConfig, device: torch.device) -> None:
    dummy = torch.nn.Parameter(torch.zeros(2, device=device))
    path = cfg.optimizer._component_
    try:
        optimizer = tt_config.instantiate(cfg.optimizer, [dummy])
    except Exception as err:
        raise ConfigError("optimizer", f"{path} rejects these settings: {short(err, with_cause=False)}") from None
    if enabled(cfg.get("lr_scheduler")) is None:
        return
    try:
        tt_config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=1000)
    except Exception as err:
        raise ConfigError("lr_scheduler", f"{cfg.lr_scheduler._component_} rejects these settings: "
                          f"{short(err, with_cause=False)}") from None
