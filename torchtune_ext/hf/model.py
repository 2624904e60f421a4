"""Hugging Face causal LMs in the recipes' flow: built by transformers, called as torchtune calls a decoder.

The recipes build a model from the config, load the checkpointer's state
dict into it, hand its output projection to the loss and call it as
``model(tokens, mask=..., input_pos=...)`` (:func:`torchtune_ext.step.forward_sums`).
:func:`causal_lm` gives a transformers ``PreTrainedModel`` that does all of
that without model code of our own:

* the architecture, weights layout and attention kernels are transformers'
  (``AutoModelForCausalLM.from_config`` on the folder's ``config.json``);
  state dict keys are transformers' (``model.layers.0.self_attn.q_proj.weight``);
* the instance's class gets a thin subclass (as FSDP2's ``fully_shard``
  does) whose ``forward`` also accepts torchtune's call: ``tokens`` ``[b, s]``,
  ``input_pos`` ``[b, s]`` as transformers' ``position_ids``. Packed rows
  (positions restarting at 0 for every document) keep attention inside each
  document through transformers' own packed-sequence detection, which works
  for every attention implementation and for sliding-window layers; the
  collator's block-causal ``mask`` is only checked against the positions
  (see :func:`_check_documents`). Called as transformers calls it
  (``input_ids=``, ``labels=``, ``generate``), it is transformers' forward;
* :meth:`TorchtuneCall.hand_over_output_projection` lets
  :class:`torchtune_ext.loss.SummedCrossEntropyLoss` apply the output
  projection to trainable rows only, with whatever the family's head does
  after its matmul (Gemma 2/3 ``final_logit_softcapping``, Cohere's
  ``logit_scale``, Granite's ``logits_scaling``), read from the class's own
  forward so that an unknown head transform is refused rather than dropped
  (:func:`_head_transforms`);
* an image-text folder (Gemma 3 4B+, Llama 4, ...) is refused unless
  ``text_only``, which builds its language model alone, as the causal LM
  class of its ``text_config`` (:func:`read_model_folder`; the checkpointer
  takes its weights out of the image-text model: :func:`language_model_keys`).
"""

import copy
import inspect
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from torchtune import training
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)
from transformers.utils import is_flash_attn_2_available

from torchtune_ext import distributed, ranks
from torchtune_ext.errors import ConfigError
from torchtune_ext.hf.tensor_parallel import apply_tensor_parallel
from torchtune_ext.loss import OutputProjection

log = logging.getLogger(__name__)
_said_builtin_class: set = set()  # folders whose auto_map line was printed: once per process, not per check

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flex_attention")


def _transformers_version() -> str:
    return transformers.__version__


def _read_config_json(folder: Path, key: str) -> Dict[str, Any]:
    if not folder.is_dir():
        raise ConfigError(key, f"'{folder}' is not a folder: point {key} at a Hugging Face model folder "
                          "(config.json, *.safetensors and tokenizer files, as `hf download <repo> --local-dir "
                          "<folder>` leaves it)")
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(key, f"'{folder}' has no config.json: point {key} at a Hugging Face model folder "
                          "(config.json, *.safetensors and tokenizer files, as `hf download <repo> --local-dir "
                          "<folder>` leaves it)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(key, f"'{path}' cannot be read as JSON ({err})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ConfigError(key, f"'{path}' names no model_type: it is not a transformers model config")
    return raw


# Families AutoModelForCausalLM builds only as a decoder (`is_decoder: true` in their config): encoders
# whose attention sees both directions otherwise, trained with masked language modelling
_ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie",
                        "bert-generation", "data2vec-text", "rembert", "roc_bert", "roformer", "xmod",
                        "megatron-bert", "big_bird")


def _multimodal_parts(config: Any) -> List[str]:
    """Sub-configs of a composite config that are not text (``vision_config``, ``audio_config``, ...)."""
    return sorted(name for name in getattr(config, "sub_configs", {}) or {}
                  if name != "text_config" and getattr(config, name, None) is not None)


def _sibling(key: str, name: str) -> str:
    """The config key ``name`` beside ``key`` (``model.path`` -> ``model.<name>``)."""
    return key.rsplit(".", 1)[0] + "." + name if "." in key else name


@dataclass(frozen=True)
class ImageText:
    """An image-text folder whose language model trains alone (``text_only``); see :func:`read_model_folder`.

    Attributes:
        model_class: the transformers class that loads the folder (``Gemma3ForConditionalGeneration``).
        text_class: the causal LM class of its language model (``Gemma3ForCausalLM``).
        dropped: the modules of ``model_class`` that the text model has no place for (vision tower,
            projector), by name: neither trained nor saved.
        dropped_parameters: how many parameters they hold.
    """

    model_class: type
    text_class: type
    dropped: Tuple[str, ...]
    dropped_parameters: int


