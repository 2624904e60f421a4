"""Per-step metrics: timing, throughput, peak memory, and a rank-aware logger.

Every optimizer step produces one record with the same keys in every recipe
(see :func:`step_record`). It goes to ``<output_dir>/logs/metrics.jsonl`` (one
JSON object per line, appended, so a resumed run continues the same file) and
to the configured torchtune metric logger (W&B by default). Only rank 0
writes; other ranks hold a logger that does nothing, so the training loop has
no rank branches.
"""

import contextlib
import functools
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config
from torchtune import utils

from torchtune_ext import flops as flops_lib
from torchtune_ext import ranks
from torchtune_ext.checkpoint import write_failed
from torchtune_ext.config import enabled
from torchtune_ext.errors import EXIT_IO_ERROR, ConfigError
from torchtune_ext.flops import ModelFlops
from torchtune_ext.step import StepResult, waiting_shares

log = utils.get_logger("INFO")  # torchtune's: the recipes show its INFO lines

GIB = 1024**3
# After a failed write, how long the metric logger's backend may take to close before the run exits anyway.
BACKEND_CLOSE_TIMEOUT_S = 5.0


class _RssSampler:
    """Peak resident set size of this process within a window, without resetting the kernel's peak.

    The kernel keeps one lifetime peak per process (VmHWM), which outside
    tools such as ``/usr/bin/time`` and job schedulers report; resetting it
    (``/proc/self/clear_refs``) would make them see only the last window. So
    the window's peak is measured here instead:

    * if VmHWM rose during the window, the new lifetime peak was reached in
      it, and it is exactly the window's peak;
    * otherwise the window stayed below an earlier peak, and a daemon thread
      sampling the current RSS (``/proc/self/statm``) every ``interval``
      seconds gives it (a spike shorter than the interval can be missed).

    Reading two small /proc files costs microseconds; the thread only starts
    at the first :meth:`reset`.
    """

    def __init__(self, interval: float = 0.005):
        self._interval = interval
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._hwm_at_reset: Optional[int] = None  # None: never reset, the window is the process's lifetime
        self._window_max = 0

    def reset(self) -> None:
        with self._lock:
            self._hwm_at_reset = lifetime_peak_rss_bytes()
            self._window_max = _read_rss_bytes()
        if self._thread is None and self._hwm_at_reset is not None:
            self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            rss = _read_rss_bytes()
            with self._lock:
                self._window_max = max(self._window_max, rss)
            time.sleep(self._interval)

    def peak_bytes(self) -> int:
        hwm = lifetime_peak_rss_bytes()
        if hwm is None:  # not Linux: the lifetime peak is all there is
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with self._lock:
            if self._hwm_at_reset is None or hwm > self._hwm_at_reset:
                return hwm
            self._window_max = max(self._window_max, _read_rss_bytes())
            return self._window_max


def lifetime_peak_rss_bytes() -> Optional[int]:
    """The process's lifetime peak resident set size (Linux VmHWM) in bytes, or None where /proc is unavailable.

    What ``/usr/bin/time`` and schedulers report, unless something clears it.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _read_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except OSError:
        return 0


_cpu_peak = _RssSampler()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (see :func:`peak_memory_gib`).

    On CPU nothing outside this process is disturbed: the kernel's lifetime
    peak, which ``/usr/bin/time`` reports, is never reset. Benchmarks that
    want the peak since start-up replace this function with a no-op.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    _cpu_peak.reset()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory since the last :func:`reset_peak_memory` (or since start-up), in GiB.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only, not the caching
    allocator's reserve). CPU: the process's peak resident set size in the
    window (:class:`_RssSampler`: exact when the window set a new lifetime
    peak, else sampled every 5 ms); the lifetime peak where /proc is
    unavailable.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return _cpu_peak.peak_bytes() / GIB


class StepTimer:
    """Wall time of one optimizer step, synchronising CUDA so it is real."""

    def __init__(self, device: torch.device):
        self._device = device
        self._start = 0.0

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start`."""
        self._sync()
        return time.perf_counter() - self._start


