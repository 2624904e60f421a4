"""Hugging Face folders in, Hugging Face folders out: the checkpointer of transformers models.

:class:`HFCheckpointer` has torchtune's checkpointer interface, which
:class:`torchtune_ext.checkpoint.CheckpointManager` drives
(``load_checkpoint()`` -> ``{"model": state_dict}``; ``save_checkpoint(state,
epoch=step, adapter_only=...)`` writes ``<output_dir>/epoch_<step>/``), but
leaves every format question to transformers:

* loading is ``AutoModelForCausalLM.from_pretrained`` on CPU in the files'
  dtype, and the state dict is that model's: keys as the model has them
  after transformers' weight conversions (transformers 5 fuses the experts
  of a mixture-of-experts layer into one tensor, where the files hold one
  tensor per expert), so it loads into :func:`torchtune_ext.model.hf.causal_lm`
  with ``load_state_dict``;
* saving is ``save_pretrained`` of a model skeleton on the meta device with
  the given state dict, which undoes those conversions, drops tied copies
  and writes safetensors, ``config.json`` and ``generation_config.json``;
  the tokenizer files of the folder it loaded from are copied beside them.

A saved folder is again a model folder: ``from_pretrained`` loads it, and it
is what a resumed run loads from.

With ``text_only``, an image-text folder (Gemma 3 4B+, Llama 4, ...) loads
with its own transformers class (which knows every layout its files may
have), and the state dict is its language model's, in the keys of the causal
LM class of its ``text_config`` (:func:`torchtune_ext.model.hf.folder.language_model_keys`);
the vision tower and projector are dropped (one log line names them). A
saved step is then a text model's folder: that class's ``config.json`` and
weights, the image-text folder's ``generation_config`` and tokenizer files,
and no image processor files.
"""

import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from peft.tuners.lora import LoraLayer
from torchtune import config as tt_config
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import logging as hf_logging

from torchtune_ext.checkpoint import (
    ADAPTER_DIR,
    MANIFEST,
    RECIPE_STATE,
    ExportLayout,
    is_adapter_key,
    read_full_tensors,
)
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf.folder import language_model_keys, read_model_folder
from torchtune_ext.model.hf.lora import ADAPTER, peft_model_from_state

log = logging.getLogger(__name__)

