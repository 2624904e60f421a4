"""LoRA fine-tuning on many devices with FSDP2, exact across ranks.

    tune run --nproc_per_node 2 recipes/lora_finetune_distributed.py \\
        --config configs/smollm2/135M_lora.yaml [key=value ...]

Only the low-rank adapters (and DoRA magnitudes) train; the base weights are
frozen and stay bit-identical. Every optimizer step is normalized by the
number of trainable label tokens of the whole step on all data-parallel
ranks, exactly as in the full-finetune recipes: the accounting lives in
``torchtune_ext.step``, the FSDP2 pieces in ``torchtune_ext.distributed``;
this file builds and shards the LoRA model, trains the adapter and saves it,
gathered to the single-device format. ``batch_size`` is per rank.

A checkpoint ``<output_dir>/step_<N>/`` holds, unless ``save_adapter_weights_only``,
the merged model in the base checkpoint's HF format (the folder loads as that
model), and the adapter in ``adapter/`` (``adapter_model.pt`` in torchtune's key
names; ``adapter_model.safetensors`` and ``adapter_config.json`` for PEFT).
Resuming loads the base weights from the base checkpoint and the adapter from
the latest step folder.
"""

from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, modules, training, utils
from torchtune.modules.peft import get_adapter_params, set_trainable_params, validate_missing_and_unexpected_for_lora

from torchtune_ext import config as recipe_config
from torchtune_ext import distributed, launch
from torchtune_ext.checkpoint import (
    CheckpointManager,
    Progress,
    expected_checkpoint_bytes,
    latest_checkpoint,
    lora_checkpoint_state,
    load_recipe_state,
    set_rng_state,
)
from torchtune_ext.data import build_step_loader
from torchtune_ext.evaluate import Validator, build_val_loader
from torchtune_ext.loss import build_loss
from torchtune_ext.memory import MemoryGuard
from torchtune_ext.metrics import StepReporter, build_metric_logger
from torchtune_ext.models import initialize_adapters, instantiate_lora_model
from torchtune_ext.optim_in_bwd import build_optimizer
from torchtune_ext.preflight import check_components
from torchtune_ext.preemption import GracefulStop
from torchtune_ext.resume import check_resume, restore_training
from torchtune_ext.run_lock import OutputDirLock
from torchtune_ext.runtime import build_profiler, keep_freed_cpu_memory, offload_activations, set_log_level
from torchtune_ext.step import StepHealth, build_lr_scheduler, train_step
from torchtune_ext.upstream import describe_model

log = utils.get_logger("INFO")