def step_record(
    result: StepResult,
    *,
    step: int,
    epoch: int,
    lr: float,
    step_seconds: float,
    device: torch.device,
    dp_world_size: int = 1,
    skipped_steps: int = 0,
    tokens_seen: int = 0,
    data: Optional[Any] = None,
    flops: Optional[ModelFlops] = None,
    peak_tflops: Optional[float] = None,
    log_peak_memory: bool = True,
) -> Dict[str, Any]:
    """The metrics of one optimizer step, as logged by every recipe.

    Keys: ``step`` (1-based optimizer step), ``epoch`` (0-based), ``loss``
    (the optimized global step loss, nats per trainable token; absent for a
    skipped step), ``lr``, ``grad_norm`` (global L2 norm before clipping;
    absent for a skipped step), the loss's token metrics (``token_accuracy``,
    ``entropy``: means over the step's trainable tokens, absent for a skipped
    step), ``num_tokens`` (trainable label tokens after
    the shift, all ranks: padding and masked prompts excluded),
    ``tokens_per_second`` (num_tokens / step wall time), ``step_seconds``,
    ``peak_memory_gib`` (see :func:`peak_memory_gib`; left out with
    ``log_peak_memory=False``), ``skipped_steps``
    (cumulative), ``tokens_seen`` (cumulative ``num_tokens`` of the steps that
    updated the model: an x axis comparable across batch sizes),
    ``once_per_step`` (1: the step's gradient came from one backward, 0: from
    one per micro-batch; absent when no backward ran), ``data_seconds``,
    ``data_wait_fraction`` and ``rank_wait_fraction`` (the shares of the
    step's wall time, data loading included, spent loading its samples and
    waiting for the other ranks: :func:`torchtune_ext.step.waiting_shares`), and with
    ``dp_world_size > 1`` also ``dp_world_size`` and ``tokens_per_second_per_device``.

    With ``data`` (this rank's
    :class:`torchtune_ext.data.StepData`): ``padding_fraction`` (positions
    computed that are padding, stand-ins included, over all positions
    computed), and with ``flops`` (:class:`torchtune_ext.flops.ModelFlops`)
    ``tflops_per_device`` (model FLOPs of every position computed, padding
    included, per second of this step; :mod:`torchtune_ext.flops`) and
    ``useful_tflops_per_device`` (the same for the non-padding tokens only),
    and with ``peak_tflops`` their ratios to it, ``mfu`` and ``useful_mfu``.
    Per-device numbers are this rank's (rank 0 logs; the data plan balances
    the ranks).
    """
    record: Dict[str, Any] = {"step": step, "epoch": epoch}
    if result.skipped is None:
        record["loss"] = result.loss
        record["grad_norm"] = result.grad_norm
        record.update(result.metrics)
    record.update(
        lr=lr,
        num_tokens=result.num_tokens,
        tokens_per_second=result.num_tokens / step_seconds if step_seconds > 0 else 0.0,
        step_seconds=step_seconds,
    )
    # why a step is slow: the shares of its wall time spent loading its data and waiting for other ranks
    record.update(waiting_shares(result, step_seconds, getattr(data, "load_seconds", 0.0)))
    if log_peak_memory:
        record["peak_memory_gib"] = peak_memory_gib(device)
    record.update(skipped_steps=skipped_steps, tokens_seen=tokens_seen)
    if result.once_per_step is not None:
        record["once_per_step"] = int(result.once_per_step)
    if data is not None and data.num_padded_positions > 0:
        record["padding_fraction"] = 1.0 - data.num_real_tokens / data.num_padded_positions
        if flops is not None and step_seconds > 0:
            computed = flops.step_flops(data.num_padded_positions, data.padded_squared_lengths)
            useful = flops.step_flops(data.num_real_tokens, data.real_squared_lengths)
            record["tflops_per_device"] = computed / step_seconds / 1e12
            record["useful_tflops_per_device"] = useful / step_seconds / 1e12
            if peak_tflops:
                record["mfu"] = record["tflops_per_device"] / peak_tflops
                record["useful_mfu"] = record["useful_tflops_per_device"] / peak_tflops
    if dp_world_size > 1:
        record["dp_world_size"] = dp_world_size
        record["tokens_per_second_per_device"] = record["tokens_per_second"] / dp_world_size
    return record


