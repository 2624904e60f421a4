"""Benchmark our recipes against upstream torchtune 0.6.1's, side by side.

    python -m bench                 # the CPU benchmark (about 40 min on an idle 2-core CPU)
    python -m bench --memory        # peak memory vs accumulation steps (about 10 min)
    python -m bench --dist-ga8      # 2 processes at GA 8 (about 10 min)
    python -m bench --quick         # smoke check, under 5 min
    python -m bench --gpu           # one CUDA device, bf16 (see bench/gpu_bench.sh)
    python -m bench --realistic     # batch 8 x GA 4 x 512 tokens, grouping on/off, HF Trainer (about 1 h)
    python -m bench --gpu-realistic # the same batch on one CUDA device, bf16
    python -m bench --hf            # ours on the transformers model vs on torchtune's (about 15 min)
    python -m bench --hf-quick      # its smoke check (about 2 min)

Run from the repository root, with the project installed and its assets
downloaded (``python -m torchtune_ext.download``). See docs/benchmarks.md.

Each case is one recipe on one setting (model kind, processes, gradient
accumulation steps, backward mode). Cases of a group (same setting) run in
alternation, one after the other, in an order that rotates with the repeat;
a round is one repeat of one group. A round during which other processes
used more than ``--busy-threshold`` CPU cores is run again at the end (the
first measurement is kept in the JSON, marked unused), up to ``--max-redo``
rounds. Results: ``<results-dir>/<profile>.json`` (every run, per step) and
``<profile>.md`` (the tables), printed at the end.
"""

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from bench import analysis, probes, report, runner
from bench.cases import PROFILES, RECIPES, UPSTREAM, Case, Group, Profile, command, with_overrides


def _log(message: str) -> None:
    print(message, flush=True)


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="profile", help="smoke check (< 5 min)")
    mode.add_argument("--memory", action="store_const", const="memory", dest="profile",
                      help="peak memory at GA 1 and 8 with fixed-length micro-batches (about 10 min)")
    mode.add_argument("--dist-ga8", action="store_const", const="dist_ga8", dest="profile",
                      help="2 processes, GA 8, full fine-tune, one repeat (about 10 min)")
    mode.add_argument("--gpu", action="store_const", const="gpu", dest="profile",
                      help="one CUDA device, bf16, SmolLM2-135M full fine-tune, GA 1 and 8 (< 10 min)")
    mode.add_argument("--realistic", action="store_const", const="realistic", dest="profile",
                      help="issue 13: batch 8 x GA 4 x 512 tokens, grouping on/off, HF Trainer baseline")
    mode.add_argument("--gpu-realistic", action="store_const", const="gpu_realistic", dest="profile",
                      help="batch 8 x GA 4 x 512 tokens on one CUDA device, bf16, grouping on/off")
    mode.add_argument("--hf", action="store_const", const="hf", dest="profile",
                      help="issue 30: our recipe on the transformers model (configs/hf) vs on torchtune's, "
                           "SmolLM2-135M, same tokens and settings (about 15 min)")
    mode.add_argument("--hf-quick", action="store_const", const="hf_quick", dest="profile",
                      help="the same, batch 1 x GA 2 x 128 tokens, one repeat (about 2 min)")
    parser.add_argument("--repeats", type=int, help="repeats of every case (profile default)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run")
    parser.add_argument("--skip-steps", type=int, help="first steps left out of the statistics")
    parser.add_argument("--batch-size", type=int, help="micro-batch size per process (every group)")
    parser.add_argument("--max-seq-len", type=int, help="tokenizer.max_seq_len (every group)")
    parser.add_argument("--groups", help="comma-separated group names to run (e.g. full_1dev_ga4,full_2proc_ga4)")
    parser.add_argument("--variants", help="comma-separated variants to run in each group (e.g. upstream,ours_once)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the discarded warm-up runs")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/bench"), help="run output folders")
    parser.add_argument("--busy-threshold", type=float, default=0.3,
                        help="CPU cores used by other processes above which a round is redone (default 0.3)")
    parser.add_argument("--max-redo", type=int, default=6, help="rounds redone at most (default 6)")
    parser.add_argument("--run-timeout-s", type=int,
                        help="seconds a run may take before it is stopped (profile default; raise it on a loaded machine)")
    parser.add_argument("--wait-quiet-s", type=float, default=300,
                        help="before each round, wait up to this long for other processes to go quiet")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                        help="rebuild the summary and tables of a finished benchmark from its JSON "
                             "(running the two-process probes if it lacks them); runs no training")
    parser.set_defaults(profile="cpu")
    return parser.parse_args(argv)


