"""A recipe family's peers run in alternation and reported: what ``bench.distillation`` and ``bench.preference`` share.

A **peer** is one implementation of the family's training step (upstream
torchtune's recipe, TRL's trainer, later ours), started as its own process by a
command that writes a :class:`bench.launch.Probe` file and a per-step metric
log into its output folder. Every peer trains the same samples with the same
settings (the family's ``key=value`` overrides on top of its config). Repeats
alternate the peers, in an order that rotates with the repeat (A B, B A, ...);
before each run the harness waits (up to ``--wait-quiet-s``) for other
processes to go quiet, and records the load average during the run and the CPU
cores other processes used, as ``python -m bench`` does. The first
``skip_steps`` steps of a run are left out of its statistics.

Per step: wall time between two step ends, non-padding tokens and learned
(label) tokens of the step's micro-batches (after the label shift), samples,
the loss the implementation logs, the peak RSS so far, and, where a teacher
runs, the wall time of its forwards.
"""

import datetime as dt
import functools
import json
import shlex
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from bench import analysis, probes, runner

REPO = runner.REPO
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"


@dataclass(frozen=True)
class Peer:
    """One implementation: ``command(output_dir)`` runs it; skipped while a path in ``needs`` is missing."""

    name: str
    label: str
    command: Callable[[Path], List[str]]
    log: str  # "disk_log" (torchtune's DiskLogger) or "jsonl" (logs/metrics.jsonl)
    needs: Sequence[str] = field(default_factory=tuple)

    def missing(self) -> List[str]:
        return [path for path in self.needs if not (REPO / path).exists()]


def default_python() -> str:
    """The peers' environment (``.venv-peers``, which has TRL) if it exists, else this interpreter."""
    return str(PEERS_PYTHON) if PEERS_PYTHON.is_file() else sys.executable


def _logged(peer: Peer, output_dir: Path) -> Dict[int, Dict[str, Any]]:
    if peer.log == "disk_log":
        logs = sorted((output_dir / "logs").glob("log_*.txt"))
        if not logs:
            raise ValueError(f"no DiskLogger file in {output_dir / 'logs'}")
        return analysis.last_record_per_step(analysis.parse_disk_log(logs[-1].read_text()))
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return analysis.last_record_per_step(json.loads(line) for line in lines if line.strip())


def read_steps(peer: Peer, output_dir: Path, steps: int) -> Dict[str, Any]:
    """Per-step numbers of a finished run from ``probe.json`` and its metric log.

    Raises:
        ValueError: the run logged another number of steps, or its adapter was not ours.
    """
    probe = json.loads((output_dir / "probe.json").read_text())
    adapter = probe.get("initial_adapter")
    if adapter is not None and not adapter.get("applied"):
        raise ValueError("the run's initial adapter was not set to ours (bench.launch.OurInitialAdapter)")
    ends = probe["step_ends"]
    if len(ends) != steps:
        raise ValueError(f"{len(ends)} step ends logged, expected {steps}")
    periods = analysis.step_periods([e["time"] for e in ends])
    logged = _logged(peer, output_dir)
    teacher = probe.get("teacher_forward")
    rows = []
    for k in range(1, steps + 1):
        # a loader may collate the next step's first micro-batch ahead: step_index says whose it is
        mbs = [mb for mb in probe["micro_batches"] if mb["step_index"] == k - 1]
        row = {"step": k, "seconds": periods.get(k), "samples": sum(mb["samples"] for mb in mbs),
               "micro_batches": len(mbs),
               "non_padding_tokens": sum(mb["non_padding_tokens"] for mb in mbs),
               "trainable_tokens": sum(mb["trainable_tokens"] for mb in mbs),
               "padded_tokens": sum(mb["padded_shape"][0] * mb["padded_shape"][1] for mb in mbs),
               "loss": logged.get(k, {}).get("loss"), "peak_bytes": ends[k - 1]["peak_bytes"]}
        if teacher is not None:
            row["teacher_seconds"] = sum(s for index, s in teacher if index == k - 1)
        rows.append(row)
    return {"steps": rows, "peak_bytes": max((e["peak_bytes"] or 0) for e in ends + probe["optimizer_steps"]),
            "versions": {k: probe[k] for k in ("trl", "transformers", "peft") if k in probe}}


