"""The one record every optimizer step logs, and the lines drawn from it (progress bar, last step)."""

from typing import Any, Dict, Mapping, Optional

import torch

from torchtune_ext.run.metrics.flops import ModelFlops
from torchtune_ext.run.metrics.peak_memory import peak_memory_gib
from torchtune_ext.train.step import StepResult, waiting_shares


def step_record(
    result: StepResult,
    *,
    step: int,
    epoch: int,
    lr: float,
    step_seconds: float,
    device: torch.device,
    dp_world_size: int = 1,
    tp_world_size: int = 1,
    skipped_steps: int = 0,
    tokens_seen: int = 0,
    data: Optional[Any] = None,
    flops: Optional[ModelFlops] = None,
    peak_tflops: Optional[float] = None,
    log_peak_memory: bool = True,
    distributed: bool = False,
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
    for a preference step (``result.unit == "pairs"``) ``num_pairs`` and ``pairs_per_second``, its
    ``loss`` and metrics being means over the pairs and ``num_tokens`` the non-padding tokens of both responses,
    ``peak_memory_gib`` (see :func:`peak_memory_gib`; left out with
    ``log_peak_memory=False``), ``skipped_steps``
    (cumulative), ``tokens_seen`` (cumulative ``num_tokens`` of the steps that
    updated the model: an x axis comparable across batch sizes),
    ``once_per_step`` (1: the step's gradient came from one backward, 0: from
    one per micro-batch; absent when no backward ran), ``data_seconds``,
    ``data_wait_fraction`` and ``rank_wait_fraction`` (the shares of the
    step's wall time, data loading included, spent loading its samples and
    waiting for the other ranks: :func:`torchtune_ext.train.step.waiting_shares`), and with
    ``distributed`` (a distributed recipe's run, 1 rank included) or ``dp_world_size > 1`` also
    ``dp_world_size`` and ``tokens_per_second_per_device``
    (over all ``dp_world_size x tp_world_size`` devices); with ``tp_world_size > 1``
    (tensor parallelism) also ``tp_world_size``.

    With ``data`` (this rank's
    :class:`torchtune_ext.data.step_loader.StepData`): ``padding_fraction`` (positions
    computed that are padding, stand-ins included, over all positions
    computed), and with ``flops`` (:class:`torchtune_ext.run.metrics.flops.ModelFlops`)
    ``tflops_per_device`` (model FLOPs of every position computed, padding
    included, per second of this step; :mod:`torchtune_ext.run.metrics.flops`) and
    ``useful_tflops_per_device`` (the same for the non-padding tokens only),
    and with ``peak_tflops`` their ratios to it, ``mfu`` and ``useful_mfu``.
    Per-device numbers are this rank's (rank 0 logs; the data plan balances
    the ranks); under tensor parallelism each device of a group computes
    1/``tp_world_size`` of the FLOPs of the group's samples.
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
    if result.unit == "pairs":  # a preference step: its loss and metrics are means over these pairs
        record.update(num_pairs=result.num_pairs,
                      pairs_per_second=result.num_pairs / step_seconds if step_seconds > 0 else 0.0)
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
            record["tflops_per_device"] = computed / tp_world_size / step_seconds / 1e12
            record["useful_tflops_per_device"] = useful / tp_world_size / step_seconds / 1e12
            if peak_tflops:
                record["mfu"] = record["tflops_per_device"] / peak_tflops
                record["useful_mfu"] = record["useful_tflops_per_device"] / peak_tflops
    # every record of a distributed recipe has them, 1 rank included: a run resumed 2 ranks -> 1 keeps its keys
    if distributed or dp_world_size * tp_world_size > 1:
        record["dp_world_size"] = dp_world_size
        record["tokens_per_second_per_device"] = record["tokens_per_second"] / (dp_world_size * tp_world_size)
    if tp_world_size > 1:
        record["tp_world_size"] = tp_world_size
    return record


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