def build_profile(args: argparse.Namespace) -> Profile:
    profile = with_overrides(PROFILES[args.profile], repeats=args.repeats, steps=args.steps,
                             skip_steps=args.skip_steps, batch_size=args.batch_size, max_seq_len=args.max_seq_len)
    if args.no_warmup:
        profile = with_overrides(profile, warmup=False)
    if args.run_timeout_s is not None:
        profile = with_overrides(profile, run_timeout_s=args.run_timeout_s)
    # a size given on the command line is for every group, including those that set their own
    if args.batch_size is not None or args.max_seq_len is not None:
        profile = with_overrides(profile, groups=tuple(
            dataclasses.replace(g, batch_size=None if args.batch_size is not None else g.batch_size,
                                max_seq_len=None if args.max_seq_len is not None else g.max_seq_len)
            for g in profile.groups))
    if args.groups:
        wanted = set(args.groups.split(","))
        unknown = wanted - {g.name for g in profile.groups}
        if unknown:
            raise SystemExit(f"unknown group(s) {sorted(unknown)}; this profile has "
                             f"{[g.name for g in profile.groups]}")
        profile = with_overrides(profile, groups=tuple(g for g in profile.groups if g.name in wanted))
    if args.variants:
        wanted = args.variants.split(",")
        known = {v for g in profile.groups for v in g.variants}
        if set(wanted) - known:
            raise SystemExit(f"unknown variant(s) {sorted(set(wanted) - known)}; these groups have {sorted(known)}")
        profile = with_overrides(profile, groups=tuple(
            dataclasses.replace(g, variants=tuple(v for v in g.variants if v in wanted))
            for g in profile.groups if any(v in wanted for v in g.variants)))
    if profile.skip_steps >= profile.steps:
        raise SystemExit("--skip-steps must be smaller than --steps")
    return profile


def rotated(variants, repeat: int):
    """The group's variants, rotated by the repeat index, so no variant always runs first."""
    k = repeat % len(variants)
    return list(variants[k:]) + list(variants[:k])


def run_round(group: Group, repeat: int, profile: Profile, args, tag: str) -> List[Dict[str, Any]]:
    runner.wait_for_quiet(args.busy_threshold, args.wait_quiet_s, _log)
    records = []
    for variant in rotated(group.variants, repeat):
        case = Case(group, variant)
        out = args.work_dir / profile.name / f"{case.name}_{tag}"
        _log(f"  {case.name} [{tag}] ...")
        record = runner.execute(case, profile, out)
        record.update(repeat=repeat, tag=tag, kind=group.kind, nproc=group.nproc, ga=group.ga)
        thr = analysis.run_throughput(record.get("steps", []), profile.skip_steps) if "steps" in record else {}
        _log(f"    {record['wall_seconds']:.0f} s wall, step {analysis.fmt(thr.get('step_seconds'))} s, "
             f"{analysis.fmt(thr.get('tokens_per_second'))} tok/s, other processes "
             f"{record['foreign_cpu']:.2f} cores, steal {record.get('steal_cpu', 0):.2f}, load {record['load_after'][0]:.2f}"
             + (f"  ERROR: {record['error']}" if record.get("error") else ""))
        records.append(record)
    return records


def warmups(profile: Profile, args) -> List[Dict[str, Any]]:
    """One short discarded run per recipe: warms the page cache and compiled kernels' caches."""
    seen, records = set(), []
    for group in profile.groups:
        for variant in group.variants:
            case = Case(group, variant)
            key = (case.impl, case.model_path, group.kind, group.nproc)
            if key in seen:
                continue
            seen.add(key)
            warm = Case(Group(group.kind, group.nproc, 1, group.variants), variant)
            _log(f"  warm-up {warm.name}")
            rec = runner.execute(warm, profile, args.work_dir / profile.name / f"warmup_{warm.name}", steps=2)
            records.append({k: rec.get(k) for k in ("case", "wall_seconds", "returncode", "error", "foreign_cpu")})
            if rec.get("error"):
                raise SystemExit(f"warm-up {warm.name} failed: {rec['error']}")
    return records


