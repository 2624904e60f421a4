"""Start one benchmark run in a subprocess, watch the machine's load, and read back its numbers."""

import json
import os
import resource
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench import analysis
from bench.cases import UPSTREAM, Case, Profile, command

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- machine load

def _cpu_seconds() -> tuple:
    """Machine-wide (busy, steal) CPU seconds since boot, all cores, from /proc/stat.

    Busy: user, nice, system, irq, softirq (guest time is inside user).
    Steal: time the hypervisor ran something else on our virtual CPUs.
    """
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    steal = fields[7] if len(fields) > 7 else 0
    return busy / tick, steal / tick


def _busy_cpu_seconds() -> float:
    return _cpu_seconds()[0]


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def foreign_load(seconds: float = 3.0) -> float:
    """CPU cores used by other processes over ``seconds`` while this process idles."""
    busy0, own0, t0 = _busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    time.sleep(seconds)
    busy1, own1, t1 = _busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    own = (own1.ru_utime + own1.ru_stime) - (own0.ru_utime + own0.ru_stime)
    return analysis.foreign_cpu_cores(busy1 - busy0, own, t1 - t0)


def wait_for_quiet(threshold: float, max_wait_s: float, log) -> float:
    """Wait (up to ``max_wait_s``) until other processes use under ``threshold`` cores; returns the last reading."""
    deadline = time.monotonic() + max_wait_s
    load = foreign_load()
    while load > threshold and time.monotonic() < deadline:
        log(f"  machine busy ({load:.2f} cores used by other processes); waiting")
        time.sleep(20)
        load = foreign_load()
    return load


class LoadSampler:
    """Samples ``os.getloadavg()`` every few seconds in a background thread."""

    def __init__(self, every_s: float = 5.0):
        self.samples: List[List[float]] = []
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            self.samples.append([round(x, 2) for x in os.getloadavg()])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# -------------------------------------------------------------------- one run

