"""Full-parameter fine-tuning on one device, with exact gradient accumulation.

    tune run recipes/full_finetune_single_device.py \\
        --config configs/smollm2/135M_full_single_device.yaml [key=value ...]

Every optimizer step is normalized by the number of trainable label tokens
in the whole step (all its micro-batches), so batch size N, or batch size 1
with N gradient accumulation steps, gives the same loss and gradients. The
accounting lives in ``torchtune_ext.step``; this file builds the model, runs
the loop and saves checkpoints.
"""

from pathlib import Path
from typing import Any, Dict

import torch
from omegaconf import DictConfig
from torchtune import config, modules, training, utils

from torchtune_ext import config as recipe_config
from torchtune_ext import launch
from torchtune_ext.checkpoint import (
    CheckpointManager,
    Progress,
    expected_checkpoint_bytes,
    latest_checkpoint,
    load_model_state,
    load_recipe_state,
    set_rng_state,
)
from torchtune_ext.data import build_step_loader
from torchtune_ext.evaluate import Validator, build_val_loader
from torchtune_ext.loss import build_loss
from torchtune_ext.memory import MemoryGuard
from torchtune_ext.metrics import StepReporter, build_metric_logger
from torchtune_ext.optim_in_bwd import build_optimizer
from torchtune_ext.preflight import check_components
from torchtune_ext.preemption import GracefulStop
from torchtune_ext.resume import check_resume, restore_training
from torchtune_ext.run_lock import OutputDirLock
from torchtune_ext.runtime import (
    build_profiler,
    embedding_rows_into_grad,
    keep_freed_cpu_memory,
    offload_activations,
    set_log_level,
)
from torchtune_ext.step import StepHealth, build_lr_scheduler, train_step
from torchtune_ext.upstream import describe_model

log = utils.get_logger("INFO")


