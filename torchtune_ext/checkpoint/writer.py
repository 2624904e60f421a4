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
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
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
from torchtune_ext.checkpoint.files import fsync_dir, make_readable, write_synced
from torchtune_ext.checkpoint.lora_export import arrange_lora_folder
from torchtune_ext.checkpoint.progress import Progress
from torchtune_ext.checkpoint.rng import rng_state
from torchtune_ext.checkpoint.sharded import (
    is_adapter_key,
    is_sharded,
    read_full_tensors,
    sharded_state_dict,
)
from torchtune_ext.checkpoint.sharded_save import ShardedSaves
from torchtune_ext.checkpoint.sizing import tensor_bytes
from torchtune_ext.checkpoint.tokenizer_files import write_chat_template
from torchtune_ext.errors import CheckpointSaveError, ConfigError, UserError
from torchtune_ext.text import format_bytes, short

log = get_logger()  # torchtune's logger, which the recipes' lines go through too


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


class CheckpointManager(ShardedSaves):
    """Saves and finds atomic step checkpoints for one run.

    Args:
        cfg_checkpointer (DictConfig): the recipe's ``checkpointer`` config; it
            is instantiated once here with its ``output_dir`` redirected to the
            staging folder.
        output_dir (str): the run's output folder.
        keep_last_n (int, optional): keep this many newest checkpoints; None keeps all.
        run_config (DictConfig, optional): the run's config, saved (resolved)
            with every checkpoint so that a resume can tell what changed.
        chat_template (str, optional): the chat template training's tokenizer
            writes (:func:`torchtune_ext.data.tokenizer.training_chat_template`),
            put into every checkpoint's tokenizer files; None: they stay as copied.
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
                 run_config: Optional[DictConfig] = None, chat_template: Optional[str] = None,
                 dp_world_size: int = 1, hash_files: bool = True,
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
        self._chat_template = chat_template  # what training's tokenizer writes; None: nothing to save
        self._sharded_load, self.sharded_saves = sharded_load, sharded_saves
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
    def from_config(cls, cfg: DictConfig, dp_world_size: int = 1, distributed: bool = False,
                    chat_template: Optional[str] = None) -> "CheckpointManager":
        """The manager of a validated recipe config (``checkpointer``, ``output_dir``,
        ``keep_last_n_checkpoints``, ``verify_checkpoint_hashes``, ``sharded_checkpoints``,
        ``enable_async_checkpointing``); ``distributed``: a distributed recipe's run; ``chat_template``:
        the one training's tokenizer writes, saved into every checkpoint's tokenizer files."""
        sharded = bool(cfg.get("sharded_checkpoints", False))
        return cls(cfg.checkpointer, cfg.output_dir, cfg.keep_last_n_checkpoints, run_config=cfg,
                   chat_template=chat_template,
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
        except UserError:
            raise  # a checkpointer's own one line (torchtune_ext.model.hf's): already names its key and fix
        except Exception as err:
            raise _unreadable(source, err, resume_from is not None and not adapter) from err
        base = str(self._cfg.get("checkpoint_dir", ""))
        if "checkpoint_dir" in overrides and os.path.isdir(base) and hasattr(self._checkpointer, "_checkpoint_dir"):
            # The weights came from the resumed step, but keep_last_n_checkpoints deletes that folder
            # a few saves later: the files each save copies beside the weights (config, tokenizer,
            # generation config) are the base checkpoint's, which outlives the run.
            self._checkpointer._checkpoint_dir = Path(base)
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
            state = self._checkpointer.load_checkpoint() if adapter or not self.sharded_saves else {}
        except UserError:
            raise  # a checkpointer's own one line: already names its key and fix
        except Exception as err:
            raise _unreadable(source, err, False) from err
        tensors = saved if self._sharded_load else read_full_tensors(resume_from, saved)
        if adapter:
            return {training.MODEL_KEY: state[training.MODEL_KEY], training.ADAPTER_KEY: tensors}
        return {training.MODEL_KEY: tensors}


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
                    ranks.from_rank_zero((type(err), err.key, str(err).split(": ", 1)[1]))
                elif isinstance(err, CheckpointSaveError):
                    ranks.from_rank_zero((CheckpointSaveError, None, str(err)))
                else:
                    ranks.from_rank_zero((RuntimeError, None,
                                     f"saving {final} failed on rank 0: {type(err).__name__}: {err}"))
                raise
        outcome = ranks.from_rank_zero(outcome)
        if outcome is not None:
            error_type, key, message = outcome
            raise error_type(key, message) if key is not None else error_type(message)
        return final


    @property
    def pending(self) -> bool:
        """An asynchronous save returned and has not been waited for: its folder may not be complete yet."""
        return self._pending is not None

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
            write_synced(written / MANIFEST, json.dumps(manifest, indent=1))
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
            fsync_dir(self.output_dir)
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
        if self._chat_template:
            write_chat_template(folder, self._chat_template)

    def _staging_is_a_file(self) -> str:
        return f"'{self.staging}' is a file, but saves stage each checkpoint in a folder of that name"


    def copied_bytes(self) -> int:
        """The small files torchtune copies from the folder it loaded from (config, tokenizer)."""
        source = getattr(self._checkpointer, "_checkpoint_dir", None)
        if source is None or not Path(source).is_dir():
            return 0
        return sum(p.stat().st_size for p in Path(source).iterdir()
                   if p.is_file() and p.suffix not in (".safetensors", ".bin", ".pt", ".pth"))

    def _needed_bytes(self, state_dict: Dict[str, Any], optimizer_state: Dict[str, Any]) -> int:
        # torchtune writes the adapter twice (.pt and PEFT .safetensors)
        return (tensor_bytes(state_dict) + tensor_bytes(state_dict.get(training.ADAPTER_KEY))
                + tensor_bytes(optimizer_state) + self.copied_bytes() + 2**20)

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
