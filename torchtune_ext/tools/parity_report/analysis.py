"""Compare each case's metrics with the reference case and write ``report.md``.

The comparison is per optimizer step: for loss and grad_norm,

    max over steps s of |x_case(s) - x_ref(s)| / |x_ref(s)|

(the absolute difference where the reference value is 0). An exact case passes
when both are at most the tolerance, it ran the same steps as the reference,
and each step saw the same number of trainable tokens (otherwise the cases did
not train on the same data and the comparison means nothing). The control case
is never failed: its deviation is reported.
"""

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from torchtune_ext.tools.parity_report.cases import Case

# Default tolerances, max relative difference per step. fp32: what the exact
# accounting achieves with a different summation order (README: <= 1e-5).
# bf16 keeps 8 significant bits (relative rounding 2**-8 ~ 4e-3) in weights,
# activations and every matmul; a different split changes the summation order,
# and differences grow over steps, so 2e-2 is "the same training" there (the
# tiny test model in bf16 on CPU: exact cases up to 5e-3 in grad_norm over 5
# steps, the control 2e-1).
DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}

PASS, FAIL, REFERENCE, CONTROL, RUN_FAILED = "PASS", "FAIL", "reference", "control", "run failed"

Metrics = List[Dict[str, Any]]


def read_metrics(path: Path) -> Metrics:
    """Rows of a recipe's ``metrics.jsonl`` (one dict per optimizer step); [] if absent."""
    if not path.is_file():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def max_relative_difference(values: Sequence[Optional[float]], reference: Sequence[Optional[float]]) -> Optional[float]:
    """``max_s |v_s - r_s| / |r_s|`` over steps where both are present (absolute where ``r_s == 0``).

    Returns:
        float, ``inf`` if lengths differ or a value is non-finite, None if no
        step has both values.
    """
    if len(values) != len(reference):
        return math.inf
    worst: Optional[float] = None
    for v, r in zip(values, reference):
        if v is None or r is None:
            continue
        diff = abs(v - r) / abs(r) if r != 0 else abs(v - r)
        if not math.isfinite(diff):
            diff = math.inf
        worst = diff if worst is None else max(worst, diff)
    return worst