@dataclass(frozen=True)
class ModelFolder:
    """What :func:`read_model_folder` found: ``config``, the config of the model that trains (for an
    image-text folder under ``text_only``, its language model's); ``image_text``, None for a text model."""

    config: Any
    image_text: Optional[ImageText] = None


def check_model_folder(path: Union[str, Path], *, key: str = "model.path", trust_remote_code: bool = False,
                       attn_implementation: Optional[str] = None, device: Optional[Union[str, torch.device]] = None,
                       text_only: bool = False):
    """Check that ``path`` holds a causal LM this transformers can build, before anything loads.

    :func:`read_model_folder`'s ``config``: see there for the arguments and errors.
    """
    return read_model_folder(path, key=key, trust_remote_code=trust_remote_code,
                             attn_implementation=attn_implementation, device=device, text_only=text_only).config


def read_model_folder(path: Union[str, Path], *, key: str = "model.path", trust_remote_code: bool = False,
                      attn_implementation: Optional[str] = None, device: Optional[Union[str, torch.device]] = None,
                      text_only: bool = False) -> ModelFolder:
    """Read the model folder ``path``: the config of the causal LM that trains, refusing what cannot train.

    Reads ``config.json`` (and, for ``trust_remote_code: true``, the
    folder's configuration code), never the weights: call it from the config
    validation; the builders and the checkpointer call it too. For an
    image-text folder under ``text_only`` it also builds the image-text
    model and its language model on the meta device (no memory), to find
    where the language model's weights sit and whether its output
    projection is tied to the embedding.

    Args:
        path: the model folder (``model.path`` / ``checkpointer.checkpoint_dir``).
        key: the config key ``path`` came from, for messages.
        trust_remote_code: allow a model whose code ships in the folder (``auto_map``).
        attn_implementation: None (transformers' choice: ``sdpa`` where the
            model supports it, else ``eager``), ``sdpa``, ``eager``,
            ``flash_attention_2`` (needs the flash-attn package and CUDA) or
            ``flex_attention`` (CUDA).
        device: the training device, to refuse a CUDA-only attention elsewhere;
            None skips that check.
        text_only: an image-text folder (Gemma 3 4B+, Llama 4, Mistral Small
            3.1, Qwen3.5: a ``text_config`` beside a ``vision_config``) trains
            its language model alone, as the causal LM class transformers has
            for its ``text_config`` (:class:`ImageText`). A text model's folder
            is read as without it (a saved step of such a run is one).

    Returns:
        :class:`ModelFolder`.

    Raises:
        ConfigError: one line naming the key: no folder or no ``config.json``;
            a ``model_type`` this transformers does not know (naming its
            version); a model whose code is in the folder without
            ``trust_remote_code``; a model that is not a causal LM (naming its
            class); an image-text model without ``text_only`` (naming its
            class and the key to set), or one whose language model
            transformers cannot build alone or would compute other logits
            with; an attention implementation that cannot run.
    """
    folder = Path(str(path)).expanduser()
    raw = _read_config_json(folder, key)
    model_type = raw["model_type"]
    auto_map = raw.get("auto_map") or {}
    known = model_type in CONFIG_MAPPING_NAMES
    remote_key = _sibling(key, "trust_remote_code")
    if not known:
        if not auto_map:
            raise ConfigError(key, f"model_type '{model_type}' in {folder / 'config.json'} is not known to "
                              f"transformers {_transformers_version()}: upgrade transformers (pip install -U "
                              "transformers) or use a model of a family it knows")
        if not trust_remote_code:
            raise ConfigError(remote_key, f"the model in '{folder}' ({model_type}) runs code that ships in the "
                              f"folder (config.json auto_map: {', '.join(sorted(auto_map))}); read that code, then "
                              f"set {remote_key}=true to allow it")
        if "AutoModelForCausalLM" not in auto_map:
            raise ConfigError(key, f"the model in '{folder}' ({model_type}) has no AutoModelForCausalLM in its "
                              "auto_map: it is not a causal language model")
    elif auto_map and not trust_remote_code and str(folder) not in _said_builtin_class and ranks.is_rank_zero():
        # what transformers does too: a family it knows runs its own code unless the folder's is allowed
        _said_builtin_class.add(str(folder))
        causal_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, model_type)
        log.warning("model: '%s' ships its own code (config.json auto_map: %s); transformers' built-in %s is "
                    "used instead, as transformers does without trust_remote_code (set %s=true to run the "
                    "folder's code)", folder, ", ".join(sorted(auto_map)), causal_class, remote_key)
    if raw.get("is_encoder_decoder") or (known and raw.get("is_decoder") is not True
                                         and model_type in _ENCODER_MODEL_TYPES):
        name = (raw.get("architectures") or [None])[0] or model_type
        raise ConfigError(key, f"{name} (model_type '{model_type}') is "
                          f"{'an encoder-decoder' if raw.get('is_encoder_decoder') else 'an encoder'} model, not a "
                          "causal language model; these recipes train decoder-only causal LMs (AutoModelForCausalLM)")
    architectures = raw.get("architectures") or []
    declared = architectures[0] if architectures else None
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises ValueError, OSError, KeyError ... for a config it cannot read
        raise ConfigError(key, f"transformers {_transformers_version()} cannot read {folder / 'config.json'}: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    image_text = None
    parts = _multimodal_parts(config)
    if parts and known:
        config, image_text = _language_model(config, declared, parts, key, text_only)
    elif parts:
        name = declared or type(config).__name__
        raise ConfigError(key, f"{name} is a multimodal model ({', '.join(parts)}); these recipes train "
                          "text-only causal LMs: use the folder of a text-only model")
    elif known:
        causal_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if causal_class is None:
            raise ConfigError(key, f"{declared or model_type} (model_type '{model_type}') is not a causal language "
                              "model transformers' AutoModelForCausalLM can build; these recipes train text-only "
                              "causal LMs")
        if declared and declared != causal_class and not declared.endswith(("ForCausalLM", "LMHeadModel")):
            raise ConfigError(key, f"{declared} (in {folder / 'config.json'}) is not a causal language model; "
                              "these recipes train text-only causal LMs (AutoModelForCausalLM)")
    if image_text is not None:
        model_class = image_text.text_class
    else:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None) if known else None
    _check_attention(attn_implementation, device, _sibling(key, "attn_implementation"), model_class)
    return ModelFolder(config, image_text)


