"""Tiny models of each family in its own formats: HF checkpoint folder and tokenizer files.

For every family torchtune's ``FullModelHFCheckpointer`` knows (model types
LLAMA3, LLAMA3_2, QWEN2, GEMMA, GEMMA2, MISTRAL, PHI3_MINI), :func:`write_family`
writes what ``tune download`` would put in a folder, at toy size:

* ``model.safetensors`` with random weights of the family's torchtune
  component builder at small dimensions, converted to HF names and layout by
  the family's own converter (q/k permuted for RoPE where HF does, Qwen's
  q/k/v biases, Phi-3's fused qkv and gate_up projections, Gemma 2's extra
  norms); ``config.json`` as the HF model has it;
* the tokenizer in the family's format, made here: a tiktoken BPE file for
  Llama 3 (plus ``tokenizer.json`` listing its special tokens), a GPT-2
  style ``vocab.json`` + ``merges.txt`` for Qwen, a SentencePiece model
  trained on a few sentences for Gemma, Mistral and Phi-3. Special tokens
  get small ids (the ``special_tokens_path`` argument of torchtune's
  tokenizer builders), so the vocabulary stays a few hundred ids.

Nothing is downloaded. :data:`FAMILIES` also says which torchtune config of
the family the recipe tests start from, and the overrides that point it at
the tiny folder.
"""

import base64
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from safetensors.torch import save_file

DIM, LAYERS, HIDDEN, MAX_SEQ_LEN = 32, 2, 64, 256
WORDS = ("the a model learns every token step batch data rank sum mean loss count grad norm "
         "question answer write short poem about river city light night day").split()


@dataclass(frozen=True)
class Family:
    """One model family at toy size.

    Attributes:
        model_type: ``checkpointer.model_type``.
        builder / lora_builder: torchtune component builders.
        arch: their architecture arguments (LoRA settings come from the config).
        tokenizer: ``tokenizer`` config (paths relative to the folder).
        hf: ``config.json`` fields of the HF model.
        full_config / lora_config: torchtune packaged configs (single device) the tests start from.
        tied: the output projection is the token embedding.
    """

    model_type: str
    builder: str
    lora_builder: str
    arch: Dict[str, Any]
    tokenizer: Dict[str, Any]
    hf: Dict[str, Any]
    full_config: str
    lora_config: str
    tied: bool
    extra: Dict[str, Any] = field(default_factory=dict)


def _llama_hf(model_type: str, arch: str, tied: bool, **more) -> Dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, "hidden_size": DIM, "intermediate_size": HIDDEN,
            "num_hidden_layers": LAYERS, "rms_norm_eps": 1e-5, "max_position_embeddings": MAX_SEQ_LEN,
            "tie_word_embeddings": tied, "torch_dtype": "float32", "hidden_act": "silu", **more}


TIKTOKEN = {"_component_": "torchtune.models.llama3.llama3_tokenizer", "path": "tokenizer.model",
            "special_tokens_path": "tokenizer.json"}
SPM_SPECIALS_FROM = 320  # Phi-3's special tokens follow the SentencePiece vocabulary

