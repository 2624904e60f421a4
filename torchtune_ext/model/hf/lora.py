"""LoRA and DoRA on transformers models through PEFT, from torchtune's LoRA keys.

torchtune's LoRA builders take ``lora_attn_modules`` (``q_proj``, ``k_proj``,
``v_proj``, ``output_proj``), ``apply_lora_to_mlp``, ``apply_lora_to_output``,
``lora_rank``, ``lora_alpha``, ``lora_dropout`` and ``use_dora``;
:func:`lora_config` maps them onto a ``peft.LoraConfig`` with the module
names of the model at hand, found in every decoder layer by
:mod:`torchtune_ext.model.hf.lora_targets`:

* attention: torchtune's names onto transformers' (``output_proj`` ->
  ``o_proj`` or ``out_proj``), in the attention layers wherever they exist;
  any other module name of the layers (MLA's ``q_a_proj``, ``kv_b_proj``) is
  adapted as named; a name no layer has is refused, listing those it has;
* MLP: every linear of the layers outside attention, token mixers and
  routers (dense MLPs, shared experts); fused experts (3-D parameters, as
  transformers 5 holds Qwen3-MoE's, gpt-oss's and DeepSeek-V3's) through
  PEFT's ``target_parameters``; routers and convolutions get no adapter unless named;
* output: ``lm_head``, refused when it is the token embedding (tied).

One log line says how many modules of each name got an adapter.

The scale is ``lora_alpha / lora_rank`` in both libraries. PEFT injects the
adapters in place (:func:`lora_causal_lm`), so the model keeps torchtune's
call convention and its output projection still goes to the loss; the base
weights of an adapted layer move under ``base_layer`` in the state dict
(:func:`model_keys` renames a checkpoint's keys to match).
"""

import logging
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Sequence

import torch
from peft import LoraConfig, get_peft_model, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import AutoModelForCausalLM

from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf.build import causal_lm, decoder_layer_classes
from torchtune_ext.model.hf.lora_targets import lora_targets

log = logging.getLogger(__name__)
_LOGGED: set = set()  # the lines logged by lora_config in this process

ADAPTER = "default"  # PEFT's adapter name