# --------------------------------------------------------------------------- image-text folders (text_only)
def _image_text_class(config: Any, declared: Optional[str]) -> Optional[type]:
    """The transformers class that loads an image-text folder: the one its config.json declares, else the
    image-text class transformers maps its config to."""
    for name in (declared, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type),
                 MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)):
        cls = getattr(transformers, name, None) if name else None
        if isinstance(cls, type) and isinstance(config, getattr(cls, "config_class", None) or ()):
            return cls
    return None


def language_model_keys(image_text: nn.Module, text: nn.Module) -> Dict[str, str]:
    """Where each state dict entry of the text model sits in the image-text model.

    Each top-level module of ``text`` (``model``, ``lm_head``) has one place in
    ``image_text``: its output projection is ``image_text``'s
    (``get_output_embeddings``), any other module the one module of the same
    class (Gemma 3: ``model`` -> ``model.language_model``, a ``Gemma3TextModel``;
    Llama 4: ``model`` -> ``language_model.model``).

    Args:
        image_text: the image-text model (on meta or loaded).
        text: the causal LM of its language model (on meta).

    Returns:
        ``{text key: image_text key}`` for every entry of ``text.state_dict()``.

    Raises:
        ValueError: a module of ``text`` with no place, or with several, in
            ``image_text``; an entry missing there or of another shape.
    """
    head = text.get_output_embeddings()
    entries = text.state_dict()
    owners = {key.partition(".")[0] for key in entries}  # modules without weights (a rotary embedding) need no place
    places: Dict[str, str] = {}
    for name, child in text.named_children():
        if name not in owners:
            continue
        if child is head:
            target = image_text.get_output_embeddings()
            found = [n for n, m in image_text.named_modules() if target is not None and m is target]
        else:
            found = [n for n, m in image_text.named_modules() if type(m) is type(child)]
        if len(found) != 1:
            raise ValueError(f"{type(image_text).__name__} has {len(found) or 'no'} module{'s' * (len(found) != 1)} "
                             f"for {type(text).__name__}'s {name} ({type(child).__name__})")
        places[name] = found[0]
    targets = image_text.state_dict()
    keys: Dict[str, str] = {}
    for key, value in entries.items():
        child, _, rest = key.partition(".")
        if child not in places:
            raise ValueError(f"{type(text).__name__}'s {key} belongs to no module of its own")
        mapped = f"{places[child]}.{rest}" if places[child] else rest
        if mapped not in targets or targets[mapped].shape != value.shape:
            raise ValueError(f"{type(image_text).__name__} has no {mapped} of shape {tuple(value.shape)} for "
                             f"{type(text).__name__}'s {key}")
        keys[key] = mapped
    return keys


def _dropped_modules(keys: Any, kept: Any) -> Tuple[str, ...]:
    """The shortest module names under which ``keys`` hold nothing ``kept`` holds (the vision tower, ...)."""
    kept = set(kept)
    prefixes = {p for k in kept for p in _prefixes(k)}
    dropped = set()
    for key in keys:
        if key not in kept:
            dropped.add(next(p for p in _prefixes(key) + [key] if p not in prefixes))
    return tuple(sorted(dropped))


