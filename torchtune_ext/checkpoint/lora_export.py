"""A LoRA checkpoint: the adapter, the merged model, and the adapter in PEFT's format beside it."""

import json
import os
from pathlib import Path
from typing import Any, Dict

import torch
from omegaconf import DictConfig
from torchtune import training

from torchtune_ext.checkpoint.discovery import ADAPTER_DIR, TORCHTUNE_ADAPTER_FILES
from torchtune_ext.config import lora_settings


def lora_checkpoint_state(model_state: Dict[str, Any], cfg_model: DictConfig, adapter_only: bool) -> Dict[str, Any]:
    """What a LoRA recipe hands to :meth:`CheckpointManager.save`.

    Args:
        model_state: the full model state dict (base and adapter), on CPU;
            may be empty (ranks other than 0 after a gather).
        cfg_model: the LoRA ``model`` config (settings it leaves out take the
            builder's defaults, :func:`torchtune_ext.config.lora_settings`).
        adapter_only: skip the merged model.

    Returns:
        ``adapter`` (the adapter weights), ``adapter_config`` (for PEFT's
        ``adapter_config.json``) and, unless ``adapter_only``, ``model``: the
        merged weights W + (alpha / rank) B A, computed on copies so the
        model's own frozen weights never change.
    """
    from torchtune.modules.peft import get_adapter_state_dict, get_lora_module_names, get_merged_lora_ckpt

    settings = lora_settings(cfg_model)
    state: Dict[str, Any] = {
        training.ADAPTER_KEY: get_adapter_state_dict(model_state),
        training.ADAPTER_CONFIG: {
            "r": settings.lora_rank,
            "lora_alpha": settings.lora_alpha,
            "target_modules": get_lora_module_names(
                list(settings.lora_attn_modules), settings.apply_lora_to_mlp, settings.apply_lora_to_output
            ),
            "peft_type": "LORA",
            "use_dora": settings.use_dora,
        },
    }
    if not adapter_only:
        # The merge adds into the tensors it is given; on CPU those can be the model's own weights.
        merged = {k: v.detach().to("cpu", copy=True) for k, v in model_state.items()}
        state[training.MODEL_KEY] = get_merged_lora_ckpt(merged, rank=settings.lora_rank, alpha=settings.lora_alpha)
    return state


def _permute_rows(t: torch.Tensor, n_heads: int, head_dim: int, inverse: bool = False) -> torch.Tensor:
    """torchtune's interleaved-RoPE row order of a q/k projection <-> HF's half-split order
    (the permutation ``convert_weights.tune_to_hf`` applies to q/k weights), on rows of ``t``."""
    rest = t.shape[1:]
    if inverse:
        return t.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)
    return t.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)


def peft_adapter_weights(adapter: Dict[str, torch.Tensor], model_type: str, hf_config: Dict[str, Any]):
    """A torchtune adapter state dict in PEFT's names and the base model's HF layout.

    Key names come from torchtune's ``tune_to_peft_adapter_weights``. Rows of
    q/k adapters follow what the family's HF converter does to the q/k
    weights: permuted from torchtune's interleaved RoPE order for Llama-like
    families (lora_B and, for DoRA, the magnitude), left as they are for
    QWEN2, whose converter does not permute (torchtune 0.6.1 permutes Qwen's
    lora_B anyway, so its PEFT adapters would not match the merged model).

    Args:
        adapter: ``lora_a`` / ``lora_b`` / ``magnitude`` tensors in torchtune names.
        model_type: ``checkpointer.model_type``.
        hf_config: the base model's ``config.json``.

    Returns:
        dict in PEFT names (``base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight``, ...).
    """
    from torchtune.models.convert_weights import tune_to_peft_adapter_weights

    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    dim = hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or dim // heads
    out = tune_to_peft_adapter_weights(dict(adapter), num_heads=heads, num_kv_heads=kv_heads, dim=dim,
                                       head_dim=head_dim)
    for key, value in out.items():
        n_heads = heads if ".q_proj." in key else kv_heads if ".k_proj." in key else None
        if n_heads is None:
            continue
        if model_type == "QWEN2" and "lora_B" in key:  # undo torchtune's permutation
            out[key] = _permute_rows(value, n_heads, head_dim, inverse=True)
        elif model_type != "QWEN2" and "lora_magnitude_vector" in key:  # rows of W, as lora_B's
            out[key] = _permute_rows(value, n_heads, head_dim)
    return out


def arrange_lora_folder(folder: Path, cfg_checkpointer: DictConfig) -> None:
    """Lay out a LoRA checkpoint written by torchtune's checkpointer so that each part loads as what it is.

    torchtune writes the adapter beside the merged model; transformers'
    ``AutoModelForCausalLM.from_pretrained(folder)`` would then attach it to the
    merged weights (the adapter counted twice). Here the adapter moves to
    ``folder/adapter/``: ``adapter_model.pt`` (torchtune names, read on resume)
    and, for HF checkpoints of families PEFT can address (not Phi-3/4, whose
    HF q/k/v and gate/up projections are fused), ``adapter_model.safetensors``
    (:func:`peft_adapter_weights`) and ``adapter_config.json`` with
    ``base_model_name_or_path`` (the base checkpoint folder) and ``task_type``,
    so ``PeftModel.from_pretrained(base, folder / "adapter")`` and
    ``AutoPeftModelForCausalLM.from_pretrained(folder / "adapter")`` work.

    Args:
        folder: the step folder as the torchtune checkpointer wrote it.
        cfg_checkpointer: the ``checkpointer`` config (base folder, model_type).
    """
    from safetensors.torch import save_file

    target = folder / ADAPTER_DIR
    target.mkdir(exist_ok=True)
    adapter = torch.load(folder / "adapter_model.pt", map_location="cpu", weights_only=True)
    os.replace(folder / "adapter_model.pt", target / "adapter_model.pt")
    peft_config = None
    if (folder / "adapter_config.json").is_file():
        peft_config = json.loads((folder / "adapter_config.json").read_text())
    for name in TORCHTUNE_ADAPTER_FILES:
        (folder / name).unlink(missing_ok=True)
    base_dir = Path(str(cfg_checkpointer.checkpoint_dir)).resolve()
    model_type = str(cfg_checkpointer.get("model_type", "")).upper()
    hf_config_file = base_dir / "config.json"
    if peft_config is None or not hf_config_file.is_file() or model_type in ("PHI3_MINI", "PHI4"):
        return  # no PEFT form: Meta checkpoints, Phi's fused projections
    weights = peft_adapter_weights(adapter, model_type, json.loads(hf_config_file.read_text()))
    save_file({k: v.contiguous() for k, v in weights.items()}, target / "adapter_model.safetensors",
              metadata={"format": "pt"})
    peft_config.update(base_model_name_or_path=str(base_dir), task_type="CAUSAL_LM")
    (target / "adapter_config.json").write_text(json.dumps(peft_config, indent=2))
