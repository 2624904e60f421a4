"""Tiny random transformers models written as Hugging Face folders, for the torchtune_ext.hf tests.

Each family's config comes from ``AutoConfig.for_model`` at toy size, the
weights from ``from_config`` (seeded), and ``save_pretrained`` writes the
folder as ``hf download`` would leave it, plus small stand-ins for the
tokenizer files (the checkpointer copies them). Nothing is downloaded.
"""

import json
from pathlib import Path
from typing import Any, Dict

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import VOCAB

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, initializer_range=0.1)

# Gemma 3's soft cap: the logits of these weights reach about 2, so a cap of 1 changes them a lot.
GEMMA_SOFTCAP = 1.0

FAMILIES: Dict[str, Dict[str, Any]] = {
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False),
    # one sliding-window layer with a window shorter than the samples, one global layer
    "gemma3": dict(model_type="gemma3_text", final_logit_softcapping=GEMMA_SOFTCAP, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8),
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", sliding_window=None, tie_word_embeddings=False),
    # attention sinks, biases, fused experts with biases; eager attention (transformers has no sdpa for it)
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
}

TOKENIZER_FILES = {
    "tokenizer_config.json": json.dumps({"model_max_length": 256, "chat_template": "{{ messages }}"}),
    "special_tokens_map.json": json.dumps({"eos_token": "</s>"}),
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "stand-in"}}),
}


def tiny_config(name: str, **overrides):
    spec = {**COMMON, **FAMILIES[name], **overrides}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def write_tiny(name: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny random ``name`` model (a key of :data:`FAMILIES`) as an HF folder; returns ``folder``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides), dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    for file, text in TOKENIZER_FILES.items():
        (folder / file).write_text(text)
    return folder


class TinyFolders:
    """``folders(name)`` -> the folder of a tiny ``name`` model under ``root``, written on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._written: Dict[str, Path] = {}

    def __call__(self, name: str) -> Path:
        if name not in self._written:  # a seed per family: llama and mistral have the same shapes
            self._written[name] = write_tiny(name, self.root / name, seed=sorted(FAMILIES).index(name))
        return self._written[name]


def build_loaded(folder: Path, **kwargs):
    """The recipes' flow: ``causal_lm`` on the meta device (fp32), the checkpointer's state dict loaded into it."""
    from torchtune_ext.hf import HFCheckpointer, causal_lm, load_state

    state = HFCheckpointer(folder, folder.parent / f"{folder.name}_unused_out").load_checkpoint()["model"]
    with torch.device("meta"):
        model = causal_lm(folder, dtype="fp32", **kwargs)
    load_state(model, state, torch.device("cpu"))
    return model
