"""Sharded saves: every rank writes the shards it holds (DCP), rank 0 the manifest; optionally in the background.

The half of :class:`torchtune_ext.checkpoint.writer.CheckpointManager` that
writes sharded checkpoints (``sharded_checkpoints``): the manager inherits
it, and shares with it the staging folder, the manifest, the rename into
place, pruning and the failure messages. Every step that can fail on one rank
is agreed on by all (each rank's outcome is gathered, then every rank raises
the same error), so that no rank waits in a collective for one that gave up.
"""

import json
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torchtune.utils import get_logger

from torchtune_ext import ranks
from torchtune_ext.checkpoint.discovery import HASHES, MANIFEST, RECIPE_STATE, file_sha256
from torchtune_ext.checkpoint.failures import is_disk_full, is_write_failure
from torchtune_ext.checkpoint.files import existing_parent, fsync_dir, make_readable, write_synced
from torchtune_ext.checkpoint.progress import Progress
from torchtune_ext.checkpoint.sharded import (
    DCP_DIR,
    SHARDED_FORMAT,
    failed_ranks,
    file_owner,
    local_bytes,
    local_state,
)
from torchtune_ext.errors import CheckpointSaveError
from torchtune_ext.text import format_bytes, short

log = get_logger()


class ShardedSaves:
    """The sharded save path of :class:`~torchtune_ext.checkpoint.writer.CheckpointManager` (see the module docstring).

    Uses the manager's ``output_dir``, ``staging``, ``_group`` (the save's own
    process group), ``_executor`` (the thread of an asynchronous save),
    ``_pending``, ``_hash_files`` and its shared steps (``_recipe_state``,
    ``_clear_way``, ``_disk_space_error``, ``_after_failure``,
    ``_free_space_advice``, ``_save_chat_template``, ``_prune``, ``wait``, ``copied_bytes``).
    """

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
        if ranks.from_rank_zero((final / MANIFEST).is_file()):
            return final  # this step is saved already
        start = time.perf_counter()
        state = local_state(model, optimizer, keys)
        needed = sum(ranks.from_every_rank(local_bytes(state))) + export_bytes + self.copied_bytes() + 2**20
        self._save_needs = needed  # what a failed write compares the free space with (_out_of_room)
        written = self.staging / f"epoch_{progress.step}"
        recipe_state = self._recipe_state(progress, None, rng_by_rank)
        recipe_state["format"] = SHARDED_FORMAT  # the optimizer state is in the shards
        failure = None
        if ranks.is_rank_zero():
            failure = self._capture(final, lambda: self._prepare_staging(final, written, needed, recipe_state),
                                    written=False)
        self._raise_agreed(final, ranks.from_every_rank(failure), needed)
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
        if is_disk_full(cause) or (isinstance(cause, Exception) and is_write_failure(cause) and self._out_of_room()):
            return ("full", short(cause), str(rank), str(written))
        if isinstance(cause, Exception) and is_write_failure(cause):
            return ("write", short(cause), str(rank), str(written))
        return ("bug", f"{type(cause).__name__}: {cause}", str(rank), str(written))

    def _out_of_room(self) -> bool:
        """At a failed write, before the staging folder goes: is the disk too full for the rest of the save?

        torch's writer reports a full disk as a bare ``RuntimeError`` (``[enforce fail at
        inline_container.cc:...] . unexpected pos ...``), without ENOSPC; as for a gathered save, the free
        space tells: less than what the save still had to write (its estimate less what is staged).
        """
        try:
            staged = sum(p.stat().st_size for p in self.staging.rglob("*") if p.is_file())
            free = shutil.disk_usage(self.output_dir).free
        except OSError:
            return False
        return free < getattr(self, "_save_needs", 0) - staged

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
        error = ranks.from_rank_zero(error, group)
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
            free = shutil.disk_usage(existing_parent(self.output_dir)).free
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
        self._raise_agreed(final, ranks.from_every_rank(failure, group), needed, group)
        files: Dict[str, Tuple[int, Optional[str]]] = {}

        def hash_own_files() -> None:
            mine = export(written, rank, ranks.process_group_size()) if export is not None else []
            if export is not None and rank == 0:
                self._save_chat_template(written)  # over the tokenizer files the export copied
            mine += [f"{DCP_DIR}/{p.name}" for p in (written / DCP_DIR).iterdir()
                     if p.name.endswith(".distcp") and file_owner(p.name) == rank]
            files.update(self._hashes(written, mine))

        failure = self._capture(final, hash_own_files)
        everyone = ranks.from_every_rank((failure, files), group)
        self._raise_agreed(final, [f for f, _ in everyone], needed, group)
        failure = None
        if rank == 0:
            hashed = {name: entry for _, theirs in everyone for name, entry in theirs.items()}
            failure = self._capture(final, lambda: self._complete(final, written, hashed, start, suspect_from,
                                                                  asynchronous=asynchronous))
        self._raise_agreed(final, [ranks.from_rank_zero(failure, group)], needed, group)

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
        write_synced(written / MANIFEST, json.dumps(manifest, indent=1))
        os.replace(written, final)
        shutil.rmtree(self.staging, ignore_errors=True)
        fsync_dir(self.output_dir)
        background = ", written in the background while training went on" if asynchronous else ""
        log.info(f"Checkpoint saved: {final} ({format_bytes(sum(files.values()))} in "
                 f"{time.perf_counter() - start:.1f} s, sharded over {ranks.process_group_size()} ranks{background})")
        self._prune(keep=final, suspect_from=suspect_from)


def _failed_future(err: BaseException) -> Future:
    """A future that raises ``err``: a failure to start a save is reported where its outcome is awaited."""
    future: Future = Future()
    future.set_exception(err)
    return future