@contextmanager
def _quiet_expert_adapters() -> Iterator[None]:
    """PEFT warns "Unsupported layer type ... proceed at your own risk" for a module whose parameters it
    adapts through target_parameters (fused experts): that is the documented use, tested here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Unsupported layer type .*(Experts|Moe)", category=UserWarning)
        yield


def lora_config(model: nn.Module, *, lora_attn_modules: Sequence[str], apply_lora_to_mlp: bool = False,
                apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                lora_dropout: float = 0.0, use_dora: bool = False) -> LoraConfig:
    """torchtune's LoRA keys as a ``peft.LoraConfig`` for ``model`` (targets:
    :func:`torchtune_ext.model.hf.lora_targets.lora_targets`, over every decoder layer).

    Raises:
        ConfigError: (``model.lora_attn_modules``) a name no decoder layer has
            (the message lists those it has); (``model.apply_lora_to_output``) a tied
            output projection; (``model.use_dora`` / ``model.lora_dropout``)
            DoRA or dropout on fused experts, which PEFT's parameter adapters lack.
    """
    targets = lora_targets(model, decoder_layer_classes(model), lora_attn_modules=lora_attn_modules,
                           apply_lora_to_mlp=apply_lora_to_mlp, apply_lora_to_output=apply_lora_to_output)
    if targets.parameters and use_dora:
        raise ConfigError("model.use_dora", f"{type(model).__name__}'s experts are fused parameters, which "
                          "PEFT adapts with LoRA only; set model.use_dora=false or model.apply_lora_to_mlp=false")
    if targets.parameters and lora_dropout:
        raise ConfigError("model.lora_dropout", f"{type(model).__name__}'s experts are fused parameters, whose "
                          "PEFT adapters have no dropout; set model.lora_dropout=0.0")
    line = f"{type(model).__name__}: {targets.describe()}"
    if line not in _LOGGED:  # the start-up checks build the model once before the recipe does: one line
        _LOGGED.add(line)
        log.info(line)
    return LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_dora=use_dora,
                      target_modules=targets.modules, target_parameters=targets.parameters or None,
                      bias="none", task_type="CAUSAL_LM")


def lora_causal_lm(path: str, *, lora_attn_modules: Sequence[str], apply_lora_to_mlp: bool = False,
                   apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                   lora_dropout: float = 0.0, use_dora: bool = False, **kwargs) -> nn.Module:
    """:func:`torchtune_ext.model.hf.causal_lm` with PEFT adapters injected in place; only the adapters train.

    The LoRA arguments are torchtune's (:func:`lora_config`); ``kwargs`` go
    to ``causal_lm``. Built on the current default device like ``causal_lm``:
    on meta the adapters are meta too until :func:`initialize_adapters`.

    Returns:
        the model; ``model.peft_config["default"]`` is its ``LoraConfig``.
    """
    model = causal_lm(path, **kwargs)
    config = lora_config(model, lora_attn_modules=lora_attn_modules, apply_lora_to_mlp=apply_lora_to_mlp,
                         apply_lora_to_output=apply_lora_to_output, lora_rank=lora_rank, lora_alpha=lora_alpha,
                         lora_dropout=lora_dropout, use_dora=use_dora)
    with _quiet_expert_adapters():
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model


def _lora_layers(model: nn.Module) -> List[LoraLayer]:
    return [m for m in model.modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]


def initialize_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initialization of every adapter (A: Kaiming uniform, B: zeros), on CPU, from ``seed`` alone.

    So every device and world size starts from the same adapter (the global
    random state is left untouched), and a model built on meta gets real
    adapters (on CPU, ready for sharding; on another device they move back
    there). DoRA magnitudes come from the loaded base weights: :func:`initialize_dora_magnitude`.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in _lora_layers(model):
            parts = [layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]]
            magnitude = getattr(layer, "lora_magnitude_vector", {})
            if ADAPTER in magnitude:  # DoRA: given its values by initialize_dora_magnitude, once the base loaded
                parts.append(magnitude[ADAPTER])
            device = parts[0].weight.device
            for part in parts:
                part.to_empty(device="cpu")
            layer.reset_lora_parameters(ADAPTER, True)  # A, B only
            if device.type not in ("cpu", "meta"):
                for part in parts:
                    part.to(device)


def initialize_dora_magnitude(model: nn.Module) -> None:
    """Set each DoRA magnitude to the row norms of its loaded base weight plus the adapter (PEFT's DoRA init).

    Call after the base weights and :func:`initialize_adapters` (unsharded model).
    """
    for layer in _lora_layers(model):
        magnitude = getattr(layer, "lora_magnitude_vector", {})
        if ADAPTER in magnitude:
            magnitude[ADAPTER].update_layer(base_layer=layer.get_base_layer(), lora_A=layer.lora_A[ADAPTER].weight,
                                            lora_B=layer.lora_B[ADAPTER].weight, scaling=layer.scaling[ADAPTER])


def adapter_params(model: nn.Module) -> Dict[str, nn.Parameter]:
    """The adapter parameters (LoRA A/B, DoRA magnitudes) by name: what the optimizer gets."""
    return {name: param for name, param in model.named_parameters() if ".lora_" in name}


def model_keys(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A checkpoint's state dict with the keys of ``model``: an adapted layer's base weight moves under
    ``base_layer`` (``...q_proj.weight`` -> ``...q_proj.base_layer.weight``). Other keys are kept."""
    plain = {key.replace(".base_layer", ""): key for key in model.state_dict() if ".base_layer" in key}
    return {plain.get(key, key): value for key, value in state_dict.items()}


def lora_checkpoint_state(model: nn.Module, model_state: Dict[str, torch.Tensor],
                          adapter_only: bool = False) -> Dict[str, Any]:
    """What a LoRA recipe hands to :meth:`torchtune_ext.checkpoint.CheckpointManager.save` for a transformers model.

    Args:
        model: the trained model (its ``peft_config`` and config are read).
        model_state: its full state dict on CPU (base and adapter, the model's keys); may be empty on
            ranks other than 0.
        adapter_only: skip the merged model.

    Returns:
        ``adapter`` (adapter tensors, the model's keys), ``adapter_config``
        (the ``LoraConfig`` as a dict) and, unless ``adapter_only``, ``model``
        (the full state, merged when saved: see :class:`torchtune_ext.model.hf.HFCheckpointer`).
    """
    state: Dict[str, Any] = {
        "adapter": {k: v for k, v in model_state.items() if ".lora_" in k},
        "adapter_config": model.peft_config[ADAPTER].to_dict(),
    }
    if not adapter_only:
        state["model"] = model_state
    return state


def peft_model_from_state(config: Any, adapter_config: Dict[str, Any], state: Dict[str, torch.Tensor], *,
                          base_dir: str, trust_remote_code: bool = False):
    """A ``peft.PeftModel`` of the transformers ``config`` holding ``state``, on CPU, for writing checkpoints.

    Args:
        config: the base model's ``PretrainedConfig``.
        adapter_config: :func:`lora_checkpoint_state`'s ``adapter_config``.
        state: the adapter, and for merging the base weights too (the training model's keys);
            base weights left out stay on the meta device (enough for ``save_pretrained`` of the adapter).
        base_dir: the base model folder, written as ``base_model_name_or_path``.

    The tensors are copies: ``merge_and_unload`` adds into the base weights,
    which may be the training model's own.

    Raises:
        ValueError: an adapter tensor the model does not have, or one it lacks.
    """
    lora = LoraConfig(**{k: v for k, v in adapter_config.items() if k in LoraConfig.__dataclass_fields__})
    lora.base_model_name_or_path = str(base_dir)
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
        with _quiet_expert_adapters():
            peft_model = get_peft_model(base, lora, adapter_name=ADAPTER)
    inner = peft_model.base_model.model
    _, unexpected = inner.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False,
                                          assign=True)
    inner.tie_weights()
    missing = [n for n, t in inner.named_parameters() if t.is_meta and ".lora_" in n]
    if missing or unexpected:
        raise ValueError(f"the adapter does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return peft_model