def _prefixes(key: str) -> List[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_tied(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def _language_model(config: Any, declared: Optional[str], parts: List[str], key: str,
                    text_only: bool) -> Tuple[Any, ImageText]:
    """The config of an image-text model's language model, as a causal LM that computes what the image-text
    model computes on text (see :func:`read_model_folder`)."""
    text_key = _sibling(key, "text_only")
    model_class = _image_text_class(config, declared)
    name = declared or (model_class.__name__ if model_class else type(config).__name__)
    text_config = config.get_text_config()
    text_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(text_config), None) if text_config is not config else None
    if text_class is None or model_class is None:
        raise ConfigError(key, f"{name} is a multimodal model ({', '.join(parts)}) whose language model "
                          f"transformers {_transformers_version()} cannot build as a causal LM alone; these "
                          "recipes train text-only causal LMs: use the folder of a text-only model")
    if not text_only:
        others = ", ".join(part.replace("_config", "") for part in parts)
        raise ConfigError(key, f"{name} is an image-text model ({', '.join(parts)}); set {text_key}=true to train "
                          f"its language model alone as {text_class.__name__} (without its {others} part), or use "
                          "the folder of a text-only model")
    text_config = copy.deepcopy(text_config)
    if getattr(text_config, "dtype", None) is None:
        text_config.dtype = getattr(config, "dtype", None)  # "auto" reads the folder's dtype off this config
    with torch.device("meta"):
        image_text = model_class._from_config(config)
        # tied as the image-text model ties it: some tie from their outer config (Mistral 3), some from the
        # text config (Llama 4), and the two may disagree
        text_config.tie_word_embeddings = _is_tied(image_text)
        text = text_class._from_config(text_config)
    try:
        keys = language_model_keys(image_text, text)
    except ValueError as err:
        raise ConfigError(text_key, f"the language model of {name} cannot be taken out of it: {err}") from None
    if _is_tied(text) != _is_tied(image_text):
        raise ConfigError(text_key, f"{name} {'ties' if _is_tied(image_text) else 'does not tie'} its output "
                          f"projection to its embedding and {text_class.__name__} cannot do the same: its language "
                          "model cannot train alone")
    try:
        outer = _head_transforms(image_text, model_class)
    except ConfigError:
        outer = None  # no lm_head call of its own: its logits come from a causal LM inside it (Llama 4)
    inner = _head_transforms(text, text_class)
    if outer is not None and outer != inner:
        raise ConfigError(text_key, f"{text_class.__name__} would compute other logits than {name}: after lm_head "
                          f"it applies {inner.describe()}, {name} {outer.describe()}; its language model cannot "
                          "train alone")
    kept = set(keys.values())
    dropped = _dropped_modules(image_text.state_dict(), kept)
    count = sum(p.numel() for n, p in image_text.named_parameters() if n not in kept)
    return text_config, ImageText(model_class, text_class, dropped, count)


# What a transformers class says it supports, per attention implementation
_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                  "flex_attention": "_supports_flex_attn"}


def _check_attention(attn_implementation: Optional[str], device: Optional[Union[str, torch.device]], key: str,
                     model_class: Optional[type] = None) -> None:
    if attn_implementation is None:
        return  # transformers picks sdpa where the model supports it, else eager
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(key, f"expected one of {', '.join(ATTN_IMPLEMENTATIONS)}, got {attn_implementation!r}")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if attn_implementation in ("flash_attention_2", "flex_attention") and device is not None and not on_cuda:
        raise ConfigError(key, f"{attn_implementation} runs on CUDA only, the device is {device}; use sdpa")
    if attn_implementation == "flash_attention_2":
        if not is_flash_attn_2_available():
            raise ConfigError(key, "flash_attention_2 needs the flash-attn package (pip install flash-attn) and a "
                              "CUDA GPU it supports; use sdpa")
    flag = _SUPPORT_FLAGS.get(attn_implementation)
    if model_class is not None and flag and not getattr(model_class, flag, False):
        raise ConfigError(key, f"{model_class.__name__} does not support {attn_implementation} in transformers "
                          f"{_transformers_version()}; use eager, or leave {key} out for transformers' choice")


# --------------------------------------------------------------------------- the head
@dataclass(frozen=True)
class HeadTransform:
    """What a family's causal-LM head does to ``lm_head``'s output, element-wise.

    Attributes:
        softcap: ``cap * tanh(logits / cap)`` (Gemma 2/3 ``final_logit_softcapping``); None: off.
        multiply: logits times this (Cohere ``logit_scale``); 1.0: off.
        divide: logits divided by this (Granite ``logits_scaling``); 1.0: off.
    """

    softcap: Optional[float] = None
    multiply: float = 1.0
    divide: float = 1.0

    def describe(self) -> str:
        """What it does, in words for a message (``softcap 30.0``, ``nothing``)."""
        done = [f"multiply by {self.multiply}"] if self.multiply != 1.0 else []
        done += [f"divide by {self.divide}"] if self.divide != 1.0 else []
        done += [f"softcap {self.softcap}"] if self.softcap is not None else []
        return ", then ".join(done) or "nothing"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# Lines a causal LM's forward may have between its lm_head call and its loss, as transformers
