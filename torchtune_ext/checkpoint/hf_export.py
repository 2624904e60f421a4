"""A Hugging Face folder from a sharded checkpoint, file by file: no process holds the whole model.

A sharded checkpoint (:mod:`torchtune_ext.checkpoint.sharded`) holds each
rank's shards in torchtune's key names. :func:`export_hf` writes the same
folder a gathered save writes with torchtune's ``FullModelHFCheckpointer``:
``model-0000i-of-0000n.safetensors`` split as the base checkpoint's files
are, ``model.safetensors.index.json``, the base folder's ``config.json`` and
tokenizer files, and for LoRA the merged model and ``adapter/`` (PEFT's
adapter and torchtune's ``adapter_model.pt``). Each output file is made
alone: its tensors are read whole from the shards (DCP reassembles them),
converted to HF names and layout with torchtune's converter of the model's
family, merged with their LoRA adapters, written, and let go, so the memory
needed is one output file (one base checkpoint file; ~5 GB for most HF
models), not the model. Ranks share the files: rank ``r`` writes files
``r``, ``r + world``, ...

On request, any sharded checkpoint (a periodic or a stop's one too) becomes
such a folder in one process, with the run's settings read from its
``recipe_state.pt``::

    python -m torchtune_ext.checkpoint.export outputs/run/step_200 outputs/run/step_200_hf

Families: the converters that work tensor by tensor (Llama 2/3/3.2,
Mistral, Gemma, Gemma 2, Qwen2). Phi-3/Phi-4 fuse q/k/v into one HF tensor
and are refused by the config check
(:func:`torchtune_ext.config.combinations.check_sharded_checkpoints`).
"""

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torchtune.models import convert_weights

from torchtune_ext.checkpoint.discovery import (
    MANIFEST,
    RECIPE_STATE,
    STAGING,
    checkpoint_problem,
    list_checkpoints,
    step_of,
)
from torchtune_ext.checkpoint.failures import is_disk_full, is_write_failure
from torchtune_ext.checkpoint.files import existing_parent, make_readable
from torchtune_ext.checkpoint.lora_export import adapter_config, arrange_lora_folder
from torchtune_ext.checkpoint.resume_state import load_recipe_state
from torchtune_ext.checkpoint.sharded import is_adapter_key, is_sharded, read_full_tensors, saved_tensors
from torchtune_ext.checkpoint.tokenizer_files import write_chat_template
from torchtune_ext.config import import_component, lora_settings
from torchtune_ext.errors import CheckpointSaveError, UserError
from torchtune_ext.text import format_bytes, short

INDEX = "model.safetensors.index.json"
# What the HF checkpointer does not copy from the base folder: weights and their indexes (torchtune's list),
# and what a step folder holds of its own.
_NOT_COPIED = (".pt", ".pth", ".bin", ".safetensors", ".index.json", ".distcp")


@dataclass(frozen=True)
class ExportLayout:
    """How a checkpointer's Hugging Face folder is laid out, for :func:`export_hf` (any subset of the keys).

    The default is torchtune's ``FullModelHFCheckpointer`` (:func:`torchtune_layout`); a checkpointer class
    with a ``sharded_export_layout(cfg_checkpointer, cfg_model, saved)`` method gives its own
    (:meth:`torchtune_ext.model.hf.HFCheckpointer.sharded_export_layout`: the model's keys are HF names already).

    Attributes:
        convert: saved keys (merged, adapters dropped) -> HF names and layout; meta tensors give the names alone.
        merge: LoRA: one file's tensors with their adapters merged in (meta tensors: the names the merge
            keeps); else the identity.
        base_key: the weight an adapter tensor belongs to, so that both go into the same file.
        base_files: HF key -> the base folder's weight file holding it (:func:`base_file_of`).
        write_others: ``(out, step_folder, adapter_only)`` -> names: rank 0's files besides the weights
            (config, tokenizer, the adapter).
        single_file: the name of a lone weight file written without an index (None: always the
            ``model-0000i-of-0000n`` names and the index).
    """

    convert: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]
    merge: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]
    base_key: Callable[[str], str]
    base_files: Dict[str, str]
    write_others: Callable[[Path, Path, bool], List[str]]
    single_file: Optional[str] = None