def loss_curves(records: Iterable[Mapping[str, Any]], x: str) -> Dict[str, Tuple[List[float], List[float]]]:
    """The training and validation loss curves of a run's records, against ``x``.

    Args:
        records: ``metrics.jsonl`` rows in order; a resumed run logs some steps
            twice, and the last record of a step (training or validation) counts.
        x: ``step`` or ``tokens_seen``.

    Returns:
        ``{"loss": (xs, ys), "val_loss": (xs, ys)}``, each sorted by step;
        records without the loss (skipped steps) are left out.
    """
    last: Dict[Tuple[str, int], Mapping[str, Any]] = {}
    for record in records:
        for key in ("loss", "val_loss"):
            if record.get(key) is not None:
                last[key, record["step"]] = record
    curves: Dict[str, Tuple[List[float], List[float]]] = {"loss": ([], []), "val_loss": ([], [])}
    for (key, _), record in sorted(last.items(), key=lambda item: item[0][1]):
        curves[key][0].append(record.get(x, 0))
        curves[key][1].append(record[key])
    return curves


def log_wandb_loss_charts(records: Iterable[Mapping[str, Any]]) -> None:
    """Log, to the active W&B run, the training and validation loss on one chart
    against ``step`` and one against ``tokens_seen`` (``loss_vs_step``,
    ``loss_vs_tokens_seen``; W&B's own panels show one metric each)."""
    import wandb

    if wandb.run is None:
        return
    records = list(records)
    charts = {}
    for x in ("step", "tokens_seen"):
        curves = {k: v for k, v in loss_curves(records, x).items() if v[0]}
        if curves:
            charts[f"loss_vs_{x}"] = wandb.plot.line_series(
                xs=[xs for xs, _ in curves.values()], ys=[ys for _, ys in curves.values()],
                keys=list(curves), title=f"training and validation loss vs {x}", xname=x)
    if charts:
        wandb.log(charts)


def define_wandb_axes() -> None:
    """Declare the x axes of a W&B run: torchtune's ``WandBLogger`` plots every
    metric against ``global_step`` (our ``step``); ``tokens_seen`` is the other
    (cumulative trainable tokens, comparable across batch sizes)."""
    import wandb

    wandb.define_metric("tokens_seen", summary="max")
    wandb.define_metric("val_loss", step_metric="global_step", summary="min")


