"""Convert a llama-architecture GGUF file into a Hugging Face Llama checkpoint folder.

The output is what ``transformers`` and torchtune's ``FullModelHFCheckpointer``
expect: ``model.safetensors`` (fp32, HF key names and HF q/k row order),
``config.json``, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json``.

Two details make or break the weights:

* gguf lists a tensor's shape fastest-varying dimension first, the reverse of
  numpy/torch. ``gguf.quants.dequantize`` already returns the numpy (row-major)
  shape, so an HF ``[out_features, in_features]`` matrix comes back as is.
* llama.cpp's HF converter reorders the rows of ``q_proj`` and ``k_proj`` of
  every head from HF's "rotate halves" RoPE layout into the interleaved-pairs
  layout that llama.cpp (and Meta's reference code) use. We undo that here; a
  checkpoint left in the interleaved layout loads without error but produces
  garbage, because torchtune's checkpointer applies the same HF->interleaved
  reordering once more.

Only the subset of GGUF needed for SmolLM2 is handled (``general.architecture ==
"llama"``, GPT-2 style byte-level BPE with ``tokenizer.ggml.pre == "smollm"``);
anything else raises ``ValueError`` instead of writing a wrong checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# GGUF tensor name -> HF Llama name; "{i}" is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Pre-tokenizers we can reproduce with the ``tokenizers`` library. llama.cpp's
# "smollm" splits every digit on its own and then applies the GPT-2 regex, which
# is exactly HF's Digits(individual_digits=True) followed by ByteLevel(use_regex=True).
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
}


def _field(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def permute_qk_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder HF q/k projection rows into llama.cpp's interleaved RoPE layout.

    This is the reordering llama.cpp's converter applies; it is provided so tests
    can reproduce a checkpoint that skipped :func:`permute_qk_to_hf`.

    Args:
        weight: ``[n_heads * head_dim, in_features]`` in HF layout, where each
            head's rows are the first halves of its rotation pairs followed by
            the second halves.
        n_heads: number of heads the rows belong to (``num_key_value_heads`` for k).

    Returns:
        Tensor of the same shape whose rows within each head alternate
        first-half/second-half, i.e. rotation pairs are adjacent.
    """
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_qk_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_qk_to_interleaved`: GGUF q/k rows back to HF order.

    Args:
        weight: ``[n_heads * head_dim, in_features]`` as stored in a GGUF file.
        n_heads: ``num_attention_heads`` for q, ``num_key_value_heads`` for k.

    Returns:
        Tensor of the same shape in HF layout.
    """
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Build an HF ``LlamaConfig`` dict from GGUF metadata.

    Args:
        reader: an opened GGUF file with ``general.architecture == "llama"``.

    Returns:
        A complete ``config.json`` dict (fp32, tied embeddings when the file has
        no separate ``output.weight``).

    Raises:
        ValueError: for another architecture, or RoPE settings we cannot express
            (partial rotary dimension, RoPE scaling).
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv_heads = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = hidden // n_heads
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial RoPE (rope.dimension_count={rope_dim}, head_dim={head_dim}) is not supported")
    if _field(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF files with RoPE scaling are not supported")
    tensor_names = {t.name for t in reader.tensors}
    vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        # GGUF stores float32; its shortest repr turns 9.99999974738e-06 back into 1e-05
        "rms_norm_eps": float(str(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "vocab_size": int(_field(reader, "llama.vocab_size", vocab)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    pad = _field(reader, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        config["pad_token_id"] = int(pad)
    return config


def generation_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The ``generation_config.json`` dict: special token ids from GGUF metadata."""
    out = {
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
    }
    pad = _field(reader, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        out["pad_token_id"] = int(pad)
    return out


def hf_state_dict(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 and rename it to HF Llama conventions.

    Args:
        reader: an opened llama-architecture GGUF file.
        config: its :func:`hf_config`, for head counts.

    Returns:
        ``{hf_name: fp32 tensor}`` with q/k rows in HF order and no
        ``lm_head.weight`` when embeddings are tied.

    Raises:
        ValueError: on a tensor name we do not know how to map, or a shape that
            disagrees with the config.
    """
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    state = {}
    for tensor in reader.tensors:
        if tensor.name in _TOP_NAMES:
            name = _TOP_NAMES[tensor.name]
        else:
            match = _LAYER_RE.match(tensor.name)
            if not match or match.group(2) not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
            name = f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # gguf lists dims innermost first
        if array.shape != shape:
            raise ValueError(f"{tensor.name}: dequantized shape {array.shape} != expected {shape}")
        # np.array copies: unquantized tensors arrive as read-only views of the memory-mapped file
        weight = torch.from_numpy(np.array(array, dtype=np.float32))
        if name.endswith("q_proj.weight"):
            weight = permute_qk_to_hf(weight, n_heads)
        elif name.endswith("k_proj.weight"):
            weight = permute_qk_to_hf(weight, n_kv)
        state[name] = weight.contiguous()
    expected_embed = (config["vocab_size"], config["hidden_size"])
    if tuple(state["model.embed_tokens.weight"].shape) != expected_embed:
        raise ValueError(f"embedding shape {tuple(state['model.embed_tokens.weight'].shape)} != {expected_embed}")
    return state


def hf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """Rebuild the HF fast tokenizer embedded in a GGUF file.

    Args:
        reader: a GGUF file with ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE).

    Returns:
        A ``tokenizers.Tokenizer`` with the file's vocabulary, merges and
        pre-tokenizer; CONTROL tokens become special added tokens and
        USER_DEFINED tokens plain added tokens, at their original ids. No
        normalizer and no post-processor: nothing is added around the text.

    Raises:
        ValueError: for another tokenizer model, an unknown ``tokenizer.ggml.pre``,
            or token types this converter does not handle.
    """
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') tokenizers are supported, got {model!r}")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unknown pre-tokenizer {pre!r}; known: {sorted(_PRE_TOKENIZERS)}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    # Byte-level tokens never contain a raw space (it is mapped to "Ġ"), so a
    # single space separates the two halves of a merge unambiguously.
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    unknown = {t for t in types if t not in (_NORMAL, _CONTROL, _USER_DEFINED)}
    if unknown:
        raise ValueError(f"unsupported GGUF token types {sorted(unknown)}")

    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            dropout=None,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=(kind == _CONTROL), normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind != _NORMAL
    ]
    tok.add_tokens(added)
    for i, (t, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind != _NORMAL and tok.token_to_id(t) != i:
            raise ValueError(f"added token {t!r} moved from id {i} to {tok.token_to_id(t)}")
    return tok


def tokenizer_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The HF ``tokenizer_config.json`` dict: special tokens by name and the chat template."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    special = {i: t for i, (t, k) in enumerate(zip(tokens, types, strict=False)) if k == _CONTROL}
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in special.items()
        },
    }
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        idx = _field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if idx is not None:
            config[name] = tokens[int(idx)]
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write an HF Llama checkpoint folder converted from ``gguf_path``.

    Args:
        gguf_path: a llama-architecture GGUF file (any quantization ``gguf`` can
            dequantize).
        out_dir: an existing, empty folder; the caller is responsible for making
            the result appear atomically.

    Returns:
        The ``config.json`` dict that was written.

    Raises:
        ValueError: if the file is not a llama model with a byte-level BPE
            tokenizer this module understands.
    """
    reader = gguf.GGUFReader(str(gguf_path))
    out = Path(out_dir)
    config = hf_config(reader)
    for name, payload in (
        ("config.json", config),
        ("generation_config.json", generation_config(reader)),
        ("tokenizer_config.json", tokenizer_config(reader)),
    ):
        (out / name).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    hf_tokenizer(reader).save(str(out / "tokenizer.json"))
    weights = out / "model.safetensors"
    save_file(hf_state_dict(reader, config), str(weights), metadata={"format": "pt"})
    # safetensors creates its file owner-only; give it the mode the other files got.
    shutil.copymode(out / "config.json", weights)
    return config
