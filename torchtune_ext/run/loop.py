"""The part of a fine-tuning run that every recipe shares: setup order, training loop, saving, cleanup.

A recipe (``recipes/*.py``) builds its model and says what trains and what
its checkpoint holds; :class:`TrainingRun` does the rest, in this order::

    run = TrainingRun(cfg, distributed=...)   # device, dtype, process group, seed, signal handling
    checkpoint = run.load_data_and_checkpoint()
        # checks, output_dir lock, resume point, tokenizer, loss, data, then the weights from disk
    model = <the recipe builds and wraps its model, loads checkpoint["model"]>
    run.setup_training(model, trainable_parameters)
        # optimizer, memory guard, LR schedule, resumed optimizer/schedule state,
        # disk check, health checks, metrics, validation, profiler; RNG state last
    run.train(save_checkpoint)                 # the loop below; returns the exit status
    run.cleanup()

Data comes before weights so that a bad dataset fails before gigabytes are
read; the RNG state of a resumed run is restored last, because building the
model (and LoRA's initialization) draws random numbers.

The accounting of each optimizer step (count the trainable tokens of all
micro-batches and ranks, divide a summed loss once) is
:func:`torchtune_ext.train.step.train_step`; this module only calls it once per step.
"""

import logging
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Type

import torch
from omegaconf import DictConfig
from torchtune import training, utils

from torchtune_ext import config as recipe_config
from torchtune_ext import parallel
from torchtune_ext.checkpoint import (
    CheckpointManager,
    Progress,
    latest_checkpoint,
    load_recipe_state,
    run_saves,
    set_rng_state,
)
from torchtune_ext.checkpoint.state_dict import gather_full_model_state_dict
from torchtune_ext.config.agreement import check_same_config_on_every_rank
from torchtune_ext.data.step_loader import build_step_loader
from torchtune_ext.data.tokenizer import build_tokenizer, training_chat_template
from torchtune_ext.run.control.preemption import GracefulStop
from torchtune_ext.run.control.rollback import output_dir_unchanged_on_error
from torchtune_ext.run.control.run_lock import OutputDirLock, check_not_in_use
from torchtune_ext.run.diagnostics import build_profiler, set_log_level
from torchtune_ext.run.evaluate import Validator, build_val_loader
from torchtune_ext.run.metrics import StepReporter, build_metric_logger
from torchtune_ext.run.preflight import (
    check_components,
    model_max_seq_len,
    model_vocab_size,
    warm_up_outlasts_the_run,
)
from torchtune_ext.run.resume import check_resume, check_resume_point, restore_training
from torchtune_ext.train.allocator import keep_freed_cpu_memory
from torchtune_ext.train.loss import build_loss
from torchtune_ext.train.memory import MemoryGuard, available_memory_bytes
from torchtune_ext.train.objective import Objective, TokenObjective
from torchtune_ext.train.optim_in_bwd import build_optimizer
from torchtune_ext.train.step import StepHealth, build_lr_scheduler, train_step

log = utils.get_logger("INFO")

