"""torchtune builders of SmolLM2-135M cut to its first N decoder layers: the student of the distillation benchmark.

Upstream torchtune's ``knowledge_distillation_single_device`` builds its student
and teacher from ``_component_`` builders. The student folder that
``python -m bench.peers.student`` writes is SmolLM2-135M's first layers, so its
builder is SmolLM2's with ``num_layers`` changed. SmolLM2's dimensions are stated
here from its ``config.json`` (the values ``torchtune_ext.models.smollm2_135m``
uses too): plain RoPE (``scale_factor=1``), tied embeddings.
"""

from typing import List

from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.modules import TransformerDecoder

# SmolLM2-135M(-Instruct)'s config.json, in torchtune's names; every layer count keeps these.
SMOLLM2_DIMS = dict(vocab_size=49_152, num_heads=9, num_kv_heads=3, embed_dim=576, intermediate_dim=1536,
                    norm_eps=1e-5, rope_base=100_000, scale_factor=1, tie_word_embeddings=True)


def smollm2_layers(num_layers: int = 10, max_seq_len: int = 8192) -> TransformerDecoder:
    """SmolLM2-135M with ``num_layers`` decoder layers (30 is the full model); loads a pruned folder's weights."""
    return llama3_2(num_layers=num_layers, max_seq_len=max_seq_len, **SMOLLM2_DIMS)


def lora_smollm2_layers(lora_attn_modules: List[str], apply_lora_to_mlp: bool = False,
                        apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                        lora_dropout: float = 0.0, num_layers: int = 10, max_seq_len: int = 8192) -> TransformerDecoder:
    """:func:`smollm2_layers` with LoRA adapters (arguments as ``torchtune_ext.models.lora_smollm2_135m``)."""
    return lora_llama3_2(lora_attn_modules=lora_attn_modules, apply_lora_to_mlp=apply_lora_to_mlp,
                         apply_lora_to_output=apply_lora_to_output, lora_rank=lora_rank, lora_alpha=lora_alpha,
                         lora_dropout=lora_dropout, num_layers=num_layers, max_seq_len=max_seq_len, **SMOLLM2_DIMS)