class MetricLogger:
    """Writes step records to JSONL and to a torchtune metric logger, on rank 0.

    Args:
        jsonl_path (Path): ``metrics.jsonl`` to append to (parents created).
        backend: a torchtune ``MetricLoggerInterface`` instance, or None.
        rank (int): this process's global rank; non-zero ranks write nothing.
        wandb_charts (bool): the backend is W&B: on :meth:`close`, log the
            combined loss charts of the whole run (:func:`log_wandb_loss_charts`,
            from the JSONL file, so a resumed run's chart covers all of it).
        resume (bool): the run continues from a checkpoint in the same folder.
    """

    def __init__(self, jsonl_path: Path, backend: Optional[Any] = None, rank: int = 0, wandb_charts: bool = False,
                 resume: bool = False):
        self._active = rank == 0
        self._backend = backend if self._active else None
        self._resume = resume
        self._logs = jsonl_path.parent
        self._jsonl = None
        self._path = jsonl_path
        self._wandb_charts = wandb_charts and self._backend is not None
        if self._active:
            jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl_path, "a", buffering=1)

    def log_config(self, cfg: DictConfig) -> None:
        """Keep the config of every start of the run, and hand it to the backend.

        Each start (the first, then every resume) writes
        ``logs/config_<k>.yaml``, k = 0, 1, 2, ...; nothing earlier is
        overwritten. torchtune's metric loggers write the config to
        ``<output_dir>/torchtune_config.yaml``; after a resume that file keeps
        the first start's config, as the backend (W&B) keeps one run.
        """
        if not self._active:
            return
        index = len(list(self._logs.glob("config_*.yaml")))
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        kind = "resumed from its latest checkpoint" if self._resume else "started"
        (self._logs / f"config_{index}.yaml").write_text(
            f"# start {index} of the run in this output_dir: {kind} at {started}\n" + OmegaConf.to_yaml(cfg))
        if self._backend is not None:
            first = Path(cfg.output_dir) / "torchtune_config.yaml"
            kept = first.read_bytes() if self._resume and first.is_file() else None
            self._backend.log_config(cfg)
            if kept is not None:
                first.write_bytes(kept)

    def log(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` (must hold ``step``) to the JSONL file and the backend.

        Raises:
            OutputWriteError: a write failed (a full disk: ``OSError`` ENOSPC); the
                message names the checkpoint to resume from. The recipes exit with 74.
        """
        if not self._active:
            return
        try:
            self._jsonl.write(json.dumps(dict(record)) + "\n")
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())
        except OSError as err:
            raise self._failed(f"the metrics of step {record['step']} to '{self._path}'", record["step"], err) from err
        if self._backend is not None:
            payload = {k: v for k, v in record.items() if k != "step" and v is not None}
            try:
                self._backend.log_dict(payload, step=record["step"])
            except OSError as err:
                raise self._failed(f"the metrics of step {record['step']} to the metric logger", record["step"],
                                   err) from err

    def _failed(self, what: str, step: int, err: OSError):
        """Stop writing (a full disk refuses the rest too) and end the backend now, without waiting on a write."""
        jsonl, self._jsonl, self._wandb_charts = self._jsonl, None, False
        try:
            jsonl.close()
        except OSError:
            pass  # its buffered line cannot be written either
        self._abandon_backend()
        return write_failed(what, self._logs.parent, err, step)

    def _abandon_backend(self) -> None:
        """Close the backend, waiting at most :data:`BACKEND_CLOSE_TIMEOUT_S` seconds, then go on without it.

        W&B's ``finish`` waits for its service to write the run out, which on a
        full disk may not end (issue 33 saw 401 s from the failure to the exit);
        the run ends as failed (exit code 74) when it can. A W&B run still
        closing when the process exits is left incomplete on disk, as after a kill.
        """
        backend, self._backend = self._backend, None
        if backend is None:
            return
        wandb = sys.modules.get("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:  # a W&B run: marked failed, as the exit
            close = functools.partial(wandb.finish, exit_code=EXIT_IO_ERROR)
        else:
            close = backend.close
        closer = threading.Thread(target=close, daemon=True, name="metric-logger-close")
        closer.start()
        closer.join(BACKEND_CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """Close the JSONL file and the backend (W&B: after logging the combined loss charts).

        Raises:
            OutputWriteError: a closing write failed (the disk is full); the
                message says that training finished and names the newest checkpoint.
        """
        what = f"'{self._path}'"
        try:
            if self._jsonl is not None:
                jsonl, self._jsonl = self._jsonl, None
                jsonl.close()
            what = "the loss charts to the metric logger"
            if self._wandb_charts:
                self._wandb_charts = False
                with open(self._path) as f:
                    log_wandb_loss_charts(json.loads(line) for line in f if line.strip())
            what = "the metric logger's last records"
            if self._backend is not None:
                backend, self._backend = self._backend, None
                backend.close()
        except OSError as err:
            self._abandon_backend()
            raise write_failed(what, self._logs.parent, err, finished=True) from err


def _end_wandb_service() -> None:
    """After a failed ``wandb.init``: end W&B's service process now, whose closing lines ("Find logs at")
    would otherwise be printed at exit, after the error line that says what to do."""
    import wandb

    try:
        wandb.teardown()
    except Exception:  # the error line matters more than W&B's bookkeeping
        pass


def build_metric_logger(cfg: DictConfig, rank: int, resume: bool = False) -> MetricLogger:
    """Metric logger for a recipe config: ``cfg.metric_logger`` plus the JSONL file.

    The JSONL file is ``<cfg.output_dir>/logs/metrics.jsonl``. The backend is
    instantiated only on rank 0 (so only one W&B run exists per job); a null
    ``metric_logger`` means JSONL only. For W&B, the run id is kept in
    ``<output_dir>/logs/wandb_run_id`` and a resumed training run continues
    the same W&B run (``resume="allow"``).

    Under torchrun every rank calls it (a collective): when rank 0's W&B run
    cannot start, every rank raises, so none goes on to train alone.

    Raises:
        ConfigError: (key ``metric_logger``) the W&B logger could not start
            its run, e.g. ``mode=online`` without an API key.
    """
    backend, is_wandb, failure = None, False, None
    logs = Path(cfg.output_dir) / "logs"
    if rank == 0 and enabled(cfg.get("metric_logger")) is not None:
        kwargs = {}
        is_wandb = str(cfg.metric_logger._component_).endswith("WandBLogger")
        id_file = logs / "wandb_run_id"
        if is_wandb and resume and id_file.is_file():
            kwargs = {"id": id_file.read_text().strip(), "resume": "allow"}
        try:
            backend = tt_config.instantiate(cfg.metric_logger, **kwargs)
        except Exception as err:
            if not is_wandb:
                raise
            # wandb.init's own refusals (no API key for mode=online, a server that cannot be reached):
            # the setup is rolled back, nothing written is lost
            reason = " ".join(str(err).split()) or type(err).__name__
            _end_wandb_service()
            failure = ConfigError("metric_logger", f"W&B could not start a run ({type(err).__name__}: {reason}); "
                                  f"metric_logger.mode=offline logs without an account or network "
                                  f"(upload later with 'wandb sync'), metric_logger=null logs to "
                                  f"logs/metrics.jsonl only")
        if backend is not None and is_wandb:
            import wandb

            if wandb.run is not None:
                logs.mkdir(parents=True, exist_ok=True)
                id_file.write_text(wandb.run.id)
                define_wandb_axes()
    if ranks.several_processes():
        # Only rank 0 starts the logger: the other ranks must not go on to train and wait for it
        said = [None if failure is None else str(failure)]
        dist.broadcast_object_list(said, src=0)
        if failure is None and said[0] is not None:
            failure = ConfigError("metric_logger", "W&B could not start a run on rank 0 (rank 0 says why)")
    if failure is not None:
        raise failure
    return MetricLogger(logs / "metrics.jsonl", backend, rank, wandb_charts=backend is not None and is_wandb,
                        resume=resume)


class StepReporter:
    """Times each optimizer step, logs its record and drives the progress bar.

    Args:
        logger: the run's :class:`MetricLogger` (it knows rank zero).
        device: the training device (CUDA is synchronized for timing and
            its peak memory is tracked per step).
        total_steps (int): optimizer steps of the whole run, for the bar.
        initial_step (int): steps already done (resume).
        log_every_n_steps (int): log every n-th step's record.
        dp_world_size (int): data-parallel ranks; the bar shows on rank 0 only.
        model: the training model, for the FLOP count (None: no FLOP metrics).
        dtype: the compute dtype, for the peak.
        peak_tflops_per_device (float, optional): the config's peak; None: see
            :func:`torchtune_ext.flops.peak_tflops_per_device` (measured on
            rank 0 only; an unknown GPU means no ``mfu``, with one warning).
        log_peak_memory (bool): the ``log_peak_memory_stats`` key.
        profiler: started here, stepped after every optimizer step and stopped
            by :meth:`close` (``torchtune_ext.runtime.build_profiler``); None: no profiler.
    """

    def __init__(self, logger: MetricLogger, device: torch.device, *, total_steps: int, initial_step: int = 0,
                 log_every_n_steps: int = 1, dp_world_size: int = 1, rank: int = 0,
                 model: Optional[torch.nn.Module] = None, dtype: Optional[torch.dtype] = None,
                 peak_tflops_per_device: Optional[float] = None, log_peak_memory: bool = True,
                 profiler: Optional[Any] = None):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._logger, self._device = logger, device
        self._log_every, self._dp_world_size = log_every_n_steps, dp_world_size
        self._log_peak_memory, self._profiler = log_peak_memory, profiler
        if profiler is not None:
            profiler.start()
        self._timer = StepTimer(device)
        self._flops = ModelFlops.from_model(model) if model is not None else None
        self._peak = None
        if self._flops is not None and rank == 0:
            self._peak, source = flops_lib.peak_tflops_per_device(device, dtype or torch.float32,
                                                                  peak_tflops_per_device)
            if self._peak is not None:
                log.info("MFU against %.3g TFLOP/s per device (%s).", self._peak, source)
        self._bar = tqdm(total=total_steps, initial=initial_step, dynamic_ncols=True, disable=rank != 0)
        self._last: Optional[Dict[str, Any]] = None
        # Log lines during training (the memory guard's, checkpoint saves) would otherwise land on the
        # bar's line: tqdm's redirect writes the console handlers' lines above the bar until close().
        self._console = contextlib.ExitStack()
        if rank == 0:
            self._console.enter_context(logging_redirect_tqdm(loggers=[log]))

    def start_step(self) -> None:
        reset_peak_memory(self._device)
        self._timer.start()

    def end_step(self, result: StepResult, *, step: int, epoch: int, lr: float, skipped_steps: int,
                 tokens_seen: int = 0, data: Optional[Any] = None) -> Dict[str, Any]:
        """Build the step's record (see :func:`step_record`), log it if due, advance the bar."""
        record = step_record(result, step=step, epoch=epoch, lr=lr, step_seconds=self._timer.stop(),
                             device=self._device, dp_world_size=self._dp_world_size, skipped_steps=skipped_steps,
                             tokens_seen=tokens_seen, data=data, flops=self._flops, peak_tflops=self._peak,
                             log_peak_memory=self._log_peak_memory)
        if self._profiler is not None:
            self._profiler.step()
        if step % self._log_every == 0:
            self._logger.log(record)
        self._bar.update(1)
        self._bar.set_description(progress_description(record))
        self._last = record
        return record

    def close(self) -> None:
        """Close the bar (and the profiler); log the last step's line (rank 0), ``lr`` in 3 significant figures.

        W&B's console run summary rounds every float to 5 decimals (a learning rate
        of 2.9e-06 shows as 0.0); the value logged, in W&B and ``metrics.jsonl``, is
        the optimizer's own.
        """
        shown = not self._bar.disable  # rank 0 (tqdm's close sets disable)
        self._bar.close()
        self._console.close()
        if self._profiler is not None:
            self._profiler.stop()
        if self._last is not None and shown:
            log.info(last_step_line(self._last))


def last_step_line(record: Mapping[str, Any]) -> str:
    """``Last optimizer step 12: loss 1.2346, lr 2.9e-06, grad_norm 0.531, 1,234 tokens/s`` (what is in the record)."""
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.3g}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3g}")
    parts.append(f"{record['tokens_per_second']:,.0f} tokens/s")
    skipped = " (skipped)" if record.get("loss") is None else ""
    return f"Last optimizer step {record['step']}{skipped}: {', '.join(parts)}"


def progress_description(record: Mapping[str, Any]) -> str:
    """Short text for the progress bar: step, loss, tokens/sec, and the shares of the step spent waiting
    for its data and (several ranks) for the other ranks."""
    loss = record.get("loss")
    loss_text = f"{loss:.4f}" if loss is not None else "skipped"
    text = f"step {record['step']} | loss {loss_text} | {record['tokens_per_second']:.0f} tok/s"
    if "data_wait_fraction" in record:  # what the step waited for, besides computing
        text += f" | waiting: data {record['data_wait_fraction']:.0%}"
        if record.get("dp_world_size", 1) > 1:
            text += f", ranks {record['rank_wait_fraction']:.0%}"
    return text


__all__ = [
    "MetricLogger",
    "StepTimer",
    "build_metric_logger",
    "define_wandb_axes",
    "last_step_line",
    "log_wandb_loss_charts",
    "loss_curves",
    "lifetime_peak_rss_bytes",
    "peak_memory_gib",
    "progress_description",
    "reset_peak_memory",
    "step_record",
]

