"""The schema: every key the recipes read, with its default, its check and what it means.

:data:`COMMON_KEYS` are read by every recipe; the distributed recipes add
:data:`DISTRIBUTED_KEYS`, the LoRA recipes :data:`LORA_KEYS`, the distillation recipes
:data:`DISTILLATION_KEYS`
(:func:`torchtune_ext.config.validate` takes them as ``extra_keys``).
``docs/configuration.md`` is generated from these tables
(``python -m torchtune_ext.config.docs``).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict

from omegaconf import ListConfig

from torchtune_ext.config.checkers import (
    boolean,
    boolean_or_auto,
    component_node,
    one_of,
    optional_component_node,
    optional_int,
    optional_positive_float,
    optional_positive_int,
    optional_string,
    positive_int,
    string,
    switched_off,
    text_model,
)
from torchtune_ext.config.distillation import (
    on_policy_share,
    optional_dtype,
    sampling_temperature,
    unit_interval,
)
from torchtune_ext.config.lora import lora_settings
from torchtune_ext.errors import ConfigError


@dataclass(frozen=True)
class Key:
    """One top-level config key: its default, the check it must pass, and what it means.

    Attributes:
        default: the value a config without the key gets (:data:`NO_DEFAULT` for a required key).
        check: ``check(key, value)`` raises :class:`~torchtune_ext.errors.ConfigError` naming the key.
        required: the config must give it.
        doc: one line saying what the key does, for ``docs/configuration.md``
            (:mod:`torchtune_ext.config.docs`).
    """

    default: Any
    check: Callable[[str, Any], None]
    required: bool = False
    doc: str = ""


# The default of a required key: there is none.
NO_DEFAULT = object()


# Values of the `backward` key (torchtune_ext.train.step.forward_backward).
BACKWARD_MODES = ("auto", "once_per_step", "per_micro_batch")


def _dataset(key: str, value: Any) -> None:
    if isinstance(value, (list, ListConfig)):
        if not value:
            raise ConfigError(key, "expected a dataset or a non-empty list of datasets")
        for i, item in enumerate(value):
            component_node(f"{key}[{i}]", item)
    else:
        component_node(key, value)


def _val_every_n_steps(key: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, f"expected a positive integer (validate every N optimizer steps), or null for "
                          f"no validation, got {value!r}")


def _optional_dataset(key: str, value: Any) -> None:
    if not switched_off(value):  # `dataset_val=null` on the command line: no validation set
        _dataset(key, value)


def _refused_if_true(why: str) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        boolean(key, value)
        if value:
            raise ConfigError(key, f"is not supported by this recipe: {why}; set {key}=false")

    return check


def _distributed_only(what: str) -> Callable[[str, Any], None]:
    """The check of a key the single-device recipes refuse when true: one process writes its checkpoint whole."""
    def check(key: str, value: Any) -> None:
        boolean(key, value)
        if value:
            raise ConfigError(key, f"{what} are written by the distributed recipes only (one process holds the "
                              "whole model anyway): run recipes/full_finetune_distributed.py or "
                              "recipes/lora_finetune_distributed.py with tune run --nproc_per_node N (N=1 works "
                              f"too), or set {key}=false for this recipe's single-folder checkpoints")

    return check


def _optional_names(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) and v for v in value)):
        raise ConfigError(key, f"expected a list of module names (e.g. [tok_embeddings, output]) or null, "
                          f"got {value!r}")


def _fsdp_section(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"cpu_offload"}:
        raise ConfigError(key, f"expected null or {{cpu_offload: <bool>}}, got {value!r}; "
                          "use fsdp_cpu_offload and fsdp_reshard_after_forward")
    boolean(f"{key}.cpu_offload", value.get("cpu_offload", False))


PROFILER_COMPONENT = "torchtune.training.setup_torch_profiler"


def _profiler(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a mapping (torchtune's profiler section) or null, got {value!r}")
    component = value.get("_component_", PROFILER_COMPONENT)
    if component not in (PROFILER_COMPONENT, None):
        raise ConfigError(f"{key}._component_", f"only {PROFILER_COMPONENT} is supported, got {component!r}")
    boolean(f"{key}.enabled", value.get("enabled", False))
    for flag in ("cpu", "cuda", "xpu", "profile_memory", "with_stack", "record_shapes", "with_flops"):
        if value.get(flag) is not None:
            boolean(f"{key}.{flag}", value[flag])
    # torch.profiler.schedule's own bounds (it asserts them when the profiler is set up, after the model load)
    for name, least in (("wait_steps", 0), ("warmup_steps", 0), ("active_steps", 1), ("num_cycles", 0)):
        steps = value.get(name)
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < least):
            raise ConfigError(f"{key}.{name}", f"expected an integer >= {least} or null, got {steps!r}")


def _lora_model(key: str, value: Any) -> None:
    lora_settings(value, key)


COMMON_KEYS: Dict[str, Key] = {
    "output_dir": Key(NO_DEFAULT, string, required=True, doc=(
        "The run's folder: checkpoints (`step_<N>/`), `logs/` (metrics.jsonl, the config of each start) and its "
        "lock; one run at a time.")),
    "model_dir": Key(None, optional_string, doc=(
        "A Hugging Face model folder (configs/hf/*.yaml interpolate it into model.path, tokenizer.path and "
        "checkpointer.checkpoint_dir, so it is the one key to set; torchtune_ext.model.hf).")),
    "model": Key(NO_DEFAULT, text_model, required=True, doc=(
        "The model builder (`_component_`) and its arguments; a text decoder (multimodal families are refused).")),
    "tokenizer": Key(NO_DEFAULT, component_node, required=True, doc=(
        "The tokenizer builder and its arguments (files, `max_seq_len`).")),
    "dataset": Key(NO_DEFAULT, _dataset, required=True, doc=(
        "The training dataset (a torchtune dataset component), or a list of them, concatenated.")),
    "data_errors": Key("warn", one_of("warn", "error"), doc=(
        "Samples with no trainable token (an answer cut away at tokenizer.max_seq_len) or with undecodable bytes: "
        "`warn` reports them, `error` stops before training (torchtune_ext.data.check).")),
    "checkpointer": Key(NO_DEFAULT, component_node, required=True, doc=(
        "The torchtune checkpointer that reads the base model and writes each checkpoint's weights in its format.")),
    "optimizer": Key(NO_DEFAULT, component_node, required=True, doc=(
        "The optimizer (e.g. torch.optim.AdamW) and its settings; on resume the config's settings apply.")),
    "lr_scheduler": Key(None, optional_component_node, doc=(
        "The learning-rate schedule, built for the run's optimizer steps; null: a constant learning rate.")),
    "loss": Key({"_component_": "torchtune_ext.train.loss.SummedCrossEntropyLoss", "num_output_chunks": "auto"},
                component_node, doc=(
        "The loss: summed over trainable tokens and divided once per step; torchtune's cross-entropy losses run "
        "as torchtune_ext.train.loss.SummedCrossEntropyLoss.")),
    "metric_logger": Key(None, optional_component_node, doc=(
        "A torchtune metric logger (e.g. W&B) besides logs/metrics.jsonl; null: the JSONL file only. With W&B, "
        "`log_model` (ours, as Hugging Face's): `false` (default), `end` (the final checkpoint) or `checkpoint` "
        "(every one) as W&B model artifacts (docs/metrics.md).")),
    "seed": Key(None, optional_int, doc=(
        "Seed of model initialization, LoRA adapters and dropout; null: a random one, saved with the checkpoint.")),
    "shuffle": Key(True, boolean, doc=(
        "Shuffle the training samples each epoch (may change on resume only at an epoch's end).")),
    "batch_size": Key(2, positive_int, doc=(
        "Samples per micro-batch on each rank (the global batch is ranks x batch_size x "
        "gradient_accumulation_steps).")),
    "epochs": Key(1, positive_int, doc="Passes over the training data."),
    "max_steps_per_epoch": Key(None, optional_positive_int, doc=(
        "End each epoch after this many optimizer steps; null: the whole dataset.")),
    "gradient_accumulation_steps": Key(1, positive_int, doc=(
        "Micro-batches per optimizer step; the step's loss is normalized by all their trainable tokens at once.")),
    "backward": Key("auto", one_of(*BACKWARD_MODES), doc=(
        "How a step's micro-batches are backpropagated, with the same gradients: `once_per_step` (one backward "
        "on the step's sum), `per_micro_batch` (one per micro-batch, memory flat in gradient_accumulation_steps), "
        "`auto` (once per step where it fits under once_per_step_memory_limit).")),
    "once_per_step_memory_limit": Key("torchtune", one_of("torchtune", "device"), doc=(
        "What bounds a once-per-step step under backward=auto: `torchtune` (no more than torchtune's recipe needs "
        "for the same samples, and the free memory) or `device` (the free memory only); "
        "torchtune_ext.train.memory.MemoryGuard.")),
    "group_by_length": Key(True, boolean, doc=(
        "Put samples of similar length into the same micro-batch (less padding); the samples of each optimizer "
        "step, and so the loss, do not depend on it.")),
    "max_tokens_per_micro_batch": Key(None, optional_positive_int, doc=(
        "Cut a step's samples into micro-batches of at most this many tokens (padding included); null: "
        "batch_size samples each.")),
    "pack_micro_batches": Key(False, boolean, doc=(
        "A micro-batch is one row of the step's samples concatenated, up to max_tokens_per_micro_batch tokens, "
        "attention kept inside each sample (no padding).")),
    "dataset_val": Key(None, _optional_dataset, doc=(
        "The validation dataset; used when run_val_every_n_steps or run_val_at_start asks for validation.")),
    "run_val_every_n_steps": Key(None, _val_every_n_steps, doc=(
        "Validate every N optimizer steps and at the end of training; null: no validation during training.")),
    "run_val_at_start": Key(False, boolean, doc="Also validate before the first optimizer step."),
    "batch_size_val": Key(None, optional_positive_int, doc=(
        "Samples per validation micro-batch; null: batch_size. The validation loss does not depend on it.")),
    "max_val_samples": Key(None, optional_positive_int, doc=(
        "Validate on the first N samples of dataset_val, in file order, whatever the batching; null: all.")),
    "clip_grad_norm": Key(None, optional_positive_float, doc=(
        "Clip the global gradient norm (all ranks, before the update) to this; null: no clipping.")),
    "dtype": Key("fp32", one_of("fp32", "bf16"), doc="Parameter and compute dtype."),
    "device": Key("auto", one_of("auto", "cpu", "cuda"), doc="Training device; `auto`: CUDA if available, else CPU."),
    "compile": Key(False, boolean, doc="torch.compile the model's layers and the loss."),
    "enable_activation_checkpointing": Key(False, boolean, doc=(
        "Recompute each decoder layer's activations in backward instead of keeping them.")),
    "enable_activation_offloading": Key(False, boolean, doc=(
        "torchtune's activation offloading to CPU memory (CUDA only, with activation checkpointing, as upstream).")),
    "resume_from_checkpoint": Key(False, boolean_or_auto, doc=(
        "Continue from the newest complete step_<N> checkpoint in output_dir (settings that changed are said); "
        "auto: continue if output_dir has one, else start the run (scheduler requeues, torchrun restarts).")),
    "verify_checkpoint_hashes": Key(True, boolean, doc=(
        "Record each checkpoint file's SHA-256 at save and check it before a resume or an evaluation loads it "
        "(about 1.1 s per 1.5 GiB); false: sizes only.")),
    "save_every_n_steps": Key(None, optional_positive_int, doc=(
        "Also save a checkpoint every N optimizer steps; null: at the end of each epoch only.")),
    "save_final_checkpoint": Key(True, boolean, doc=(
        "false: skip the checkpoint at the end of the last epoch (runs whose metrics are all that matters); "
        "periodic and earlier checkpoints are still written.")),
    "keep_last_n_checkpoints": Key(2, optional_positive_int, doc=(
        "Keep the newest N checkpoints (the one a resume starts from, and the one before it in case it turns "
        "out bad); null keeps all.")),
    "skip_nonfinite_steps": Key(False, boolean, doc=(
        "Skip an optimizer step whose loss or gradient norm is NaN or infinite instead of stopping "
        "(5 in a row still stop the run).")),
    "loss_spike_nats": Key(3.0, optional_positive_float, doc=(
        "A step whose loss is this many nats per token above the highest of the last 32 healthy steps is a "
        "spike; two in a row stop the run (torchtune_ext.train.health); null: off.")),
    "optimizer_in_bwd": Key(False, boolean, doc=(
        "One optimizer per parameter, stepped in its gradient hook (less memory; needs "
        "gradient_accumulation_steps=1 and no clipping; torchtune_ext.train.optim_in_bwd).")),
    "log_every_n_steps": Key(1, positive_int, doc="Log every N-th optimizer step's metrics."),
    "peak_tflops_per_device": Key(None, optional_positive_float, doc=(
        "Dense peak TFLOP/s of one device, for the mfu metric; null: a table of common GPUs, or a matmul timed "
        "at start-up on CPU (torchtune_ext.run.metrics.flops).")),
    "log_peak_memory_stats": Key(True, boolean, doc=(
        "Log peak_memory_gib with each step (false leaves it out, upstream's default).")),
    "profiler": Key(None, _profiler, doc=(
        "torchtune.training.setup_torch_profiler's section; off unless `enabled: true`.")),
    "collate_fn": Key("torchtune.data.padded_collate_sft", string, doc=(
        "How unpacked samples become a micro-batch: torchtune's padded_collate_sft or one with the same "
        "arguments and output keys.")),
    "low_cpu_ram": Key(False, _refused_if_true("only the single-device LoRA recipe uses it (QLoRA state dicts)"),
                       doc="Only the single-device LoRA recipe reads it (see LoRA keys); must be false here."),
    "sharded_checkpoints": Key(False, _distributed_only("sharded checkpoints"), doc=(
        "Only the distributed recipes write sharded checkpoints (see the distributed keys); must be false here.")),
    "enable_async_checkpointing": Key(False, _distributed_only("asynchronous (sharded) checkpoints"), doc=(
        "Only the distributed recipes save asynchronously (see the distributed keys); must be false here.")),
    "log_level": Key("INFO", one_of("DEBUG", "INFO", "WARNING", "ERROR"), doc="Level of the run's log lines."),
}


# Keys of the distributed (FSDP2) recipes, on top of COMMON_KEYS.
DISTRIBUTED_KEYS: Dict[str, Key] = {
    "fsdp_cpu_offload": Key(False, boolean, doc=(
        "FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state live in CPU memory; the "
        "optimizer step runs on CPU.")),
    "fsdp_reshard_after_forward": Key(True, boolean, doc=(
        "FSDP2 reshard_after_forward: false keeps gathered parameters until backward (more memory, less "
        "communication).")),
    "custom_sharded_layers": Key(None, _optional_names, doc=(
        "Modules (by name, e.g. [tok_embeddings, output]) that get an FSDP unit of their own besides every "
        "decoder layer, as in torchtune.")),
    "tensor_parallel_dim": Key(1, positive_int, doc=(
        "Ranks per tensor-parallel group: N ranks train as N/T data-parallel (FSDP2) x T tensor-parallel; T must "
        "divide N and the model's head counts; 1: data parallel only (docs/distributed.md).")),
    "tensor_parallel_plan": Key(None, optional_component_node, doc=(
        "How tensor parallelism splits the model (a function returning torch ParallelStyles by module name); "
        "null: torchtune's base_llama_tp_plan for the Llama-like families, a transformers model's own tp_plan, "
        "refused for others.")),
    "fsdp": Key(None, _fsdp_section, doc=(
        "Some torchtune configs carry `fsdp: {cpu_offload: ...}`, which upstream never reads; fsdp_cpu_offload "
        "applies.")),
    "low_cpu_ram": Key(False, _refused_if_true("the distributed recipes gather state dicts shard by shard "
                                               "already; it applies to the single-device LoRA recipe"),
                       doc="Must be false: the distributed recipes gather state dicts shard by shard already."),
    "sharded_checkpoints": Key(False, boolean, doc=(
        "Each rank writes only its own shards of the model and optimizer state (torch.distributed.checkpoint); "
        "nothing is gathered, a resume reshards to any world size, and the final checkpoint is also written as a "
        "Hugging Face folder, file by file (docs/distributed.md); false: rank 0 gathers and writes the whole "
        "state.")),
    "enable_async_checkpointing": Key(False, boolean, doc=(
        "torchtune's key: sharded checkpoints (implies sharded_checkpoints: true) written while training goes on, "
        "at most one in flight; a stop or the end waits for it.")),
}


LORA_KEYS: Dict[str, Key] = {
    "model": Key(NO_DEFAULT, _lora_model, required=True, doc=(
        "A LoRA builder and its adapter settings (lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, "
        "lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base); settings left out take the builder's "
        "defaults.")),
    "save_adapter_weights_only": Key(False, boolean, doc=(
        "Checkpoints hold the adapter only; false also writes the merged full model.")),
    "low_cpu_ram": Key(False, boolean, doc=(
        "QLoRA: torchtune's state-dict hook that dequantizes NF4 weights through a memory-mapped file instead of "
        "RAM (Linux; the single-device recipe).")),
}


# Keys of the knowledge-distillation recipes, on top of COMMON_KEYS (and LORA_KEYS for a LoRA student).
DISTILLATION_KEYS: Dict[str, Key] = {
    "teacher_model": Key(None, optional_component_node, doc=(
        "The teacher's torchtune builder (as torchtune's KD configs), loaded by teacher_checkpointer; or null "
        "with teacher_model_dir. Frozen, in eval mode, never saved; it must share the student's vocabulary.")),
    "teacher_checkpointer": Key(None, optional_component_node, doc=(
        "The checkpointer that loads teacher_model's weights (checkpoint_dir, checkpoint_files, model_type).")),
    "teacher_model_dir": Key(None, optional_string, doc=(
        "A Hugging Face folder holding the teacher (transformers builds it), instead of teacher_model and "
        "teacher_checkpointer.")),
    "teacher_dtype": Key(None, optional_dtype, doc=(
        "The teacher's dtype: null is the student's (dtype); fp32, bf16 or fp16.")),
    "kd_loss": Key({"_component_": "torchtune_ext.train.distill.KDLoss", "divergence": "forward_kl",
                    "temperature": 1.0}, component_node, doc=(
        "The divergence from the teacher: torchtune_ext.train.distill.KDLoss (divergence: forward_kl, reverse_kl "
        "or jsd; temperature), or torchtune's ForwardKLLoss / ForwardKLWithChunkedOutputLoss (forward KL); summed "
        "per trainable token like the CE, chunked as loss.num_output_chunks says.")),
    "kd_ratio": Key(0.5, unit_interval, doc=(
        "The step loss is (1 - kd_ratio) * CE + kd_ratio * KD, each summed over the step's trainable tokens and "
        "divided once by their number (torchtune's definition).")),
    "on_policy_ratio": Key(0.0, on_policy_share, doc=(
        "The share of each step's samples the student completes itself (chosen by a draw seeded by seed, step and "
        "the sample); the teacher scores the completion and its tokens train on the reverse KL. 0: offline "
        "distillation on the dataset's completions; 1: fully on-policy. Single device, unpacked data.")),
    "on_policy_max_new_tokens": Key(32, positive_int, doc=(
        "The longest on-policy completion, in tokens (it also ends at the tokenizer's first stop token).")),
    "on_policy_temperature": Key(1.0, sampling_temperature, doc=(
        "The temperature the student samples its on-policy completions at (> 0).")),
    "on_policy_top_k": Key(None, optional_positive_int, doc=(
        "Sample on-policy completions among the top_k most likely tokens only; null: among all.")),
}


# Keys of earlier versions that are gone; validation says what replaces each (config.combinations).
REMOVED_KEYS = ("backward_once_per_step",)