def run_measured(cmd: List[str], output_dir: Path, timeout_s: float) -> Dict[str, Any]:
    """Run ``cmd`` from the repository root, its output into ``output_dir/run.log``; what the machine did meanwhile.

    Returns ``command``, ``returncode`` (``"timeout"`` past ``timeout_s``), ``wall_seconds``,
    ``own_cpu_seconds``, the load average before, after and every 5 s during the run
    (``load_samples``), the CPU cores other processes used (``foreign_cpu``) and the
    host's steal (``steal_cpu``, cores).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("WANDB_MODE", "offline")
    record: Dict[str, Any] = {"command": cmd, "load_before": list(os.getloadavg())}
    (busy0, steal0), own0, t0 = _cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
    with open(output_dir / "run.log", "w") as log, LoadSampler() as sampler:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            record["returncode"] = proc.returncode
        except subprocess.TimeoutExpired:
            record["returncode"] = "timeout"
    wall = time.perf_counter() - t0
    own = _children_cpu_seconds() - own0
    busy1, steal1 = _cpu_seconds()
    record.update(
        wall_seconds=wall, own_cpu_seconds=own, load_after=list(os.getloadavg()), load_samples=sampler.samples,
        foreign_cpu=analysis.foreign_cpu_cores(busy1 - busy0, own, wall), steal_cpu=(steal1 - steal0) / wall,
        output_dir=str(output_dir),
    )
    return record


def execute(case: Case, profile: Profile, output_dir: Path, *, steps: Optional[int] = None) -> Dict[str, Any]:
    """Run ``case`` once into ``output_dir`` (replaced) and return its raw record.

    The record holds what :func:`run_measured` measures (command, exit status,
    wall time, load, the CPU other processes used) and the parsed per-step
    numbers (:func:`read_run`).
    """
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    record: Dict[str, Any] = {"case": case.name, "group": case.group.name, "variant": case.variant}
    record.update(run_measured(command(case, profile, output_dir, steps), output_dir, profile.run_timeout_s))
    if record["returncode"] == 0:
        try:
            record.update(read_run(case, output_dir, steps or profile.steps))
        except (OSError, ValueError, KeyError) as err:
            record["error"] = f"could not read the run's output: {type(err).__name__}: {err}"
    else:
        record["error"] = f"exit status {record['returncode']}; see {output_dir / 'run.log'}"
    return record


def _probes(output_dir: Path) -> List[Dict[str, Any]]:
    single = output_dir / "probe.json"
    paths = [single] if single.is_file() else sorted(output_dir.glob("probe_rank*.json"))
    if not paths:
        raise ValueError(f"no probe file in {output_dir}")
    probes = [json.loads(p.read_text()) for p in paths]
    return sorted(probes, key=lambda p: p["rank"])


def _logged_metrics(case: Case, output_dir: Path) -> Dict[int, Dict[str, Any]]:
    if case.impl == UPSTREAM:
        logs = sorted((output_dir / "logs").glob("log_*.txt"))
        if not logs:
            raise ValueError(f"no DiskLogger file in {output_dir / 'logs'}")
        return analysis.last_record_per_step(analysis.parse_disk_log(logs[-1].read_text()))
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return analysis.last_record_per_step(json.loads(line) for line in lines if line.strip())


def read_run(case: Case, output_dir: Path, num_steps: int) -> Dict[str, Any]:
    """Per-step numbers of a finished run, from its probe files and its own metric log.

    Returns a dict with ``steps`` (one dict per optimizer step: ``period``,
    token counts summed over ranks, ``padded_tokens`` (rows x padded length,
    summed over micro-batches and ranks), ``loss``, ``grad_norm`` and the
    recipe's own token count ``logged_tokens``), ``peak_memory_bytes`` (per rank),
    ``torch_threads``, ``accounting`` (ours: seconds per piece, per step) and
    ``mean_sample_tokens``.
    """
    probes = _probes(output_dir)
    for probe in probes:
        adapter = probe.get("initial_adapter")  # upstream LoRA: bench.launch --adapter-seed
        if adapter is not None and not adapter.get("applied"):
            raise ValueError(f"rank {probe['rank']}: upstream's initial adapter was not replaced by ours (the recipe "
                             "no longer calls the functions bench.launch.OurInitialAdapter hooks): its losses would "
                             "compare two different random adapters")
    rank0 = probes[0]
    ends = [e["time"] for e in rank0["step_ends"]]
    if len(ends) != num_steps:
        raise ValueError(f"{len(ends)} step ends logged, expected {num_steps}")
    periods = analysis.step_periods(ends)
    tokens = analysis.tokens_per_step([p["micro_batches"] for p in probes], case.group.ga, num_steps)
    logged = _logged_metrics(case, output_dir)
    steps = []
    for k in range(1, num_steps + 1):
        metrics = logged.get(k, {})
        entry = {"step": k, "period": periods.get(k), **tokens[k - 1],
                 "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm")}
        if case.impl == UPSTREAM:
            # upstream logs num_tokens / (time * world_size), num_tokens counted before the shift
            tps = metrics.get("tokens_per_second_per_gpu")
            entry["recipe_step_seconds"] = (entry["trainable_tokens_pre_shift"] / (tps * len(probes))) if tps else None
            entry["logged_tokens"] = entry["trainable_tokens_pre_shift"]
        else:
            entry["recipe_step_seconds"] = metrics.get("step_seconds")
            entry["logged_tokens"] = metrics.get("num_tokens")
        if "hf_logged_loss" in metrics:  # the HF Trainer's own (rounded) loss, next to the exact sum
            entry["hf_logged_loss"] = metrics["hf_logged_loss"]
        steps.append(entry)
    for k, entry in enumerate(steps):
        # rows x padded length of the step's micro-batches, all ranks (None if a probe lacks shapes)
        shapes = [mb.get("padded_shape") for p in probes
                  for mb in analysis.micro_batches_of_step(p["micro_batches"], case.group.ga, k)]
        entry["padded_tokens"] = sum(s[0] * s[1] for s in shapes) if all(shapes) else None
    samples = sum(mb["samples"] for p in probes for k in range(num_steps)
                  for mb in analysis.micro_batches_of_step(p["micro_batches"], case.group.ga, k))
    non_padding = sum(s["non_padding_tokens"] for s in steps)
    accounting: Dict[str, Dict[str, float]] = {}
    for piece, calls in rank0.get("accounting", {}).items():
        per_step: Dict[str, float] = {}
        for index, seconds in calls:
            # a call made after `index` step ends falls in the period of step index + 1
            key = str(index + 1)
            per_step[key] = per_step.get(key, 0.0) + seconds
        accounting[piece] = per_step
    return {
        "steps": steps,
        "peak_memory_bytes": [max((e["peak_bytes"] or 0) for e in p["step_ends"] + p["optimizer_steps"])
                              for p in probes],
        "torch_threads": [p["torch_threads"] for p in probes],
        "accounting": accounting,
        "mean_sample_tokens": non_padding / samples if samples else None,
    }