FAMILIES: Dict[str, Family] = {
    "llama3": Family(
        "LLAMA3", "torchtune.models.llama3._component_builders.llama3",
        "torchtune.models.llama3._component_builders.lora_llama3",
        dict(vocab_size=528, num_heads=4, num_kv_heads=2, rope_base=500_000.0), TIKTOKEN,
        _llama_hf("llama", "LlamaForCausalLM", False, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_theta=500_000.0, vocab_size=528),
        "llama3_1/8B_full_single_device", "llama3_1/8B_lora_single_device", tied=False),
    "llama3_2": Family(
        "LLAMA3_2", "torchtune.models.llama3_2._component_builders.llama3_2",
        "torchtune.models.llama3_2._component_builders.lora_llama3_2",
        dict(vocab_size=528, num_heads=4, num_kv_heads=2, rope_base=500_000, scale_factor=32,
             tie_word_embeddings=True), TIKTOKEN,
        _llama_hf("llama", "LlamaForCausalLM", True, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_theta=500_000.0, vocab_size=528,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "llama3_2/1B_full_single_device", "llama3_2/1B_lora_single_device", tied=True),
    "qwen2": Family(
        "QWEN2", "torchtune.models.qwen2._component_builders.qwen2",
        "torchtune.models.qwen2._component_builders.lora_qwen2",
        dict(vocab_size=320, num_heads=4, num_kv_heads=2, norm_eps=1e-6, rope_base=1_000_000.0,
             tie_word_embeddings=True),
        {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "path": "vocab.json",
         "merges_file": "merges.txt", "special_tokens_path": "tokenizer.json"},
        _llama_hf("qwen2", "Qwen2ForCausalLM", True, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, vocab_size=320, use_sliding_window=False),
        "qwen2_5/0.5B_full_single_device", "qwen2_5/0.5B_lora_single_device", tied=True),
    "gemma": Family(
        "GEMMA", "torchtune.models.gemma._component_builders.gemma",
        "torchtune.models.gemma._component_builders.lora_gemma",
        dict(vocab_size=320, num_heads=4, head_dim=16, num_kv_heads=1, norm_eps=1e-6),
        {"_component_": "torchtune.models.gemma.gemma_tokenizer", "path": "tokenizer.model"},
        _llama_hf("gemma", "GemmaForCausalLM", True, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  rms_norm_eps=1e-6, vocab_size=320, hidden_act="gelu_pytorch_tanh",
                  hidden_activation="gelu_pytorch_tanh", rope_theta=10_000.0),
        "gemma/2B_full", "gemma/2B_lora_single_device", tied=True),
    "gemma2": Family(
        "GEMMA2", "torchtune.models.gemma2._component_builders.gemma2",
        "torchtune.models.gemma2._component_builders.lora_gemma2",
        dict(vocab_size=320, num_heads=4, head_dim=16, num_kv_heads=2, norm_eps=1e-6, hidden_capping_value=50.0,
             final_capping_value=30.0, sliding_window_size=64, query_pre_attn_scalar=16),
        {"_component_": "torchtune.models.gemma.gemma_tokenizer", "path": "tokenizer.model"},
        _llama_hf("gemma2", "Gemma2ForCausalLM", True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-6, vocab_size=320, hidden_act="gelu_pytorch_tanh",
                  hidden_activation="gelu_pytorch_tanh", rope_theta=10_000.0, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, sliding_window=64, query_pre_attn_scalar=16),
        "gemma2/2B_full", "gemma2/2B_lora_single_device", tied=True),
    "mistral": Family(
        "MISTRAL", "torchtune.models.mistral._component_builders.mistral",
        "torchtune.models.mistral._component_builders.lora_mistral",
        dict(vocab_size=320, num_heads=4, num_kv_heads=2, rope_base=10_000),
        {"_component_": "torchtune.models.mistral.mistral_tokenizer", "path": "tokenizer.model"},
        _llama_hf("mistral", "MistralForCausalLM", False, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, vocab_size=320, rope_theta=10_000.0, sliding_window=None),
        "mistral/7B_full_low_memory", "mistral/7B_lora_single_device", tied=False),
    "phi3": Family(
        "PHI3_MINI", "torchtune.models.phi3._component_builders.phi3",
        "torchtune.models.phi3._component_builders.lora_phi3",
        dict(vocab_size=336, num_heads=4, num_kv_heads=4, rope_base=10_000),
        {"_component_": "torchtune.models.phi3.phi3_mini_tokenizer", "path": "tokenizer.model",
         "special_tokens_path": "tokenizer.json"},
        _llama_hf("phi3", "Phi3ForCausalLM", False, num_attention_heads=4, num_key_value_heads=4, vocab_size=336,
                  rope_theta=10_000.0, pad_token_id=SPM_SPECIALS_FROM),
        "phi3/mini_full_low_memory", "phi3/mini_lora_single_device", tied=False),
}


def _sentences(n: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))).capitalize() + "." for _ in range(n)]


def _special_tokens_json(path: Path, names: List[str], first_id: int) -> Dict[str, int]:
    """A ``tokenizer.json`` holding only ``added_tokens``, what torchtune's ``special_tokens_path`` reads."""
    tokens = {name: first_id + i for i, name in enumerate(names)}
    path.write_text(json.dumps({"added_tokens": [{"id": i, "content": n, "special": True}
                                                 for n, i in tokens.items()]}))
    return tokens