# writes them (comments stripped): each maps to what HeadTransform reproduces.
_LM_HEAD_CALLS = {
    "logits = self.lm_head(hidden_states[:, slice_indices, :])",
    "logits = self.lm_head(hidden_states[:, slice_indices, :]).float()",
    "logits = self.lm_head(hidden_states[:, slice_indices, :].to(self.lm_head.weight.dtype)).float()",
    "logits = self.lm_head(hidden_states[:, slice_indices, :]).contiguous()",
    "lm_logits = self.lm_head(hidden_states[:, slice_indices, :])",
}
_SOFTCAP_LINES = {
    "if self.config.final_logit_softcapping is not None:",
    "logits = logits / self.config.final_logit_softcapping",
    "logits = torch.tanh(logits)",
    "logits = logits * self.config.final_logit_softcapping",
    # an image-text class reads it off its text config (Gemma 4)
    "if (final_logit_softcapping := self.config.get_text_config().final_logit_softcapping) is not None:",
    "logits = logits / final_logit_softcapping",
    "logits = logits * final_logit_softcapping",
}
_MULTIPLY_LINE = "logits = logits * self.logit_scale"
_DIVIDE_LINE = "logits = logits / self.config.logits_scaling"
_HEAD_END = re.compile(r"^(loss\b|if labels\b|return\b|aux_loss\b)")


def _head_transforms(model: nn.Module, cls: type) -> HeadTransform:
    """Read off ``cls.forward`` what it does to ``lm_head``'s output; refuse what we cannot reproduce.

    Raises:
        ConfigError: (key ``model``) the forward's source cannot be read, its
            lm_head call is not one we know, or a line after it is not a
            transform of :class:`HeadTransform`.
    """
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError) as err:
        raise ConfigError("model", f"the source of {cls.__name__}.forward cannot be read ({err}), so what it does "
                          "after its output projection is unknown") from None
    lines = [line.split("#", 1)[0].strip() for line in source.splitlines()]
    lines = [line for line in lines if line]
    calls = [i for i, line in enumerate(lines) if "self.lm_head(" in line]
    if len(calls) != 1 or lines[calls[0]] not in _LM_HEAD_CALLS:
        found = lines[calls[0]] if calls else "no lm_head call"
        raise ConfigError("model", f"{cls.__name__} computes its logits in a way torchtune_ext.hf does not know "
                          f"({found!r}); its output projection cannot be handed to the loss")
    config, multiply, divide, softcap = model.config, 1.0, 1.0, None
    for line in lines[calls[0] + 1:]:
        if _HEAD_END.match(line):
            break
        if line in _SOFTCAP_LINES:
            softcap = getattr(config.get_text_config(), "final_logit_softcapping", None)
        elif line == _MULTIPLY_LINE:
            multiply = float(model.logit_scale)
        elif line == _DIVIDE_LINE:
            divide = float(config.logits_scaling)
        else:
            raise ConfigError("model", f"{cls.__name__} does more after its output projection than "
                              f"torchtune_ext.hf reproduces ({line!r}); its loss would differ from the model's")
    return HeadTransform(softcap=float(softcap) if softcap is not None else None, multiply=multiply, divide=divide)


# --------------------------------------------------------------------------- packed rows
def _separates(mask: Any, batch: int, seq_len: int) -> torch.Tensor:
    """``[batch, seq_len - 1]`` bool: position ``t + 1`` may not attend to ``t`` (a document starts at ``t + 1``).

    ``mask``: torchtune's block-causal mask, a ``[b, s, s]`` bool tensor (True
    = may attend) or, on CUDA with flex attention, a ``BlockMask``.
    """
    query = torch.arange(1, seq_len)
    if isinstance(mask, torch.Tensor):
        return ~mask[:, query, query - 1].bool()
    device = getattr(mask, "kv_indices", query).device
    b = torch.arange(batch, device=device)[:, None]
    q = query.to(device)[None, :]
    heads = torch.zeros_like(b)
    return ~mask.mask_mod(b, heads, q, q - 1)


def _check_documents(mask: Any, input_pos: Optional[torch.Tensor], tokens: torch.Tensor) -> None:
    """Check that the collator's block-causal ``mask`` and the positions tell the same documents.

    transformers finds the documents of a packed row from its positions (a
    new document wherever the position does not go up by 1), so a document
    the mask separates must start with a position restart. One exception: a
    last segment the mask separates while its positions go on counting is
    torchtune's ``PackedDataset`` padding (its ``input_pos`` continue the
    last document); no label is trained there and no earlier token attends
    to it, so it changes nothing.

    Raises:
        ValueError: ``mask`` without ``input_pos``, or a document boundary of
            the mask where the positions go on counting (the documents would
            see each other).
    """
    if input_pos is None:
        raise ValueError("a packed micro-batch needs input_pos with its mask: transformers models find the "
                         "documents of a row from the positions (restarting at 0 for every document)")
    batch, seq_len = tokens.shape
    if seq_len < 2:
        return
    by_mask = _separates(mask, batch, seq_len).to(input_pos.device)
    by_pos = input_pos[:, 1:] - input_pos[:, :-1] != 1
    unseen = by_mask & ~by_pos  # the mask separates, the positions do not
    # allowed: the row's last mask boundary, when nothing after it restarts (torchtune's padding)
    last_boundary = torch.where(by_mask, torch.arange(seq_len - 1, device=by_mask.device), -1).amax(dim=1, keepdim=True)
    tail_ok = torch.arange(seq_len - 1, device=by_mask.device)[None, :] == last_boundary
    if bool((unseen & ~tail_ok).any()):
        row, col = [int(i) for i in (unseen & ~tail_ok).nonzero()[0]]
        raise ValueError(f"packed micro-batch row {row}: the mask starts a document at position {col + 1} but "
                         "input_pos does not restart there; transformers models find documents from input_pos, "
                         "so the documents would attend to each other")


