"""The atomic writer: :class:`CheckpointManager` saves ``step_<N>/`` through a staging folder and finds it again.

The torchtune checkpointer writes into ``<output_dir>/.staging/``; the
manifest is written last; then the folder is renamed to ``step_<N>``. Free
space is checked against the checkpoint's size first; a save that fails
(a full disk included, and the steps before and after the write: clearing
an old staging folder, the rename, syncing the folder) removes its staging
folder and leaves the previous checkpoints intact. Old checkpoints are
pruned (``keep_last_n_checkpoints``) only after the new one is complete.
"""

import contextlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config
from torchtune import training
from torchtune.utils import get_logger

from torchtune_ext import ranks
from torchtune_ext.checkpoint.discovery import (
    ADAPTER_WEIGHTS,
    HASHES,
    MANIFEST,
    RECIPE_STATE,
    STAGING,
    file_sha256,
    intact_before,
    latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)
from torchtune_ext.checkpoint.failures import WRITE_ADVICE, is_disk_full, is_write_failure
from torchtune_ext.checkpoint.lora_export import arrange_lora_folder
from torchtune_ext.checkpoint.progress import Progress
from torchtune_ext.checkpoint.rng import rng_state
from torchtune_ext.checkpoint.sharded import (
    DCP_DIR,
    SHARDED_FORMAT,
    failed_ranks,
    file_owner,
    is_adapter_key,
    is_sharded,
    local_bytes,
    local_state,
    read_full_tensors,
    sharded_state_dict,
)
from torchtune_ext.checkpoint.sizing import planned_save_steps, tensor_bytes
from torchtune_ext.errors import CheckpointSaveError, ConfigError, DiskSpaceError
from torchtune_ext.text import format_bytes, short
from torchtune_ext.tokenizer import training_chat_template, write_chat_template

log = get_logger()  # torchtune's logger, which the recipes' lines go through too