def write_tiktoken(folder: Path) -> int:
    """Llama 3 format: tiktoken BPE ranks (every byte, then a few merges) and its special tokens."""
    from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS

    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"in", b"er", b"the"]
    (folder / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    specials = _special_tokens_json(folder / "tokenizer.json", list(LLAMA3_SPECIAL_TOKENS), len(tokens))
    return max(specials.values()) + 1


def write_qwen_bpe(folder: Path) -> int:
    """Qwen format: GPT-2 byte-level ``vocab.json`` + ``merges.txt`` and Qwen 2.5's special tokens."""
    from torchtune.models.qwen2._tokenizer import bytes_to_unicode
    from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS

    chars = list(bytes_to_unicode().values())
    merges = [("t", "h"), ("h", "e"), ("Ġ", "t"), ("i", "n")]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    specials = _special_tokens_json(folder / "tokenizer.json", list(QWEN2_5_SPECIAL_TOKENS), len(vocab))
    return max(specials.values()) + 1


def write_sentencepiece(folder: Path, specials: Optional[List[str]] = None) -> int:
    """SentencePiece BPE with byte fallback (Gemma, Mistral, Phi-3), trained here on a few sentences."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_sentences(400)), model_writer=model, vocab_size=300, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    size = spm.SentencePieceProcessor(model_proto=model.getvalue()).vocab_size()
    assert size <= SPM_SPECIALS_FROM
    if specials:
        tokens = _special_tokens_json(folder / "tokenizer.json", specials, SPM_SPECIALS_FROM)
        return max(tokens.values()) + 1
    return size


def tune_to_hf(family: Family, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The family's own torchtune -> HF conversion (what its checkpointer writes)."""
    from torchtune.models import convert_weights

    heads, kv_heads = family.arch["num_heads"], family.arch["num_kv_heads"]
    head_dim = family.arch.get("head_dim")
    if family.model_type == "QWEN2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        return qwen2_tune_to_hf(state, num_heads=heads, num_kv_heads=kv_heads, dim=DIM,
                                tie_word_embeddings=family.tied)
    if family.model_type == "GEMMA2":
        from torchtune.models.gemma2._convert_weights import gemma2_tune_to_hf

        return gemma2_tune_to_hf(state, num_heads=heads, num_kv_heads=kv_heads, dim=DIM, head_dim=head_dim)
    if family.model_type == "PHI3_MINI":
        from torchtune.models.phi3._convert_weights import phi3_tune_to_hf

        return phi3_tune_to_hf(state)
    return convert_weights.tune_to_hf(state, num_heads=heads, num_kv_heads=kv_heads, dim=DIM, head_dim=head_dim)


def model_config(family: Family, lora: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ``model`` config of the tiny model (full, or LoRA with the settings in ``lora``)."""
    args = dict(num_layers=LAYERS, embed_dim=DIM, intermediate_dim=HIDDEN, max_seq_len=MAX_SEQ_LEN, **family.arch)
    if lora is None:
        return {"_component_": family.builder, **args}
    return {"_component_": family.lora_builder, **args, **lora}


def build(family: Family, seed: int = 0) -> torch.nn.Module:
    from omegaconf import OmegaConf
    from torchtune import config

    torch.manual_seed(seed)
    model = config.instantiate(OmegaConf.create(model_config(family)))
    # torchtune draws embeddings from N(0, 1); with a tied output that gives
    # logits of ~30 nats. 0.02, as HF initializes, starts near ln(vocab).
    torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
    if not family.tied:
        torch.nn.init.normal_(model.output.weight, std=0.02)
    return model


def write_family(name: str, folder: Path, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Write the tiny ``name`` family model into ``folder`` as ``tune download`` would.

    Returns:
        the model's state dict in torchtune names (what loading must give back).
    """
    family = FAMILIES[name]
    folder.mkdir(parents=True, exist_ok=True)
    if family.tokenizer["_component_"] == TIKTOKEN["_component_"]:
        needed = write_tiktoken(folder)
    elif "qwen" in family.tokenizer["_component_"]:
        needed = write_qwen_bpe(folder)
    else:
        from torchtune.models.phi3._tokenizer import PHI3_SPECIAL_TOKENS

        needed = write_sentencepiece(folder, list(PHI3_SPECIAL_TOKENS) if family.model_type == "PHI3_MINI" else None)
    assert needed <= family.arch["vocab_size"], (name, needed)
    model = build(family, seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file({k: v.contiguous() for k, v in tune_to_hf(family, dict(state)).items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(family.hf, indent=1))
    return state


def recipe_overrides(name: str, folder: Path, data_file: Path, output_dir: Path) -> List[str]:
    """``key=value`` overrides that point a torchtune config of the family at the tiny folder and data."""
    family = FAMILIES[name]
    tokenizer = {k: (str(folder / v) if k.endswith("path") or k == "merges_file" else v)
                 for k, v in family.tokenizer.items()}
    return [
        f"output_dir={output_dir}", "device=cpu", "dtype=fp32", "max_steps_per_epoch=2", "batch_size=2",
        "gradient_accumulation_steps=1", "seed=5", "compile=false",
        f"checkpointer.checkpoint_dir={folder}", "checkpointer.checkpoint_files=[model.safetensors]",
        *(f"tokenizer.{k}={v}" for k, v in tokenizer.items() if k != "_component_"),
        "tokenizer.max_seq_len=128",
        "dataset._component_=torchtune.datasets.alpaca_dataset", "dataset.source=json",
        f"dataset.data_files={data_file}", "dataset.split=train",
    ]