def summarize(profile: Profile, runs: List[Dict[str, Any]], counts: Dict[str, Any],
              peak: Dict[str, Any]) -> Dict[str, Any]:
    usable = report.usable_runs(runs)
    cases: Dict[str, Any] = {}
    groups: Dict[str, Any] = {}
    for group in profile.groups:
        c = counts[group.kind]

        def fpt(seq_len, c=c):
            return analysis.flops_per_token(c["trainable_params"], c["frozen_params"], c["num_layers"],
                                            c["attn_dim"], seq_len)

        by_variant = {}
        for variant in group.variants:
            case = Case(group, variant)
            mine = [r for r in usable if r["case"] == case.name]
            by_variant[variant] = mine
            if mine:
                cases[case.name] = {"group": group.name, "variant": variant, "kind": group.kind,
                                    "nproc": group.nproc, "ga": group.ga,
                                    "summary": report.summarize_case(mine, profile.skip_steps, fpt,
                                                                     peak["flops_per_second"])}
        if profile.report == "realistic":
            comparisons = report.realistic_comparisons(by_variant, profile.skip_steps)
        elif profile.report == "hf":
            comparisons = report.transformers_comparisons(by_variant, profile.skip_steps)
        else:
            comparisons = {}
            for variant, mine in by_variant.items():
                if variant != UPSTREAM and mine and by_variant.get(UPSTREAM):
                    comparisons[variant] = report.compare_to_upstream(mine, by_variant[UPSTREAM], profile.skip_steps)
        seq = [r["mean_sample_tokens"] for rs in by_variant.values() for r in rs if r.get("mean_sample_tokens")]
        groups[group.name] = {"kind": group.kind, "nproc": group.nproc, "ga": group.ga, "label": group.label,
                              "batch_size": profile.batch_size_of(group), "tag": group.tag,
                              "max_seq_len": profile.max_seq_len_of(group),
                              "comparisons": comparisons,
                              "flops_per_token": fpt(seq[0]) if seq else None,
                              "mean_sample_tokens": seq[0] if seq else None}
    evaluate = {"realistic": report.evaluate_realistic_targets,
                "hf": report.evaluate_transformers_targets}.get(profile.report, report.evaluate_targets)
    return {"cases": cases, "groups": groups, "targets": evaluate(cases, groups)}


def _heading(result: Dict[str, Any], title: str) -> List[str]:
    """A report's title, then when, on what machine and software, and by which command it ran."""
    m = result["machine"]
    return [
        title,
        "",
        f"{result['finished']}, {m.get('Model name', '?')}, {m.get('cpus')} CPUs, {m.get('memory_gib')} GiB"
        + (f", {m['gpu']}" if m.get("gpu") else "") + f"; torch {m.get('torch')}, torchtune {m.get('torchtune')}.",
        f"Command: `{result['command']}`",
        "",
    ]


def realistic_markdown(result: Dict[str, Any], profile: Profile) -> str:
    """The report of the realistic profiles: one table of every case, per-step losses, targets."""
    s = result["summary"]
    order = [g.name for g in profile.groups if g.name in s["groups"]]
    usable = {}
    for r in report.usable_runs(result["runs"]):
        usable.setdefault(r["case"], r)
    case_order = [c.name for c in profile.cases()]
    lines = [
        *_heading(result, f"# Benchmark `{profile.name}`: realistic settings (issue 13)"),
        f"SmolLM2-135M-Instruct, Alpaca demo data (prompts masked), {profile.dtype} on {profile.device}, "
        f"{profile.steps} optimizer steps per run, statistics over steps {profile.skip_steps + 1}-{profile.steps}, "
        f"{profile.repeats} repeat(s), seed 0 (every implementation trains on the same samples per step). "
        "Batch sizes are per process; a group's label gives its micro-batch size and `tokenizer.max_seq_len`. "
        "Tokens/s counts non-padding tokens, the same definition for every implementation. × upstream / "
        "× HF Trainer: this row's median tokens/s over theirs. Padding: share of the collated positions that "
        "are padding. Peak memory: "
        + ("max memory allocated" if profile.device == "cuda" else "peak RSS of the process (largest rank)")
        + " from the first micro-batch to the last step. "
        f"MFU against a measured peak of {result['peak']['flops_per_second'] / 1e9:.0f} GFLOP/s "
        f"({result['peak']['dtype']} {result['peak']['n']}² matmul). Loss differences: largest relative "
        "difference of the per-step loss over all steps.",
        "",
        report.realistic_table(s["cases"], s["groups"], order),
        "",
        "## Targets",
        "",
        report.realistic_targets_table(s["targets"]),
        "",
        "## Cost of the accounting and the wait for the slowest rank (ours, rank 0)",
        "",
        "With 2 processes, `waiting for peers` is the time rank 0 waits at each step's first collective "
        "for the other rank: what balancing the ranks' tokens (`group_by_length`, ours_once) is meant to "
        "cut against ours_ungrouped.",
        "",
        report.accounting_table(s["cases"], [n for n in case_order if n in s["cases"]]),
        "",
        "## Per-step loss",
        "",
        report.loss_table(usable, case_order),
        "",
        "—: not logged or not finite (upstream divides each micro-batch's loss by its own token count, "
        "NaN when a micro-batch has no trainable token, e.g. every prompt truncated at a short max_seq_len).",
        "",
    ]
    hf = [r for name, r in usable.items() if name.endswith("_hf_trainer")]
    if hf:
        lines += ["The HF Trainer's loss above is the sum of its micro-batch losses (each divided by the step's "
                  "label count, `num_items_in_batch`); the Trainer logs the same number rounded to 4 digits.", ""]
    redone = [r for r in result["runs"] if not r.get("used", True)]
    lines += [f"Runs: {len(result['runs'])} ({len(redone)} discarded: other processes were busy during their round)."]
    return "\n".join(lines) + "\n"


