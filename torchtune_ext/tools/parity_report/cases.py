"""The cases of the parity report and the command line that runs each one.

For a global batch of N samples per optimizer step the cases are

* ``bs{N}_ga1``      -- batch N, no accumulation (the reference, backward once);
* ``bs1_ga{N}``      -- batch 1, N accumulation steps;
* ``bs{N/2}_ga2``    -- batch N/2, 2 accumulation steps (N even and > 2);
* ``dp{K}_bs{N/K}_ga1`` -- K data-parallel ranks (``--nproc K``);

each in both backward modes (suffix ``_once``: ``backward=auto``,
``_each``: backward after each micro-batch), plus the control
``control_bs1_ga{N}_mean_of_means``: batch 1 with N accumulation steps under
the common inexact normalization (see :mod:`.control`).

Every case is a subprocess running the real recipe with the same config and
seed, so all cases see the same samples in the same order; only the split of
the step (micro-batch size, accumulation steps, ranks) and the backward mode
change.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from torchtune.config._utils import _merge_yaml_and_cli_args

# Seed passed to every case when the config leaves it unset: a null seed would
# draw a different one per run, and with it a different data order.
FALLBACK_SEED = 1234


@dataclass(frozen=True)
class Case:
    """One run of the report.

    Attributes:
        name (str): folder and W&B run name, e.g. ``bs1_ga4_once``.
        batch_size (int): micro-batch size per rank.
        gradient_accumulation_steps (int): micro-batches per optimizer step.
        once_per_step (bool): the recipe's backward mode: ``backward=auto`` (once per step where it fits), else
            ``backward=per_micro_batch``.
        nproc (int): data-parallel ranks (1: the single-device recipe).
        control (bool): run under the inexact control normalization.
    """

    name: str
    batch_size: int
    gradient_accumulation_steps: int
    once_per_step: bool
    nproc: int = 1
    control: bool = False

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all micro-batches and ranks."""
        return self.batch_size * self.gradient_accumulation_steps * self.nproc

    @property
    def split(self) -> str:
        """``micro-batch × accumulation × ranks``, for the report table."""
        return f"{self.batch_size} × {self.gradient_accumulation_steps} × {self.nproc}"

    @property
    def backward(self) -> str:
        """The backward mode in words, for the report table."""
        return "once per step" if self.once_per_step else "per micro-batch"


def _mode(once: bool) -> str:
    return "once" if once else "each"