def _from_rank_zero(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not ranks.several_processes(group):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _from_every_rank(value: Any, group: Any = None) -> List[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not ranks.several_processes(group):
        return [value]
    values = [None] * ranks.process_group_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


@contextlib.contextmanager
def _quiet_torchtune_checkpointer() -> Iterator[None]:
    """Hide the INFO lines of torchtune's checkpointer while it writes into staging.

    They name the staging folder (``.staging/epoch_6``) instead of the
    checkpoint (``step_6``) and call every save "final"; the manager logs one
    accurate line instead. Warnings still pass.
    """

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.endswith("_checkpointer.py")

    tt_logger = logging.getLogger("torchtune.utils._logging")  # what torchtune's get_logger returns
    tt_logger.addFilter(keep)
    try:
        yield
    finally:
        tt_logger.removeFilter(keep)


class CheckpointManager:
    """Saves and finds atomic step checkpoints for one run.

    Args:
        cfg_checkpointer (DictConfig): the recipe's ``checkpointer`` config; it
            is instantiated once here with its ``output_dir`` redirected to the
            staging folder.
        output_dir (str): the run's output folder.
        keep_last_n (int, optional): keep this many newest checkpoints; None keeps all.
        run_config (DictConfig, optional): the run's config, saved (resolved)
            with every checkpoint so that a resume can tell what changed.
        dp_world_size (int): data-parallel ranks of this run.
        hash_files (bool): record each file's SHA-256 in the manifest (the
            ``verify_checkpoint_hashes`` key): a pass over the checkpoint's bytes
            right after writing them, about 1.1 s per 1.5 GiB on an idle core.
        sharded_load (bool): a sharded checkpoint resumes shard by shard
            (:meth:`load` returns a :class:`ShardedStateDict`; a distributed
            recipe); False: its tensors are read whole (one process).
        sharded_saves (bool): this run saves with :meth:`save_sharded` (its
            checkpointer then need not read the base weights of a full fine-tune).
        asynchronous (bool): :meth:`save_sharded` may return while the shards
            are written; a process group of its own carries the save's collectives.
    """

    def __init__(self, cfg_checkpointer: DictConfig, output_dir: str, keep_last_n: Optional[int] = None, *,
                 run_config: Optional[DictConfig] = None, dp_world_size: int = 1, hash_files: bool = True,
                 sharded_load: bool = False, sharded_saves: bool = False, asynchronous: bool = False):
        self.output_dir = Path(output_dir)
        self.staging = self.output_dir / STAGING
        self.keep_last_n = keep_last_n
        self._cfg = cfg_checkpointer
        self._checkpointer = None
        self._run_config = OmegaConf.to_container(run_config, resolve=True) if run_config is not None else None
        # The config's relative paths (the base checkpoint, the tokenizer) are relative to this folder: an export
        # on request run from elsewhere reads them from here (hf_export.export_step)
        self._run_dir = os.getcwd()
        self._dp_world_size = dp_world_size
        self._hash_files = hash_files
        self._chat_template: Optional[str] = None  # what training's tokenizer writes; "" if nothing to save
        self._sharded_load, self._sharded_saves = sharded_load, sharded_saves
        self._pending: Optional[Future] = None  # the asynchronous save in flight
        self._executor: Optional[ThreadPoolExecutor] = None
        self._group: Any = None
        if asynchronous:
            # One worker: at most one save in flight. Its collectives go through a gloo group of their
            # own, so that they never interleave with training's on the default group (and run on CPU
            # tensors under nccl too). Creating it is a collective: every rank builds its manager here.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            if ranks.several_processes():
                self._group = dist.new_group(backend="gloo")

    @classmethod
    def from_config(cls, cfg: DictConfig, dp_world_size: int = 1, distributed: bool = False) -> "CheckpointManager":
        """The manager of a validated recipe config (``checkpointer``, ``output_dir``,
        ``keep_last_n_checkpoints``, ``verify_checkpoint_hashes``, ``sharded_checkpoints``,
        ``enable_async_checkpointing``); ``distributed``: a distributed recipe's run."""
        sharded = bool(cfg.get("sharded_checkpoints", False))
        return cls(cfg.checkpointer, cfg.output_dir, cfg.keep_last_n_checkpoints, run_config=cfg,
                   dp_world_size=dp_world_size, hash_files=cfg.get("verify_checkpoint_hashes", True),
                   sharded_load=distributed, sharded_saves=sharded,
                   asynchronous=sharded and bool(cfg.get("enable_async_checkpointing", False)))

    def load(self, resume_from: Optional[Path] = None, adapter: bool = False) -> Dict[str, Any]:
        """Load the model through the configured torchtune checkpointer.

        Args:
            resume_from: a checkpoint folder of this run; None loads the base
                checkpoint named in the config.
            adapter: LoRA: the model always comes from the base checkpoint,
                and with ``resume_from`` the adapter from that folder.

        Returns:
            what ``checkpointer.load_checkpoint()`` returns: ``model`` (key
            ``training.MODEL_KEY``), and for ``adapter`` with ``resume_from``
            also the adapter state dict in torchtune key names
            (``training.ADAPTER_KEY``).

        Raises:
            ConfigError: (key ``resume_from_checkpoint``) if ``resume_from``
                fails :func:`verify_checkpoint`, or holds no adapter when one
                is asked for; (key ``output_dir``) if a file is where the
                staging folder goes.

        The same checkpointer instance later writes the checkpoints (it needs
        the base checkpoint's weight map), into the staging folder.
        """
        if self.staging.exists() and not self.staging.is_dir():
            raise ConfigError("output_dir", f"{self._staging_is_a_file()}: move or delete the file")
        overrides: Dict[str, Any] = {"output_dir": str(self.staging)}
        if resume_from is not None and is_sharded(resume_from):
            return self._load_sharded(resume_from, adapter, overrides)
        if resume_from is not None:
            manifest = verify_checkpoint(resume_from)
            adapter_file = next((n for n in (ADAPTER_WEIGHTS, "adapter_model.pt")  # earlier layout: top level
                                 if n in manifest["files"]), None)
            if adapter and adapter_file is None:
                raise ConfigError("resume_from_checkpoint", f"checkpoint '{resume_from}' holds no "
                                  f"{ADAPTER_WEIGHTS}; it was not written by a LoRA recipe")
            if not adapter and adapter_file is not None:
                raise ConfigError("resume_from_checkpoint", f"'{resume_from}' was written by a LoRA recipe (it "
                                  f"holds {adapter_file}): its optimizer state is the adapter's, which a full "
                                  "fine-tune cannot continue; resume it with a LoRA recipe")
            if not adapter:
                overrides["checkpoint_dir"] = str(resume_from)
                overrides["checkpoint_files"] = sorted(  # HF safetensors, or Meta's .bin / .pth
                    n for n in manifest["files"]
                    if "/" not in n and n.endswith((".safetensors", ".bin", ".pth")) and not n.startswith("adapter")
                )
        source = Path(overrides.get("checkpoint_dir", self._cfg.get("checkpoint_dir", "")))
        try:
            self._checkpointer = tt_config.instantiate(self._cfg, **overrides)
            state = self._checkpointer.load_checkpoint()
        except Exception as err:
            raise _unreadable(source, err, resume_from is not None and not adapter) from err
        if adapter and resume_from is not None:
            try:
                state[training.ADAPTER_KEY] = torch.load(
                    resume_from / adapter_file, map_location="cpu", weights_only=True
                )
            except Exception as err:
                raise ConfigError("resume_from_checkpoint", f"'{resume_from / adapter_file}' cannot be read "
                                  f"({short(err)}).{intact_before(resume_from)}") from err
        return state

    def _load_sharded(self, resume_from: Path, adapter: bool, overrides: Dict[str, Any]) -> Dict[str, Any]:
        """:meth:`load` of a sharded checkpoint: the model's (or adapter's) tensors as a
        :class:`ShardedStateDict`, or read whole in one process; the checkpointer built on the base checkpoint."""
        verify_checkpoint(resume_from)
        saved = sharded_state_dict(resume_from)
        lora = any(is_adapter_key(k) for k in saved)
        if adapter and not lora:
            raise ConfigError("resume_from_checkpoint", f"checkpoint '{resume_from}' holds no adapter; it was not "
                              "written by a LoRA recipe")
        if not adapter and lora:
            raise ConfigError("resume_from_checkpoint", f"'{resume_from}' was written by a LoRA recipe (it holds an "
                              "adapter): its optimizer state is the adapter's, which a full fine-tune cannot "
                              "continue; resume it with a LoRA recipe")
        if not adapter:  # the whole model is in the shards: the base checkpoint's weights are not needed
            saved = sharded_state_dict(resume_from, [k for k in saved if not is_adapter_key(k)])
        else:
            saved = sharded_state_dict(resume_from, [k for k in saved if is_adapter_key(k)])
        source = Path(self._cfg.get("checkpoint_dir", ""))
        try:
            self._checkpointer = tt_config.instantiate(self._cfg, **overrides)
            # LoRA trains on the base weights; gathered saves need the checkpointer to have read its
            # base checkpoint once (torchtune keeps the weight map of its files then)
            state = self._checkpointer.load_checkpoint() if adapter or not self._sharded_saves else {}
        except Exception as err:
            raise _unreadable(source, err, False) from err
        tensors = saved if self._sharded_load else read_full_tensors(resume_from, saved)
        if adapter:
            return {training.MODEL_KEY: state[training.MODEL_KEY], training.ADAPTER_KEY: tensors}
        return {training.MODEL_KEY: tensors}

    def announce(self, checkpoint_bytes: int, progress: Progress, loader: Any, cfg: DictConfig, *,
                 save_memory: Tuple[int, Optional[int]] = (0, None)) -> None:
        """Log the disk use to expect at start-up; refuse to start without room for one checkpoint.

        Call it on every rank (one collective), after :meth:`load`. Removes the
        empty staging folder that building the checkpointer made.

        Args:
            checkpoint_bytes: one checkpoint's tensors (:func:`expected_checkpoint_bytes`); the
                copied config and tokenizer files are added here.
            progress: where the run starts (``total_steps`` already planned).
            loader: the run's :class:`torchtune_ext.data.StepLoader`.
            cfg: the recipe config (``epochs``, ``save_every_n_steps``, ``save_final_checkpoint``).
            save_memory: this rank's ``(bytes, available)``: the CPU memory a
                save needs on top of training (:func:`save_memory_bytes`) and
                the memory available (None: unknown).

        Raises:
            DiskSpaceError: if ``output_dir`` has less free space than one checkpoint.
            ConfigError: (key ``sharded_checkpoints``) rank 0 has not the CPU
                memory to gather a checkpoint; (``enable_async_checkpointing``)
                a rank has not the memory to copy its shards; on every rank.
        """
        checkpoint_bytes += self._copied_bytes()
        saves = len(planned_save_steps(progress, loader, cfg))
        existing = len(list_checkpoints(str(self.output_dir)))
        on_disk = existing + saves
        if self.keep_last_n is not None:  # a new checkpoint is complete before the oldest goes
            on_disk = min(on_disk, self.keep_last_n + 1)
        to_come = max(on_disk - existing, 0)  # the free space already excludes the existing ones
        # Rank 0's figure on every rank, so that all ranks refuse together. By then every rank
        # has built its checkpointer (load), which makes the staging folder; see below.
        free = _from_rank_zero(shutil.disk_usage(_existing_parent(self.output_dir)).free)
        if free < checkpoint_bytes:
            raise DiskSpaceError("output_dir", f"not enough free disk space for one checkpoint in "
                                 f"'{self.output_dir}': it needs about {format_bytes(checkpoint_bytes)}, "
                                 f"{format_bytes(free)} are free. Free some space or choose another output_dir")
        self._check_save_memory(save_memory, saves)
        kept = (f"the newest {self.keep_last_n} kept" if self.keep_last_n is not None else "none deleted")
        line = (f"Checkpoints: about {format_bytes(checkpoint_bytes)} each, {saves} to write, {kept} "
                f"(keep_last_n_checkpoints={self.keep_last_n if self.keep_last_n is not None else 'null'}): "
                f"up to {format_bytes(on_disk * checkpoint_bytes)} in '{self.output_dir}', "
                f"{format_bytes(free)} free")
        if not ranks.is_rank_zero():
            return
        try:  # each save makes it again: a run that saves nothing leaves no empty staging folder
            self.staging.rmdir()
        except OSError:
            pass  # not empty: an interrupted save's, which the next save clears
        if free < to_come * checkpoint_bytes:
            # a new checkpoint is complete before the oldest goes: with 1 kept, 2 are on disk at times
            lower = "lower keep_last_n_checkpoints or " if self.keep_last_n is None or self.keep_last_n > 1 else ""
            log.warning(f"{line}: not enough for all of them; {lower}free some space")
        else:
            log.info(line)

    def save(self, state_dict: Dict[str, Any], progress: Progress, optimizer_state: Dict[str, Any], *,
             rng_by_rank: Optional[List[Dict[str, Any]]] = None, adapter_only: bool = False,
             suspect_from: Optional[int] = None) -> Path:
        """Write ``step_<progress.step>`` atomically (rank 0 writes; every rank gets the outcome).

        Args:
            state_dict: what the torchtune checkpointer saves: ``model`` (full
                state dict on CPU; may be empty on ranks other than 0) and for
                LoRA ``adapter`` and ``adapter_config``.
            progress: step counters and data position.
            optimizer_state: the full optimizer state dict (may be empty on
                ranks other than 0).
            rng_by_rank: every rank's :func:`rng_state`, in rank order; None:
                this process's (one rank).
            adapter_only: LoRA: save only the adapter (no merged model).
            suspect_from: the first optimizer step whose parameters the health
                checks distrust (``StepHealth.suspect_from``); pruning then also
                keeps the newest checkpoint from before it, the one to resume from.

        Returns:
            Path of the checkpoint folder. A step saved already (the end of an
            epoch right after a periodic save) is not written again.

        Raises:
            CheckpointSaveError: if the checkpoint does not fit in the free
                space (checked before writing), the disk filled up while
                writing, or a write failed (an ``OSError``, or torch.save's or
                safetensors' report of one; also from clearing the staging
                folder, a file in its place, the rename into ``step_<N>`` and
                syncing ``output_dir``); the staging folder is removed and
                earlier checkpoints are intact.
            Any other error (a bug), after removing the staging folder.
            All ranks raise (ranks other than 0 a ``RuntimeError`` with rank 0's message).
        """
        final = self.output_dir / f"step_{progress.step}"
        outcome: Any = None
        if ranks.is_rank_zero():
            try:
                outcome = self._write(final, state_dict, progress, optimizer_state, rng_by_rank, adapter_only,
                                      suspect_from)
            except BaseException as err:
                # exceptions do not all pickle: send what the other ranks raise
                if isinstance(err, ConfigError):
                    _from_rank_zero((type(err), err.key, str(err).split(": ", 1)[1]))
                elif isinstance(err, CheckpointSaveError):
                    _from_rank_zero((CheckpointSaveError, None, str(err)))
                else:
                    _from_rank_zero((RuntimeError, None,
                                     f"saving {final} failed on rank 0: {type(err).__name__}: {err}"))
                raise
        outcome = _from_rank_zero(outcome)
        if outcome is not None:
            error_type, key, message = outcome
            raise error_type(key, message) if key is not None else error_type(message)
        return final

    # ------------------------------------------------------------ sharded saves
    def save_sharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress, *,
                     rng_by_rank: Optional[List[Dict[str, Any]]] = None, keys: Optional[Iterable[str]] = None,
                     export: Optional[Callable[[Path, int, int], List[str]]] = None, export_bytes: int = 0,
                     asynchronous: bool = False, suspect_from: Optional[int] = None) -> Path:
        """Write ``step_<progress.step>`` as a sharded checkpoint: every rank writes its own shards (DCP).

        Call it on every rank. Nothing is gathered: each rank writes the
        shards of the model and optimizer state it holds into
        ``dcp/`` (:mod:`torchtune_ext.checkpoint.sharded`), rank 0 the
        progress and RNG states (``recipe_state.pt``); each rank hashes the
        files it wrote; rank 0 writes the manifest once every rank's files
        are complete, and only then renames the staging folder into place,
        as :meth:`save` does (a kill at any point leaves earlier checkpoints
        intact). Free space is checked first against the sum of every rank's
        shards (and ``export_bytes``).

        Args:
            model, optimizer: this rank's (FSDP2-sharded) model and its optimizer.
            progress: step counters and data position (copied now).
            rng_by_rank: every rank's :func:`rng_state`, in rank order (rank 0 needs them); None: this process's.
            keys: the model keys to save (LoRA with ``save_adapter_weights_only``: the adapter); None: all.
            export: writes this rank's share of a Hugging Face folder into the
                staging folder, ``export(folder, rank, world_size)`` -> the names
                it wrote (:func:`torchtune_ext.checkpoint.hf_export.export_hf`);
                the final checkpoint's. Not with ``asynchronous``.
            export_bytes: what ``export`` writes in all, for the free-space check.
            asynchronous: return once this rank's shards are copied (in CPU
                memory); the write, the hashes, the manifest and the rename go on
                in a thread while training continues. The next save, or
                :meth:`wait`, waits for it first (at most one in flight).
            suspect_from: as in :meth:`save`.

        Returns:
            Path of the checkpoint folder (complete, or being written with ``asynchronous``).

        Raises:
            CheckpointSaveError: on every rank when a write failed on any rank
                (a full disk included; the message names the rank), or there
                is not enough free space; the staging folder is removed.
                With ``asynchronous``, a failure of the write is raised by the
                next :meth:`save_sharded` or :meth:`wait`.
            RuntimeError: on every rank, anything else a rank raised while saving (a bug).
        """
        self.wait()  # at most one save in flight; a failure of the previous one is raised here
        final = self.output_dir / f"step_{progress.step}"
        if _from_rank_zero((final / MANIFEST).is_file()):
            return final  # this step is saved already
        start = time.perf_counter()
        state = local_state(model, optimizer, keys)
        needed = sum(_from_every_rank(local_bytes(state))) + export_bytes + self._copied_bytes() + 2**20
        written = self.staging / f"epoch_{progress.step}"
        recipe_state = self._recipe_state(progress, None, rng_by_rank)
        recipe_state["format"] = SHARDED_FORMAT  # the optimizer state is in the shards
        failure = None
        if ranks.is_rank_zero():
            failure = self._capture(final, lambda: self._prepare_staging(final, written, needed, recipe_state),
                                    written=False)
        self._raise_agreed(final, _from_every_rank(failure), needed)
        if asynchronous and self._executor is not None:
            try:  # copies this rank's shards to CPU memory now; writes them in DCP's thread
                upload = dcp.async_save(state, checkpoint_id=str(written / DCP_DIR), process_group=self._group)
            except BaseException as err:  # a failure to start: DCP reports it on every rank
                upload = _failed_future(err)
            self._pending = self._executor.submit(self._finish_sharded, final, written, upload, None, needed,
                                                  suspect_from, start, asynchronous=True)
            return final
        try:
            dcp.save(state, checkpoint_id=str(written / DCP_DIR))
            upload = None
        except BaseException as err:  # DCP's CheckpointException (a BaseException) carries every rank's failure
            upload = _failed_future(err)
        self._finish_sharded(final, written, upload, export, needed, suspect_from, start)
        return final

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any.

        Raises:
            CheckpointSaveError: (every rank) that save failed; earlier checkpoints are intact.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for a save in flight (a failure is logged: the run is ending anyway), then stop its thread."""
        try:
            self.wait()
        except Exception as err:
            log.error(str(err))
        if self._executor is not None:
            self._executor.shutdown()

    def _recipe_state(self, progress: Progress, optimizer_state: Optional[Dict[str, Any]],
                      rng_by_rank: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
        """``recipe_state.pt`` (:class:`ResumeState` reads it back)."""
        return {
            "progress": asdict(progress),
            training.OPT_KEY: optimizer_state,
            "rng": rng_state() if rng_by_rank is None else rng_by_rank[0],
            "rng_by_rank": [rng_state()] if rng_by_rank is None else rng_by_rank,
            "dp_world_size": self._dp_world_size,
            "config": self._run_config,
            "run_dir": self._run_dir,
        }

    def _prepare_staging(self, final: Path, written: Path, needed: int, recipe_state: Dict[str, Any]) -> None:
        """Rank 0, before any shard is written: a clean staging folder, room for ``needed`` bytes, recipe_state.pt."""
        self._clear_way(final)
        free = shutil.disk_usage(self.output_dir).free
        if free < needed:
            raise self._disk_space_error(final, needed, free)
        written.mkdir(parents=True)
        torch.save(recipe_state, written / RECIPE_STATE)

    def _capture(self, final: Path, work: Callable[[], Any], written: bool = True) -> Optional[Tuple[str, ...]]:
        """Run ``work``; None if it succeeded, else what failed, in a form every rank can be sent."""
        try:
            work()
            return None
        except BaseException as err:
            return self._describe_failure(final, err, written)

    def _describe_failure(self, final: Path, err: BaseException, written: bool = True) -> Tuple[str, ...]:
        """``(kind, detail, rank)`` of a failed save step: ``done`` (a finished error: its class and message),
        ``full``, ``write`` or ``bug``. DCP's error names the rank that failed."""
        if isinstance(err, CheckpointSaveError):
            return ("done", str(err), str(ranks.rank()))
        rank, cause = min(failed_ranks(err).items())
        if is_disk_full(cause):
            return ("full", short(cause), str(rank), str(written))
        if isinstance(cause, Exception) and is_write_failure(cause):
            return ("write", short(cause), str(rank), str(written))
        return ("bug", f"{type(cause).__name__}: {cause}", str(rank), str(written))

    def _raise_agreed(self, final: Path, failures: List[Optional[Tuple[str, ...]]], needed: int,
                      group: Any = None) -> None:
        """Every rank raises the same error if any rank's step failed (rank 0 removes the staging folder first)."""
        failure = next((f for f in failures if f is not None), None)
        if failure is None:
            return
        error: Optional[Tuple[str, str]] = None
        if ranks.is_rank_zero():
            shutil.rmtree(self.staging, ignore_errors=True)
            error = self._failure_error(final, failure, needed)
        error = _from_rank_zero(error, group)
        if error[0] == "bug":
            raise RuntimeError(error[1])
        raise CheckpointSaveError(error[1])

    def _failure_error(self, final: Path, failure: Tuple[str, ...], needed: int) -> Tuple[str, str]:
        """(``bug`` or ``save``, the message) of a failed sharded save, once the staging folder is gone."""
        kind, detail, rank = failure[:3]
        if kind == "done":
            return "save", detail
        written = failure[3] == "True"
        where = f" on rank {rank}" if ranks.several_processes() else ""
        if kind == "bug":
            return "bug", f"saving {final.name} failed{where}: {detail}"
        if kind == "full":
            free = shutil.disk_usage(_existing_parent(self.output_dir)).free
            return "save", (f"the disk filled up while saving {final.name} in output_dir '{self.output_dir}'{where} "
                            f"({detail}): it needs about {format_bytes(needed)}, {format_bytes(free)} are free now; "
                            f"{self._after_failure(self._free_space_advice(), written=written)}")
        return "save", (f"saving {final.name} in output_dir '{self.output_dir}' failed{where} ({detail}): "
                        f"{self._after_failure(written=written)}")

    def _finish_sharded(self, final: Path, written: Path, upload: Optional[Future],
                        export: Optional[Callable[[Path, int, int], List[str]]], needed: int,
                        suspect_from: Optional[int], start: float, asynchronous: bool = False) -> None:
        """After the shards are written (``upload`` done): the export, each rank's hashes, then rank 0's
        manifest, rename and pruning; every rank raises the same error if any rank failed.
        ``asynchronous``: in the save's thread, while training goes on (its log line says so)."""
        group, rank = self._group, ranks.rank()
        failure = None
        if upload is not None:
            failure = self._capture(final, upload.result)
        self._raise_agreed(final, _from_every_rank(failure, group), needed, group)
        files: Dict[str, Tuple[int, Optional[str]]] = {}

        def hash_own_files() -> None:
            mine = export(written, rank, ranks.process_group_size()) if export is not None else []
            if export is not None and rank == 0:
                self._save_chat_template(written)  # over the tokenizer files the export copied
            mine += [f"{DCP_DIR}/{p.name}" for p in (written / DCP_DIR).iterdir()
                     if p.name.endswith(".distcp") and file_owner(p.name) == rank]
            files.update(self._hashes(written, mine))

        failure = self._capture(final, hash_own_files)
        everyone = _from_every_rank((failure, files), group)
        self._raise_agreed(final, [f for f, _ in everyone], needed, group)
        failure = None
        if rank == 0:
            hashed = {name: entry for _, theirs in everyone for name, entry in theirs.items()}
            failure = self._capture(final, lambda: self._complete(final, written, hashed, start, suspect_from,
                                                                  asynchronous=asynchronous))
        self._raise_agreed(final, [_from_rank_zero(failure, group)], needed, group)

    def _hashes(self, folder: Path, names: Iterable[str]) -> Dict[str, Tuple[int, Optional[str]]]:
        """name -> (size, SHA-256 or None without ``verify_checkpoint_hashes``) of files under ``folder``."""
        return {name: ((folder / name).stat().st_size, file_sha256(folder / name) if self._hash_files else None)
                for name in names}

    def _complete(self, final: Path, written: Path, hashed: Dict[str, Tuple[int, Optional[str]]], start: float,
                  suspect_from: Optional[int], asynchronous: bool = False) -> None:
        """Rank 0: hash what no rank hashed (its small files, ``.metadata``), write the manifest, rename into place.

        ``asynchronous``: the log line says the checkpoint was written in the background (training went on
        meanwhile, so its time is not a pause of training, and the line comes some steps after the save's step).
        """
        make_readable(written)
        names = [p.relative_to(written).as_posix() for p in sorted(written.rglob("*")) if p.is_file()]
        hashed.update(self._hashes(written, [n for n in names if n not in hashed and n != MANIFEST]))
        files = {name: hashed[name][0] for name in names if name in hashed}
        manifest: Dict[str, Any] = {"step": int(final.name.split("_")[1]), "files": files, "format": SHARDED_FORMAT}
        if self._hash_files:
            manifest[HASHES] = {name: hashed[name][1] for name in files}
        _write_synced(written / MANIFEST, json.dumps(manifest, indent=1))
        os.replace(written, final)
        shutil.rmtree(self.staging, ignore_errors=True)
        _fsync_dir(self.output_dir)
        background = ", written in the background while training went on" if asynchronous else ""
        log.info(f"Checkpoint saved: {final} ({format_bytes(sum(files.values()))} in "
                 f"{time.perf_counter() - start:.1f} s, sharded over {ranks.process_group_size()} ranks{background})")
        self._prune(keep=final, suspect_from=suspect_from)

    def _clear_way(self, final: Path) -> None:
        """Before a save writes anything: a folder in the way of ``final`` (no manifest) moved aside, the
        staging folder of an interrupted save removed.

        Raises:
            CheckpointSaveError: a file is where the staging folder goes, or an ``OSError``.
        """
        try:  # a failure here is a failed save too, only with nothing written yet
            if final.exists():  # not written by a save (no manifest): keep it, under another name
                aside = final.with_name(f"{final.name}.incomplete")
                while aside.exists():
                    aside = aside.with_name(aside.name + "+")
                os.replace(final, aside)
                log.warning("'%s' was not a complete checkpoint (no %s); it is kept as '%s'.", final, MANIFEST, aside)
            if self.staging.is_dir():
                shutil.rmtree(self.staging)  # left by an interrupted save
            elif self.staging.exists():  # made since start-up, where load() refuses it
                raise CheckpointSaveError(f"saving {final.name} failed before writing: {self._staging_is_a_file()}: "
                                          f"{self._after_failure('move or delete the file', written=False)}")
        except OSError as err:
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed before "
                                      f"writing ({short(err)}): {self._after_failure(written=False)}") from err

    def _write(self, final: Path, state_dict: Dict[str, Any], progress: Progress, optimizer_state: Dict[str, Any],
               rng_by_rank: Optional[List[Dict[str, Any]]], adapter_only: bool,
               suspect_from: Optional[int] = None) -> None:
        if (final / MANIFEST).is_file():
            return  # this step is saved already
        self._clear_way(final)
        try:
            free = shutil.disk_usage(self.output_dir).free
        except OSError as err:
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed before "
                                      f"writing ({short(err)}): {self._after_failure(written=False)}") from err
        needed = self._needed_bytes(state_dict, optimizer_state)
        if free < needed:
            raise self._disk_space_error(final, needed, free)
        recipe_state = self._recipe_state(progress, optimizer_state, rng_by_rank)
        start = time.perf_counter()
        written = self.staging / f"epoch_{progress.step}"  # torchtune's checkpointer names it after "epoch"
        try:
            with _quiet_torchtune_checkpointer():
                self._checkpointer.save_checkpoint(state_dict, epoch=progress.step, adapter_only=adapter_only)
            if (written / "adapter_model.pt").is_file():
                arrange_lora_folder(written, self._cfg)
            self._save_chat_template(written)
            torch.save(recipe_state, written / RECIPE_STATE)
            # torchtune copies the non-weight files of the folder it loaded from, so a resumed
            # run's staging folder holds the previous manifest: never list the manifest itself
            (written / MANIFEST).unlink(missing_ok=True)
            make_readable(written)
            files = {p.relative_to(written).as_posix(): p.stat().st_size
                     for p in sorted(written.rglob("*")) if p.is_file()}
            # Read back right after writing: the bytes are still in the page cache, so this costs a pass
            # of SHA-256 over memory, not a read from disk (README "Checkpoints" has the measured cost).
            hashed = time.perf_counter()
            manifest = {"step": progress.step, "files": files}
            if self._hash_files:
                manifest[HASHES] = {name: file_sha256(written / name) for name in files}
            hash_seconds = time.perf_counter() - hashed
            _write_synced(written / MANIFEST, json.dumps(manifest, indent=1))
        except BaseException as err:
            try:  # the folder may be gone or unreadable too: that must not hide the error
                staged = [p for p in self.staging.rglob("*") if p.is_file()]
                partial, wrote = sum(p.stat().st_size for p in staged), bool(staged)
                free_now: Optional[int] = shutil.disk_usage(self.output_dir).free
            except OSError:
                partial, wrote, free_now = 0, True, None
            shutil.rmtree(self.staging, ignore_errors=True)
            if not (isinstance(err, Exception) and is_write_failure(err)):
                raise
            # torch.save reports a full disk as a bare RuntimeError: the free space tells
            if is_disk_full(err) or (free_now is not None and free_now < needed - partial):
                raise self._disk_space_error(final, needed, (free_now or 0) + partial, cause=err) from err
            fix = "fix the cause" if isinstance(err, OSError) else WRITE_ADVICE
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed "
                                      f"({short(err)}): {self._after_failure(fix, written=wrote)}") from err
        try:
            os.replace(written, final)
        except OSError as err:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed when moving "
                                      f"it into place ({short(err)}): {self._after_failure()}") from err
        shutil.rmtree(self.staging, ignore_errors=True)
        try:
            _fsync_dir(self.output_dir)
        except OSError as err:
            raise CheckpointSaveError(f"saving {final.name} in output_dir '{self.output_dir}' failed: the folder "
                                      f"could not be synced to disk ({short(err)}); {final} is complete but may "
                                      f"not survive a crash of the machine: fix the cause, then continue with "
                                      f"resume_from_checkpoint=true") from err
        hashing = f", of which {hash_seconds:.1f} s for the SHA-256 of its files" if self._hash_files else ""
        log.info(f"Checkpoint saved: {final} ({format_bytes(sum(files.values()))} in "
                 f"{time.perf_counter() - start:.1f} s{hashing})")
        self._prune(keep=final, suspect_from=suspect_from)

    def _save_chat_template(self, folder: Path) -> None:
        """torchtune copies the base folder's tokenizer files, whose chat template may not be the format
        training wrote (SmolLM2's adds a default system prompt): save the training tokenizer's instead."""
        if self._run_config is None:
            return
        if self._chat_template is None:  # built once, at the first save
            self._chat_template = training_chat_template(self._run_config) or ""
        if self._chat_template:
            write_chat_template(folder, self._chat_template)

    def _staging_is_a_file(self) -> str:
        return f"'{self.staging}' is a file, but saves stage each checkpoint in a folder of that name"

    def _check_save_memory(self, save_memory: Tuple[int, Optional[int]], saves: int) -> None:
        """Refuse on every rank when some rank has not the CPU memory one save needs (see :meth:`announce`)."""
        every = _from_every_rank(tuple(save_memory))
        short = [(rank, need, free) for rank, (need, free) in enumerate(every) if free is not None and need > free]
        if saves and short:
            rank, need, free = short[0]
            if self._sharded_saves:
                raise ConfigError("enable_async_checkpointing", f"rank {rank} copies its shards to CPU memory to "
                                  f"save in the background: about {format_bytes(need)}, {format_bytes(free)} "
                                  "available. Set enable_async_checkpointing=false (the shards are written from "
                                  "where they are)")
            raise ConfigError("sharded_checkpoints", f"a gathered checkpoint puts the whole model and optimizer "
                              f"state in rank 0's CPU memory: about {format_bytes(need)}, {format_bytes(free)} "
                              "available. Set sharded_checkpoints=true (each rank writes its own shards)")
        if ranks.is_rank_zero() and save_memory[0]:
            where = "each rank's shards copied" if self._sharded_saves else "gathered on rank 0"
            log.info(f"Each save holds about {format_bytes(save_memory[0])} of CPU memory ({where}); "
                     f"{format_bytes(save_memory[1]) if save_memory[1] is not None else 'unknown'} available")

    def _copied_bytes(self) -> int:
        """The small files torchtune copies from the folder it loaded from (config, tokenizer)."""
        source = getattr(self._checkpointer, "_checkpoint_dir", None)
        if source is None or not Path(source).is_dir():
            return 0
        return sum(p.stat().st_size for p in Path(source).iterdir()
                   if p.is_file() and p.suffix not in (".safetensors", ".bin", ".pt", ".pth"))

    def _needed_bytes(self, state_dict: Dict[str, Any], optimizer_state: Dict[str, Any]) -> int:
        # torchtune writes the adapter twice (.pt and PEFT .safetensors)
        return (tensor_bytes(state_dict) + tensor_bytes(state_dict.get(training.ADAPTER_KEY))
                + tensor_bytes(optimizer_state) + self._copied_bytes() + 2**20)

    def _disk_space_error(self, final: Path, needed: int, free: int,
                          cause: Optional[BaseException] = None) -> CheckpointSaveError:
        if cause is None:
            what = f"not enough free disk space to save {final.name} in output_dir '{self.output_dir}'"
            now = ""
        else:
            what = f"the disk filled up while saving {final.name} in output_dir '{self.output_dir}' ({cause})"
            now = " now"
        after = self._after_failure(self._free_space_advice(), written=cause is not None)
        return CheckpointSaveError(f"{what}: it needs about {format_bytes(needed)}, {format_bytes(free)} are "
                                   f"free{now}; {after}")

    def _free_space_advice(self) -> str:
        """How to make room for the next save. Old checkpoints go only after a new one is complete,
        so keep_last_n_checkpoints cannot make room for this one; older checkpoints on disk can."""
        try:
            older = list_checkpoints(str(self.output_dir))[:-1]
        except (OSError, ConfigError):
            older = []
        if not older:
            return "free some space"
        names = ", ".join(p.name for p in older[:3]) + (", ..." if len(older) > 3 else "")
        which = "the older one" if len(older) == 1 else f"the {len(older)} older ones"
        return (f"free some space (resuming needs only the newest checkpoint: {which}, {names}, "
                f"can be deleted; a lower keep_last_n_checkpoints keeps fewer from then on)")

    def _after_failure(self, fix: str = "fix the cause", written: bool = True) -> str:
        """What is left after a failed save and how to go on (the end of the error's message)."""
        if not written:
            done = "nothing was written"
        elif self.staging.exists():
            done = f"the partial checkpoint in '{self.staging}' could not be removed (delete it)"
        else:
            done = "the partial checkpoint was removed"
        try:
            previous = latest_checkpoint(str(self.output_dir))
        except (OSError, ConfigError) as err:
            return f"{done}; the earlier checkpoints could not be listed ({short(err)}): {fix}, then resume"
        if previous is None:
            return f"{done} and no checkpoint of this run exists yet: {fix}, then start the run again"
        return f"{done} and {previous} is intact: {fix}, then continue with resume_from_checkpoint=true"

    def _prune(self, keep: Path, suspect_from: Optional[int] = None) -> None:
        if self.keep_last_n is None:
            return
        try:
            found = list_checkpoints(str(self.output_dir))
        except ConfigError as err:  # the new checkpoint is complete: training can go on
            log.warning(f"keep_last_n_checkpoints={self.keep_last_n}: old checkpoints were not pruned: {err}")
            return
        protected = {keep}  # the checkpoint a resume would start from stays, whatever the numbering
        if suspect_from is not None:  # and the last one saved before the health checks' first bad sign
            protected.update([p for p in found if int(p.name.split("_")[1]) < suspect_from][-1:])
        for old in found[: -self.keep_last_n]:
            if old in protected:
                continue
            try:
                shutil.rmtree(old)
            except OSError as err:  # the new checkpoint is complete: training can go on
                what = ("could not be deleted" if (old / MANIFEST).is_file() else
                        f"was deleted only in part (its {MANIFEST} is gone: what is left is not a checkpoint)")
                log.warning(f"keep_last_n_checkpoints={self.keep_last_n}: the old checkpoint '{old}' {what} "
                            f"({short(err)}); delete it by hand")