class TrainingRun:
    """One fine-tuning run's shared state and loop; a recipe holds one and adds its model.

    Args:
        cfg (DictConfig): a config already checked by :func:`torchtune_ext.config.validate`.
        distributed (bool): join the job's process group (gloo on CPU, nccl on
            CUDA) and train data-parallel over its ranks with FSDP2, with
            ``tensor_parallel_dim`` ranks per tensor-parallel group; the
            recipe shards its model (``parallelism``). False: one process, one device.

    Attributes set by the constructor: ``cfg``, ``device``, ``dtype``,
    ``rank``, ``world_size`` (data-parallel ranks), ``dp_rank``,
    ``parallelism`` (:class:`torchtune_ext.parallel.mesh.Parallelism`; None
    on one device), ``progress``; by
    :meth:`load_data_and_checkpoint`: ``tokenizer``, ``loss_fn``, ``data``,
    ``val_data``, ``checkpoints``; by :meth:`setup_training`: ``model``,
    ``optimizer``, ``lr_scheduler`` and the metric logger.
    """

    def __init__(self, cfg: DictConfig, *, distributed: bool = False) -> None:
        self.cfg = cfg
        self.distributed = distributed
        set_log_level(cfg.log_level)
        self.device = utils.get_device(None if cfg.device == "auto" else cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.device)
        self.rank, self.processes = (
            parallel.init_process_group(self.device, cfg.fsdp_cpu_offload) if distributed else (0, 1))
        check_same_config_on_every_rank(cfg)  # a node's stale config or override: refused before any collective
        self.parallelism = self._build_parallelism() if distributed else None
        # Data-parallel ranks: the ranks of a tensor-parallel group share one share of the samples.
        self.world_size = self.parallelism.dp_size if distributed else 1
        self.dp_rank = self.parallelism.dp_rank if distributed else 0
        self.progress = Progress(seed=training.set_seed(seed=cfg.seed))
        if distributed:
            parallel.seed_data_parallel_rank(self.progress.seed, self.parallelism)
        self._stop = GracefulStop(self.device, self.rank, cfg.output_dir)  # SIGTERM / Ctrl-C: save, exit 75
        self._resumed = None
        self._lock = self.metric_logger = None
        self._unannounced: Optional[Tuple[Path, bool]] = None  # a saved checkpoint the metric logger has not heard of

    def _build_parallelism(self) -> "parallel.Parallelism":
        tensor_parallel_dim = self.cfg.get("tensor_parallel_dim", 1)
        plan = (parallel.tensor_parallel_plan(self.cfg.get("tensor_parallel_plan"), self.cfg.model._component_)
                if tensor_parallel_dim > 1 else None)
        return parallel.build_parallelism(self.device, tensor_parallel_dim, plan)

    @property
    def dp_group(self) -> Optional[Any]:
        """The group the step's token count and sums are reduced over: the data-parallel ranks under
        tensor parallelism; None (every rank, as ever) without it."""
        return self.parallelism.dp_group if self.parallelism and self.parallelism.tp_size > 1 else None

    def log(self, message: str) -> None:
        """Log ``message`` once per job (rank 0)."""
        utils.log_rank_zero(log, message)

    def log_model(self, model: torch.nn.Module) -> None:
        """Log the model's size, its trainable share, dtype and device (and FSDP2's ranks)."""
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        share = f", {trainable:,} trainable ({100 * trainable / total:.2f}%)" if trainable < total else ""
        fsdp = f", FSDP2 over {self.world_size} ranks" if self.distributed else ""
        if self.parallelism and self.parallelism.tp_size > 1:
            fsdp = f", {self.world_size} data-parallel (FSDP2) x {self.parallelism.tp_size} tensor-parallel ranks"
        self.log(f"Model: {total:,} parameters{share}, {self.dtype} on {self.device}{fsdp}")

    # ------------------------------------------------------------------ setup
    def load_data_and_checkpoint(self, *, adapter: bool = False) -> Dict[str, Any]:
        """Everything before the model: checks, lock, resume point, tokenizer, loss, data, then the weights.

        Args:
            adapter: LoRA: with a resume, also read the adapter of the latest
                checkpoint (the base weights always come from the base checkpoint).

        Returns:
            the checkpointer's state dicts: ``training.MODEL_KEY`` (full, unsharded,
            on CPU), and ``training.ADAPTER_KEY`` for a resumed LoRA run.

        Raises:
            ConfigError: a component, file or checkpoint that cannot be used
                (:func:`torchtune_ext.run.preflight.check_components`,
                :func:`torchtune_ext.run.resume.check_resume`, the data checks).
        """
        cfg = self.cfg
        check_components(cfg, self.device)  # before anything is loaded or written
        self._lock = OutputDirLock(cfg.output_dir, self.rank)  # one run per output_dir
        resume_from = latest_checkpoint(cfg.output_dir) if cfg.resume_from_checkpoint else None
        self._resumed = load_recipe_state(resume_from) if resume_from else None
        if self._resumed:
            check_resume(self._resumed, cfg)
            self.progress = self._resumed.progress
            self.log(f"Resuming from {resume_from} (step {self.progress.step})")
        self.resume_from: Optional[Path] = resume_from
        # the resolved config of the run that wrote it (None: a fresh run, or an older checkpoint)
        self.resumed_config: Optional[Dict[str, Any]] = self._resumed.config if self._resumed else None

        # Data first: a bad dataset fails before anything is loaded or written.
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.build_objective_and_data()
        self._total_steps = self.progress.plan(self.data, cfg.epochs)
        if warning := warm_up_outlasts_the_run(cfg.lr_scheduler, self._total_steps):
            utils.log_rank_zero(log, warning, level=logging.WARNING)

        self.checkpoints = CheckpointManager.from_config(cfg, dp_world_size=self.world_size,
                                                         distributed=self.distributed,
                                                         chat_template=training_chat_template(cfg, self.tokenizer))
        return self.checkpoints.load(resume_from, adapter=adapter)

    def build_objective_and_data(self) -> None:
        """Set ``loss_fn`` (which owns the output projection), ``objective`` (what each step optimizes and
        validation measures), ``data`` and ``val_data``: next-token cross-entropy over the trainable tokens.
        A run with another objective (preference pairs: :class:`torchtune_ext.run.preference.PreferenceRun`)
        overrides it."""
        cfg = self.cfg
        self.loss_fn = build_loss(cfg.loss, compile=cfg.compile)
        self.objective: Objective = TokenObjective(self.loss_fn)
        dp = dict(dp_rank=self.dp_rank, dp_world_size=self.world_size,  # a tensor-parallel group: the same samples
                  model_vocab_size=model_vocab_size(cfg.model))  # a token id past the embedding: refused
        self.data = build_step_loader(cfg, self.tokenizer, seed=self.progress.data_seed,
                                      ignore_index=self.loss_fn.ignore_index,
                                      model_max_seq_len=model_max_seq_len(cfg.model), **dp)
        self.val_data = build_val_loader(cfg, self.tokenizer, ignore_index=self.loss_fn.ignore_index, **dp)

    def setup_training(self, model: torch.nn.Module, trainable_parameters: Iterable[torch.nn.Parameter], *,
                       lora: bool = False) -> None:
        """Everything after the model: optimizer to profiler, then the resumed RNG state.

        Args:
            model: the recipe's model, built, wrapped (FSDP2 when distributed)
                and loaded. From here on it returns its final hidden states and
                the loss applies its output projection, to the trainable rows only
                (:meth:`torchtune_ext.train.loss.SummedCrossEntropyLoss.take_output_projection`).
            trainable_parameters: what the optimizer updates (the step's grad
                norm and clipping cover exactly these).
            lora: the checkpoints hold an adapter (and, unless
                ``save_adapter_weights_only``, the merged model): the start-up
                disk check sizes them so
                (:func:`torchtune_ext.checkpoint.expected_checkpoint_bytes`).
        """
        cfg = self.cfg
        self.model = model
        self.loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
        self.log_model(model)
        self.optimizer = build_optimizer(cfg.optimizer, trainable_parameters, cfg.optimizer_in_bwd)
        self._memory_guard = MemoryGuard(model, self.device, self.optimizer, activation_dtype=self.dtype,
                                         limit=cfg.once_per_step_memory_limit)
        self.lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self.optimizer, self._total_steps)
        if self._resumed:
            load_optimizer_state = run_saves.optimizer_state_loader(self._resumed, model, self.optimizer,
                                                                    distributed=self.distributed, device=self.device)
            restore_training(self._resumed, cfg, self.optimizer, self.lr_scheduler, dp_world_size=self.world_size,
                             rank=self.rank, load_optimizer_state=load_optimizer_state)
        self._lora = lora
        # refuses to start without disk space for one checkpoint, or CPU memory to save it
        run_saves.check_room(self.checkpoints, model, self.optimizer, self.progress, self.data, cfg, lora=lora,
                             distributed=self.distributed, available_memory=available_memory_bytes)

        self._health = StepHealth(cfg.output_dir, skip_nonfinite_steps=cfg.skip_nonfinite_steps,
                                  loss_spike_nats=cfg.loss_spike_nats, start_step=self.progress.step,
                                  history=self.progress.healthy_losses)  # saved with each checkpoint
        self.metric_logger = build_metric_logger(cfg, rank=self.rank, resume=bool(self._resumed))
        self.metric_logger.log_config(cfg)
        self._validator = Validator(cfg, self.val_data, model, self.objective, self.metric_logger, self.device,
                                    dp_group=self.dp_group)
        self._profiler = build_profiler(cfg.profiler)
        if self._resumed:  # last: building the model drew random numbers (LoRA's dropout draws more)
            set_rng_state(self._resumed.rng_for(self.rank, self.processes))

    # ------------------------------------------------------------------ train
    def train(self, save_checkpoint: Callable[[], Path]) -> int:
        """Train to the end, or until a signal asks to stop.

        Args:
            save_checkpoint: the recipe's save (it knows what its checkpoint
                holds); called at ``save_every_n_steps``, at the end of each
                epoch, and on a stop request.

        Returns:
            int: the exit status: 0, or 75 after a signal's checkpoint
            (:class:`torchtune_ext.run.control.preemption.GracefulStop`).
        """
        cfg, progress = self.cfg, self.progress
        save_checkpoint = self._announced(save_checkpoint)
        keep_freed_cpu_memory(self.device)  # CPU: each step reuses the last one's pages instead of faulting them in
        reporter = StepReporter(self.metric_logger, self.device, total_steps=progress.total_steps,
                                initial_step=progress.step, log_every_n_steps=cfg.log_every_n_steps,
                                dp_world_size=self.world_size, rank=self.rank, model=self.model, dtype=self.dtype,
                                tp_world_size=self.parallelism.tp_size if self.parallelism else 1,
                                peak_tflops_per_device=cfg.peak_tflops_per_device,
                                log_peak_memory=cfg.log_peak_memory_stats, profiler=self._profiler,
                                distributed=self.distributed)
        self._validator.at_start(progress)
        while progress.epoch < cfg.epochs:
            epoch = progress.epoch
            for step_data in self.data.epoch(progress.epoch, progress.samples_in_epoch, progress.steps_in_epoch):
                if self._stop.requested():  # all ranks agree
                    saved = save_checkpoint() if progress.step else None
                    self._announce_pending()  # an asynchronous save is complete before the exit status says so
                    return self._stop.stop(saved, progress.step)
                reporter.start_step()
                lr = training.get_lr(self.optimizer)
                step_metrics = getattr(self.objective, "step_metrics", None)  # an objective's own timings
                if step_metrics is not None:
                    step_metrics()  # from here on: what validation measured is not this step's
                begin_step = getattr(self.objective, "begin_step", None)  # on-policy distillation seeds by step
                if begin_step is not None:
                    begin_step(progress.step + 1)
                result = train_step(
                    self.model, self.optimizer, self.objective, step_data.micro_batches, device=self.device,
                    backward=cfg.backward, clip_grad_norm=cfg.clip_grad_norm, dp_group=self.dp_group,
                    health=self._health, step=progress.step + 1, memory_guard=self._memory_guard,
                    baseline=step_data.baseline,
                )
                if step_metrics is not None:
                    result.metrics.update(step_metrics())
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                progress.complete_step(skipped=result.skipped is not None, end_sample=step_data.end_sample,
                                       num_tokens=result.num_tokens)
                reporter.end_step(result, step=progress.step, epoch=progress.epoch, lr=lr,
                                  skipped_steps=progress.skipped_steps, tokens_seen=progress.tokens_seen,
                                  data=step_data)
                self._validator.after_step(progress, end_of_epoch=step_data.last_in_epoch)
                if step_data.last_in_epoch:  # before a periodic save of this step, whose checkpoint ends the epoch
                    progress.complete_epoch()
                if cfg.save_every_n_steps and progress.step % cfg.save_every_n_steps == 0:
                    save_checkpoint()
            if progress.epoch == epoch:  # resumed at the end of an epoch: it had no step left
                progress.complete_epoch()
            if progress.epoch < cfg.epochs or cfg.save_final_checkpoint:
                save_checkpoint()
        self._announce_pending()  # an asynchronous save still in flight: its failure is the run's
        reporter.close()
        self.log(self._health.finish())  # a summary; an error if the run ended in non-finite steps
        return self._stop.finished()  # a signal during the cleanup no longer changes the outcome

    # ------------------------------------------------------------- checkpoint
    def _announced(self, save_checkpoint: Callable[[], Path]) -> Callable[[], Path]:
        """``save_checkpoint``, after which the metric logger hears of the checkpoint once it is complete
        (``metric_logger.log_model``: a W&B artifact): at once, or, for an asynchronous save, when the next
        save or the end of the run waits for it (before the next save may prune it)."""
        def save() -> Path:
            self._announce_pending()  # the next save would wait for it first anyway
            folder = save_checkpoint()
            self._unannounced = (folder, self.progress.epoch >= self.cfg.epochs)  # final: the end of training's
            if not self.checkpoints.pending:
                self._announce_pending()
            return folder

        return save

    def _announce_pending(self) -> None:
        """Wait for a save in flight; then tell the metric logger of the checkpoint not yet announced."""
        self.checkpoints.wait()
        unannounced, self._unannounced = self._unannounced, None
        if unannounced is not None:
            folder, final = unannounced
            self.metric_logger.checkpoint_saved(folder, final=final)

    def full_model_state(self) -> Dict[str, torch.Tensor]:
        """The model's whole state dict on CPU: gathered from every rank onto rank 0 (others get ``{}``)."""
        if self.distributed:  # every rank takes part in gathering
            return gather_full_model_state_dict(self.model, self.device)
        return self.model.state_dict()

    def save(self, state: Dict[str, Any], *, adapter_only: bool = False) -> Path:
        """Save ``state`` (the recipe's model or adapter weights) with the optimizer, progress and RNG states.

        Atomic (:func:`torchtune_ext.checkpoint.run_saves.save_gathered`);
        under FSDP2 every rank takes part and rank 0 writes. Returns the step folder.
        """
        return run_saves.save_gathered(self.checkpoints, state, self.model, self.optimizer, self.progress,
                                       distributed=self.distributed, adapter_only=adapter_only,
                                       suspect_from=self._health.suspect_from)

    def save_sharded(self) -> Path:
        """Save a sharded checkpoint (``sharded_checkpoints``): every rank writes its own shards
        (:func:`torchtune_ext.checkpoint.run_saves.save_sharded`). Returns the step folder."""
        return run_saves.save_sharded(self.checkpoints, self.model, self.optimizer, self.progress, self.cfg,
                                      lora=self._lora, distributed=self.distributed,
                                      suspect_from=self._health.suspect_from)

    def cleanup(self) -> None:
        """Close the metric logger, restore the signal handlers, release the lock, leave the process group."""
        if getattr(self, "checkpoints", None) is not None:
            self.checkpoints.close()  # a save still in flight ends first
        if self.metric_logger is not None:
            self.metric_logger.close()
        self._stop.close()
        if self._lock is not None:
            self._lock.release()
        if self.distributed:
            parallel.destroy_process_group()