MODEL_KEY, ADAPTER_KEY, ADAPTER_CONFIG_KEY = "model", "adapter", "adapter_config"  # torchtune's training.*_KEY
# Files of a model folder that the saved folder gets from save_pretrained, or that are not the model's.
_WRITTEN_BY_SAVE = ("config.json", "generation_config.json", MANIFEST, RECIPE_STATE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json", ".msgpack", ".h5")
# An image-text folder's image (and video) processor settings: a text model's folder has no use for them.
_IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def _is_weights(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES)


def tokenizer_files(folder: Union[str, Path], text_only: bool = False) -> List[Path]:
    """The files a saved folder copies from the folder it loaded from: every top-level file that is neither
    weights nor written by ``save_pretrained`` (tokenizer files, chat template, README, license); with
    ``text_only`` (the language model of an image-text folder) not the image processor's files either."""
    skip = set(_WRITTEN_BY_SAVE) | (set(_IMAGE_PROCESSOR_FILES) if text_only else set())
    return sorted(p for p in Path(folder).iterdir()
                  if p.is_file() and p.name not in skip and not _is_weights(p.name))


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") off: one line per tensor
    group in a recipe's log says nothing the checkpoint log line does not."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _shape_problem(item: Any) -> str:
    """One of transformers' ``mismatched_keys``, ``(name, shape in the files, shape config.json gives)``, in words."""
    if isinstance(item, tuple) and len(item) == 3:
        name, saved, expected = item
        return (f"{name} is {list(saved)} in the files, but config.json makes it {list(expected)}")
    return f"{item[0] if isinstance(item, tuple) else item} has another shape"


class HFCheckpointer:
    """Reads and writes Hugging Face model folders (see the module docstring).

    Args:
        checkpoint_dir: the model folder to load (``config.json`` + safetensors).
        output_dir: where ``save_checkpoint`` writes ``epoch_<N>/`` (the
            recipes redirect it to their staging folder).
        checkpoint_files: optional; the weight files the folder must hold
            (the checkpoint manager names them when it resumes). transformers
            reads the folder's weights itself (``model.safetensors`` or its index).
        trust_remote_code: allow a model whose code ships in the folder (as ``model.trust_remote_code``).
        text_only: as ``model.text_only`` (configs/hf/*.yaml set it from there):
            an image-text folder gives its language model's weights (see the module docstring).

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``, ``checkpointer.text_only``) see
            :func:`torchtune_ext.model.hf.folder.read_model_folder`; (``checkpointer.checkpoint_files``)
            a named file that is not in the folder.
    """

    def __init__(self, checkpoint_dir: Union[str, Path], output_dir: Union[str, Path],
                 checkpoint_files: Optional[List[str]] = None, trust_remote_code: bool = False,
                 text_only: bool = False):
        self._checkpoint_dir = Path(str(checkpoint_dir))
        self._output_dir = Path(str(output_dir))
        self._trust_remote_code = trust_remote_code
        self._folder = read_model_folder(self._checkpoint_dir, key="checkpointer.checkpoint_dir",
                                         trust_remote_code=trust_remote_code, text_only=text_only)
        for name in list(checkpoint_files or []):
            if not (self._checkpoint_dir / str(name)).is_file():
                raise ConfigError("checkpointer.checkpoint_files", f"'{self._checkpoint_dir / str(name)}' does not "
                                  "exist (transformers reads the folder's own weights; the list may be left out)")
        self._config = None
        self._generation_config = None
        self._output_dir.mkdir(parents=True, exist_ok=True)  # as torchtune's checkpointers do

    def load_checkpoint(self) -> Dict[str, Any]:
        """``{"model": state_dict}``: the folder's weights as transformers' model holds them, on CPU, in the
        files' dtype.

        With ``text_only`` on an image-text folder, its language model's
        weights in the text model's keys (``model.language_model.layers.0...``
        -> ``model.layers.0...``); the rest of the folder is dropped, said in one log line.

        Raises:
            ConfigError: (key ``checkpointer.checkpoint_dir``) weights the model
                (text_only: its language model) expects are missing from the
                files, or have another shape.
        """
        image_text = self._folder.image_text
        model_class = image_text.model_class if image_text is not None else AutoModelForCausalLM
        verbosity = hf_logging.get_verbosity()
        # transformers raises on a shape that does not fit after a many-line report ("look at the above
        # report!"); the shapes come back in the loading info instead and make the one line below
        hf_logging.set_verbosity_error()
        try:
            with _no_progress_bars():
                model, info = model_class.from_pretrained(
                    str(self._checkpoint_dir), dtype="auto", trust_remote_code=self._trust_remote_code,
                    output_loading_info=True, ignore_mismatched_sizes=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        keys = self._language_model_keys(model) if image_text is not None else None
        wanted = set(keys.values()) if keys is not None else None  # a folder without its vision tower is fine
        problems = [f"{key} missing" for key in sorted(info.get("missing_keys") or [])
                    if wanted is None or key in wanted]
        problems += [_shape_problem(item) for item in sorted(info.get("mismatched_keys") or [], key=str)
                     if wanted is None or (item[0] if isinstance(item, tuple) else item) in wanted]
        if problems:
            config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            heads = ", ".join(f"{k}={getattr(config, k)}" for k in ("num_attention_heads", "num_key_value_heads",
                                                                   "head_dim", "hidden_size")
                              if getattr(config, k, None) is not None)
            raise ConfigError("checkpointer.checkpoint_dir", f"the weights in '{self._checkpoint_dir}' do not fit "
                              f"its config.json ({heads}): {'; '.join(problems[:3])}; config.json must describe "
                              "the weights: use the config.json that came with them, or fix the values it gives")
        if info.get("unexpected_keys"):
            log.warning("%s: weights the model does not use were not loaded: %s", self._checkpoint_dir,
                        ", ".join(sorted(info["unexpected_keys"])[:5]))
        self._config = model.config if image_text is None else self._folder.config  # the text model's
        self._generation_config = model.generation_config
        if keys is None:
            return {MODEL_KEY: model.state_dict()}
        full = model.state_dict()
        log.info("%s: %s (text_only): its language model trains as %s; %s (%s parameters) neither trained nor saved",
                 self._checkpoint_dir, image_text.model_class.__name__, image_text.text_class.__name__,
                 ", ".join(image_text.dropped), f"{image_text.dropped_parameters:,}")
        return {MODEL_KEY: {text_key: full[key] for text_key, key in keys.items()}}

    def _language_model_keys(self, model) -> Dict[str, str]:
        """The loaded image-text model's keys of its language model, by the text model's keys."""
        with torch.device("meta"):
            text = AutoModelForCausalLM.from_config(self._folder.config)
        return language_model_keys(model, text)

    def _skeleton(self, dtype: torch.dtype):
        """The model on the meta device, for ``save_pretrained`` (which knows the weight conversions to undo)."""
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self._config, dtype=dtype,
                                                        trust_remote_code=self._trust_remote_code)
        if self._generation_config is not None:
            skeleton.generation_config = self._generation_config
        return skeleton

    def save_checkpoint(self, state_dict: Dict[str, Any], epoch: int, intermediate_checkpoint: bool = False,
                        adapter_only: bool = False) -> Path:
        """Write ``<output_dir>/epoch_<epoch>/`` as a Hugging Face model folder.

        Args:
            state_dict: ``model``: the full model state dict (CPU), keys as
                :meth:`load_checkpoint` gives them (the model's); for LoRA
                what :func:`torchtune_ext.model.hf.lora.lora_checkpoint_state` gives
                (``adapter``, ``adapter_config``, ``model`` unless ``adapter_only``):
                the adapter goes to ``adapter/`` in PEFT's format (and
                ``adapter_model.pt`` for resuming), the merged model to the folder.
            epoch: the folder's number (the recipes pass the optimizer step).
            intermediate_checkpoint: torchtune's argument, unused: the
                recipes save their own training state beside it.
            adapter_only: LoRA: nothing but the adapter.

        Returns:
            the folder written.
        """
        if self._config is None:
            raise RuntimeError("HFCheckpointer.save_checkpoint needs load_checkpoint first (the model's config)")
        folder = self._output_dir / f"epoch_{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        with _no_progress_bars():
            if ADAPTER_KEY in state_dict:
                self._save_lora(folder, state_dict, adapter_only)
            else:
                model_state = dict(state_dict[MODEL_KEY])  # save_pretrained takes tensors out of the dict it gets
                dtype = next((t.dtype for t in model_state.values() if t.is_floating_point()), torch.float32)
                skeleton = self._skeleton(dtype)
                for name in tied_copies(skeleton):
                    # a gathered (FSDP) state holds a tied lm_head as a tensor of its own, which
                    # save_pretrained, finding no shared storage, would write a second time
                    model_state.pop(name, None)
                skeleton.save_pretrained(str(folder), state_dict=model_state)
        if not adapter_only:
            for path in tokenizer_files(self._checkpoint_dir, text_only=self._folder.image_text is not None):
                shutil.copy2(path, folder / path.name)
        return folder

    @staticmethod
    def sharded_export_layout(cfg_checkpointer: Any, cfg_model: Any, saved: Dict[str, torch.Tensor]) -> ExportLayout:
        """How a sharded checkpoint of a transformers model becomes this checkpointer's folder
        (:func:`torchtune_ext.checkpoint.hf_export.export_hf`); see :func:`sharded_export_layout`."""
        return sharded_export_layout(cfg_checkpointer, cfg_model, saved)

    def _save_lora(self, folder: Path, state_dict: Dict[str, Any], adapter_only: bool) -> None:
        """``folder/adapter/``: PEFT's adapter files and ``adapter_model.pt`` (the training model's keys, for
        resuming); unless ``adapter_only``, ``folder`` itself: the merged model (PEFT's merge_and_unload)."""
        adapter = state_dict[ADAPTER_KEY]
        state = adapter if adapter_only else {**state_dict[MODEL_KEY], **adapter}
        peft_model = write_adapter(folder, self._config, state_dict[ADAPTER_CONFIG_KEY], adapter, state,
                                   base_dir=self._checkpoint_dir, trust_remote_code=self._trust_remote_code)
        if not adapter_only:
            merged = peft_model.merge_and_unload()
            merged.generation_config = self._generation_config or merged.generation_config
            merged.save_pretrained(str(folder))


def tied_copies(model: torch.nn.Module) -> List[str]:
    """Names of ``model``'s parameters that are another parameter under a second name (a tied ``lm_head.weight``).

    A Hugging Face folder holds each tied weight once (under the name
    ``named_parameters`` keeps); transformers ties the copy again on load.
    """
    kept = {name for name, _ in model.named_parameters()}
    return [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in kept]


def write_adapter(folder: Path, config: Any, adapter_config: Dict[str, Any], adapter: Dict[str, torch.Tensor],
                  state: Dict[str, torch.Tensor], *, base_dir: Path, trust_remote_code: bool = False):
    """``folder/adapter/``: PEFT's adapter files of ``adapter`` and ``adapter_model.pt`` (the training model's
    keys, for resuming). ``state``: the tensors the returned ``peft.PeftModel`` holds (the adapter, and the
    base weights for a merge)."""
    peft_model = peft_model_from_state(config, adapter_config, state, base_dir=str(Path(base_dir).resolve()),
                                       trust_remote_code=trust_remote_code)
    # the adapter alone: an adapted lm_head must not bring the base embedding weights along
    peft_model.save_pretrained(str(folder / ADAPTER_DIR), save_embedding_layers=False)
    torch.save({k: v.detach().cpu() for k, v in adapter.items()}, folder / ADAPTER_DIR / "adapter_model.pt")
    return peft_model


def sharded_export_layout(cfg_checkpointer: Any, cfg_model: Any, saved: Dict[str, torch.Tensor]) -> ExportLayout:
    """The folder :meth:`HFCheckpointer.save_checkpoint` writes, from a sharded checkpoint file by file.

    The saved keys are the training model's, HF names already: the layout
    is the model's own, built from ``cfg_model`` on the meta device (no
    memory). Per output file: a tied copy is dropped (``lm_head.weight`` of a
    tied model), LoRA adapters are merged into their weights by PEFT
    (``merge()`` of each adapted layer of that file, DoRA and fused experts
    included) and PEFT's ``base_layer`` leaves the names, then transformers'
    ``revert_weight_conversion`` gives the files' layout (per-expert tensors
    of a fused mixture-of-experts layer) as ``save_pretrained`` does. The
    files follow the base folder's (its index); one file is
    ``model.safetensors`` without an index, as ``save_pretrained`` writes it.
    Rank 0 also writes ``config.json`` (the trained dtype),
    ``generation_config.json``, the tokenizer files and, for LoRA,
    ``adapter/`` (:func:`write_adapter`).
    """
    checkpoint_dir = Path(str(cfg_checkpointer.checkpoint_dir))
    text_only = bool(cfg_checkpointer.get("text_only", False))
    trust_remote_code = bool(cfg_checkpointer.get("trust_remote_code", False))
    folder = read_model_folder(checkpoint_dir, key="checkpointer.checkpoint_dir",
                               trust_remote_code=trust_remote_code, text_only=text_only)
    with torch.device("meta"):
        model = tt_config.instantiate(cfg_model)  # the training model's names (PEFT's adapters in place)
    kept = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}  # not tied copies
    lora = any(is_adapter_key(k) for k in saved)
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}

    def base_key(key: str) -> str:
        if not is_adapter_key(key):
            return key
        module = key[: key.index(".lora_")]
        return next((k for k in saved if k.startswith(f"{module}.base_layer.")), key)

    def merge(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        state = {k: v for k, v in state.items() if k in kept or is_adapter_key(k)}
        if not lora or any(t.is_meta for t in state.values()):  # names and shapes: the merge keeps the weight's
            return {k: v for k, v in state.items() if not is_adapter_key(k)}
        model.load_state_dict(state, strict=False, assign=True)
        for name, module in adapted.items():
            if any(k.startswith(f"{name}.") for k in state):
                module.merge(adapter_names=[ADAPTER])
        own = model.state_dict()
        merged = {k: own[k] for k in state if not is_adapter_key(k)}
        # the skeleton lets go of this file's tensors: one file's at a time
        model.load_state_dict({k: torch.empty_like(v, device="meta") for k, v in state.items()}, strict=False,
                              assign=True)
        return merged

    def convert(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        plain = {k.replace(".base_layer", ""): v for k, v in state.items()}
        return revert_weight_conversion(model, plain)

    def write_others(out: Path, step_folder: Path, adapter_only: bool) -> List[str]:
        written = []
        dtype = next((t.dtype for t in saved.values() if t.is_floating_point()), torch.float32)
        if not adapter_only:
            config = folder.config
            config.dtype = dtype
            config.architectures = [type(model).__name__]  # as save_pretrained writes it (adapt keeps the name)
            config.save_pretrained(str(out))
            generation = (GenerationConfig.from_pretrained(str(checkpoint_dir))
                          if (checkpoint_dir / "generation_config.json").is_file()
                          else GenerationConfig.from_model_config(config))
            generation.save_pretrained(str(out))
            for path in tokenizer_files(checkpoint_dir, text_only=folder.image_text is not None):
                shutil.copy2(path, out / path.name)
                written.append(path.name)
            written += ["config.json", "generation_config.json"]
        if lora:
            adapter = read_full_tensors(step_folder, {k: v for k, v in saved.items() if is_adapter_key(k)})
            write_adapter(out, folder.config, model.peft_config[ADAPTER].to_dict(), adapter, adapter,
                          base_dir=checkpoint_dir, trust_remote_code=trust_remote_code)
            written += sorted(p.relative_to(out).as_posix() for p in (out / ADAPTER_DIR).rglob("*") if p.is_file())
        return written

    return ExportLayout(convert=convert, merge=merge, base_key=base_key,
                        base_files=_base_files(checkpoint_dir), write_others=write_others,
                        single_file="model.safetensors")


def _base_files(checkpoint_dir: Path) -> Dict[str, str]:
    """HF key -> the base folder's weight file: its safetensors index; {} (one file) without one."""
    index = checkpoint_dir / "model.safetensors.index.json"
    return dict(json.loads(index.read_text())["weight_map"]) if index.is_file() else {}

