"""A Hugging Face model folder, read before anything is built: its config, its class, what it can train.

:func:`read_model_folder` (and :func:`check_model_folder`, the config check
before anything loads) reads ``config.json`` with transformers, refuses what
the recipes cannot train in one line (an encoder, an image-text folder
without ``text_only``, an attention implementation the device lacks), and
says which causal LM class builds it; an image-text folder with
``text_only`` builds its language model alone, as the causal LM class of its
``text_config`` (the checkpointer takes its weights out of the image-text
model: :func:`language_model_keys`).
"""


import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import transformers
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)
from transformers.utils import is_flash_attn_2_available

from torchtune_ext import ranks
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf.call import head_transforms

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
        outer = head_transforms(image_text, model_class)
    except ConfigError:
        outer = None  # no lm_head call of its own: its logits come from a causal LM inside it (Llama 4)
    inner = head_transforms(text, text_class)
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
