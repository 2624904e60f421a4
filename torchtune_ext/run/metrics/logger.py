"""The metric logger: each step's record to ``logs/metrics.jsonl`` and to a torchtune logger (W&B), on rank 0.

Other ranks hold a logger that does nothing, so the training loop has no
rank branches. A write that fails (a full disk) stops the run with exit
status 74 and names the checkpoint to resume from.
"""

import functools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Set

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config

from torchtune_ext import ranks
from torchtune_ext.checkpoint import write_failed
from torchtune_ext.checkpoint.discovery import step_of
from torchtune_ext.config import enabled, log_model_mode
from torchtune_ext.errors import EXIT_IO_ERROR, ConfigError
from torchtune_ext.run.metrics.model_artifacts import log_checkpoint_artifact
from torchtune_ext.run.metrics.wandb_charts import define_wandb_axes, end_wandb_service, log_wandb_loss_charts

# After a failed write, how long the metric logger's backend may take to close before the run exits anyway.
BACKEND_CLOSE_TIMEOUT_S = 5.0


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
        log_model (str): with W&B, which checkpoints :meth:`checkpoint_saved` logs as model artifacts:
            ``false`` none, ``end`` the final one, ``checkpoint`` every one (``metric_logger.log_model``).
    """

    def __init__(self, jsonl_path: Path, backend: Optional[Any] = None, rank: int = 0, wandb_charts: bool = False,
                 resume: bool = False, log_model: str = "false"):
        self._active = rank == 0
        self._backend = backend if self._active else None
        self._resume = resume
        self._logs = jsonl_path.parent
        self._jsonl = None
        self._path = jsonl_path
        self._wandb_charts = wandb_charts and self._backend is not None
        self._log_model = log_model if self._wandb_charts else "false"
        self._logged_checkpoints: Set[Path] = set()
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

    def checkpoint_saved(self, folder: Path, *, final: bool) -> None:
        """Hear of checkpoint ``folder``, complete (its save returned, or was waited for); ``final``: the end of
        training's. With ``log_model`` (W&B, rank 0) it becomes a model artifact, once, after its files are
        checked against its manifest (:func:`~torchtune_ext.run.metrics.model_artifacts.log_checkpoint_artifact`).

        Raises:
            OutputWriteError: W&B could not copy the files (a full disk); the message names the checkpoint to
                resume from. The recipes exit with 74.
        """
        wanted = self._log_model == "checkpoint" or (self._log_model == "end" and final)
        if self._backend is None or not wanted or folder in self._logged_checkpoints:
            return
        self._logged_checkpoints.add(folder)
        try:
            log_checkpoint_artifact(folder, final=final)
        except OSError as err:
            raise self._failed(f"checkpoint {folder} to W&B as a model artifact", step_of(folder), err) from err

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


def build_metric_logger(cfg: DictConfig, rank: int, resume: bool = False) -> MetricLogger:
    """Metric logger for a recipe config: ``cfg.metric_logger`` plus the JSONL file.

    The JSONL file is ``<cfg.output_dir>/logs/metrics.jsonl``. The backend is
    instantiated only on rank 0 (so only one W&B run exists per job); a null
    ``metric_logger`` means JSONL only. For W&B, the run id is kept in
    ``<output_dir>/logs/wandb_run_id`` and a resumed training run continues
    the same W&B run (``resume="allow"``); the run is named after the output
    folder unless ``metric_logger.name`` says otherwise. ``metric_logger.log_model``
    is ours (which checkpoints become W&B artifacts), not handed to W&B.

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
        if is_wandb and cfg.metric_logger.get("name") is None:
            # W&B would pick a random name: the output folder's is the one the user looks for
            kwargs["name"] = Path(cfg.output_dir).resolve().name
        node = cfg.metric_logger
        if "log_model" in node:  # ours: wandb.init would refuse it
            node = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
            node.pop("log_model")
        try:
            backend = tt_config.instantiate(node, **kwargs)
        except Exception as err:
            if not is_wandb:
                raise
            # wandb.init's own refusals (no API key for mode=online, a server that cannot be reached):
            # the setup is rolled back, nothing written is lost
            reason = " ".join(str(err).split()) or type(err).__name__
            end_wandb_service()
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
                        resume=resume, log_model=log_model_mode(cfg.get("metric_logger")))