def tune_to_hf(model_type: str, hf_config: Dict[str, Any]) -> Callable[[Dict[str, torch.Tensor]], Dict]:
    """torchtune's converter (torchtune names -> HF names and q/k row order) of a family, for any subset of keys.

    The arguments are the ones ``FullModelHFCheckpointer.save_checkpoint`` passes
    for that ``model_type``, from the base folder's ``config.json``.
    """
    heads, kv_heads, dim = (hf_config["num_attention_heads"], hf_config["num_key_value_heads"],
                            hf_config["hidden_size"])
    head_dim = hf_config.get("head_dim")
    if model_type == "QWEN2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        return lambda sd: qwen2_tune_to_hf(sd, num_heads=heads, num_kv_heads=kv_heads, dim=dim,
                                           tie_word_embeddings=hf_config.get("tie_word_embeddings", False))
    if model_type == "GEMMA2":
        from torchtune.models.gemma2._convert_weights import gemma2_tune_to_hf

        return lambda sd: gemma2_tune_to_hf(sd, num_heads=heads, num_kv_heads=kv_heads, dim=dim, head_dim=head_dim)
    return lambda sd: convert_weights.tune_to_hf(sd, num_heads=heads, num_kv_heads=kv_heads, dim=dim,
                                                 head_dim=head_dim)


def base_file_of(checkpoint_dir: Path) -> Dict[str, str]:
    """HF key -> the base folder's weight file holding it: from its safetensors index, or its only file.

    Empty when the folder has neither (then :func:`export_hf` writes one file).
    """
    index = checkpoint_dir / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("adapter")]
    if len(files) != 1:
        return {}
    with safe_open(str(files[0]), framework="pt") as f:
        return {key: files[0].name for key in f.keys()}


def _base_key(key: str) -> str:
    """The weight an adapter tensor belongs to (``...q_proj.lora_a.weight`` -> ``...q_proj.weight``)."""
    for part in (".lora_a.weight", ".lora_b.weight", ".magnitude"):
        if key.endswith(part):
            return key[: -len(part)] + ".weight"
    return key


def _plan(model_keys: Dict[str, torch.Tensor], layout: ExportLayout) -> List[List[str]]:
    """The output files: lists of saved keys, in the order of the base files (adapters with their weight)."""
    file_of: Dict[str, str] = {}
    for key in model_keys:
        base = layout.base_key(key)
        if base not in model_keys:
            continue
        hf_keys = list(layout.convert(layout.merge({base: model_keys[base]})))  # meta tensors: names and shapes
        file_of[key] = layout.base_files.get(hf_keys[0], "") if hf_keys else ""
    order = sorted(set(file_of.values()))
    return [[k for k in model_keys if file_of.get(k) == name] for name in order]


def copy_base_files(checkpoint_dir: Path, folder: Path) -> List[str]:
    """Copy the base folder's files that are not weights (config, tokenizer, generation config) into ``folder``.

    Returns the names copied.
    """
    copied = []
    for path in sorted(checkpoint_dir.iterdir()):
        if path.is_file() and not path.name.endswith(_NOT_COPIED) and path.name not in (MANIFEST, RECIPE_STATE):
            shutil.copy2(path, folder / path.name)
            copied.append(path.name)
    return copied


def torchtune_layout(cfg_checkpointer: Any, cfg_model: Any, saved: Dict[str, torch.Tensor]) -> ExportLayout:
    """torchtune's ``FullModelHFCheckpointer`` folder: torchtune's converter of ``checkpointer.model_type``,
    the base checkpoint's files, the LoRA merge of torchtune's adapters (see the module docstring)."""
    checkpoint_dir = Path(str(cfg_checkpointer.checkpoint_dir))
    hf_config = json.loads((checkpoint_dir / "config.json").read_text())
    settings = lora_settings(cfg_model) if any(is_adapter_key(k) for k in saved) else None

    def write_others(out: Path, step_folder: Path, adapter_only: bool) -> List[str]:
        written = copy_base_files(checkpoint_dir, out)
        if settings is not None:
            adapter = read_full_tensors(step_folder, {k: v for k, v in saved.items() if is_adapter_key(k)})
            written += _write_adapter(out, adapter, cfg_model, cfg_checkpointer)
        return written

    return ExportLayout(convert=tune_to_hf(str(cfg_checkpointer.get("model_type", "")).upper(), hf_config),
                        merge=lambda state: _merged(state, settings), base_key=_base_key,
                        base_files=base_file_of(checkpoint_dir), write_others=write_others)


def export_layout(cfg_checkpointer: Any, cfg_model: Any, saved: Dict[str, torch.Tensor]) -> ExportLayout:
    """The layout of the configured checkpointer's folders: its class's ``sharded_export_layout``, else torchtune's."""
    component = import_component("checkpointer._component_", str(cfg_checkpointer._component_))
    own = getattr(component, "sharded_export_layout", None)
    return own(cfg_checkpointer, cfg_model, saved) if own is not None else torchtune_layout(
        cfg_checkpointer, cfg_model, saved)


