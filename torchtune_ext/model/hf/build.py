"""Hugging Face causal LMs in the recipes' flow: built by transformers, called as torchtune calls a decoder.

The recipes build a model from the config, load the checkpointer's state
dict into it, hand its output projection to the loss and call it as
``model(tokens, mask=..., input_pos=...)`` (:func:`torchtune_ext.train.step.forward_sums`).
:func:`causal_lm` gives a transformers ``PreTrainedModel`` that does all of
that without model code of our own: the architecture, weights layout and
attention kernels are transformers' (``AutoModelForCausalLM.from_config`` on
the folder's ``config.json``, read by :mod:`~torchtune_ext.model.hf.folder`);
state dict keys are transformers' (``model.layers.0.self_attn.q_proj.weight``);
torchtune's call convention and the head are :mod:`~torchtune_ext.model.hf.call`.
Here: building it (on the meta device), activation checkpointing, FSDP2
sharding per decoder layer, and loading its weights.
"""


import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from accelerate import init_empty_weights
from torch import nn
from torchtune import training
from transformers import AutoModelForCausalLM

from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf.call import adapt
from torchtune_ext.model.hf.folder import check_model_folder
from torchtune_ext.parallel import fsdp
from torchtune_ext.parallel.hf_plan import apply_tensor_parallel

log = logging.getLogger(__name__)


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
            come from :class:`torchtune_ext.model.hf.HFCheckpointer` with the same
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

    :func:`torchtune_ext.parallel.fsdp.shard_model` with the model's own
    decoder layers as the units: the same keyword arguments (``cpu_offload``,
    ``reshard_after_forward``, ``custom_sharded_layers``) and the same
    gradient reduction (a sum over ranks: FSDP's averaging off). Under
    tensor parallelism the model is split first by the config's plan or
    its own ``tp_plan`` (:mod:`torchtune_ext.parallel.hf_plan`).
    """
    return fsdp.shard_model(model, device, is_block=is_decoder_layer(model),
                                   tensor_parallel=apply_tensor_parallel, **kwargs)

def load_state(model: nn.Module, state_dict: Dict[str, torch.Tensor], device: Union[str, torch.device], *,
               strict: bool = True, source: str = "the checkpoint"):
    """Load a full (unsharded) state dict into a model that is not sharded, built on meta or materialized.

    On meta (:func:`causal_lm` under ``torch.device("meta")``) the tensors
    are cast to the model's dtypes, moved to ``device`` and assigned (no
    random initialization ever ran), tied weights are tied again and the
    buffers (and LoRA adapters initialized on CPU) move to ``device``. A
    LoRA model's base weights load with ``strict=False`` after
    :func:`torchtune_ext.model.hf.lora.model_keys`; the missing keys are then its
    adapters'. A sharded model loads with
    :func:`torchtune_ext.checkpoint.state_dict.load_full_model_state_dict`.

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