class FullFinetuneRecipeSingleDevice:
    """Single-device full fine-tuning; see the module docstring.

    Args:
        cfg (DictConfig): a config already checked by ``torchtune_ext.config.validate``.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        set_log_level(cfg.log_level)
        self._device = utils.get_device(None if cfg.device == "auto" else cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self.progress = Progress(seed=training.set_seed(seed=cfg.seed))
        self._stop = GracefulStop(self._device, output_dir=cfg.output_dir)  # SIGTERM / Ctrl-C: save, exit 75

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        check_components(cfg, self._device)  # before anything is loaded or written
        self._lock = OutputDirLock(cfg.output_dir)  # one run per output_dir
        resume_from = latest_checkpoint(cfg.output_dir) if cfg.resume_from_checkpoint else None
        resumed = load_recipe_state(resume_from) if resume_from else None
        if resumed:
            check_resume(resumed, cfg)
            self.progress = resumed.progress
            log.info(f"Resuming from {resume_from} (step {self.progress.step})")

        # Data first: a bad dataset fails before anything is loaded or written.
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = build_loss(cfg.loss, compile=cfg.compile)
        self._data = build_step_loader(cfg, self._tokenizer, seed=self.progress.data_seed,
                                       ignore_index=self._loss_fn.ignore_index)
        self._val_data = build_val_loader(cfg, self._tokenizer, ignore_index=self._loss_fn.ignore_index)
        total_steps = self.progress.plan(self._data, cfg.epochs)

        self._checkpoints = CheckpointManager.from_config(cfg)
        checkpoint = self._checkpoints.load(resume_from)
        self._model = self._setup_model(cfg.model, checkpoint[training.MODEL_KEY], resume_from)
        self._optimizer = build_optimizer(cfg.optimizer, self._model.parameters(), cfg.optimizer_in_bwd)
        self._memory_guard = MemoryGuard(self._model, self._device, self._optimizer, activation_dtype=self._dtype,
                                         limit=cfg.once_per_step_memory_limit)
        self._lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self._optimizer, total_steps)
        if resumed:
            restore_training(resumed, cfg, self._optimizer, self._lr_scheduler)
        self._checkpoints.announce(expected_checkpoint_bytes(self._model, self._optimizer), self.progress,
                                   self._data, cfg)

        self._health = StepHealth(cfg.output_dir, skip_nonfinite_steps=cfg.skip_nonfinite_steps,
                                  loss_spike_nats=cfg.loss_spike_nats, start_step=self.progress.step)
        self._metric_logger = build_metric_logger(cfg, rank=0, resume=bool(resumed))
        self._metric_logger.log_config(cfg)
        self._validator = Validator(cfg, self._val_data, self._model, self._loss_fn, self._metric_logger, self._device)
        self._profiler = build_profiler(cfg.profiler)
        if resumed:
            set_rng_state(resumed.rng_for(0, 1))  # last: building the model consumed random numbers

    def _setup_model(self, cfg_model: DictConfig, state_dict: Dict[str, Any], source) -> torch.nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        if self.cfg.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        offload_activations(model, self.cfg.enable_activation_offloading)
        load_model_state(model, state_dict, source or self.cfg.checkpointer.checkpoint_dir,
                         model_name=describe_model(self.cfg))
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        # Same gradients; on CPU the tied embedding adds its rows to .grad instead of a vocabulary-sized tensor.
        embedding_rows_into_grad(model, self._device, compiled=self.cfg.compile)
        if self.cfg.compile:
            training.compile_model(model)
        self._loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
        log.info(f"Model: {sum(p.numel() for p in model.parameters()):,} parameters, "
                 f"{self._dtype} on {self._device}")
        return model

    # ------------------------------------------------------------------ train
    def train(self) -> int:
        """Train to the end, or until a signal asks to stop; returns the exit status (0, or 75 on a stop)."""
        cfg, progress = self.cfg, self.progress
        keep_freed_cpu_memory(self._device)  # CPU: each step reuses the last one's pages instead of faulting them in
        reporter = StepReporter(self._metric_logger, self._device, total_steps=progress.total_steps,
                                initial_step=progress.step, log_every_n_steps=cfg.log_every_n_steps,
                                model=self._model, dtype=self._dtype, peak_tflops_per_device=cfg.peak_tflops_per_device,
                                log_peak_memory=cfg.log_peak_memory_stats, profiler=self._profiler)
        self._validator.at_start(progress)
        while progress.epoch < cfg.epochs:
            epoch = progress.epoch
            for step_data in self._data.epoch(progress.epoch, progress.samples_in_epoch, progress.steps_in_epoch):
                if self._stop.requested():
                    return self._stop.stop(self.save_checkpoint() if progress.step else None, progress.step)
                reporter.start_step()
                lr = training.get_lr(self._optimizer)
                result = train_step(
                    self._model, self._optimizer, self._loss_fn, step_data.micro_batches, device=self._device,
                    backward_once_per_step=cfg.backward_once_per_step, clip_grad_norm=cfg.clip_grad_norm,
                    health=self._health, step=progress.step + 1, memory_guard=self._memory_guard,
                    baseline=step_data.baseline,
                )
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                progress.complete_step(skipped=result.skipped is not None, end_sample=step_data.end_sample,
                                       num_tokens=result.num_tokens)
                reporter.end_step(result, step=progress.step, epoch=progress.epoch, lr=lr,
                                  skipped_steps=progress.skipped_steps, tokens_seen=progress.tokens_seen,
                                  data=step_data)
                self._validator.after_step(progress, end_of_epoch=step_data.last_in_epoch)
                if step_data.last_in_epoch:  # before a periodic save of this step, whose checkpoint ends the epoch
                    progress.complete_epoch()
                if cfg.save_every_n_steps and progress.step % cfg.save_every_n_steps == 0:
                    self.save_checkpoint()
            if progress.epoch == epoch:  # resumed at the end of an epoch: it had no step left
                progress.complete_epoch()
            if progress.epoch < cfg.epochs or cfg.save_final_checkpoint:
                self.save_checkpoint()
        reporter.close()
        log.info(self._health.finish())  # a summary; an error if the run ended in non-finite steps
        return self._stop.finished()  # a signal during the cleanup no longer changes the outcome

    # ------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> Path:
        return self._checkpoints.save({training.MODEL_KEY: self._model.state_dict()}, self.progress,
                                      self._optimizer.state_dict(), suspect_from=self._health.suspect_from)

    def cleanup(self) -> None:
        self._metric_logger.close()
        self._stop.close()
        self._lock.release()


@launch.exit_on_user_error  # outside config.parse: it also checks the command line torchtune parses
@config.parse
def recipe_main(cfg: DictConfig) -> None:
    cfg = recipe_config.validate(cfg)
    recipe = FullFinetuneRecipeSingleDevice(cfg)
    with recipe_config.output_dir_unchanged_on_error(cfg.output_dir):
        recipe.setup()
    status = recipe.train()
    recipe.cleanup()
    return status


if __name__ == "__main__":
    launch.run_main(recipe_main)