def export_hf(step_folder: Path, out: Path, cfg_checkpointer: Any, cfg_model: Any = None, *,
              adapter_only: bool = False, rank: int = 0, world_size: int = 1) -> List[str]:
    """Write this rank's share of the HF folder of a sharded checkpoint into ``out`` (see the module docstring).

    Args:
        step_folder: the checkpoint (its ``dcp/``).
        out: the folder to write (exists).
        cfg_checkpointer: the run's ``checkpointer`` config (``_component_``, ``checkpoint_dir``,
            ``model_type``): which layout (:func:`export_layout`).
        cfg_model: the run's ``model`` config: a LoRA model's settings (rank,
            alpha, targets) for the merge and PEFT's adapter config.
        adapter_only: LoRA: the adapter alone, no merged model.
        rank, world_size: which of the files this process writes; rank 0
            also writes the index, the copied files and the adapter.

    Returns:
        the names (relative to ``out``) of the files this rank wrote.
    """
    model_keys = saved_tensors(step_folder)
    layout = export_layout(cfg_checkpointer, cfg_model, model_keys)
    written: List[str] = []
    if not adapter_only:
        files = _plan(model_keys, layout)
        weight_map: Dict[str, str] = {}
        total = 0
        for i, keys in enumerate(files):
            name = layout.single_file if layout.single_file and len(files) == 1 else \
                f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            hf_meta = layout.convert(layout.merge({k: model_keys[k] for k in keys}))
            weight_map.update({k: name for k in hf_meta})
            total += sum(t.numel() * t.element_size() for t in hf_meta.values())
            if i % world_size != rank:
                continue
            tensors = layout.convert(layout.merge(read_full_tensors(step_folder, {k: model_keys[k] for k in keys})))
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
            written.append(name)
            del tensors  # one file's tensors at a time
        if rank == 0 and not (layout.single_file and len(files) == 1):
            (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
            written.append(INDEX)
    if rank == 0:
        written += layout.write_others(out, step_folder, adapter_only)
    return written


def _merged(state: Dict[str, torch.Tensor], settings: Optional[Any]) -> Dict[str, torch.Tensor]:
    """LoRA: W + (alpha / rank) B A (DoRA: rescaled by its magnitudes), adapters dropped; else ``state``."""
    if settings is None:
        return state
    from torchtune.modules.peft import get_merged_lora_ckpt

    if any(t.is_meta for t in state.values()):  # names and shapes only: the merge keeps the weight's
        return {k: v for k, v in state.items() if not is_adapter_key(k)}
    return get_merged_lora_ckpt(dict(state), rank=settings.lora_rank, alpha=settings.lora_alpha)


def _write_adapter(out: Path, adapter: Dict[str, torch.Tensor], cfg_model: Any, cfg_checkpointer: Any) -> List[str]:
    """``adapter/``: as a gathered LoRA save lays it out (:func:`arrange_lora_folder`). Returns the names written."""
    from torchtune.models.convert_weights import tune_to_peft_adapter_config

    torch.save(adapter, out / "adapter_model.pt")
    (out / "adapter_config.json").write_text(json.dumps(tune_to_peft_adapter_config(adapter_config(cfg_model))))
    arrange_lora_folder(out, cfg_checkpointer)
    return sorted(p.relative_to(out).as_posix() for p in (out / "adapter").rglob("*") if p.is_file())


# Inside the staging folder ``<OUT>.partial`` while this tool writes it: only a folder holding it was made by an
# export (an interrupted one) and may be removed; any other folder of that name is the user's and is kept.
EXPORT_MARKER = ".export-in-progress"


def export_step(step_folder: Path, out: Path,
                chat_template_of: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None) -> List[str]:
    """The Hugging Face folder of a sharded checkpoint, written to ``out`` in this process.

    The base checkpoint, model type, LoRA settings and training's chat
    template are the run's (its ``recipe_state.pt``); relative paths in its
    config are taken from the folder training ran in. ``chat_template_of``
    gives training's chat template from the run's config (called in that
    folder; :func:`torchtune_ext.data.tokenizer.training_chat_template`);
    None: the base folder's tokenizer files stay as copied. ``out`` is written as
    ``<out>.partial`` (with :data:`EXPORT_MARKER` inside) and renamed when
    complete; its files are readable as a checkpoint's (:func:`make_readable`).
    Returns the names written.

    Raises:
        UserError: ``step_folder`` is no complete sharded checkpoint (missing,
            a run folder), its run's base checkpoint folder is gone, ``out``
            exists and is not empty, or ``<out>.partial`` is a folder this tool
            did not make. Nothing is written then.
        CheckpointSaveError: writing the folder failed (a full disk, a read-only folder); its partial
            output is removed.
    """
    step_folder, out = Path(step_folder).absolute(), Path(out).absolute()
    if not is_sharded(step_folder):
        raise UserError(_not_sharded(step_folder))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"'{out}' exists and is not an empty folder: nothing is overwritten; give a new folder")
    partial = out.with_name(out.name + ".partial")
    if partial.exists() and not (partial / EXPORT_MARKER).is_file():
        raise UserError(f"'{partial}' exists and was not made by this export (no {EXPORT_MARKER} in it): the export "
                        "stages its files there; move or delete it, or give another OUT")
    _check_intact(step_folder)
    try:
        state = load_recipe_state(step_folder)
    except UserError as err:  # its message is a resume's: name the export's way out instead
        raise UserError(f"'{step_folder / RECIPE_STATE}' cannot be read: nothing exported. "
                        f"{_intact_others(step_folder)}") from err
    config = state.config
    if not config or "checkpointer" not in config:
        raise UserError(f"'{step_folder / RECIPE_STATE}' holds no run config: it cannot say which base checkpoint "
                        "and model type the shards belong to")
    checkpointer = dict(config["checkpointer"])
    run_dir = _run_dir(step_folder, config, state.run_dir, str(checkpointer["checkpoint_dir"]))
    checkpointer["checkpoint_dir"] = str(run_dir / str(checkpointer["checkpoint_dir"]))  # absolute stays absolute
    template = _training_chat_template(config, run_dir, chat_template_of) if chat_template_of else None
    lora = any(is_adapter_key(k) for k in saved_tensors(step_folder))
    try:
        if partial.exists():
            shutil.rmtree(partial)  # an interrupted export's (it holds the marker)
        partial.mkdir(parents=True)
        (partial / EXPORT_MARKER).touch()
        written = export_hf(step_folder, partial, OmegaConf.create(checkpointer), OmegaConf.create(config["model"]),
                            adapter_only=lora and bool(config.get("save_adapter_weights_only", False)))
        # The base folder's tokenizer files were copied: carry training's chat template instead, as a gathered
        # save and a run's final export do (CheckpointManager._save_chat_template)
        if template:
            write_chat_template(partial, template)
        # safetensors writes owner-only files; a checkpoint is for others to load too (the writer does the same)
        make_readable(partial)
        (partial / EXPORT_MARKER).unlink()
        if out.exists():
            out.rmdir()  # empty: checked above
        os.replace(partial, out)
    except Exception as err:
        if not is_write_failure(err):
            raise
        raise _export_write_failed(out, partial, err) from err
    return written


