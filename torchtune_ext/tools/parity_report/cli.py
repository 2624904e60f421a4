"""Command line of the parity report (``tune-parity-report`` / ``python -m torchtune_ext.parity_report``).

    python -m torchtune_ext.parity_report \\
        --recipe recipes/full_finetune_single_device.py \\
        --config configs/smollm2/135M_full_single_device.yaml \\
        --global-batch-size 4 --steps 5 [--nproc 4] [--output-dir DIR] [key=value ...]

Runs every case of :mod:`.cases` through the real recipe, one subprocess each,
from the current directory, then writes into ``--output-dir``:

* ``report.md`` -- one row per case: max relative difference of per-step loss
  and grad_norm against the reference, final loss, median tokens/s, peak
  memory, pass/fail;
* ``loss.png``, ``grad_norm.png`` (curves per step), ``tokens_per_second.png``,
  ``memory.png`` (bars per case), each with a ``.json`` sidecar of its data;
* ``metrics.jsonl`` (every step of every case, with a ``case`` key),
  ``summary.json``, and ``runs/<case>/`` (each run's output folder, its
  ``logs/metrics.jsonl``, W&B run and ``run.log``).

Exit status: 0 every exact case matches the reference within the tolerance;
1 some case deviates; 2 bad arguments; 3 a run failed (the report is still
written).
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from torchtune_ext.tools.parity_report import analysis, plots
from torchtune_ext.tools.parity_report.cases import (
    FALLBACK_SEED,
    Case,
    case_command,
    case_overrides,
    effective_config,
    plan_cases,
    run_case,
    select_cases,
    uses_wandb,
)

DEFAULT_RECIPE = "recipes/full_finetune_single_device.py"
DEFAULT_CONFIG = "configs/smollm2/135M_full_single_device.yaml"
EXIT_DEVIATION, EXIT_USAGE, EXIT_RUN_FAILED = 1, 2, 3

# Keys each case sets itself; a user override of one of them is replaced.
OWNED_KEYS = {
    "batch_size", "gradient_accumulation_steps", "backward", "once_per_step_memory_limit", "epochs",
    "max_steps_per_epoch",
    "output_dir", "seed", "resume_from_checkpoint", "save_final_checkpoint", "save_every_n_steps",
    "log_every_n_steps", "metric_logger.group", "metric_logger.name",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_ext.parity_report",
        description="Run a recipe as batch N, batch 1 x N accumulation steps, batch N/2 x 2 (and N ranks), "
        "in both backward modes, plus an inexact control, and report whether they train the same.",
    )
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="recipe file, as for tune run (default: %(default)s)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="config file (default: %(default)s)")
    parser.add_argument("--global-batch-size", type=int, default=4, metavar="N",
                        help="samples per optimizer step, >= 2 (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per case (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=None, metavar="K",
                        help="also run the distributed recipe on K ranks, batch N/K each")
    parser.add_argument("--distributed-recipe", default=None,
                        help="recipe for --nproc (default: --recipe with 'single_device' -> 'distributed')")
    parser.add_argument("--distributed-config", default=None, help="config for --nproc (default: --config)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/parity_report"),
                        help="report folder (default: %(default)s); its runs/<case>/ folders are replaced")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max relative difference per step for an exact case (default: "
                        + ", ".join(f"{k} {v:g}" for k, v in analysis.DEFAULT_TOLERANCE.items())
                        + ", by the config's dtype)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names to run (default: all); the reference always runs")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for tune run")
    return parser


def resolve_tolerance(tolerance: Optional[float], dtype: str) -> float:
    """``--tolerance`` if given, else the default for the config's ``dtype`` (fp32 1e-5, bf16 2e-2)."""
    if tolerance is not None:
        return tolerance
    return analysis.DEFAULT_TOLERANCE.get(dtype, analysis.DEFAULT_TOLERANCE["fp32"])


def _distributed_recipe(args: argparse.Namespace) -> str:
    return args.distributed_recipe or args.recipe.replace("single_device", "distributed")