class LoRAFinetuneRecipeDistributed:
    """Data-parallel (FSDP2) LoRA fine-tuning; see the module docstring.

    Args:
        cfg (DictConfig): a config already checked by ``torchtune_ext.config.validate``
            with ``torchtune_ext.config.LORA_KEYS`` and ``DISTRIBUTED_KEYS``.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        set_log_level(cfg.log_level)
        self._device = utils.get_device(None if cfg.device == "auto" else cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._rank, self._world_size = distributed.init_process_group(self._device, cfg.fsdp_cpu_offload)
        self.progress = Progress(seed=training.set_seed(seed=cfg.seed))
        self._stop = GracefulStop(self._device, self._rank, cfg.output_dir)  # SIGTERM / Ctrl-C: save, exit 75

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        check_components(cfg, self._device)  # before anything is loaded or written
        self._lock = OutputDirLock(cfg.output_dir, self._rank)  # one run per output_dir
        resume_from = latest_checkpoint(cfg.output_dir) if cfg.resume_from_checkpoint else None
        resumed = load_recipe_state(resume_from) if resume_from else None
        if resumed:
            check_resume(resumed, cfg)
            self.progress = resumed.progress
            utils.log_rank_zero(log, f"Resuming from {resume_from} (step {self.progress.step})")

        # Data first: a bad dataset fails before anything is loaded or written.
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = build_loss(cfg.loss, compile=cfg.compile)
        self._data = build_step_loader(cfg, self._tokenizer, seed=self.progress.data_seed,
                                       ignore_index=self._loss_fn.ignore_index, dp_rank=self._rank,
                                       dp_world_size=self._world_size)
        self._val_data = build_val_loader(cfg, self._tokenizer, ignore_index=self._loss_fn.ignore_index,
                                          dp_rank=self._rank, dp_world_size=self._world_size)
        total_steps = self.progress.plan(self._data, cfg.epochs)

        self._checkpoints = CheckpointManager.from_config(cfg, dp_world_size=self._world_size)
        checkpoint = self._checkpoints.load(resume_from, adapter=True)
        self._model = self._setup_model(cfg.model, checkpoint[training.MODEL_KEY], checkpoint.get(training.ADAPTER_KEY))
        # Only the adapter: the step's grad_norm and clipping cover exactly what trains.
        self._optimizer = build_optimizer(cfg.optimizer, self._adapter_params.values(), cfg.optimizer_in_bwd)
        self._memory_guard = MemoryGuard(self._model, self._device, self._optimizer, activation_dtype=self._dtype,
                                         limit=cfg.once_per_step_memory_limit)
        self._lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self._optimizer, total_steps)
        if resumed:
            restore_training(resumed, cfg, self._optimizer, self._lr_scheduler, dp_world_size=self._world_size,
                             rank=self._rank, load_optimizer_state=partial(
                                 distributed.load_full_optimizer_state_dict, self._model, self._optimizer,
                                 device=self._device))
        self._checkpoints.announce(expected_checkpoint_bytes(self._model, self._optimizer, lora=True,
                                                             adapter_only=cfg.save_adapter_weights_only),
                                   self.progress, self._data, cfg)

        self._health = StepHealth(cfg.output_dir, skip_nonfinite_steps=cfg.skip_nonfinite_steps,
                                  loss_spike_nats=cfg.loss_spike_nats, start_step=self.progress.step)
        self._metric_logger = build_metric_logger(cfg, rank=self._rank, resume=bool(resumed))
        self._metric_logger.log_config(cfg)
        self._validator = Validator(cfg, self._val_data, self._model, self._loss_fn, self._metric_logger, self._device)
        self._profiler = build_profiler(cfg.profiler)
        if resumed:  # last: building the model drew random numbers; lora_dropout draws more
            set_rng_state(resumed.rng_for(self._rank, self._world_size))

    def _setup_model(self, cfg_model: DictConfig, base_state: Dict[str, Any],
                     adapter_state: Optional[Dict[str, Any]]) -> torch.nn.Module:
        # Built on the meta device: no rank materializes the full model; each
        # receives only its shard when the weights are loaded.
        model = instantiate_lora_model(cfg_model, self._dtype, torch.device("meta"))
        # The adapters are small: in full on CPU, from the run's seed, as in every recipe and world size.
        initialize_adapters(model, self.progress.seed)
        set_trainable_params(model, get_adapter_params(model))
        if self.cfg.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        offload_activations(model, self.cfg.enable_activation_offloading)
        if self.cfg.compile:
            training.compile_model(model)
        offload = self.cfg.fsdp_cpu_offload
        distributed.shard_model(model, self._device, cpu_offload=offload,
                                reshard_after_forward=self.cfg.fsdp_reshard_after_forward,
                                custom_sharded_layers=self.cfg.custom_sharded_layers)
        base_missing, base_unexpected = distributed.load_full_model_state_dict(
            model, base_state, self._device, cpu_offload=offload, strict=False,
            source=self.cfg.checkpointer.checkpoint_dir, model_name=describe_model(self.cfg),
        )
        for module in model.modules():
            if hasattr(module, "initialize_dora_magnitude"):
                module.initialize_dora_magnitude()  # DoRA starts from the norms of the loaded base weights
        adapter_missing = adapter_unexpected = None
        if adapter_state is not None:
            try:
                adapter_missing, adapter_unexpected = distributed.load_full_model_state_dict(
                    model, adapter_state, self._device, cpu_offload=offload, strict=False
                )
            except recipe_config.ConfigError as err:  # shape mismatch: lora_rank changed since the checkpoint
                raise recipe_config.ConfigError(
                    "resume_from_checkpoint", f"the saved adapter does not fit model.lora_rank: resume with the "
                    f"LoRA settings it was trained with ({err})") from None
        settings = recipe_config.lora_settings(cfg_model)
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=list(settings.lora_attn_modules), apply_lora_to_mlp=settings.apply_lora_to_mlp,
            apply_lora_to_output=settings.apply_lora_to_output, base_missing=base_missing,
            base_unexpected=base_unexpected, lora_missing=adapter_missing, lora_unexpected=adapter_unexpected,
        )
        # Sharding replaced every parameter: collect the adapter's anew.
        self._adapter_params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        training.validate_expected_param_dtype(self._adapter_params.items(), dtype=self._dtype)
        self._loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in self._adapter_params.values())
        utils.log_rank_zero(log, f"Model: {total:,} parameters, {trainable:,} trainable "
                                 f"({100 * trainable / total:.2f}%), {self._dtype} on {self._device}, "
                                 f"FSDP2 over {self._world_size} ranks")
        return model

    # ------------------------------------------------------------------ train
    def train(self) -> int:
        """Train to the end, or until a signal asks to stop; returns the exit status (0, or 75 on a stop)."""
        cfg, progress = self.cfg, self.progress
        keep_freed_cpu_memory(self._device)  # CPU: each step reuses the last one's pages instead of faulting them in
        reporter = StepReporter(self._metric_logger, self._device, total_steps=progress.total_steps,
                                initial_step=progress.step, log_every_n_steps=cfg.log_every_n_steps,
                                dp_world_size=self._world_size, rank=self._rank, model=self._model, dtype=self._dtype,
                                peak_tflops_per_device=cfg.peak_tflops_per_device,
                                log_peak_memory=cfg.log_peak_memory_stats, profiler=self._profiler)
        self._validator.at_start(progress)
        while progress.epoch < cfg.epochs:
            epoch = progress.epoch
            for step_data in self._data.epoch(progress.epoch, progress.samples_in_epoch, progress.steps_in_epoch):
                if self._stop.requested():  # all ranks agree
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
        utils.log_rank_zero(log, self._health.finish())  # a summary; an error if the run ended in non-finite steps
        return self._stop.finished()  # a signal during the cleanup no longer changes the outcome

    # ------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> Path:
        # Every rank takes part in gathering; rank 0 receives the full state on CPU and writes.
        optimizer_state = distributed.gather_full_optimizer_state_dict(self._model, self._optimizer)
        model_state = distributed.gather_full_model_state_dict(self._model, self._device)
        state = lora_checkpoint_state(model_state, self.cfg.model, self.cfg.save_adapter_weights_only)
        return self._checkpoints.save(state, self.progress, optimizer_state, rng_by_rank=distributed.gather_rng_states(),
                                      adapter_only=self.cfg.save_adapter_weights_only,
                                      suspect_from=self._health.suspect_from)

    def cleanup(self) -> None:
        self._metric_logger.close()
        self._stop.close()
        self._lock.release()
        distributed.destroy_process_group()


@launch.exit_on_user_error  # outside config.parse: it also checks the command line torchtune parses
@config.parse
def recipe_main(cfg: DictConfig) -> None:
    cfg = recipe_config.validate(cfg, extra_keys={**recipe_config.LORA_KEYS, **recipe_config.DISTRIBUTED_KEYS})
    recipe = LoRAFinetuneRecipeDistributed(cfg)
    with recipe_config.output_dir_unchanged_on_error(cfg.output_dir):
        recipe.setup()
    status = recipe.train()
    recipe.cleanup()
    return status


if __name__ == "__main__":
    launch.run_main(recipe_main)