# --------------------------------------------------------------------------- the call convention
class TorchtuneCall:
    """Mixed into a transformers causal LM's class by :func:`causal_lm` (see the module docstring).

    Attributes set by :func:`adapt`: ``_ext_hf_class`` (the transformers class),
    ``_ext_head`` (:class:`HeadTransform`), ``_ext_returns_hidden`` (after the
    hand-over), ``_ext_router`` (router load-balancing settings or None),
    ``_ext_router_aux`` (the last forward's router loss) and ``_ext_body``
    (the name of the decoder stack that gives the final hidden states).
    """

    def forward(self, tokens: Optional[torch.Tensor] = None, mask: Any = None,
                input_pos: Optional[torch.Tensor] = None, **kwargs):
        """torchtune's call, or transformers' own.

        ``model(tokens, mask=..., input_pos=...)`` (``tokens`` ``[b, s]`` ids,
        ``input_pos`` ``[b, s]`` positions restarting at 0 per document of a
        packed row, ``mask`` the collator's block-causal mask, checked
        against them) returns ``[b, s, vocab]`` logits as the model's own
        head computes them, or ``[b, s, hidden]`` final normed hidden states
        after :meth:`hand_over_output_projection`. With any other keyword
        (``input_ids``, ``labels``, ``attention_mask``...) it is
        transformers' forward, unchanged.
        """
        if tokens is None or kwargs:
            return super().forward(tokens, **kwargs) if tokens is not None else super().forward(**kwargs)
        if mask is not None:
            _check_documents(mask, input_pos, tokens)
        extra = {"output_router_logits": True} if self._ext_router is not None else {}
        # No attention_mask: with one, transformers would build a plain causal mask and ignore the
        # documents of a packed row (transformers PR #46634); without, it finds them from the positions.
        out = getattr(self, self._ext_body)(input_ids=tokens, position_ids=input_pos, use_cache=False, **extra)
        if self._ext_router is not None:
            self._ext_router_aux = self._ext_router.loss(out.router_logits)
        hidden = out.last_hidden_state
        if self._ext_returns_hidden:
            return hidden
        return self._ext_head(self.get_output_embeddings()(hidden))

    def hand_over_output_projection(self) -> OutputProjection:
        """From now on return final hidden states; the loss applies the output projection.

        Returns:
            :class:`torchtune_ext.loss.OutputProjection`: ``project`` maps
            ``[rows, hidden]`` to fp32 ``[rows, vocab]`` logits through this
            model's ``lm_head`` module (so a LoRA adapter on it, tied weights
            and FSDP's gathering work as in the model) and its head
            transform; with router load balancing on, ``auxiliary`` holds
            the router loss of the last forward and its coefficient.
        """
        self._ext_returns_hidden = True
        head, transform = self.get_output_embeddings(), self._ext_head
        vocab = getattr(head, "out_features", None)
        vocab = vocab if isinstance(vocab, int) else self.config.get_text_config().vocab_size
        auxiliary = {}
        if self._ext_router is not None:
            auxiliary["router_aux_loss"] = (lambda: self._ext_router_aux, self._ext_router.coef)
        return OutputProjection(project=lambda rows: transform(head(rows).float()), vocab_size=vocab,
                                auxiliary=auxiliary)


@dataclass(frozen=True)
class RouterBalance:
    """The router load-balancing loss of a mixture-of-experts model, as its transformers module computes it.

    ``loss(router_logits)`` is the Switch Transformer auxiliary loss (Fedus
    et al., 2021, eqs. 4-6) over every position of the micro-batch (padding
    included: the model gets no padding mask), via the family's own
    ``load_balancing_loss_func``.
    """

    function: Callable
    num_experts: int
    top_k: int
    coef: float

    def loss(self, router_logits) -> torch.Tensor:
        return self.function(router_logits, self.num_experts, self.top_k, None)


def _router_balance(model: nn.Module, cls: type, coef: Optional[float]) -> RouterBalance:
    function = getattr(sys.modules[cls.__module__], "load_balancing_loss_func", None)
    num_experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    if function is None or not isinstance(num_experts, int) or not isinstance(top_k, int):
        raise ConfigError("model.output_router_logits", f"{cls.__name__} has no router load-balancing loss "
                          "torchtune_ext.hf knows; set model.output_router_logits=false")
    if coef is None:
        coef = getattr(model, "router_aux_loss_coef", model.config.router_aux_loss_coef)
    coef = float(coef)
    return RouterBalance(function, num_experts, top_k, coef)


