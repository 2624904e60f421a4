"""Continuing a run from its checkpoint under the settings of the new command line.

A resumed run takes from its checkpoint what the run has become: the
weights, the optimizer's moments, the step counters, the position in the
data (in samples, so any batch size, accumulation and world size continue at
the right sample) and the RNG states. It takes from its config how to go
on, and says in one line what changed; nothing is ignored in silence:

* **Optimizer hyper-parameters** (``optimizer.lr``, ``weight_decay``,
  ``betas``, ...) are the config's. A checkpoint's optimizer state would
  otherwise bring back the old values with its param groups.
* **The LR schedule** is built again from the config for the run's total
  optimizer steps (the steps done plus those left at the new global batch
  size) and advanced to the step reached: with unchanged settings this gives
  the uninterrupted run's learning rates exactly; with a new length, peak or
  global batch the run continues on the new curve at the step reached (the
  warmup does not start over).
* **The global batch size** (data-parallel ranks x ``batch_size`` x
  ``gradient_accumulation_steps``) may change: one line gives the old and new
  values and the sample the run continues at.
* **``seed``** stays the run's, with the random states saved in the
  checkpoint. A different ``seed`` in the config is reported and not used.
* **``shuffle``** may change only at an epoch boundary: in the middle of an
  epoch the new order would train some samples twice and others never, so the
  run is refused with a message.
* **The kind of model** may not change: a LoRA checkpoint does not resume in a
  full fine-tune (its optimizer state is the adapter's) nor a full one in a
  LoRA recipe (it holds no adapter), and a LoRA resume must build the same
  adapter tensors (``lora_rank``, ``lora_attn_modules``, ``apply_lora_to_mlp``,
  ``apply_lora_to_output``, ``use_dora``); ``lora_alpha`` and ``lora_dropout``
  may change (a changed setting, reported).
"""

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune.utils import get_logger

from torchtune_ext import ranks
from torchtune_ext.checkpoint import ResumeState, incomplete_checkpoints, latest_checkpoint, verify_checkpoint
from torchtune_ext.config import lora_settings
from torchtune_ext.errors import ConfigError

log = get_logger()

# Keys whose change at resume is the point of resuming, not a change of the run.
_NOT_SETTINGS = ("resume_from_checkpoint",)


def _flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def changed_settings(saved: Optional[Dict[str, Any]], cfg: DictConfig, saved_world_size: int,
                     dp_world_size: int) -> List[Tuple[str, Any, Any]]:
    """``(key, old, new)`` for every config key (dotted) that differs from the saved run's.

    ``dp_world_size`` is listed as a key too; a nested key set on one side
    only is listed with None on the other. Top-level keys that only one of
    the two recipes knows (``fsdp_cpu_offload`` when a distributed run
    resumes on the single-device recipe) are not. Returns ``[]`` when the
    checkpoint holds no config (written by an earlier version).
    """
    if saved is None:
        return []
    current = OmegaConf.to_container(cfg, resolve=True)
    shared = set(saved) & set(current)
    old = _flatten({**{k: v for k, v in saved.items() if k in shared}, "dp_world_size": saved_world_size})
    new = _flatten({**{k: v for k, v in current.items() if k in shared}, "dp_world_size": dp_world_size})
    missing = object()
    changes = []
    for key in sorted(set(old) | set(new)):
        if key.split(".")[0] in _NOT_SETTINGS:
            continue
        a, b = old.get(key, missing), new.get(key, missing)
        if a != b:
            changes.append((key, None if a is missing else a, None if b is missing else b))
    return changes


def global_batch_size(cfg: Any, dp_world_size: int) -> int:
    """Samples per optimizer step, all ranks: ranks x ``batch_size`` x ``gradient_accumulation_steps``."""
    return dp_world_size * cfg["batch_size"] * cfg["gradient_accumulation_steps"]


def is_lora_model(cfg_model: Any) -> bool:
    """Whether a ``model`` config builds a LoRA/QLoRA/DoRA model (torchtune's ``lora_*`` / ``qlora_*`` builders)."""
    component = str((cfg_model or {}).get("_component_") or "")
    return component.rpartition(".")[2].startswith(("lora_", "qlora_"))


# LoRA settings that decide which adapter tensors exist and their shapes
_ADAPTER_SHAPE_SETTINGS = ("lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output", "lora_rank", "use_dora")


def _holds_model_weights(folder: Any) -> bool:
    """Whether a checkpoint folder holds a whole model's weight files (a LoRA step: its merged model)."""
    if folder is None or not Path(folder).is_dir():
        return False
    return any(p.suffix in (".safetensors", ".bin", ".pth") and not p.name.startswith("adapter")
               for p in Path(folder).iterdir())


