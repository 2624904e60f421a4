"""Checks across keys: values each valid alone that do not work together, and their consequences.

Run by :func:`torchtune_ext.config.validate` after every key has passed its
own check (:mod:`torchtune_ext.config.schema`).
"""

import logging
import os

from omegaconf import DictConfig, ListConfig, open_dict

from torchtune_ext import ranks
from torchtune_ext.config.checkers import (
    boolean,
    check_output_chunks,
    enabled,
    import_component,
    log_model_mode,
    switched_off,
    validation_enabled,
)
from torchtune_ext.config.schema import COMMON_KEYS
from torchtune_ext.config.upstream import check_model_type
from torchtune_ext.errors import ConfigError
from torchtune_ext.moved import canonical

log = logging.getLogger(__name__)

# Boolean arguments of torch.optim optimizers (fused and foreach also take null: torch decides).
_OPTIMIZER_FLAGS = ("fused", "foreach", "amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")


def check_validation(cfg: DictConfig, training: bool) -> None:
    """Validation's keys: ``dataset_val=null`` means none, ``batch_size_val`` defaults to ``batch_size``, and
    validation asked for needs a ``dataset_val`` (training only).

    Raises:
        ConfigError: (key ``dataset_val``) run_val_every_n_steps or run_val_at_start without one.
    """
    if switched_off(cfg.dataset_val):
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


def resolve_backward(cfg: DictConfig, backward_given: bool) -> None:
    """``backward_once_per_step``, the older name of ``backward``, is gone: one line says what to write instead.

    A config that gives it next to a ``backward`` it agrees with (true: ``auto``
    or ``once_per_step``; false: ``per_micro_batch``), as the configs saved by
    earlier versions in ``logs/`` do, runs with one warning; alone or
    contradicting ``backward`` it is an error, so no run silently changes
    its backward mode.

    Raises:
        ConfigError: (key ``backward_once_per_step``) given without an agreeing ``backward``.
    """
    if "backward_once_per_step" in cfg:
        old = cfg.backward_once_per_step
        agrees = ("auto", "once_per_step") if old else ("per_micro_batch",)
        meant = "auto" if old else "per_micro_batch"
        if old is not None and not (backward_given and cfg.backward in agrees):
            raise ConfigError("backward_once_per_step", f"was removed (it was the older name of backward): use "
                              f"backward={meant} for backward_once_per_step={str(old).lower()}")
        with open_dict(cfg):
            del cfg["backward_once_per_step"]
        if old is not None and ranks.is_rank_zero():
            _run_logger(cfg).warning(f"Config key 'backward_once_per_step' was removed (the older name of "
                                     f"'backward'); backward={cfg.backward} applies: delete the older key")
    if (cfg.optimizer_in_bwd and cfg.backward == "per_micro_batch" and cfg.max_tokens_per_micro_batch
            and ranks.is_rank_zero()):
        # several micro-batches per step only come from the token budget (optimizer_in_bwd needs GA 1)
        _run_logger(cfg).warning("backward=per_micro_batch does not apply with optimizer_in_bwd=true: each "
                                 "parameter is updated in its gradient hook, so a step's micro-batches run one "
                                 "backward together (backward=once_per_step).")


def _run_logger(cfg: DictConfig) -> logging.Logger:
    """torchtune's logger (this module's INFO lines are not shown), at the run's log_level already: the
    recipe applies it after the config check."""
    from torchtune import utils

    return utils.get_logger(cfg.get("log_level"))


def _on_cuda(cfg: DictConfig) -> bool:
    import torch

    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


# checkpointer.model_type values whose torchtune -> HF conversion works tensor by tensor, as a sharded
# checkpoint's export needs (torchtune_ext.checkpoint.hf_export); Phi-3/4 fuse q/k/v into one HF tensor.
SHARDED_EXPORT_MODEL_TYPES = ("LLAMA2", "LLAMA3", "LLAMA3_2", "MISTRAL", "GEMMA", "GEMMA2", "QWEN2")


# The transformers models' checkpointer (configs/hf/*.yaml): its layout of a sharded export is its own
# (torchtune_ext.model.hf.checkpointer.sharded_export_layout).
# (spelled as now: a config's path goes through torchtune_ext.moved.canonical first)
HF_CHECKPOINTERS = ("torchtune_ext.model.hf.HFCheckpointer", "torchtune_ext.model.hf.checkpointer.HFCheckpointer")