_ADAPTED: Dict[type, type] = {}


def adapt(model: nn.Module, *, output_router_logits: bool = False,
          router_aux_loss_coef: Optional[float] = None) -> nn.Module:
    """Give a transformers causal LM torchtune's call convention, in place (see :class:`TorchtuneCall`).

    The instance's class becomes a subclass of its transformers class with
    the same name (``save_pretrained`` still writes that name into
    ``architectures``); weights, state dict and every other method are unchanged.

    Raises:
        ConfigError: (key ``model``) a head :func:`_head_transforms` refuses;
            (``model.output_router_logits``) router load balancing on a model without it.
    """
    cls = getattr(model, "_ext_hf_class", type(model))
    head = _head_transforms(model, cls)
    router = _router_balance(model, cls, router_aux_loss_coef) if output_router_logits else None
    if cls not in _ADAPTED:
        _ADAPTED[cls] = type(cls.__name__, (TorchtuneCall, cls), {"__module__": cls.__module__,
                                                                 "__qualname__": cls.__qualname__})
    model.__class__ = _ADAPTED[cls]
    model._ext_hf_class = cls
    model._ext_head = head
    model._ext_returns_hidden = False
    model._ext_router = router
    model._ext_router_aux = None
    model._ext_body = _body(model)
    return model


def _body(model: nn.Module) -> str:
    """The name of the causal LM's decoder stack: its ``base_model``, or where that is the model itself
    (Llama4ForCausalLM names ``language_model`` as its prefix, to load from Llama 4's image-text files,
    and keeps its stack in ``model``) its one child that is a transformers model.

    Raises:
        ConfigError: (key ``model``) none, or several.
    """
    if model.base_model is not model:
        return model.base_model_prefix
    found = [name for name, child in model.named_children() if isinstance(child, transformers.PreTrainedModel)]
    if len(found) != 1:
        raise ConfigError("model", f"{type(model).__name__}: no one decoder stack found among its modules "
                          f"({', '.join(name for name, _ in model.named_children())})")
    return found[0]


def _dtype(dtype: Optional[Union[str, torch.dtype]], config: Any) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()  # the recipe's: it builds the model under training.set_default_dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        configured = getattr(config, "dtype", None) or torch.float32
        return getattr(torch, configured) if isinstance(configured, str) else configured
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype in names:
        return names[dtype]
    named = getattr(torch, str(dtype), None)
    if isinstance(named, torch.dtype) and named.is_floating_point:
        return named
    raise ConfigError("model.dtype", f"expected auto, fp32, bf16, fp16 or a floating-point torch dtype name, "
                      f"got {dtype!r}")


def causal_lm(path: Union[str, Path], *, attn_implementation: Optional[str] = None, trust_remote_code: bool = False,
              dtype: Optional[Union[str, torch.dtype]] = None, output_router_logits: bool = False,
              router_aux_loss_coef: Optional[float] = None, text_only: bool = False) -> nn.Module:
    """The causal LM of a Hugging Face folder, built by transformers, random weights, torchtune's call convention.

    Built on the current default device: under ``torch.device("meta")``
    (the distributed recipes, before FSDP2) the parameters stay on meta
    while the non-persistent buffers (RoPE frequencies, Gemma's embedding
    scale) are computed on CPU as transformers computes them, so nothing is
    left to re-initialize after the weights load (:func:`load_state`).
    Elsewhere (CPU, ``cuda``) the parameters get transformers' random
    initialization; load the checkpoint's weights afterwards.

    Args:
        path: the model folder (``config.json``; weights are the checkpointer's job).
        attn_implementation: None (default): transformers' choice, ``sdpa``
            where the model supports it, else ``eager``; or ``sdpa``, ``eager``,
            ``flash_attention_2`` (flash-attn installed, CUDA), ``flex_attention`` (CUDA).
        trust_remote_code: allow a model whose code ships in the folder.
        dtype: None: the default dtype (the recipe's ``dtype``); ``auto``: the
            folder's ``config.json``; or ``fp32`` / ``bf16`` / a torch dtype name.
        output_router_logits: mixture-of-experts models: add the router
            load-balancing loss (see docs/models.md); default off.
        router_aux_loss_coef: its coefficient; None: the model config's.
        text_only: an image-text folder (Gemma 3 4B+, Llama 4, Mistral Small
            3.1, Qwen3.5) gives its language model alone, as the causal LM
            class of its ``text_config`` (``Gemma3ForCausalLM``); its weights
            come from :class:`torchtune_ext.hf.HFCheckpointer` with the same
            flag. Without it such a folder is refused. A text model's folder
            is built as without it.

    Returns:
        the transformers model (:class:`TorchtuneCall` mixed in), in train mode.

    Raises:
        ConfigError: see :func:`check_model_folder` and :func:`adapt`.
    """
    config = check_model_folder(path, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
                                text_only=text_only)
    if getattr(config, "use_cache", None):
        config.use_cache = False  # training: no KV cache
    kwargs = dict(dtype=_dtype(dtype, config), trust_remote_code=trust_remote_code)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if torch.empty(()).device.type == "meta":
        # Parameters on meta, buffers on CPU (accelerate's init_empty_weights), so that the buffers
        # hold transformers' values; FSDP2 moves them to the device.
        with torch.device("cpu"), init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        model.tie_weights()  # the context's parameter registration replaced tied parameters by copies
    else:
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.train()
    return adapt(model, output_router_logits=output_router_logits, router_aux_loss_coef=router_aux_loss_coef)