class FinetuneRecipe:
    """What every recipe class shares: a :class:`TrainingRun`, ``train()`` and ``cleanup()``.

    A recipe subclasses it once and adds ``setup()`` (the order of setup,
    with its own model), the building of its model, and ``save_checkpoint()``
    (what its checkpoint holds). ``distributed = True``: data parallel with FSDP2.

    Args:
        cfg (DictConfig): a config already checked by :func:`torchtune_ext.config.validate`.
    """

    distributed = False
    run_class: Type[TrainingRun] = TrainingRun  # what the run optimizes (preference pairs: PreferenceRun)

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run = self.run_class(cfg, distributed=self.distributed)  # device, dtype, process group, seed, signals

    def train(self) -> int:
        """Train to the end or to a stop; returns the exit status (:meth:`TrainingRun.train`).

        With ``sharded_checkpoints`` the run saves its model's shards itself
        (:meth:`TrainingRun.save_sharded`): the recipe's ``save_checkpoint``
        says what a gathered checkpoint holds.
        """
        save = self.run.save_sharded if self.cfg.get("sharded_checkpoints") else self.save_checkpoint
        return self.run.train(save)

    def save_checkpoint(self) -> Path:
        raise NotImplementedError("a recipe says what its checkpoint holds")

    def cleanup(self) -> None:
        self.run.cleanup()