def _write_outputs(out: Path, cases: List[Case], metrics: Dict[str, List[dict]],
                   results: List[analysis.CaseResult], tolerance: float, title_lines: List[str]) -> None:
    with open(out / "metrics.jsonl", "w") as f:
        for case in cases:
            for row in metrics.get(case.name, []):
                f.write(json.dumps({"case": case.name, **row}) + "\n")
    (out / "summary.json").write_text(json.dumps(analysis.summary_dict(results, tolerance), indent=1))

    for key, title, unit in (
        ("loss", "Loss per optimizer step", "loss (nats per trainable token)"),
        ("grad_norm", "Gradient norm per optimizer step (before clipping)", "total L2 norm of the gradient"),
    ):
        fig = plots.curve_figure(cases, metrics, key, title=title, ylabel=unit, tolerance=tolerance)
        plots.save(fig, out / f"{key}.png", title=title, unit=unit, series=plots.curve_series(cases, metrics, key))
    by_name = {r.case.name: r for r in results}
    for name, attr, title, unit, fmt in (
        ("tokens_per_second", "median_tokens_per_second", "Throughput: median over steps",
         "trainable tokens per second (no padding, no masked prompt)", ".0f"),
        ("memory", "peak_memory_gib", "Peak memory over the run", "GiB (CPU: peak RSS of rank 0; CUDA: max allocated)",
         ".2f"),
    ):
        values = {c.name: getattr(by_name[c.name], attr) for c in cases}
        fig = plots.bar_figure(cases, values, title=title, xlabel=unit, fmt=fmt)
        plots.save(fig, out / f"{name}.png", title=title, unit=unit,
                   series=[{"label": c.name, "y": values[c.name]} for c in cases])

    images = ["loss.png", "grad_norm.png", "tokens_per_second.png", "memory.png"]
    (out / "report.md").write_text(
        analysis.render_markdown(results, tolerance=tolerance, title_lines=title_lines, images=images)
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Run the report; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)

    def usage_error(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE

    bad = [o for o in args.overrides if "=" not in o and not o.startswith("~")]
    if bad:
        return usage_error(f"overrides must be key=value, got {bad}")
    if args.steps < 1:
        return usage_error(f"--steps must be >= 1, got {args.steps}")
    try:
        cfg = effective_config(args.config, args.overrides)
        cases = select_cases(
            plan_cases(args.global_batch_size, args.nproc), args.cases.split(",") if args.cases else None
        )
    except (ValueError, OSError) as err:
        return usage_error(str(err))
    dist_recipe = _distributed_recipe(args)
    dist_config = args.distributed_config or args.config
    if any(c.nproc > 1 for c in cases):
        for what, path in (("--distributed-recipe", dist_recipe), ("--distributed-config", dist_config)):
            if not Path(path).is_file():
                return usage_error(f"{what} '{path}' not found; pass {what} PATH for --nproc")

    dtype = cfg.get("dtype") or "fp32"
    tolerance = resolve_tolerance(args.tolerance, dtype)
    seed = cfg.get("seed")
    seed = FALLBACK_SEED if seed is None else seed
    group = f"parity-{time.strftime('%Y%m%d-%H%M%S')}" if uses_wandb(cfg) else None
    replaced = sorted({o.split("=")[0] for o in args.overrides} & OWNED_KEYS)
    if replaced:
        print(f"note: the report sets {', '.join(replaced)} itself; your override(s) of them are replaced")

    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    metrics: Dict[str, List[dict]] = {}
    seconds: Dict[str, float] = {}
    failed_runs: List[str] = []
    env = dict(os.environ, WANDB_SILENT="true")
    start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        run_dir = out / "runs" / case.name
        # metrics.jsonl is appended to, so a run folder left from an earlier report would mix old rows in
        shutil.rmtree(run_dir, ignore_errors=True)
        recipe, config = (dist_recipe, dist_config) if case.nproc > 1 else (args.recipe, args.config)
        overrides = [*args.overrides, *case_overrides(case, steps=args.steps, output_dir=run_dir, seed=seed,
                                                      wandb_group=group)]
        print(f"[{i}/{len(cases)}] {case.name}: batch {case.split} ({case.backward})", flush=True)
        result = run_case(case_command(case, recipe, config, overrides), run_dir / "run.log", env)
        seconds[case.name] = result.seconds
        metrics[case.name] = analysis.read_metrics(run_dir / "logs" / "metrics.jsonl")
        if result.returncode != 0:
            failed_runs.append(case.name)
            print(f"    run failed (exit {result.returncode}) after {result.seconds:.0f} s; log {result.log_path}:\n"
                  f"{result.tail()}", flush=True)
            if i == 1:
                # without the reference nothing can be compared; a bad recipe path or
                # config fails every case the same way, so stop here
                print("    the reference failed: skipping the other cases", flush=True)
                break
        else:
            rows = metrics[case.name]
            final = rows[-1].get("loss") if rows else None
            print(f"    done in {result.seconds:.0f} s, {len(rows)} step(s), final loss {final}", flush=True)
    total = time.perf_counter() - start

    results = analysis.compare(cases, metrics, tolerance, seconds, failed_runs)
    shown_overrides = " ".join(args.overrides) or "none"
    title_lines = [
        f"Recipe `{args.recipe}`, config `{args.config}`, overrides: `{shown_overrides}`"
        + (f"; distributed: `{dist_recipe}`, `{dist_config}`" if any(c.nproc > 1 for c in cases) else "") + ".",
        f"Global batch N = {args.global_batch_size} samples per optimizer step, {args.steps} steps per case, "
        f"dtype {dtype}, seed {seed}; tolerance {tolerance:g} (max relative difference per step against "
        f"`{cases[0].name}`).",
        f"{len(cases)} runs in {total:.0f} s on {os.cpu_count()} CPU core(s)"
        + (f"; W&B group `{group}` (runs under `runs/<case>/logs/wandb/`)." if group else "."),
    ]
    _write_outputs(out, cases, metrics, results, tolerance, title_lines)

    print(f"\nreport: {out / 'report.md'}")
    for r in results:
        diff = "" if r.status == analysis.REFERENCE else \
            f" loss Δ {analysis.format_diff(r.loss_diff)}, grad_norm Δ {analysis.format_diff(r.grad_norm_diff)}"
        print(f"  {r.status:>10}  {r.case.name}{diff}")
    if failed_runs:
        return EXIT_RUN_FAILED
    return EXIT_DEVIATION if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