def decoder_layer_classes(model: nn.Module) -> Tuple[type, ...]:
    """The classes of the model's repeated blocks: its modules named in transformers' ``_no_split_modules``.

    Raises:
        ValueError: the model names none, or none of them is in the model.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"{type(model).__name__}: no module of its _no_split_modules ({sorted(names)}) found")
    return tuple(sorted(found, key=lambda c: c.__name__))


def is_decoder_layer(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """A predicate ``(name, module) -> bool`` true for the model's decoder layers (:func:`decoder_layer_classes`).

    A layer wrapped for activation checkpointing counts as the wrapper (it
    holds the same parameters), not twice.
    """
    classes = decoder_layer_classes(model)

    def is_layer(name: str, module: nn.Module) -> bool:
        inner = getattr(module, "_checkpoint_wrapped_module", None)
        if inner is not None:
            return isinstance(inner, classes)
        return isinstance(module, classes) and not name.endswith("._checkpoint_wrapped_module")

    return is_layer


def set_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (torch's non-reentrant checkpoint wrapper).

    The layers are the model's ``_no_split_modules`` classes; the state
    dict keys do not change (the wrapper strips its own prefix). Call it
    before :func:`shard_model`.
    """
    training.set_activation_checkpointing(model, auto_wrap_policy=set(decoder_layer_classes(model)))


def shard_model(model: nn.Module, device: torch.device, **kwargs):
    """FSDP2 over the decoder layers (:func:`decoder_layer_classes`), then the root; gradients summed.

    :func:`torchtune_ext.distributed.shard_model` with the model's own
    decoder layers as the units: the same keyword arguments (``cpu_offload``,
    ``reshard_after_forward``, ``custom_sharded_layers``) and the same
    gradient reduction (a sum over ranks: FSDP's averaging off). Under
    tensor parallelism the model is split first by the config's plan or
    its own ``tp_plan`` (:mod:`torchtune_ext.hf.tensor_parallel`).
    """
    return distributed.shard_model(model, device, is_block=is_decoder_layer(model),
                                   tensor_parallel=apply_tensor_parallel, **kwargs)


def load_state(model: nn.Module, state_dict: Dict[str, torch.Tensor], device: Union[str, torch.device], *,
               strict: bool = True, source: str = "the checkpoint"):
    """Load a full (unsharded) state dict into a model that is not sharded, built on meta or materialized.

    On meta (:func:`causal_lm` under ``torch.device("meta")``) the tensors
    are cast to the model's dtypes, moved to ``device`` and assigned (no
    random initialization ever ran), tied weights are tied again and the
    buffers (and LoRA adapters initialized on CPU) move to ``device``. A
    LoRA model's base weights load with ``strict=False`` after
    :func:`torchtune_ext.hf.lora.model_keys`; the missing keys are then its
    adapters'. A sharded model loads with
    :func:`torchtune_ext.distributed.load_full_model_state_dict`.

    Returns:
        ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict``.

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) a key (strict) or a
            shape that does not fit the model.
    """
    device = torch.device(device)
    expected = model.state_dict()
    on_meta = any(p.is_meta for p in model.parameters())
    converted = {k: v.to(device=device, dtype=expected[k].dtype) for k, v in state_dict.items() if k in expected}
    unexpected = [k for k in state_dict if k not in expected]
    try:
        if strict and unexpected:
            raise RuntimeError(f"Unexpected key(s) in state_dict: {', '.join(unexpected[:5])}")
        keys = model.load_state_dict(converted, strict=strict, assign=on_meta)
    except RuntimeError as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines()[:4] if line.strip())
        raise ConfigError("checkpointer.checkpoint_dir", f"the weights in '{source}' do not fit the model "
                          f"({detail})") from err
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise ConfigError("checkpointer.checkpoint_dir", f"'{source}' holds no value for {meta[0]}")
    if on_meta:
        model.tie_weights()
        model.to(device)  # the buffers (computed on CPU) and adapters initialized on CPU
    return type(keys)(list(keys.missing_keys), list(keys.unexpected_keys) + unexpected)
