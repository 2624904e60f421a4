"""Pure functions of the benchmark: log parsing, per-step numbers, statistics, FLOPs, tables.

Nothing here runs a model or a process; ``tests/test_bench.py`` covers it.
"""

import math
import re
import statistics
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from torchtune_ext.run.metrics import flops

GIB = 1024**3

# --------------------------------------------------------------------------- logs

_DISK_LOG_LINE = re.compile(r"^Step (\d+) \| (.*)$")


def parse_disk_log(text: str) -> List[Dict[str, Any]]:
    """Parse the file of torchtune 0.6.1's ``DiskLogger``.

    ``DiskLogger.log_dict`` writes one line per call,
    ``Step <n> | name:value name:value ... `` (a space after every pair).
    Values are floats (tensors are written by ``str``, e.g. ``tensor(7.9)``,
    which is unwrapped); anything else is kept as text.

    Returns:
        one dict per line, in file order, with ``step`` (int) and the logged names.
    """
    records = []
    for line in text.splitlines():
        match = _DISK_LOG_LINE.match(line.strip())
        if not match:
            continue
        record: Dict[str, Any] = {"step": int(match.group(1))}
        for pair in match.group(2).split():
            name, sep, value = pair.partition(":")
            if not sep:
                continue
            record[name] = _number(value)
        records.append(record)
    return records


def _number(value: str) -> Any:
    inner = re.fullmatch(r"tensor\((.*?)(?:,.*)?\)", value)
    if inner:
        value = inner.group(1)
    try:
        return float(value)
    except ValueError:
        return value


