"""Tiny random transformers models of the families whose layers are not all attention, or whose head or
experts are unusual: LFM2 (short convolutions), Qwen3-Next (Gated DeltaNet + experts), Falcon-H1 (Mamba2
beside attention, a logit multiplier), DeepSeek-V3 (MLA, a dense first layer, then experts).

The smallest configs transformers builds (hidden 16, one or two layers, vocabulary 128), so a test of
each stays well under a second; nothing is downloaded.
"""

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support.helpers import VOCAB
from tests.support.hf_tiny import TOKENIZER_FILES

SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, initializer_range=0.2)

HYBRID = {
    # a short-convolution layer, then an attention layer; tied embeddings (LFM2's default)
    "lfm2": dict(layer_types=["conv", "full_attention"], block_dim=16, block_ff_dim=32, conv_L_cache=3),
    # a Gated DeltaNet layer, then an attention layer; every MLP a mixture of experts with a shared expert
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                       linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
                       num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                       decoder_sparse_step=1, tie_word_embeddings=False),
    # Mamba2 and attention side by side in each layer; lm_head_multiplier scales the logits
    "falcon_h1": dict(num_hidden_layers=1, mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8, mamba_d_state=4,
                      mamba_n_groups=1, mamba_chunk_size=8, mamba_d_conv=4, mamba_expand=2,
                      lm_head_multiplier=0.5, tie_word_embeddings=False),
    # multi-head latent attention; the first layer dense, the second routed experts and a shared one
    "deepseek_v3": dict(first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                        n_shared_experts=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=8, head_dim=4, num_key_value_heads=2, n_group=1, topk_group=1,
                        tie_word_embeddings=False),
}


def hybrid_config(name: str, **overrides):
    spec = {**SMALL, **HYBRID[name], **overrides}
    return AutoConfig.for_model(name, **spec)


def hybrid_model(name: str, seed: int = 0, **overrides):
    """The tiny ``name`` model in fp32 on CPU, transformers' random initialization from ``seed``, eval mode."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hybrid_config(name, **overrides), dtype=torch.float32).eval()


def write_hybrid(name: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Write the tiny ``name`` model as a Hugging Face folder (with tokenizer stand-ins); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    hybrid_model(name, seed, **overrides).save_pretrained(str(folder))
    for file, text in TOKENIZER_FILES.items():
        (folder / file).write_text(text)
    return folder


def document_leak(model, length: int = 6, seed: int = 0) -> float:
    """How far the logits of the second document of a packed row move when the first document changes.

    Two documents of ``length`` tokens in one row, positions restarting at 0, no attention mask (as
    :mod:`torchtune_ext.model.hf.call` calls the model): 0.0 when the documents are kept apart.
    """
    g = torch.Generator().manual_seed(seed)
    first, other, second = (torch.randint(3, VOCAB, (1, length), generator=g) for _ in range(3))
    positions = torch.arange(length).repeat(2)[None]
    with torch.no_grad():
        a = model(input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False).logits
        b = model(input_ids=torch.cat([other, second], 1), position_ids=positions, use_cache=False).logits
    return (a[0, length:] - b[0, length:]).abs().max().item()
