"""Tiny random transformers models written as Hugging Face folders, for the torchtune_ext.model.hf tests.

Each family's config comes from ``AutoConfig.for_model`` at toy size, the
weights from ``from_config`` (seeded), and ``save_pretrained`` writes the
folder as ``hf download`` would leave it, plus small stand-ins for the
tokenizer files (the checkpointer copies them). Nothing is downloaded.
"""

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from tests.support.helpers import VOCAB

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

# Image-text folders (text_config + vision_config) whose language model trains alone (text_only): the text
# part at the size of COMMON, a one-layer vision tower. Gemma 3 without a soft cap, as Google's checkpoints.
_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)
IMAGE_TEXT: Dict[str, Dict[str, Any]] = {
    # tied embeddings; one sliding-window layer with a window shorter than the samples
    "gemma3": dict(text_config=dict(final_logit_softcapping=None, sliding_window=4, query_pre_attn_scalar=8,
                                    layer_types=["sliding_attention", "full_attention"]),
                   vision_config=_VISION, mm_tokens_per_image=4, image_token_index=127, boi_token_index=125,
                   eoi_token_index=126),
    # the language model is a whole Llama4ForCausalLM inside (language_model.lm_head); experts; chunked attention
    "llama4": dict(text_config=dict(intermediate_size_mlp=64, num_local_experts=2,
                                    num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8,
                                    no_rope_layers=[1, 0], moe_layers=[0, 1], tie_word_embeddings=False),
                   vision_config=dict(_VISION, vision_output_dim=16, projector_input_dim=16, projector_output_dim=32,
                                      rope_theta=10000)),
    # the outer config ties (transformers' default) while the text config does not: the model ties
    "mistral3": dict(text_config=dict(model_type="mistral", sliding_window=None, tie_word_embeddings=False),
                     vision_config=dict(_VISION, model_type="pixtral", head_dim=8)),
    # linear-attention (Gated DeltaNet) and full-attention layers; multimodal RoPE
    "qwen3_5": dict(text_config=dict(layer_types=["linear_attention", "full_attention"],
                                     linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                     linear_value_head_dim=8),
                    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                       patch_size=14)),
}
# An image-text folder's image processor settings (a stand-in): a text-only saved step leaves them out.
IMAGE_PROCESSOR_FILES = {"preprocessor_config.json": json.dumps({"image_processor_type": "stand-in"})}

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


def image_text_config(name: str, text: Optional[Dict[str, Any]] = None, **overrides):
    """A tiny image-text ``name`` model's config (a key of :data:`IMAGE_TEXT`); ``text`` overrides its text part."""
    spec = {**IMAGE_TEXT[name], **overrides}
    spec["text_config"] = {**COMMON, **spec["text_config"], **(text or {})}
    return AutoConfig.for_model(name, **spec)


def write_tiny_image_text(name: str, folder: Path, seed: int = 0, text: Optional[Dict[str, Any]] = None,
                          **overrides) -> Path:
    """Write a tiny random image-text ``name`` model (a key of :data:`IMAGE_TEXT`) as an HF folder, with
    tokenizer and image processor stand-ins; returns ``folder``."""
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(image_text_config(name, text, **overrides), dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    for file, content in {**TOKENIZER_FILES, **IMAGE_PROCESSOR_FILES}.items():
        (folder / file).write_text(content)
    return folder


class TinyFolders:
    """``folders(name)`` -> the folder of a tiny ``name`` model under ``root``, written on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._written: Dict[Any, Path] = {}

    def __call__(self, name: str) -> Path:
        if name not in self._written:  # a seed per family: llama and mistral have the same shapes
            self._written[name] = write_tiny(name, self.root / name, seed=sorted(FAMILIES).index(name))
        return self._written[name]

    def image_text(self, name: str) -> Path:
        """The folder of a tiny image-text ``name`` model (a key of :data:`IMAGE_TEXT`), written on first use."""
        if ("image_text", name) not in self._written:
            self._written[("image_text", name)] = write_tiny_image_text(
                name, self.root / f"{name}_image_text", seed=sorted(IMAGE_TEXT).index(name))
        return self._written[("image_text", name)]


def build_loaded(folder: Path, **kwargs):
    """The recipes' flow: ``causal_lm`` on the meta device (fp32), the checkpointer's state dict loaded into it
    (``text_only`` goes to both, as configs/hf/*.yaml pass it)."""
    from torchtune_ext.model.hf import HFCheckpointer, causal_lm, load_state

    checkpointer = HFCheckpointer(folder, folder.parent / f"{folder.name}_unused_out",
                                  text_only=kwargs.get("text_only", False))
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = causal_lm(folder, dtype="fp32", **kwargs)
    load_state(model, state, torch.device("cpu"))
    return model


def our_token_losses(model, tokens: torch.Tensor, shifted: torch.Tensor, ignore_index: int):
    """Our loss on ``model``: it takes the output projection, so ``model(tokens)`` gives final hidden states.

    Returns ``(hidden, per_token, total)``: the hidden states ``[batch, seq, hidden_size]``, each trainable
    position of ``shifted`` (labels after the shift) alone (``[n]``, in ``nonzero()`` order), and the loss of
    all of them at once (a 0-d tensor).
    """
    from torchtune_ext.train.loss import SummedCrossEntropyLoss

    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=ignore_index)
    loss_fn.take_output_projection(model)
    hidden = model(tokens)
    per_token = []
    for row, col in (shifted != ignore_index).nonzero().tolist():
        single = torch.full_like(shifted, ignore_index)
        single[row, col] = shifted[row, col]
        per_token.append(loss_fn(hidden, single).loss)
    return hidden, torch.stack(per_token), loss_fn(hidden, shifted).loss


def write_olmo2(folder):
    """A tiny OLMo 2 folder for the tensor-parallel tests (not in :data:`FAMILIES`: nothing else tests it); its
    tensor-parallel plan gathers q/k/v."""
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("olmo2", **COMMON), dtype=torch.float32)
    model.save_pretrained(str(folder))
    for file, text in TOKENIZER_FILES.items():
        (folder / file).write_text(text)
    return folder
