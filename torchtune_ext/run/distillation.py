"""What a distillation recipe adds to the fine-tuning run: the teacher and the objective that uses it.

The loop, accounting, checkpointing, resume and metrics are the fine-tuning
run's (:mod:`torchtune_ext.run.loop`); a distillation recipe calls
:func:`distil` between building its student and
:meth:`~torchtune_ext.run.loop.TrainingRun.setup_training`, so that training
and validation optimize and measure
``(1 - kd_ratio) * CE + kd_ratio * KD`` per trainable token
(:class:`torchtune_ext.train.distill.DistillationObjective`). The teacher is
no part of the student: the optimizer and the checkpoints never see it.
"""

from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig

from torchtune_ext import config as recipe_config
from torchtune_ext.checkpoint import is_sharded
from torchtune_ext.config.distillation import (
    check_on_policy,
    check_same_teacher,
    check_teacher,
    check_teacher_components,
)
from torchtune_ext.data.tokenizer import build_tokenizer
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.teacher import build_teacher, check_vocabulary
from torchtune_ext.train.distill import DistillationObjective, build_kd_loss
from torchtune_ext.train.on_policy import OnPolicySettings


def student_is_lora(cfg_model: Any) -> bool:
    """Whether the ``model`` node builds a LoRA student (a ``lora_*`` / ``qlora_*`` builder): only its
    adapters train; otherwise every student parameter does."""
    name = str(cfg_model.get("_component_", "")).rsplit(".", 1)[-1]
    return name.startswith(("lora_", "qlora_"))


def check_teacher_not_sharded(cfg: DictConfig) -> None:
    """Refuse a sharded (DCP) checkpoint as the teacher, before anything loads: a ``step_<N>`` folder of a run
    with ``sharded_checkpoints: true`` (``dcp/.metadata``), or its ``dcp`` folder. Neither recipe reads one as a
    teacher (the teacher's checkpointer reads whole files); its Hugging Face export is a teacher.

    Raises:
        ConfigError: (key ``teacher_model_dir`` or ``teacher_checkpointer.checkpoint_dir``) naming the export.
    """
    folder = cfg.get("teacher_model_dir")
    key = "teacher_model_dir"
    if folder is None and cfg.get("teacher_checkpointer") is not None:
        folder, key = cfg.teacher_checkpointer.get("checkpoint_dir"), "teacher_checkpointer.checkpoint_dir"
    if folder is None:
        return
    path = Path(str(folder))
    step = next((p for p in (path, path.parent) if is_sharded(p)), None)  # the step folder, or its dcp/
    if step is None:
        return
    point = ("teacher_model_dir=OUT" if key == "teacher_model_dir" else
             "teacher_checkpointer.checkpoint_dir=OUT (with checkpoint_files of its model-*.safetensors)")
    raise ConfigError(key, f"'{folder}' is a sharded (DCP) checkpoint, which a teacher cannot load from; export "
                      f"it first: python -m torchtune_ext.checkpoint.export {step} OUT, then {point}")


def distillation_keys(cfg: DictConfig, distributed: bool = False) -> Dict[str, recipe_config.Key]:
    """The recipe's keys beyond the common ones, after the teacher's keys and on-policy's combinations are
    checked (:mod:`torchtune_ext.config.distillation`): distillation, LoRA for a LoRA student, FSDP2."""
    check_teacher(cfg)
    check_teacher_not_sharded(cfg)
    check_teacher_components(cfg)
    check_on_policy(cfg, distributed)
    keys = dict(recipe_config.DISTILLATION_KEYS)
    if student_is_lora(cfg.get("model", {})):
        keys.update(recipe_config.LORA_KEYS)
    if distributed:
        keys.update(recipe_config.DISTRIBUTED_KEYS)
    return keys


def check_teacher_vocabulary(cfg: DictConfig) -> None:
    """Refuse a teacher with another vocabulary than the student's, before anything loads
    (:func:`torchtune_ext.model.teacher.check_vocabulary`, on the meta device)."""
    check_vocabulary(cfg, build_tokenizer(cfg.tokenizer))


def on_policy_settings(cfg: DictConfig, seed: int, tokenizer: Any) -> OnPolicySettings:
    """The ``on_policy_*`` keys of a checked config, the run's ``seed`` and the tokenizer's stop ids."""
    stop = getattr(tokenizer, "stop_tokens", None) or [getattr(tokenizer, "eos_id", None)]
    return OnPolicySettings(ratio=float(cfg.on_policy_ratio), max_new_tokens=int(cfg.on_policy_max_new_tokens),
                            temperature=float(cfg.on_policy_temperature), top_k=cfg.on_policy_top_k, seed=int(seed),
                            stop_ids=tuple(int(i) for i in stop if i is not None))


def distil(run: Any, *, shard: Optional[dict] = None, student: Any = None) -> DistillationObjective:
    """Build the frozen teacher and make the run optimize the distillation objective.

    Call after ``run.load_data_and_checkpoint()`` (the tokenizer and the CE
    loss exist) and before ``run.setup_training()`` (validation takes the
    run's objective).

    Args:
        run: the recipe's :class:`~torchtune_ext.run.loop.TrainingRun`.
        shard: distributed: FSDP2 arguments for the teacher (:func:`torchtune_ext.model.teacher.build_teacher`).
        student: the student model, which generates when ``on_policy_ratio`` > 0.

    Returns:
        the objective now in ``run.objective``.

    Raises:
        ConfigError: a bad ``kd_loss``; a resumed run's teacher is not the one it was saved with.
    """
    cfg = run.cfg
    check_same_teacher(run.resumed_config, cfg)  # before the teacher loads
    kd_loss = build_kd_loss(cfg.kd_loss, run.loss_fn.ignore_index)
    teacher, project = build_teacher(cfg, run.device, shard=shard)
    run.teacher = teacher
    on_policy = on_policy_settings(cfg, run.progress.seed, run.tokenizer)
    run.objective = DistillationObjective(run.loss_fn, teacher, project, kd_loss, cfg.kd_ratio,
                                          on_policy=on_policy, student=student)
    run.log(f"Teacher: {sum(p.numel() for p in teacher.parameters()):,} parameters, frozen, "
            f"{next(teacher.parameters()).dtype}; kd_ratio {cfg.kd_ratio}, {kd_loss.divergence} at temperature "
            f"{kd_loss.temperature:g}"
            + (f"; on-policy: {on_policy.ratio:g} of the samples completed by the student (at most "
               f"{on_policy.max_new_tokens} tokens, temperature {on_policy.temperature:g})" if on_policy.ratio else ""))
    return run.objective