@dataclass
class CaseResult:
    """One row of the report.

    Attributes:
        case (Case): what ran.
        status (str): ``reference``, ``PASS``, ``FAIL``, ``control`` or ``run failed``.
        loss_diff, grad_norm_diff (float | None): max relative difference per
            step against the reference (None for the reference itself).
        final_loss (float | None): loss of the last step (nats per trainable token).
        median_tokens_per_second (float | None): median over steps of trainable
            (non-padding, unmasked) label tokens per second.
        peak_memory_gib (float | None): max over steps of the recipe's
            ``peak_memory_gib`` (rank 0).
        seconds (float | None): wall time of the whole run, start-up included.
        reasons (list of str): why a case failed, or notes.
    """

    case: Case
    status: str
    loss_diff: Optional[float] = None
    grad_norm_diff: Optional[float] = None
    final_loss: Optional[float] = None
    median_tokens_per_second: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    seconds: Optional[float] = None
    reasons: List[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """True if this row makes the report fail (the control never does)."""
        return self.status in (FAIL, RUN_FAILED)


def _column(rows: Metrics, key: str) -> List[Optional[float]]:
    return [r.get(key) for r in rows]


def _summary(rows: Metrics) -> Dict[str, Optional[float]]:
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    speeds = [r["tokens_per_second"] for r in rows if r.get("tokens_per_second") is not None]
    memory = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    return {
        "final_loss": losses[-1] if losses else None,
        "median_tokens_per_second": statistics.median(speeds) if speeds else None,
        "peak_memory_gib": max(memory) if memory else None,
    }


def compare(
    cases: Sequence[Case],
    metrics: Dict[str, Metrics],
    tolerance: float,
    seconds: Optional[Dict[str, float]] = None,
    failed_runs: Sequence[str] = (),
) -> List[CaseResult]:
    """Compare every case with the first one, the reference.

    Args:
        cases: from :func:`.cases.plan_cases`; ``cases[0]`` is the reference.
        metrics: case name -> its metrics rows.
        tolerance: max relative difference per step an exact case may have.
        seconds: case name -> run wall time.
        failed_runs: names of cases whose subprocess exited non-zero.

    Returns:
        one :class:`CaseResult` per case, in order. If the reference itself
        failed to run, every other case is ``FAIL`` (nothing to compare with).
    """
    seconds = seconds or {}
    reference = cases[0]
    ref_rows = metrics.get(reference.name, [])
    ref_ok = reference.name not in failed_runs and bool(ref_rows)
    results = []
    for case in cases:
        rows = metrics.get(case.name, [])
        result = CaseResult(case, PASS, seconds=seconds.get(case.name), **_summary(rows))
        results.append(result)
        if case.name in failed_runs or not rows:
            result.status = RUN_FAILED
            if case.name in failed_runs:
                result.reasons.append("the run exited with an error (see its run.log)")
            else:
                result.reasons.append("no metrics logged" if case.name in metrics else "not run")
            continue
        if case is reference:
            result.status = REFERENCE
            continue
        if not ref_ok:
            result.status = FAIL
            result.reasons.append("the reference case did not run")
            continue
        result.loss_diff = max_relative_difference(_column(rows, "loss"), _column(ref_rows, "loss"))
        result.grad_norm_diff = max_relative_difference(_column(rows, "grad_norm"), _column(ref_rows, "grad_norm"))
        if _column(rows, "step") != _column(ref_rows, "step"):
            result.reasons.append(
                f"ran steps {_column(rows, 'step')}, the reference {_column(ref_rows, 'step')}"
            )
        elif _column(rows, "num_tokens") != _column(ref_rows, "num_tokens"):
            result.reasons.append(
                "trainable tokens per step differ from the reference "
                f"({_column(rows, 'num_tokens')} vs {_column(ref_rows, 'num_tokens')}): not the same data"
            )
        for name, diff in (("loss", result.loss_diff), ("grad_norm", result.grad_norm_diff)):
            if diff is None or diff > tolerance:
                result.reasons.append(f"{name} differs by {format_diff(diff)} > tolerance {tolerance:g}")
        if case.control:
            result.status = CONTROL
        elif result.reasons:
            result.status = FAIL
    return results


def format_diff(value: Optional[float]) -> str:
    """A relative difference as the report prints it: ``0``, ``2.7e-07``, ``inf`` or ``n/a``."""
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "inf"
    return "0" if value == 0 else f"{value:.1e}"


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _status_text(result: CaseResult, tolerance: float) -> str:
    if result.status == CONTROL:
        worst = max((d for d in (result.loss_diff, result.grad_norm_diff) if d is not None), default=None)
        if worst is not None and worst > tolerance:
            return "off, as expected (control)"
        return "control: NOT off (see notes)"
    return f"**{result.status}**" if result.failed else result.status


def render_markdown(
    results: Sequence[CaseResult],
    *,
    tolerance: float,
    title_lines: Sequence[str],
    images: Sequence[str] = (),
) -> str:
    """``report.md``: a summary line, the table (one row per case), notes and images.

    Args:
        results: from :func:`compare`.
        tolerance: the tolerance that was applied.
        title_lines: lines describing the experiment (recipe, config, N, steps...).
        images: file names of plots to embed, relative to the report.
    """
    reference = results[0].case.name
    exact = [r for r in results[1:] if not r.case.control]
    failed = [r for r in results if r.failed]
    verdict = "FAIL" if failed else "PASS"
    lines = ["# Gradient-accumulation parity report", "", *title_lines, ""]
    if failed:
        names = ", ".join(r.case.name for r in failed)
        lines.append(f"**Result: {verdict}** -- {len(failed)} case(s) failed: {names}.")
    else:
        lines.append(
            f"**Result: {verdict}** -- all {len(exact)} exact case(s) match `{reference}` "
            f"within {tolerance:g} (max relative difference per step, loss and grad_norm)."
        )
    for r in results:
        if r.case.control and r.loss_diff is not None:
            lines.append(
                f"The control (`{r.case.name}`) is off by {format_diff(r.loss_diff)} in loss and "
                f"{format_diff(r.grad_norm_diff)} in grad_norm."
            )
    lines += [
        "",
        "| case | micro-batch × accum. × ranks | backward | max rel. Δ loss | max rel. Δ grad_norm "
        "| final loss | median tokens/s | peak memory (GiB) | run time (s) | result |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        ref = r.status == REFERENCE
        lines.append(
            f"| `{r.case.name}` | {r.case.split} | {r.case.backward} "
            f"| {'—' if ref else format_diff(r.loss_diff)} | {'—' if ref else format_diff(r.grad_norm_diff)} "
            f"| {_fmt(r.final_loss, '.4f')} | {_fmt(r.median_tokens_per_second, '.0f')} "
            f"| {_fmt(r.peak_memory_gib, '.2f')} | {_fmt(r.seconds, '.0f')} | {_status_text(r, tolerance)} |"
        )
    notes = [f"- `{r.case.name}`: {'; '.join(r.reasons)}" for r in results if r.reasons and not r.case.control]
    control = [r for r in results if r.case.control and r.status == CONTROL]
    for r in control:
        if not any(d is not None and d > tolerance for d in (r.loss_diff, r.grad_norm_diff)):
            notes.append(
                f"- `{r.case.name}` matches the reference: every micro-batch of every step has the same "
                "number of trainable tokens, so the inexact normalization happens to be exact on this data."
            )
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += [
        "",
        "Columns: Δ is max over steps of |case − reference| / |reference|; loss in nats per trainable "
        "token; tokens/s counts trainable label tokens only (no padding, no masked prompt), median over "
        "steps; peak memory is the max over steps (CPU: process peak RSS of rank 0; CUDA: max allocated); "
        "run time includes start-up. The control normalizes each micro-batch by its own token count and "
        "divides by the number of micro-batches; it is expected to be off and is not failed on.",
    ]
    if images:
        lines += ["", *[f"![{Path(name).stem}]({name})" for name in images]]
    return "\n".join(lines) + "\n"


def summary_dict(results: Sequence[CaseResult], tolerance: float) -> Dict[str, Any]:
    """Machine-readable summary (written as ``summary.json``)."""
    return {
        "tolerance": tolerance,
        "passed": not any(r.failed for r in results),
        "cases": [{**asdict(r), "case": asdict(r.case)} for r in results],
    }