def run_peer(peer: Peer, out: Path, steps: int, timeout_s: float) -> Dict[str, Any]:
    """One run of ``peer`` into ``out`` (replaced): :func:`bench.runner.run_measured`'s record plus its steps."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    record = {"peer": peer.name, **runner.run_measured(peer.command(out), out, timeout_s)}
    if record["returncode"] != 0:
        record["error"] = f"exit status {record['returncode']}; see {out / 'run.log'}"
        return record
    try:
        record.update(read_steps(peer, out, steps))
    except (OSError, ValueError, KeyError) as err:
        record["error"] = f"could not read the run's output: {type(err).__name__}: {err}"
    return record


def alternate(peers: Sequence[Peer], repeats: int, work_dir: Path, steps: int, timeout_s: float,
              wait_quiet_s: float, log: Callable[[str], None] = functools.partial(print, flush=True)
              ) -> List[Dict[str, Any]]:
    """Every runnable peer ``repeats`` times, rotated per repeat; a peer whose ``needs`` are missing is skipped."""
    runnable = []
    for peer in peers:
        if peer.missing():
            log(f"  {peer.name}: skipped, {', '.join(peer.missing())} does not exist yet")
        else:
            runnable.append(peer)
    runs = []
    for repeat in range(repeats):
        k = repeat % max(len(runnable), 1)
        for peer in runnable[k:] + runnable[:k]:
            runner.wait_for_quiet(0.3, wait_quiet_s, log)
            log(f"  {peer.name} [repeat {repeat + 1}/{repeats}] ...")
            record = run_peer(peer, work_dir / f"{peer.name}_r{repeat}", steps, timeout_s)
            record["repeat"] = repeat
            loads = [s[0] for s in record["load_samples"]] or [record["load_after"][0]]
            log(f"    {record['wall_seconds']:.0f} s wall, load average {min(loads):.1f}-{max(loads):.1f}, "
                f"other processes {record['foreign_cpu']:.2f} cores" + (f"  ERROR: {record['error']}"
                                                                         if record.get("error") else ""))
            runs.append(record)
            # what is done so far, should the benchmark be stopped before it writes its results
            (work_dir / "runs.partial.json").write_text(json.dumps(runs, default=str))
    return runs


def run_stats(run: Dict[str, Any], skip_steps: int) -> Dict[str, Optional[float]]:
    """One run's rates over its measured steps: totals over the steps after ``skip_steps``, divided by their time."""
    rows = [r for r in run.get("steps", []) if r["step"] > skip_steps and r["seconds"]]
    if not rows:
        return {}
    seconds = sum(r["seconds"] for r in rows)
    stats = {"step_seconds": statistics.median(r["seconds"] for r in rows),
             "tokens_per_second": sum(r["non_padding_tokens"] for r in rows) / seconds,
             "trainable_tokens_per_second": sum(r["trainable_tokens"] for r in rows) / seconds,
             "samples_per_second": sum(r["samples"] for r in rows) / seconds,
             "peak_gib": run["peak_bytes"] / 2**30}
    if all("teacher_seconds" in r for r in rows):
        stats["teacher_share"] = sum(r["teacher_seconds"] for r in rows) / seconds
    loads = [s[0] for s in run.get("load_samples") or []]
    stats["load_median"] = statistics.median(loads) if loads else run["load_after"][0]
    stats["foreign_cpu"] = run["foreign_cpu"]
    return stats


def summarize(runs: Sequence[Dict[str, Any]], peers: Sequence[Peer], skip_steps: int) -> Dict[str, Any]:
    """Per peer: the median over its repeats of each :func:`run_stats` value, and the per-repeat values."""
    out = {}
    for peer in peers:
        per_run = [run_stats(r, skip_steps) for r in runs if r["peer"] == peer.name and not r.get("error")]
        per_run = [s for s in per_run if s]
        if per_run:
            out[peer.name] = {"median": {k: statistics.median(s[k] for s in per_run) for k in per_run[0]},
                              "runs": per_run}
    return out


def same_samples(runs: Sequence[Dict[str, Any]]) -> bool:
    """Whether every run saw the same tokens per step (non-padding and learned): the peers trained the same samples."""
    seen = {tuple((r["non_padding_tokens"], r["trainable_tokens"]) for r in run["steps"])
            for run in runs if run.get("steps")}
    return len(seen) <= 1


def result_header(title: str, argv: Sequence[str], prog: str) -> Dict[str, Any]:
    return {"title": title, "command": shlex.join(["python", "-m", prog, *argv]),
            "started": dt.datetime.now().isoformat(timespec="seconds"), "machine": probes.machine()}


def heading_lines(result: Dict[str, Any]) -> List[str]:
    m = result["machine"]
    loads = [s[0] for r in result["runs"] for s in r.get("load_samples") or []]
    return [f"# {result['title']}", "",
            f"{result.get('finished', 'not finished')}, {m.get('Model name', '?')}, {m.get('cpus')} CPUs, "
            f"{m.get('memory_gib')} GiB; torch {m.get('torch')}, torchtune {m.get('torchtune')}"
            + "".join(f", {k} {v}" for k, v in result.get("versions", {}).items()) + ".",
            f"Command: `{result['command']}`",
            "",
            f"Load average during the runs: {min(loads):.1f}-{max(loads):.1f} (sampled every 5 s)." if loads else "",
            ""]


def loss_table(runs: Sequence[Dict[str, Any]], peers: Sequence[Peer]) -> str:
    """Per-step logged loss of each peer's first successful run."""
    first = {}
    for r in runs:
        if not r.get("error") and r["peer"] not in first:
            first[r["peer"]] = r
    names = [p.name for p in peers if p.name in first]
    steps = max((len(first[n]["steps"]) for n in names), default=0)
    rows = [[k] + [analysis.fmt(first[n]["steps"][k - 1]["loss"], ".7g") for n in names] for k in range(1, steps + 1)]
    return analysis.markdown_table(["step"] + names, rows)


def write(result: Dict[str, Any], results_dir: Path, name: str, markdown: str) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    (results_dir / f"{name}.md").write_text(markdown)
    print(markdown)