def run_recipe(recipe_class: Type, cfg: DictConfig, extra_keys: Optional[Dict[str, recipe_config.Key]] = None) -> int:
    """Validate ``cfg``, then set up, train and clean up one ``recipe_class(cfg)``; returns the exit status.

    Before any work: the config (:func:`torchtune_ext.config.validate`), that
    no other run holds ``output_dir``, and where the run starts
    (:func:`torchtune_ext.run.resume.check_resume_point`). If setup fails, what
    appeared in ``output_dir`` after this run took its lock is removed again
    (:func:`torchtune_ext.run.control.rollback.output_dir_unchanged_on_error`);
    a run refused the lock touches nothing, and training's writes are never
    rolled back. A run that finishes names once more the config keys it
    ignored (the warning at its start is long out of sight by then).
    """
    cfg = recipe_config.validate(cfg, extra_keys=extra_keys)
    check_not_in_use(cfg.output_dir)  # another run's folder: nothing more is looked at
    check_resume_point(cfg)
    recipe = recipe_class(cfg)
    with output_dir_unchanged_on_error(cfg.output_dir):
        recipe.setup()
    status = recipe.train()
    if status == 0:  # a stop's line (exit 75) stays the last one
        recipe_config.remind_ignored_keys(cfg, extra_keys)
    recipe.cleanup()
    return status