def _check_same_kind_of_model(resumed: ResumeState, cfg: DictConfig) -> None:
    """A checkpoint's model must be what this run builds: full or LoRA, and the same adapter tensors."""
    saved_model = (resumed.config or {}).get("model")
    if saved_model is None:  # checkpoints of earlier versions: CheckpointManager.load and the loads check
        return
    where = f"'{resumed.path}'" if resumed.path is not None else "the checkpoint"
    distributed = "fsdp_cpu_offload" in cfg  # only the distributed recipes' schema has it
    kind = "distributed" if distributed else "single_device"
    saved_lora, lora = is_lora_model(saved_model), is_lora_model(cfg.model)
    if saved_lora and not lora:
        adapter_only = bool(resumed.config.get("save_adapter_weights_only", False))
        merged = ""
        if not adapter_only and _holds_model_weights(resumed.path):
            merged = (f", or fine-tune its merged weights in a new output_dir with "
                      f"checkpointer.checkpoint_dir={resumed.path}")
        elif not adapter_only and resumed.sharded:  # a periodic or stop's sharded step: shards only, no merge yet
            merged = (f", or export its merged model (python -m torchtune_ext.checkpoint.export {resumed.path} "
                      f"{resumed.path}_hf) and fine-tune that in a new output_dir with "
                      f"checkpointer.checkpoint_dir={resumed.path}_hf")
        raise ConfigError("resume_from_checkpoint", f"{where} was written by a LoRA recipe (model "
                          f"{saved_model.get('_component_')}): its optimizer state is the adapter's, which a full "
                          f"fine-tune cannot continue; resume it with a LoRA recipe "
                          f"(recipes/lora_finetune_{kind}.py){merged}")
    if lora and not saved_lora:
        raise ConfigError("resume_from_checkpoint", f"{where} was written by a full fine-tune (model "
                          f"{saved_model.get('_component_')}): it holds no adapter to continue; resume it with "
                          f"recipes/full_finetune_{kind}.py, or train a LoRA adapter on its weights in a new "
                          f"output_dir with checkpointer.checkpoint_dir={resumed.path}")
    if not lora:
        return
    try:
        old, new = lora_settings(saved_model), lora_settings(cfg.model)
    except ConfigError:  # the saved builder is gone: the adapter check at load time still applies
        return

    def shown(value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    changed = [f"model.{name} {shown(getattr(old, name))!r} -> {shown(getattr(new, name))!r}"
               for name in _ADAPTER_SHAPE_SETTINGS if getattr(old, name) != getattr(new, name)]
    if changed:
        raise ConfigError("model", f"the adapter in {where} was trained with other LoRA settings "
                          f"({', '.join(changed)}), so its weights do not fit this model; resume with the settings "
                          "it was trained with, or start a new run in another output_dir")


def check_resume_point(cfg: DictConfig) -> None:
    """Before setup: a resume has a complete, intact checkpoint to start from; a new run writes over none.

    Call it once the config is valid (:func:`torchtune_ext.config.validate`) and
    the folder is known not to be another run's
    (:func:`torchtune_ext.run.control.run_lock.check_not_in_use`).

    Raises:
        ConfigError: (key ``resume_from_checkpoint``) ``resume_from_checkpoint``
            without a complete checkpoint (``step_<N>/`` with its manifest) in
            ``output_dir``, or the newest fails
            :func:`torchtune_ext.checkpoint.verify_checkpoint` (with
            ``verify_checkpoint_hashes``, its SHA-256 too); (key
            ``output_dir``) a later ``step_<N>`` folder without a manifest, which
            a save of this run would collide with; a new run in a folder that
            holds checkpoints of a run; a folder that cannot be read.

    ``resume_from_checkpoint: auto`` becomes true here when ``output_dir``
    holds a complete checkpoint and false when it holds none, so a job that a
    scheduler requeues or torchrun restarts (``--max-restarts``) runs one
    command from its first start on. Every rank reads the same folder before
    any of them writes to it, so they agree.
    """
    restart = _torchrun_restart()
    if restart and ranks.is_rank_zero():
        log.warning("%s after a worker failed; the recipe starts again from the top", restart)
    if cfg.resume_from_checkpoint == "auto":
        cfg.resume_from_checkpoint = latest_checkpoint(cfg.output_dir) is not None
        if ranks.is_rank_zero():
            log.info("resume_from_checkpoint=auto: %s", "continuing from the newest checkpoint in output_dir"
                     if cfg.resume_from_checkpoint else "no complete checkpoint in output_dir yet, so a new run")
    if cfg.resume_from_checkpoint:
        latest = latest_checkpoint(cfg.output_dir)
        if latest is None:
            raise ConfigError(
                "resume_from_checkpoint",
                f"no complete checkpoint (step_<N>/ with checkpoint.json) in output_dir '{cfg.output_dir}'",
            )
        for folder in incomplete_checkpoints(cfg.output_dir):
            # A later save of that step would collide with it; an earlier one is merely ignored.
            if int(folder.name.split("_")[1]) > int(latest.name.split("_")[1]):
                raise ConfigError("output_dir", f"'{folder}' has no checkpoint.json, so it is not a complete "
                                  f"checkpoint and this run would later save over it; move it out of "
                                  f"'{cfg.output_dir}' (resuming continues from '{latest}')")
            log.warning("'%s' has no checkpoint.json: not a complete checkpoint, ignored.", folder)
        verify_checkpoint(latest, content=cfg.verify_checkpoint_hashes)  # before anything loads from it
    elif any(name.startswith("step_") for name in _listdir(cfg.output_dir)):
        if latest_checkpoint(cfg.output_dir) is None:
            raise ConfigError("output_dir", f"'{cfg.output_dir}' holds step_<N> folders without checkpoint.json "
                              "(saves that did not finish): no run can continue from them and a new run would "
                              "save over them; move them out of it or choose another output_dir")
        raise ConfigError(
            "output_dir",
            f"'{cfg.output_dir}' already holds checkpoints of a run; set resume_from_checkpoint=true to "
            "continue it, or choose another output_dir (nothing is overwritten)"
            + (f"; this is {restart}: launch with resume_from_checkpoint=auto so that restarted workers "
               "continue from the newest checkpoint" if restart else ""),
        )


def _torchrun_restart() -> str:
    """'torchrun's restart 1 of 3' when torchrun started this job's workers again (``--max-restarts``), else ''."""
    count = ranks.torchrun_restart()
    return f"torchrun's restart {count} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}" if count else ""


def _listdir(path: str):
    try:
        return os.listdir(path) if os.path.isdir(path) else []
    except OSError as err:  # no read permission: which checkpoints it holds cannot be told
        raise ConfigError("output_dir", f"'{path}' cannot be read ({type(err).__name__}: {err}); give this user "
                          f"read access to it (e.g. chmod u+rwx '{path}') or choose another output_dir") from None


def check_resume(resumed: ResumeState, cfg: DictConfig) -> None:
    """Refuse settings a run cannot continue with; call it before building anything.

    Raises:
        ConfigError: (key ``shuffle``) ``shuffle`` changed in the middle of an epoch;
            (key ``optimizer_in_bwd``) it changed: the saved optimizer state has
            the other layout (one optimizer per parameter, or one for all);
            (key ``resume_from_checkpoint``) a LoRA checkpoint in a full
            fine-tune or the reverse; (key ``model``) a LoRA setting that
            changes the adapter's tensors (rank, adapted modules, DoRA).
    """
    _check_same_kind_of_model(resumed, cfg)
    saved = resumed.config
    if saved is not None and bool(saved.get("optimizer_in_bwd", False)) != bool(cfg.get("optimizer_in_bwd", False)):
        was = str(bool(saved.get("optimizer_in_bwd", False))).lower()
        raise ConfigError("optimizer_in_bwd", f"the run was saved with optimizer_in_bwd={was}, whose optimizer "
                          "state has another layout (one optimizer per parameter with true, one for all with "
                          f"false); resume with optimizer_in_bwd={was}")
    if saved is not None and saved.get("shuffle") != cfg.shuffle and resumed.progress.samples_in_epoch:
        raise ConfigError("shuffle", f"the run was saved in the middle of epoch {resumed.progress.epoch} with "
                          f"shuffle={saved.get('shuffle')}: another order would train some of the epoch's "
                          "samples twice and others never. Resume with the same shuffle; it may change from "
                          "the next epoch on (at a checkpoint written at an epoch's end)")


def restore_training(resumed: ResumeState, cfg: DictConfig, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                     *, dp_world_size: int = 1, rank: int = 0,
                     load_optimizer_state: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
    """Continue the optimizer and LR schedule of a resumed run, with the config's settings.

    Call it after building the optimizer from the config and the scheduler
    for ``progress.total_steps`` (planned with the new settings). Loads the
    optimizer state (its moments), puts back the config's hyper-parameters,
    advances the scheduler to ``resumed.progress.step`` and logs (rank 0)
    what changed against the checkpoint's run.

    Args:
        resumed: the loaded checkpoint state.
        cfg: the validated config of this run.
        optimizer: built from ``cfg.optimizer``.
        lr_scheduler: built from ``cfg.lr_scheduler``, or None.
        dp_world_size: data-parallel ranks of this run.
        rank: this process's rank (only rank 0 logs).
        load_optimizer_state: loads the full optimizer state dict into
            ``optimizer`` (sharded models); default ``optimizer.load_state_dict``.
    """
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        (load_optimizer_state or optimizer.load_state_dict)(resumed.optimizer)
    except (ValueError, KeyError, RuntimeError) as err:  # torch's "loaded state dict contains a parameter group
        # that doesn't match the size of optimizer's group", a missing state entry, a moment of another shape
        where = f"'{resumed.path}'" if resumed.path is not None else "the checkpoint"
        detail = " ".join(str(err).split())
        raise ConfigError("resume_from_checkpoint", f"the optimizer state in {where} does not fit the parameters "
                          f"this run trains ({type(err).__name__}: {detail}); was it written by another recipe "
                          "(LoRA or full fine-tune) or another model? Resume with the recipe and model it was "
                          "trained with") from None
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)  # the config's lr, betas, weight decay ... (and the scheduler's initial_lr)
    step = resumed.progress.step
    if lr_scheduler is not None:
        with warnings.catch_warnings():
            # "lr_scheduler.step() before optimizer.step()": on purpose, the optimizer stepped before the resume
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                lr_scheduler.step()  # as the run did, so any scheduler reaches the same state
    if rank == 0:
        for line in _report(resumed, cfg, optimizer, lr_scheduler, dp_world_size):
            log.info(line)


def _report(resumed: ResumeState, cfg: DictConfig, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
            dp_world_size: int) -> List[str]:
    progress, saved = resumed.progress, resumed.config
    lines = []
    changes = [c for c in changed_settings(saved, cfg, resumed.dp_world_size, dp_world_size) if c[0] != "seed"]
    listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)
    if progress.step >= progress.total_steps and progress.epoch < cfg.epochs:
        # the epoch in progress is the last and max_steps_per_epoch ends it at or before the step reached:
        # the new value is what ends the run, so it is applied (the rest is not: no step is left)
        cut = [c for c in changes if c[0] == "max_steps_per_epoch"]
        rest = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes if key != "max_steps_per_epoch")
        lines.append(f"Nothing is left to train: max_steps_per_epoch={cfg.max_steps_per_epoch} ends epoch "
                     f"{progress.epoch}, the last of epochs={cfg.epochs}, and the checkpoint (step {progress.step}) "
                     f"has run {progress.steps_in_epoch} optimizer steps of it; raise max_steps_per_epoch or epochs "
                     "to train more"
                     + (f". Changed settings, applied: max_steps_per_epoch {cut[0][1]!r} -> {cut[0][2]!r} (the epoch "
                        "ends here)" if cut else "")
                     + (f"{';' if cut else '. Changed settings,'} not applied, as no step is left: {rest}"
                        if rest else ""))
    elif progress.step >= progress.total_steps:  # a finished run: say so rather than promise a change
        lines.append(f"Nothing is left to train: the checkpoint (step {progress.step}) has finished "
                     f"{progress.epoch} epoch(s) and epochs={cfg.epochs}; raise epochs to train more"
                     + (f". Changed settings, not applied: {listed}" if changes else ""))
        if any(key == "max_steps_per_epoch" for key, _, _ in changes):
            lines[-1] += " (an epoch that has ended stays ended)"
    elif changes:
        lines.append(f"Resuming with changed settings, applied from step {progress.step + 1}: {listed}")
    if cfg.seed is not None and cfg.seed != progress.seed:
        lines.append(f"seed={cfg.seed} is not used: the run continues with its seed {progress.seed} "
                     "and the random states saved in the checkpoint")
    if saved is not None:
        old, new = global_batch_size(saved, resumed.dp_world_size), global_batch_size(cfg, dp_world_size)
        if old != new:
            lines.append(
                f"The global batch changes at resume: {old} -> {new} samples per optimizer step "
                f"({resumed.dp_world_size} ranks x batch_size {saved['batch_size']} x gradient_accumulation_steps "
                f"{saved['gradient_accumulation_steps']} -> {dp_world_size} x {cfg.batch_size} x "
                f"{cfg.gradient_accumulation_steps}); epoch {progress.epoch} continues at sample "
                f"{progress.samples_in_epoch}")
    old_total = resumed.saved_total_steps
    if lr_scheduler is not None and old_total and old_total != progress.total_steps:
        lr = optimizer.param_groups[0]["lr"]
        lines.append(f"The LR schedule is rebuilt for {progress.total_steps} optimizer steps (was {old_total}) "
                     f"and continues at step {progress.step + 1} with lr {lr:.4g}")
    return lines
