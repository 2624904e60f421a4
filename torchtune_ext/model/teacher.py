"""The distillation teacher: built, checked against the student's vocabulary, loaded, frozen.

A teacher is a model like a student (a torchtune builder loaded by a
torchtune checkpointer, or a Hugging Face folder through transformers) that
never trains: its parameters need no gradient, it stays in eval mode, the
optimizer never sees it and no checkpoint holds it (it is no submodule of
the student). It returns its final hidden states; its output projection is
applied by the distillation loss to the trainable rows only, in chunks
(:class:`torchtune_ext.train.distill.DistillationObjective`).
"""

import json
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config as tt_config
from torchtune import training

from torchtune_ext.errors import ConfigError
from torchtune_ext.model.build import (
    build_model,
    is_hf_config,
    load_model_state,
    load_sharded_model_state,
    shard_model,
)
from torchtune_ext.train.loss import SummedCrossEntropyLoss, output_width


def teacher_components(cfg: DictConfig) -> Tuple[DictConfig, DictConfig]:
    """(model node, checkpointer node) of the teacher: ``teacher_model`` and ``teacher_checkpointer``, or
    transformers' model and our HF checkpointer for ``teacher_model_dir``."""
    if cfg.get("teacher_model_dir") is not None:
        folder = str(cfg.teacher_model_dir)
        return (OmegaConf.create({"_component_": "torchtune_ext.model.hf.causal_lm", "path": folder}),
                OmegaConf.create({"_component_": "torchtune_ext.model.hf.HFCheckpointer", "checkpoint_dir": folder,
                                  "output_dir": str(cfg.output_dir)}))
    return cfg.teacher_model, cfg.teacher_checkpointer


def teacher_dtype(cfg: DictConfig, device: torch.device) -> torch.dtype:
    """``teacher_dtype``, or the student's ``dtype`` when null."""
    return training.get_dtype(cfg.teacher_dtype or cfg.dtype, device=device)


def _vocabulary(folder: Any) -> Optional[dict]:
    """The token -> id map of a folder's ``tokenizer.json`` (with its added tokens); None without one."""
    path = Path(str(folder)) / "tokenizer.json"
    if folder is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = dict(data.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    return vocab


def check_vocabulary(cfg: DictConfig, tokenizer: Any) -> None:
    """Refuse a teacher whose vocabulary is not the student's, before any weight loads.

    Both models are built on the meta device (no memory). Their output widths
    may differ by padding only: each must cover every id ``tokenizer`` can
    produce (Qwen2's 151,936 rows for 151,646 tokens). Where both folders
    have a ``tokenizer.json``, their token -> id maps must be equal.

    Raises:
        ConfigError: (key ``teacher_model`` or ``teacher_model_dir``) one line naming both sizes.
    """
    model_node, checkpointer_node = teacher_components(cfg)
    key = "teacher_model_dir" if cfg.get("teacher_model_dir") is not None else "teacher_model"
    meta = torch.device("meta")
    widths = [output_width(build_model(node, torch.float32, meta).output) if not is_hf_config(node)
              else _hf_width(node) for node in (cfg.model, model_node)]
    real = _tokenizer_size(tokenizer)
    if widths[0] != widths[1] and (real is None or real > min(widths)):
        raise ConfigError(key, f"the teacher's vocabulary ({widths[1]:,} outputs) is not the student's "
                          f"({widths[0]:,}; the tokenizer has {real or 'an unknown number of'} tokens): "
                          "distillation needs one tokenizer for both models")
    teacher_vocab = _vocabulary(checkpointer_node.get("checkpoint_dir"))
    student_vocab = _vocabulary(cfg.checkpointer.get("checkpoint_dir"))
    if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
        raise ConfigError(key, f"the teacher's tokenizer.json ({len(teacher_vocab):,} tokens) differs from the "
                          f"student's ({len(student_vocab):,}): distillation needs one tokenizer for both models")


def _hf_width(node: Any) -> int:
    folder = Path(str(node.path)) / "config.json"
    config = json.loads(folder.read_text())
    return int(config.get("text_config", config)["vocab_size"])


def _tokenizer_size(tokenizer: Any) -> Optional[int]:
    """How many ids the tokenizer can produce (its vocabulary and special tokens), if it says."""
    size = getattr(tokenizer, "vocab_size", None)
    special = getattr(tokenizer, "special_tokens", None)
    if isinstance(special, dict) and special:
        size = max(size or 0, max(int(i) for i in special.values()) + 1)
    return int(size) if size else None


def build_teacher(cfg: DictConfig, device: torch.device, *,
                  shard: Optional[dict] = None) -> Tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """Build, load and freeze the teacher; returns it (hidden states out) and its output projection.

    Args:
        cfg: the checked distillation config (:func:`teacher_components`, :func:`teacher_dtype`).
        device: the training device.
        shard: distributed: the keyword arguments of
            :func:`torchtune_ext.model.build.shard_model` (the teacher is sharded with FSDP2 per
            decoder layer and loaded shard by shard); None: whole, on ``device``.

    Returns:
        ``(teacher, project)``: ``teacher(tokens, **inputs)`` returns ``[batch, seq_len, hidden]``;
        ``project`` maps ``[rows, hidden]`` to ``[rows, vocab]`` logits.
    """
    model_node, checkpointer_node = teacher_components(cfg)
    dtype = teacher_dtype(cfg, device)
    state = tt_config.instantiate(checkpointer_node).load_checkpoint()[training.MODEL_KEY]
    source = checkpointer_node.get("checkpoint_dir")
    if shard is None:
        teacher = build_model(model_node, dtype, device)
        load_model_state(teacher, state, device, source, model_name=f"the teacher {model_node._component_}")
    else:
        teacher = build_model(model_node, dtype, torch.device("meta"))
        teacher.requires_grad_(False)
        shard_model(teacher, device, **shard)
        load_sharded_model_state(teacher, state, device, cpu_offload=shard.get("cpu_offload", False))
    del state
    teacher.requires_grad_(False)  # no gradient, so no optimizer state; eval: no dropout
    teacher.eval()
    head = SummedCrossEntropyLoss()  # only for its hand-over of the output projection (hidden states out)
    head.take_output_projection(teacher)
    return teacher, head.project