def _export_write_failed(out: Path, partial: Path, err: BaseException) -> CheckpointSaveError:
    """A write of the export failed (a full disk, a read-only folder): its staging folder is removed, and the
    error says why and what to do (the recipes' exit status for a failed write, 74)."""
    shutil.rmtree(partial, ignore_errors=True)
    where = existing_parent(out)
    if is_disk_full(err):
        free = shutil.disk_usage(where).free
        cause = f"the disk is full ({format_bytes(free)} free once the partial export was removed)"
        fix = "free some space, or give an OUT on another disk"
    else:
        cause = short(err)
        fix = (f"give an OUT in a folder you can write (not '{where}')" if isinstance(err, OSError) and
               err.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "fix the cause, or give another OUT")
    return CheckpointSaveError(f"writing the export to '{out}' failed ({cause}); nothing is left of it (the partial "
                               f"'{partial.name}' was removed) and the checkpoint is unchanged: {fix}")


def _check_intact(step_folder: Path) -> None:
    """Refuse a checkpoint that does not match its manifest, content included, before anything is read from it.

    The SHA-256 of every file is compared where the manifest records them (as a resume and ``evaluate`` do):
    a shard changed at the same size would otherwise export as damaged weights.

    Raises:
        UserError: an unfinished save's staging folder, or a file missing, of another size or content.
    """
    if step_folder.name == STAGING:
        raise UserError(f"'{step_folder}' is the staging folder of a save that did not finish, not a checkpoint: "
                        f"nothing exported. {_intact_others(step_folder)}")
    problem = checkpoint_problem(step_folder, content=True)
    if problem:
        raise UserError(f"{problem}: nothing exported. {_intact_others(step_folder)}")