def plan_cases(global_batch_size: int, nproc: Optional[int] = None) -> List[Case]:
    """All cases for a global batch size, the reference first, the control last.

    Args:
        global_batch_size (int): N, samples per optimizer step, >= 2.
        nproc (int, optional): also run the distributed recipe on this many
            ranks, each with micro-batch N / nproc and no accumulation.

    Returns:
        list of :class:`Case`; splits that coincide (for N = 2, N/2 with 2
        steps is batch 1 with N steps) appear once.

    Raises:
        ValueError: N < 2 (nothing to compare), or N not divisible by ``nproc``.
    """
    n = global_batch_size
    if n < 2:
        raise ValueError(f"--global-batch-size must be >= 2 to split a step, got {n}")
    splits = [(n, 1), (1, n)]
    if n % 2 == 0 and (n // 2, 2) not in splits:
        splits.append((n // 2, 2))
    cases = [
        Case(f"bs{bs}_ga{ga}_{_mode(once)}", bs, ga, once)
        for bs, ga in splits
        for once in (True, False)
    ]
    if nproc is not None:
        if nproc < 2 or n % nproc:
            raise ValueError(f"--nproc must be >= 2 and divide --global-batch-size {n}, got {nproc}")
        cases += [
            Case(f"dp{nproc}_bs{n // nproc}_ga1_{_mode(once)}", n // nproc, 1, once, nproc=nproc)
            for once in (True, False)
        ]
    cases.append(Case(f"control_bs1_ga{n}_mean_of_means", 1, n, False, control=True))
    return cases


def select_cases(cases: Sequence[Case], names: Optional[Sequence[str]]) -> List[Case]:
    """The cases named in ``names`` (None: all), always with the reference (the first case).

    Raises:
        ValueError: a name that is not a case, listing the valid names.
    """
    if not names:
        return list(cases)
    known = {c.name for c in cases}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; the cases are: {', '.join(c.name for c in cases)}")
    return [c for i, c in enumerate(cases) if i == 0 or c.name in names]


def effective_config(config_path: str, overrides: Sequence[str]) -> DictConfig:
    """The config a recipe will see for ``--config config_path`` plus ``overrides``.

    Uses torchtune's own merge of YAML and ``key=value`` overrides, so
    component shorthands (``metric_logger=null``) and ``~key`` removals mean
    what they mean to ``tune run``. Interpolations are left unresolved.

    Raises:
        ValueError: an override not of the form ``key=value``.
        FileNotFoundError: ``config_path`` does not exist.
    """
    yaml = OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)
    return _merge_yaml_and_cli_args(argparse.Namespace(**yaml), list(overrides))


def uses_wandb(cfg: DictConfig) -> bool:
    """True if the config's metric logger is torchtune's ``WandBLogger``."""
    logger = cfg.get("metric_logger")
    component = logger.get("_component_") if isinstance(logger, DictConfig) else None
    return isinstance(component, str) and component.endswith("WandBLogger")


def case_overrides(
    case: Case, *, steps: int, output_dir: Path, seed: int, wandb_group: Optional[str]
) -> List[str]:
    """``key=value`` overrides that turn the user's config into ``case``.

    The report owns these keys; they come after the user's overrides, so they
    win. Checkpoints are off (``save_final_checkpoint=false``, no periodic
    saves): the report needs only the metrics, and on a real model each save
    costs time and disk.

    Args:
        steps (int): optimizer steps to run (``max_steps_per_epoch``, one epoch).
        output_dir (Path): the case's own output folder (absolute).
        seed (int): the seed every case shares.
        wandb_group (str, optional): W&B group; None when the config does not
            log to W&B.
    """
    overrides = [
        f"batch_size={case.batch_size}",
        f"gradient_accumulation_steps={case.gradient_accumulation_steps}",
        f"backward={'auto' if case.once_per_step else 'per_micro_batch'}",
        # the _once cases compare the once-per-step backward itself: the default limit
        # (torchtune) would run most of their steps per micro-batch on a real model
        "once_per_step_memory_limit=device",
        "epochs=1",
        f"max_steps_per_epoch={steps}",
        f"output_dir={output_dir}",
        f"seed={seed}",
        "resume_from_checkpoint=false",
        "save_final_checkpoint=false",
        "save_every_n_steps=null",
        "log_every_n_steps=1",
        # training steps only: one metrics record per step (the shipped configs validate before and after)
        "run_val_every_n_steps=null",
        "run_val_at_start=false",
    ]
    if wandb_group is not None:
        overrides += [f"metric_logger.group={wandb_group}", f"metric_logger.name={case.name}"]
    return overrides


def case_command(case: Case, recipe: str, config: str, overrides: Sequence[str]) -> List[str]:
    """The argv that runs ``case``: ``tune run`` (with ``--nproc_per_node`` for
    data-parallel cases), or the control launcher for the control case.

    ``tune`` is invoked through this interpreter (``python -m
    torchtune._cli.tune``) so the runs use the same environment as the report.
    """
    if case.control:
        control = "torchtune_ext.tools.parity_report.control"
        return [sys.executable, "-m", control, recipe, "--config", config, *overrides]
    tune = [sys.executable, "-m", "torchtune._cli.tune", "run"]
    if case.nproc > 1:
        tune += ["--nproc_per_node", str(case.nproc)]
    return [*tune, recipe, "--config", config, *overrides]


@dataclass
class RunResult:
    """How a case's subprocess ended.

    Attributes:
        returncode (int): the subprocess exit status.
        seconds (float): its wall time.
        log_path (Path): its stdout and stderr, interleaved.
    """

    returncode: int
    seconds: float
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def run_case(command: Sequence[str], log_path: Path, env: Optional[Dict[str, str]] = None) -> RunResult:
    """Run one case to completion from the current directory.

    The working directory is the caller's, so relative paths in the config
    (``assets/...``) and ``tune run``'s relative recipe paths resolve as they
    would for the user.

    Args:
        command: from :func:`case_command`.
        log_path: file for the command line, then the subprocess's output (parents created).
        env: environment (default: this process's).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n\n")  # so a case can be rerun by hand
        log.flush()
        proc = subprocess.run(list(command), stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ))
    return RunResult(proc.returncode, time.perf_counter() - start, log_path)
