"""Per step: time it, log its record, draw the progress bar; the run's last line at the end."""

import contextlib
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torchtune import utils

from torchtune_ext import ranks
from torchtune_ext.run.metrics import flops as flops_lib
from torchtune_ext.run.metrics.flops import ModelFlops
from torchtune_ext.run.metrics.logger import MetricLogger
from torchtune_ext.run.metrics.peak_memory import reset_peak_memory
from torchtune_ext.run.metrics.record import last_step_line, progress_description, step_record
from torchtune_ext.run.metrics.timer import StepTimer
from torchtune_ext.train.step import StepResult

log = utils.get_logger("INFO")  # torchtune's: the recipes show its INFO lines


def largest_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of every rank (a collective: every rank calls it); a tensor on ``device`` (NCCL)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


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
        tp_world_size (int): ranks per tensor-parallel group (per-device numbers, :func:`step_record`).
        model: the training model, for the FLOP count (None: no FLOP metrics).
        dtype: the compute dtype, for the peak.
        peak_tflops_per_device (float, optional): the config's peak; None: see
            :func:`torchtune_ext.run.metrics.flops.peak_tflops_per_device` (measured on
            rank 0 only; an unknown GPU means no ``mfu``, with one warning).
        log_peak_memory (bool): the ``log_peak_memory_stats`` key.
        distributed (bool): a distributed recipe's run: its records have the
            distributed keys at any world size (:func:`step_record`).
        profiler: started here, stepped after every optimizer step and stopped
            by :meth:`close` (``torchtune_ext.run.diagnostics.build_profiler``); None: no profiler.
    """

    def __init__(self, logger: MetricLogger, device: torch.device, *, total_steps: int, initial_step: int = 0,
                 log_every_n_steps: int = 1, dp_world_size: int = 1, tp_world_size: int = 1, rank: int = 0,
                 model: Optional[torch.nn.Module] = None, dtype: Optional[torch.dtype] = None,
                 peak_tflops_per_device: Optional[float] = None, log_peak_memory: bool = True,
                 profiler: Optional[Any] = None, distributed: bool = False):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._logger, self._device = logger, device
        self._log_every, self._dp_world_size, self._tp_world_size = log_every_n_steps, dp_world_size, tp_world_size
        self._log_peak_memory, self._profiler, self._distributed = log_peak_memory, profiler, distributed
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
                             device=self._device, dp_world_size=self._dp_world_size,
                             tp_world_size=self._tp_world_size, skipped_steps=skipped_steps,
                             tokens_seen=tokens_seen, data=data, flops=self._flops, peak_tflops=self._peak,
                             log_peak_memory=self._log_peak_memory, distributed=self._distributed)
        if "peak_memory_gib" in record and ranks.several_processes():
            # the largest rank's, as tokens_per_second counts every rank's tokens (rank 0 logs)
            record["peak_memory_gib"] = largest_over_ranks(record["peak_memory_gib"], self._device)
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
