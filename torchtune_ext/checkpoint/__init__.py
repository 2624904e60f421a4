"""Atomic, resumable checkpoints: ``<output_dir>/step_<N>/``.

A checkpoint folder holds the model in the same format as the base checkpoint
(written by the configured torchtune checkpointer: HF safetensors plus the
base folder's config and tokenizer files; for LoRA the merged model unless
turned off, and the adapter in ``adapter/``, see :func:`arrange_lora_folder`),
``recipe_state.pt`` (what :class:`ResumeState`
describes: step counters and data position, the full optimizer state, every
rank's RNG states, the world size and the config of the run that wrote it)
and ``checkpoint.json``, a manifest of every other file with its size and
its SHA-256, computed right after the files are written (while they are
still in the page cache: about 1.4 GiB/s on a CPU with SHA extensions).
A resume checks sizes always and the SHA-256 of every file unless
``verify_checkpoint_hashes: false`` (:func:`verify_checkpoint`), so a file
damaged at the same size (a bad sector, a partial copy over it) is refused
before anything loads; checkpoints of earlier versions, without hashes, are
checked by size only.

Writes are atomic (:mod:`~torchtune_ext.checkpoint.writer`): the torchtune checkpointer writes into
``<output_dir>/.staging/``; the manifest is written last; then the folder is
renamed to ``step_<N>``. Free space is checked against the checkpoint's size
first; a save that fails (a full disk included, and the steps before and
after the write: clearing an old staging folder, the rename, syncing the
folder) removes its staging folder and leaves the previous checkpoints intact.
Old checkpoints are pruned (``keep_last_n_checkpoints``) only after the new one
is complete (one that cannot be deleted is a warning), and the newest is never
pruned. Only ``step_<N>`` folders with a valid manifest are
ever resumed from.

Resuming a full fine-tune loads the model from the step folder. Resuming LoRA
loads the base weights from the base checkpoint again and the adapter from
the step folder's ``adapter/adapter_model.pt``: the merged model there already holds
the adapter (and is absent with ``save_adapter_weights_only``).

The modules, each with one job:

* :mod:`~torchtune_ext.checkpoint.progress`: step counters and the data position;
* :mod:`~torchtune_ext.checkpoint.rng`: every RNG's state;
* :mod:`~torchtune_ext.checkpoint.discovery`: which checkpoints a folder holds; the manifest check (sizes, SHA-256);
* :mod:`~torchtune_ext.checkpoint.sizing`: a checkpoint's bytes and the steps that will save one;
* :mod:`~torchtune_ext.checkpoint.resume_state`: ``recipe_state.pt`` and reading it back;
* :mod:`~torchtune_ext.checkpoint.failures`: a full disk or a failed write, told from a bug;
* :mod:`~torchtune_ext.checkpoint.writer`: the atomic writer, :class:`CheckpointManager`;
* :mod:`~torchtune_ext.checkpoint.sharded`: sharded checkpoints (torch.distributed.checkpoint): each rank's shards;
* :mod:`~torchtune_ext.checkpoint.hf_export`: a Hugging Face folder from a sharded checkpoint, file by file
  (on request: ``python -m torchtune_ext.checkpoint.export STEP_FOLDER OUT``);
* :mod:`~torchtune_ext.checkpoint.lora_export`: the LoRA merge and the PEFT adapter;
* :mod:`~torchtune_ext.checkpoint.model_state`: loading a state dict into a model, a misfit in one line.

The names below are what the rest of the library and the recipes import.
"""

from torchtune_ext.checkpoint.discovery import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    HASHES,
    MANIFEST,
    RECIPE_STATE,
    STAGING,
    file_sha256,
    incomplete_checkpoints,
    intact_before,
    latest_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)
from torchtune_ext.checkpoint.failures import write_failed
from torchtune_ext.checkpoint.hf_export import ExportLayout, export_hf, export_step
from torchtune_ext.checkpoint.lora_export import arrange_lora_folder, lora_checkpoint_state, peft_adapter_weights
from torchtune_ext.checkpoint.model_state import check_adapter_fits, check_model_fits, load_model_state
from torchtune_ext.checkpoint.progress import Progress
from torchtune_ext.checkpoint.resume_state import ResumeState, load_recipe_state
from torchtune_ext.checkpoint.rng import rng_state, set_rng_state
from torchtune_ext.checkpoint.sharded import (
    DCP_DIR,
    ShardedStateDict,
    is_adapter_key,
    is_sharded,
    load_model_shards,
    load_optimizer_shards,
    read_full_tensors,
    saved_tensors,
)
from torchtune_ext.checkpoint.sizing import (
    expected_checkpoint_bytes,
    planned_save_steps,
    save_memory_bytes,
    tensor_bytes,
)
from torchtune_ext.checkpoint.writer import CheckpointManager, make_readable
from torchtune_ext.errors import CheckpointSaveError, DiskSpaceError, OutputWriteError

__all__ = [
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
    "HASHES",
    "MANIFEST",
    "RECIPE_STATE",
    "STAGING",
    "CheckpointManager",
    "CheckpointSaveError",
    "DCP_DIR",
    "DiskSpaceError",
    "ExportLayout",
    "OutputWriteError",
    "Progress",
    "ResumeState",
    "ShardedStateDict",
    "arrange_lora_folder",
    "check_adapter_fits",
    "check_model_fits",
    "expected_checkpoint_bytes",
    "save_memory_bytes",
    "export_hf",
    "export_step",
    "file_sha256",
    "incomplete_checkpoints",
    "intact_before",
    "is_adapter_key",
    "is_sharded",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model_shards",
    "load_model_state",
    "load_optimizer_shards",
    "load_recipe_state",
    "lora_checkpoint_state",
    "make_readable",
    "peft_adapter_weights",
    "read_full_tensors",
    "planned_save_steps",
    "rng_state",
    "saved_tensors",
    "set_rng_state",
    "tensor_bytes",
    "verify_checkpoint",
    "write_failed",
]