def _unreadable(folder: Path, err: BaseException, resuming: bool) -> ConfigError:
    """The error for a checkpoint folder the torchtune checkpointer could not load."""
    detail = short(err)
    if isinstance(err, RuntimeError) and "shape" in str(err) and "is invalid for input of size" in str(err):
        # convert_weights reshapes q/k by the head counts of config.json
        try:
            hf = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            hf = {}
        dims = ", ".join(f"{k}={hf[k]}" for k in ("num_attention_heads", "num_key_value_heads", "hidden_size",
                                                    "head_dim") if k in hf)
        detail = (f"the weights do not fit '{folder / 'config.json'}' ({dims}): {detail}. config.json must "
                  "describe the checkpoint's architecture")
    elif resuming:
        return ConfigError("resume_from_checkpoint", f"checkpoint '{folder}' cannot be loaded: {detail}."
                           + intact_before(folder))
    return ConfigError("checkpointer.checkpoint_dir", f"cannot load the checkpoint in '{folder}': {detail}")


def _failed_future(err: BaseException) -> Future:
    """A future that raises ``err``: a failure to start a save is reported where its outcome is awaited."""
    future: Future = Future()
    future.set_exception(err)
    return future


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def make_readable(folder: Path) -> None:
    """Give every file under ``folder`` the permissions of a newly created file (0666 less the umask), and
    ``folder`` and the folders under it those of a newly created folder (0777 less the umask).

    Some writers (safetensors, temporary files and folders) create them
    readable only by their owner; a checkpoint is for others to load too.
    """
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
        elif path.is_dir() and not path.is_symlink():
            path.chmod(0o777 & ~umask)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