def check_sharded_checkpoints(cfg: DictConfig) -> None:
    """``enable_async_checkpointing`` implies ``sharded_checkpoints``; these need torchtune's HF checkpointer
    of a family whose final checkpoint can be exported file by file, or the transformers models' one.

    Raises:
        ConfigError: (key ``sharded_checkpoints``) another checkpointer, or a model type it cannot export.
    """
    if cfg.get("enable_async_checkpointing") and not cfg.get("sharded_checkpoints"):
        cfg.sharded_checkpoints = True  # torchtune's asynchronous checkpoints are sharded (DCP) ones
    if not cfg.get("sharded_checkpoints"):
        return
    component = str(cfg.checkpointer.get("_component_", ""))
    if canonical(str(component)) in HF_CHECKPOINTERS:
        return  # the model's keys are HF names: any family transformers saves exports file by file
    if not component.endswith(".FullModelHFCheckpointer"):
        raise ConfigError("sharded_checkpoints", f"needs torchtune's FullModelHFCheckpointer or "
                          f"torchtune_ext.model.hf.HFCheckpointer (the final checkpoint becomes a Hugging Face folder "
                          f"from the shards), not {component}; set sharded_checkpoints=false (and "
                          "enable_async_checkpointing=false) for this checkpointer")
    model_type = str(cfg.checkpointer.get("model_type", "")).upper()
    if model_type not in SHARDED_EXPORT_MODEL_TYPES:
        raise ConfigError("sharded_checkpoints", f"is not supported for checkpointer.model_type={model_type}: its "
                          "Hugging Face conversion fuses tensors, so the shards cannot be exported file by file; "
                          "set sharded_checkpoints=false (and enable_async_checkpointing=false)")


def check_tensor_parallel_dim(tensor_parallel_dim: int, world_size: int) -> None:
    """``tensor_parallel_dim`` must divide the job's ranks into whole tensor-parallel groups.

    Raises:
        ConfigError: (key ``tensor_parallel_dim``) naming both numbers and the values that would fit.
    """
    if world_size % tensor_parallel_dim:
        fits = [t for t in range(1, world_size + 1) if world_size % t == 0]
        ranks_of_job = f"{world_size} rank{'s' if world_size > 1 else ''}"
        raise ConfigError("tensor_parallel_dim", f"{tensor_parallel_dim} does not divide the {ranks_of_job} of "
                          f"this job into tensor-parallel groups; use one of {', '.join(map(str, fits))} "
                          "(1: data parallel only), or start the job on a multiple of it")


def check_combinations(cfg: DictConfig, training: bool = True) -> None:
    """Keys that are valid alone but not together, and component paths that must import.

    Raises:
        ConfigError: naming the key to change, e.g. ``optimizer_in_bwd`` with
            ``gradient_accumulation_steps > 1``, activation offloading without
            CUDA or checkpointing, a ``checkpointer.output_dir`` other than
            ``output_dir``, a component that cannot be imported.
    """
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
    check_sharded_checkpoints(cfg)
    if log_model_mode(cfg.get("metric_logger")) == "end" and training and not cfg.save_final_checkpoint:
        raise ConfigError("metric_logger.log_model", "end logs the final checkpoint, which "
                          "save_final_checkpoint=false leaves out: set save_final_checkpoint=true, or "
                          "metric_logger.log_model=checkpoint to log the periodic checkpoints")
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
    # before the process group: torchrun's WORLD_SIZE is the number of ranks the job will have
    check_tensor_parallel_dim(cfg.get("tensor_parallel_dim", 1), ranks.world_size())
    if cfg.get("tensor_parallel_dim", 1) > 1 and cfg.get("compile", False):
        # Measured (torch 2.13, gloo): 1 x 2 tensor-parallel ranks with compiled layers trained the tiny Llama with
        # a gradient norm 0.5% off the uncompiled run's from the first step (2 data-parallel ranks compiled: 1e-8).
        raise ConfigError("compile", "cannot be combined with tensor_parallel_dim > 1: compiled tensor-parallel "
                          "layers gave other gradients than uncompiled ones (docs/distributed.md); set "
                          "compile=false, or tensor_parallel_dim=1")
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
        boolean("loss.token_metrics", cfg.loss.token_metrics)
    # torch's optimizers take any truthy value for these: "false" or "maybe" would run fused
    optimizer = enabled(cfg.get("optimizer")) or {}
    for flag in _OPTIMIZER_FLAGS:
        if optimizer.get(flag) is not None:
            boolean(f"optimizer.{flag}", optimizer[flag])
    max_seq_len = cfg.tokenizer.get("max_seq_len")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or max_seq_len < 2):
        raise ConfigError("tokenizer.max_seq_len",
                          f"expected an integer >= 2 (one input and one label), got {max_seq_len!r}")
    budget = cfg.max_tokens_per_micro_batch
    if budget is not None and max_seq_len is not None and budget < max_seq_len:
        raise ConfigError("max_tokens_per_micro_batch",
                          f"{budget} is smaller than tokenizer.max_seq_len={max_seq_len}: "
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