def transformers_markdown(result: Dict[str, Any], profile: Profile) -> str:
    """The report of the ``hf`` profiles: the transformers path against the torchtune path."""
    s = result["summary"]
    order = [g.name for g in profile.groups if g.name in s["groups"]]
    runs_by_case: Dict[str, List[Dict[str, Any]]] = {}
    for r in report.usable_runs(result["runs"]):
        runs_by_case.setdefault(r["case"], []).append(r)
    first = {name: runs[0] for name, runs in runs_by_case.items()}
    case_order = [c.name for c in profile.cases()]
    loads = [x[0] for r in result["runs"] for x in r.get("load_samples") or []]
    lines = [
        *_heading(result, f"# Benchmark `{profile.name}`: the transformers path against the torchtune path"),
        "Our full fine-tune recipe twice on SmolLM2-135M-Instruct's weights: on torchtune's model "
        "(`configs/smollm2`, `torchtune_ext.model.build.smollm2_135m`, torchtune's checkpointer) and on the "
        "transformers model of the same folder (`configs/hf`, `torchtune_ext.model.hf.causal_lm`, `model_dir` the "
        "folder), every other key of the transformers config set to the torchtune config's "
        "(`bench.cases.transformers_path_overrides`: the same tokenizer, so the same token ids, warm-up and "
        f"memory limit). Alpaca demo data (prompts masked), {profile.dtype} on {profile.device}, "
        f"{profile.steps} optimizer steps per run, statistics over steps {profile.skip_steps + 1}-{profile.steps}, "
        f"{profile.repeats} repeat(s) run in alternation, seed 0. Tokens/s: non-padding tokens of a step over "
        "its time, median over every measured step of every repeat (both paths train on the same samples per "
        "step); in brackets the range of the per-repeat ratios. Peak memory: "
        + ("max memory allocated" if profile.device == "cuda" else "peak RSS of the process")
        + " from the first micro-batch to the last step, median over repeats. Load average: median of the "
        "1-minute load average sampled every 5 s during the runs; other processes: CPU cores used by other "
        "processes during the run, median over repeats"
        + (f" (load average over all runs: {min(loads):.1f}–{max(loads):.1f})" if loads else "") + ".",
        "",
        report.transformers_table(s["cases"], s["groups"], order, runs_by_case, profile.skip_steps),
        "",
        "## Targets",
        "",
        report.transformers_targets_table(s["targets"]),
        "",
        "## Per-step loss",
        "",
        report.loss_table(first, case_order),
        "",
    ]
    redone = [r for r in result["runs"] if not r.get("used", True)]
    lines += [f"Runs: {len(result['runs'])} ({len(redone)} discarded: other processes were busy during their round)."]
    return "\n".join(lines) + "\n"