def _intact_others(step_folder: Path) -> str:
    """A sentence naming the run's intact sharded checkpoints (content checked), the ones that can be exported."""
    try:
        others = [p for p in list_checkpoints(str(step_folder.parent)) if p != step_folder and is_sharded(p)]
    except UserError:
        return "The other checkpoints of this run cannot be listed."
    intact = [p for p in others if checkpoint_problem(p, content=True) is None]
    if step_folder.name[len("step_"):].isdigit():  # the earlier ones: what the run had before this step
        intact = [p for p in intact if step_of(p) < step_of(step_folder)] or intact
    if not intact:
        return "No other sharded checkpoint of this run is intact."
    return (f"Intact sharded checkpoints of this run: {', '.join(p.name for p in intact)}; export one of them, "
            f"e.g. '{intact[-1]}'")


def _not_sharded(step_folder: Path) -> str:
    """Why ``step_folder`` cannot be exported, and which folders can: a missing step, a run folder, other."""
    def sharded_in(folder: Path) -> List[str]:
        try:
            return [p.name for p in list_checkpoints(str(folder)) if is_sharded(p)]
        except (UserError, OSError):
            return []

    if not step_folder.exists():
        parent = step_folder.parent
        if not parent.is_dir():
            return f"'{step_folder}' does not exist, nor does '{parent}': give a step_<N> folder of a run's output_dir"
        names = sharded_in(parent)
        found = ", ".join(names) if names else "none"
        return f"'{step_folder}' does not exist; sharded checkpoints in '{parent}': {found}"
    names = sharded_in(step_folder) if step_folder.is_dir() else []
    if names:
        return (f"'{step_folder}' is a run's output_dir, not one checkpoint: pass one of its sharded checkpoints "
                f"(oldest first: {', '.join(names)}), e.g. '{step_folder / names[-1]}', the newest")
    return (f"'{step_folder}' is not a sharded checkpoint (no dcp/.metadata): give a step_<N> folder of a "
            "run with sharded_checkpoints: true; a gathered checkpoint is a Hugging Face folder already")


def _run_dir(step_folder: Path, config: Dict[str, Any], recorded: Optional[str], checkpoint_dir: str) -> Path:
    """The folder training ran in, against which the run config's relative paths are taken.

    The first of: the one ``recipe_state.pt`` records (checkpoints of later
    versions), the one ``output_dir`` gives (the step folder's parent less
    ``output_dir``'s own parts, when they match), and the current one, that
    holds the base checkpoint (``checkpoint_dir/config.json``; an absolute
    one: the first, for the tokenizer's relative paths).

    Raises:
        UserError: none holds it (one line: what was tried, what to do).
    """
    candidates = [Path(recorded)] if recorded else []
    output_dir = Path(str(config.get("output_dir", "")))
    run_folder = step_folder.parent
    if str(output_dir) not in ("", ".") and not output_dir.is_absolute():
        if run_folder.parts[-len(output_dir.parts):] == output_dir.parts:
            candidates.append(Path(*run_folder.parts[:-len(output_dir.parts)]))
    candidates.append(Path.cwd())
    for candidate in candidates:
        if (candidate / checkpoint_dir / "config.json").is_file():
            return candidate
    if Path(checkpoint_dir).is_absolute():
        raise UserError(f"the run's base checkpoint folder '{checkpoint_dir}' (its config.json and tokenizer files "
                        "go into the export) is gone: restore it there")
    tried = ", ".join(f"'{c}'" for c in dict.fromkeys(candidates))
    raise UserError(f"the run's base checkpoint folder '{checkpoint_dir}' is relative to the directory training ran "
                    f"in, and no config.json is under it in {tried}: run the export from that directory, or restore "
                    "the base checkpoint folder there")


def _training_chat_template(config: Dict[str, Any], run_dir: Path,
                            chat_template_of: Callable[[Dict[str, Any]], Optional[str]]) -> Optional[str]:
    """Training's chat template, its tokenizer built in the folder training ran in.

    Raises:
        UserError: the tokenizer cannot be built (its files are gone).
    """
    import contextlib

    try:
        with contextlib.chdir(run_dir):  # the tokenizer's relative paths are the run's
            return chat_template_of(config)
    except Exception as err:
        raise UserError(f"the run's tokenizer (config key 'tokenizer', in '{run_dir}') cannot be built to write "
                        f"training's chat template into the export ({short(err)}): restore its files there") from err