def last_record_per_step(records: Iterable[Mapping[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """``{step: record}``, keeping the last record of a step (a resumed run repeats steps)."""
    return {int(r["step"]): dict(r) for r in records if "step" in r}


# ------------------------------------------------------------------- probe data

def step_periods(step_end_times: Sequence[float]) -> Dict[int, float]:
    """Step time of steps 2..n: the wall time between consecutive step ends (1-based steps).

    Step 1 has no previous end; it is the warm-up step anyway.
    """
    return {i + 1: step_end_times[i] - step_end_times[i - 1] for i in range(1, len(step_end_times))}


def micro_batches_of_step(rank_batches: Sequence[Mapping[str, Any]], ga: int, k: int) -> List[Mapping[str, Any]]:
    """One rank's micro-batches of optimizer step ``k`` (0-based), in order.

    Probes record ``step_index``, the step the micro-batch trains in (for the
    recipes, the optimizer steps finished when it was collated; for the HF
    Trainer, whose loader fetches ahead, its position // ``ga``): a token budget can make a step's micro-batch
    count differ from ``ga``. Records without it (older probes) are taken
    ``ga`` at a time. Extra micro-batches fetched after the last step are ignored.

    Raises:
        ValueError: records without ``step_index`` and fewer than ``ga`` left for step ``k``.
    """
    if rank_batches and all("step_index" in mb for mb in rank_batches):
        return [mb for mb in rank_batches if mb["step_index"] == k]
    window = list(rank_batches[k * ga:(k + 1) * ga])
    if len(window) != ga:
        raise ValueError(f"step {k + 1}: rank has {len(window)} of {ga} micro-batches")
    return window


def tokens_per_step(
    micro_batches_per_rank: Sequence[Sequence[Mapping[str, int]]], ga: int, num_steps: int
) -> List[Dict[str, int]]:
    """Sum each optimizer step's micro-batch token counts over its micro-batches and all ranks.

    Every rank collates its micro-batches in order; a step's micro-batches are
    those of :func:`micro_batches_of_step`.

    Returns:
        ``num_steps`` dicts with the summed ``non_padding_tokens``,
        ``trainable_tokens`` (after the shift) and ``trainable_tokens_pre_shift``.

    Raises:
        ValueError: a rank has no micro-batch recorded for a step.
    """
    keys = ("non_padding_tokens", "trainable_tokens", "trainable_tokens_pre_shift")
    steps = []
    for k in range(num_steps):
        total = dict.fromkeys(keys, 0)
        for rank_batches in micro_batches_per_rank:
            window = micro_batches_of_step(rank_batches, ga, k)
            if not window:
                raise ValueError(f"step {k + 1}: rank has no micro-batch")
            for mb in window:
                for key in keys:
                    total[key] += int(mb[key])
        steps.append(total)
    return steps


# ------------------------------------------------------------------ statistics

def summarize(values: Sequence[float]) -> Dict[str, Optional[float]]:
    """Median and spread of repeated measurements.

    Returns:
        ``median``, ``min``, ``max``, ``n`` and ``spread`` = (max - min) / median
        (relative range; 0 for one value, None for none).
    """
    values = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"median": None, "min": None, "max": None, "spread": None, "n": 0}
    median = statistics.median(values)
    spread = (max(values) - min(values)) / median if median else None
    return {"median": median, "min": min(values), "max": max(values), "spread": spread, "n": len(values)}


def run_throughput(steps: Sequence[Mapping[str, float]], skip_steps: int) -> Dict[str, Optional[float]]:
    """Mean step time and tokens/sec of one run over its measured steps.

    Args:
        steps: per-step dicts with ``step`` (1-based), ``period`` (seconds,
            None for step 1), ``non_padding_tokens`` and ``trainable_tokens``.
        skip_steps: the first ``skip_steps`` steps are excluded.

    Returns:
        ``step_seconds`` (mean period), ``tokens_per_second`` (non-padding
        tokens / time) and ``trainable_tokens_per_second`` over the measured
        steps, and ``measured_steps``. Totals over steps, so a long step weighs
        by its length, as in a real run.
    """
    measured = [s for s in steps if s["step"] > skip_steps and s.get("period") is not None]
    if not measured:
        return {"step_seconds": None, "tokens_per_second": None, "trainable_tokens_per_second": None,
                "measured_steps": 0}
    seconds = sum(s["period"] for s in measured)
    return {
        "step_seconds": seconds / len(measured),
        "tokens_per_second": sum(s["non_padding_tokens"] for s in measured) / seconds,
        "trainable_tokens_per_second": sum(s["trainable_tokens"] for s in measured) / seconds,
        "measured_steps": len(measured),
    }


def step_throughputs(steps: Sequence[Mapping[str, float]], skip_steps: int) -> List[float]:
    """Non-padding tokens/sec of each measured step (``non_padding_tokens / period``), in step order.

    Args: as :func:`run_throughput`.
    """
    return [s["non_padding_tokens"] / s["period"] for s in steps
            if s["step"] > skip_steps and s.get("period") and s["period"] > 0]


def best_of_repeats_throughput(runs_steps: Sequence[Sequence[Mapping[str, float]]],
                               skip_steps: int) -> Optional[float]:
    """Non-padding tokens/sec from each measured step's shortest time over the repeats.

    Every repeat of a case trains on the same samples per step (same seed), so
    a step's work is the same in each; what a busy host adds (CPU steal, other
    processes) only ever lengthens a step. The minimum over repeats is then the
    estimate least disturbed by it; the median per run (:func:`run_throughput`)
    keeps the disturbance of the typical run.

    Args:
        runs_steps: per repeat, its step dicts as :func:`run_throughput` takes them.
        skip_steps: the first ``skip_steps`` steps are excluded.

    Returns:
        tokens of the measured steps / sum over them of the shortest period;
        None if no step was measured.
    """
    best: Dict[int, float] = {}
    tokens: Dict[int, float] = {}
    for steps in runs_steps:
        for s in steps:
            if s["step"] <= skip_steps or s.get("period") is None:
                continue
            k = int(s["step"])
            best[k] = min(best.get(k, math.inf), float(s["period"]))
            tokens[k] = float(s["non_padding_tokens"])
    seconds = sum(best.values())
    return sum(tokens.values()) / seconds if seconds else None


def max_relative_difference(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Optional[float]:
    """Largest ``|a_i - b_i| / |b_i|`` over pairs where both are numbers (None if there are none)."""
    diffs = [abs(x - y) / abs(y) if y else abs(x - y) for x, y in zip(a, b) if x is not None and y is not None]
    return max(diffs) if diffs else None


def foreign_cpu_cores(busy_seconds: float, own_cpu_seconds: float, wall_seconds: float) -> float:
    """CPU used by other processes during a run, in cores.

    Args:
        busy_seconds: machine-wide non-idle CPU time during the run (``/proc/stat``).
        own_cpu_seconds: user + system time of the run's own processes.
        wall_seconds: duration of the run.
    """
    if wall_seconds <= 0:
        return 0.0
    return max(busy_seconds - own_cpu_seconds, 0.0) / wall_seconds


# ---------------------------------------------------------------------- FLOPs

# The count the recipes log as tflops_per_device / mfu: one formula for both.
flops_per_token = flops.flops_per_token

def mfu(tokens_per_second: Optional[float], flops_per_tok: float, peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization: achieved model FLOPs per second over the measured peak."""
    if not tokens_per_second or not peak_flops:
        return None
    return tokens_per_second * flops_per_tok / peak_flops


def matmul_flops(n: int) -> float:
    """FLOPs of one ``n x n`` by ``n x n`` matrix product (multiply-add = 2)."""
    return 2.0 * n**3


# --------------------------------------------------------------------- tables

def fmt(value: Optional[float], spec: str = ".3g") -> str:
    """Format a number for a table; ``—`` for missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec)


def fmt_median_spread(stats: Mapping[str, Optional[float]], spec: str = ".3g") -> str:
    """``median ±spread%`` (spread = relative range of the repeats)."""
    if stats.get("median") is None:
        return "—"
    text = format(stats["median"], spec)
    if stats.get("spread") is not None and stats.get("n", 0) > 1:
        text += f" ±{100 * stats['spread'] / 2:.0f}%"
    return text


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> str:
    """A GitHub markdown table; ``align`` is one of ``l``/``r`` per column (default: first left, rest right)."""
    align = align or ("l" + "r" * (len(header) - 1))
    marks = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