def markdown(result: Dict[str, Any], profile: Profile) -> str:
    if profile.report == "realistic":
        return realistic_markdown(result, profile)
    if profile.report == "hf":
        return transformers_markdown(result, profile)
    s = result["summary"]
    order = [g.name for g in profile.groups if g.name in s["groups"]]
    case_order = [f"{g}_{v}" for g in order for v in ("ours_once", "ours_each") if f"{g}_{v}" in s["cases"]]
    lines = [
        *_heading(result, f"# Benchmark `{profile.name}`: ours vs upstream torchtune 0.6.1"),
        f"SmolLM2-135M-Instruct, Alpaca demo data (prompts masked), {profile.dtype} on {profile.device}, "
        f"micro-batch {profile.batch_size} per process, `tokenizer.max_seq_len={profile.max_seq_len}`, "
        + (f"every micro-batch padded to {profile.pad_to} tokens, " if profile.pad_to else "") +
        f"{profile.steps} optimizer steps per run, statistics over steps {profile.skip_steps + 1}-{profile.steps}, "
        f"{profile.repeats} repeats. Step time and tokens/s: median ±half the range over repeats; tokens/s counts "
        "non-padding tokens, the same definition for both recipes. Ratio: ours / upstream median tokens/s "
        "(in brackets: the range of the per-repeat ratios). Peak memory: "
        + ("max memory allocated" if profile.device == "cuda" else "peak RSS of the process (largest rank)")
        + " from the first micro-batch to the last step. "
        f"MFU against a measured peak of {result['peak']['flops_per_second'] / 1e9:.0f} GFLOP/s "
        f"({result['peak']['dtype']} {result['peak']['n']}² matmul).",
        "",
        report.results_table(s["cases"], s["groups"], order),
        "",
        "## Peak memory (GiB) against gradient accumulation steps",
        "",
        report.memory_table(s["cases"]),
        "",
        "## Cost of the accounting (ours, rank 0)",
        "",
        report.accounting_table(s["cases"], case_order),
        "",
    ]
    if result.get("allreduce"):
        a = result["allreduce"]
        lines += [f"One-scalar `global_sum` over {a['world_size']} processes (gloo), alone: median "
                  f"{a['median_us']:.0f} µs, p90 {a['p90_us']:.0f} µs.", ""]
    if result.get("sync_cost"):
        c = result["sync_cost"]
        lines += [f"One micro-batch ({c['seq_len']} tokens) forward + backward over {c['world_size']} processes "
                  f"(gloo, {c['threads_per_process']} thread each): {c['no_sync_seconds']:.2f} s without gradient "
                  f"sync, {c['sync_seconds']:.2f} s with it: one reduce-scatter costs "
                  f"{c['sync_cost_seconds']:.2f} s, which is what syncing once per step saves on each of the "
                  "other micro-batches of a step.", ""]
    if result.get("grad_norm"):
        g = result["grad_norm"]
        lines += ["## Gradient norm (once per step, both recipes)", "",
                  analysis.markdown_table(
                      ["method", "seconds", "relative error"],
                      [[name, f"{g[name]['seconds']:.3f}", f"{g[name]['relative_error']:.1e}"]
                       for name in ("ours_blocked", "float64_per_entry", "upstream_clip_grad_norm_")]),
                  "", f"{g['params']:,} parameters, random gradients, {g['threads']} threads.", ""]
    lines += ["## Targets", "", report.targets_table(s["targets"]), ""]
    redone = [r for r in result["runs"] if not r.get("used", True)]
    lines += [f"Runs: {len(result['runs'])} ({len(redone)} discarded: other processes were busy during their round)."]
    return "\n".join(lines) + "\n"


def two_process_probe(name: str, out: Path) -> Any:
    """Run ``bench/probes.py <name>`` on 2 processes (gloo); its JSON, or None if it failed."""
    env = dict(os.environ, PYTHONPATH=str(runner.REPO))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "bench/probes.py", name, str(out)], cwd=runner.REPO, env=env, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text()) if out.is_file() else None


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render:
        return render(args.render, args)
    profile = build_profile(args)
    if profile.device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("--gpu needs a CUDA device")
    cases = profile.cases()
    _log(f"profile {profile.name}: {len(cases)} cases x {profile.repeats} repeats, {profile.steps} steps each")
    if args.dry_run:
        for case in cases:
            print(shlex.join(command(case, profile, args.work_dir / profile.name / case.name)))
        return 0

    started = dt.datetime.now().isoformat(timespec="seconds")
    result: Dict[str, Any] = {"profile": {**profile.__dict__, "groups": [g.__dict__ for g in profile.groups]},
                              "command": shlex.join(["python", "-m", "bench", *argv]), "started": started,
                              "machine": probes.machine(), "runs": []}
    counts = {kind: probes.model_counts(kind, RECIPES[("ours", kind, False)][1]) for kind in ("full", "lora")}
    result["model"] = counts

    runner.wait_for_quiet(args.busy_threshold, args.wait_quiet_s, _log)
    if profile.device == "cuda":
        result["peak"] = probes.peak_flops("cuda", torch.bfloat16, 8192, 20)
    else:
        result["peak"] = probes.peak_flops("cpu", torch.float32, 2048, 10)
    _log(f"peak: {result['peak']['flops_per_second'] / 1e9:.1f} GFLOP/s ({result['peak']['dtype']})")

    if profile.device == "cpu" and profile.report == "standard":  # only the standard report shows it
        result["grad_norm"] = probes.grad_norm_cost()
    if profile.warmup:
        result["warmups"] = warmups(profile, args)

    partial = args.work_dir / profile.name / "runs.partial.json"
    rounds = [(repeat, group) for repeat in range(profile.repeats) for group in profile.groups]
    redo_budget = args.max_redo
    t0 = time.monotonic()
    while rounds:
        repeat, group = rounds.pop(0)
        tag = f"r{repeat}" + ("" if not any(r["group"] == group.name and r["repeat"] == repeat
                                            for r in result["runs"]) else f"_redo{time.strftime('%H%M%S')}")
        _log(f"round: {group.name}, repeat {repeat + 1}/{profile.repeats} "
             f"({(time.monotonic() - t0) / 60:.0f} min so far)")
        records = run_round(group, repeat, profile, args, tag)
        busy = max(r["foreign_cpu"] for r in records) > args.busy_threshold
        for r in records:
            r["busy_round"] = busy
        if busy and redo_budget > 0:
            _log(f"  round was busy (other processes up to {max(r['foreign_cpu'] for r in records):.2f} cores): "
                 "will redo it at the end")
            redo_budget -= 1
            for r in records:
                r["used"] = False  # until a quiet redo replaces it (or it is the last try, see below)
            rounds.append((repeat, group))
        result["runs"].extend(records)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(result, default=str))

    # A round redone until the budget ran out and never quiet: keep its last try.
    for group in profile.groups:
        for repeat in range(profile.repeats):
            mine = [r for r in result["runs"] if r["group"] == group.name and r["repeat"] == repeat]
            if mine and not any(r.get("used", True) for r in mine):
                last_tag = mine[-1]["tag"]
                for r in mine:
                    if r["tag"] == last_tag:
                        r["used"] = True

    if any(g.nproc > 1 for g in profile.groups) and profile.device == "cpu":
        for probe in ("allreduce", "sync_cost"):
            _log(f"probe: {probe}")
            result[probe] = two_process_probe(probe, args.work_dir / profile.name / f"{probe}.json")

    result["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    return finish(result, profile, args)


def finish(result: Dict[str, Any], profile: Profile, args: argparse.Namespace) -> int:
    """Summarize, write ``<profile>.json`` and ``<profile>.md``, print the tables; 3 if a used run failed."""
    result["summary"] = summarize(profile, result["runs"], result["model"], result["peak"])
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{profile.name}.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result, profile)
    (args.results_dir / f"{profile.name}.md").write_text(text)
    print(text)
    failed = [r for r in result["runs"] if r.get("error") and r.get("used", True)]
    return 3 if failed else 0


def render(path: Path, args: argparse.Namespace) -> int:
    """Re-summarize a results JSON written by an earlier run (same or newer bench code)."""
    result = json.loads(path.read_text())
    fields = dict(result["profile"])
    if "finished" not in result:  # a runs.partial.json: the rounds done before the run stopped
        result["finished"] = "not finished (the rounds done before it stopped)"
        fields["repeats"] = len({r["repeat"] for r in result["runs"]})
    fields["groups"] = tuple(Group(**{**g, "variants": tuple(g["variants"])}) for g in fields["groups"])
    fields["extra_overrides"] = tuple(fields.get("extra_overrides", ()))
    profile = Profile(**fields)
    if profile.device == "cpu" and profile.report == "standard" and not result.get("grad_norm"):
        result["grad_norm"] = probes.grad_norm_cost()
    if any(g.nproc > 1 for g in profile.groups) and profile.device == "cpu":
        for probe in ("allreduce", "sync_cost"):
            if not result.get(probe):
                _log(f"probe: {probe}")
                result[probe] = two_process_probe(probe, args.work_dir / profile.name / f"{probe}.json")
    return finish(result, profile, args)


if __name__ == "__main__":
    sys.exit(main())
