"""Model builders: SmolLM2-135M (full and LoRA) and a tiny Llama for tests.

SmolLM2 is a plain Llama: GQA, SwiGLU, RMSNorm, tied embeddings and ordinary
RoPE (``rope_scaling: null`` in its HF config). torchtune's ``llama3_2``
component builders have all of that except that they always use
``Llama3ScaledRoPE``. With ``scale_factor=1`` its frequency rescaling is the
identity in every band (``freq / 1`` and ``(1 - s) * freq + s * freq``), so it
computes the same cache as ``RotaryPositionalEmbeddings``; the tests check that
bit for bit. Reusing the builders keeps torchtune's LoRA wiring, tied-output
handling and checkpoint key names (model type ``LLAMA3_2``).
"""

from __future__ import annotations

import torch
from torch import nn
from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

# Plain RoPE; see the module docstring.
_NO_ROPE_SCALING = 1

_SMOLLM2_135M = dict(
    vocab_size=49_152,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    embed_dim=576,
    intermediate_dim=1536,
    norm_eps=1e-5,
    rope_base=100_000,
    scale_factor=_NO_ROPE_SCALING,
    tie_word_embeddings=True,
)

def smollm2_135m(max_seq_len: int = 8192, num_layers: int = 30) -> TransformerDecoder:
    """SmolLM2-135M (base or Instruct; same architecture), 134.5M parameters.

    Load weights with ``FullModelHFCheckpointer(model_type="LLAMA3_2")`` from
    ``assets/SmolLM2-135M-Instruct``.

    Args:
        max_seq_len: longest sequence the RoPE cache and KV cache are sized for,
            in tokens. SmolLM2 was trained with 8192.
        num_layers: decoder layers; 10 builds the distillation demo's student
            (``assets/SmolLM2-135M-Instruct-10L``, the first 10 of the 30).

    Returns:
        A torchtune ``TransformerDecoder``; ``model(tokens)`` maps ``[b, s]``
        token ids to ``[b, s, 49152]`` fp32 logits.
    """
    return llama3_2(max_seq_len=max_seq_len, **{**_SMOLLM2_135M, "num_layers": num_layers})

def lora_smollm2_135m(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    max_seq_len: int = 8192,
    quantize_base: bool = False,
    num_layers: int = 30,
) -> TransformerDecoder:
    """SmolLM2-135M with LoRA (or DoRA) adapters.

    Args:
        lora_attn_modules: attention projections to adapt, any of
            ``"q_proj", "k_proj", "v_proj", "output_proj"``.
        apply_lora_to_mlp: also adapt the three MLP projections.
        apply_lora_to_output: must stay False: the output projection is the
            tied token embedding, and torchtune's llama3_2 LoRA builder raises.
        lora_rank: rank ``r`` of each adapter.
        lora_alpha: adapters are scaled by ``lora_alpha / lora_rank``.
        lora_dropout: dropout probability on the adapter input.
        use_dora: use DoRA (magnitude-decomposed) adapters instead of LoRA.
        max_seq_len: as in :func:`smollm2_135m`.
        quantize_base: QLoRA, as torchtune's builders: base weights in
            torchao's NF4. SmolLM2's 576 x 576 and 192 x 576 attention
            projections are not multiples of NF4's 16,384-value blocks, so
            this raises (the recipes turn it into a config error).
        num_layers: as in :func:`smollm2_135m`.

    Returns:
        A ``TransformerDecoder`` whose base weights load from the same
        checkpoint as :func:`smollm2_135m`.

    Raises:
        ValueError: if ``apply_lora_to_output`` is True (raised by torchtune).
        AssertionError: with ``quantize_base`` (raised by torchao).
    """
    return lora_llama3_2(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        max_seq_len=max_seq_len,
        quantize_base=quantize_base,
        **{**_SMOLLM2_135M, "num_layers": num_layers},
    )

def initialize_torchtune_adapters(model: nn.Module, seed: int) -> None:
    """Initialize every LoRA/DoRA adapter of a torchtune ``model`` from ``seed`` alone, on CPU.

    torchtune's builders initialize adapters from the global random stream,
    after the base weights drew from it, on the device the model is built on.
    The values would then depend on the recipe (a model built on the meta
    device draws nothing for its base weights), on the device (CUDA and CPU
    generators differ) and on the world size. Here each adapter module
    (anything with ``adapter_params`` and ``initialize_parameters``: LoRA and
    DoRA linears) is re-initialized in ``model.modules()`` order on CPU from
    a generator seeded with ``seed``, then moved back to the device it was
    on (adapters of a model on the meta device stay on CPU, ready for
    sharding). So every recipe, device and world size starts from the same
    adapter. The global random state is left untouched.

    Call it right after building the model, before collecting its adapter
    parameters: on the meta device the parameters are replaced. DoRA
    magnitudes are not set here; they come from the loaded base weights
    (``initialize_dora_magnitude``).

    Args:
        model: a torchtune model with LoRA/DoRA modules (on any device, or meta).
        seed: the run's seed.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if not (hasattr(module, "adapter_params") and hasattr(module, "initialize_parameters")):
                continue
            device = module.lora_a.weight.device
            module.to_empty(device="cpu")  # torchtune's LoRA/DoRA override: the adapter only, not the base weight
            module.initialize_parameters()
            if device.type not in ("cpu", "meta"):
                values = {name: module.get_parameter(name).detach().clone() for name in module.adapter_params()}
                module.to_empty(device=device)
                with torch.no_grad():
                    for name, value in values.items():
                        module.get_parameter(name).copy_(value)

def tiny_llama(
    vocab_size: int = 49_152,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    embed_dim: int = 64,
    intermediate_dim: int = 128,
    max_seq_len: int = 2048,
    norm_eps: float = 1e-5,
    rope_base: int = 10_000,
    tie_word_embeddings: bool = True,
) -> TransformerDecoder:
    """A randomly initialised Llama of the SmolLM2 family, small enough for unit tests.

    The default ``vocab_size`` is SmolLM2's, so any id from
    ``SmolLM2Tokenizer`` is valid; pass a smaller one for synthetic token ids.

    Args:
        vocab_size: number of token ids.
        num_layers: transformer blocks.
        num_heads: query heads; ``embed_dim`` must be divisible by it.
        num_kv_heads: key/value heads (GQA); must divide ``num_heads``.
        embed_dim: model width.
        intermediate_dim: SwiGLU hidden width.
        max_seq_len: longest sequence in tokens.
        norm_eps: RMSNorm epsilon.
        rope_base: RoPE base period.
        tie_word_embeddings: share the output projection with the embedding.

    Returns:
        A ``TransformerDecoder`` mapping ``[b, s]`` ids to ``[b, s, vocab_size]`` logits.
    """
    return llama3_2(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        rope_base=rope_base,
        scale_factor=_NO_ROPE_SCALING,
        tie_word_embeddings=tie_word_embeddings,
    )

def lora_tiny_llama(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 4,
    lora_alpha: float = 8,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    vocab_size: int = 49_152,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    embed_dim: int = 64,
    intermediate_dim: int = 128,
    max_seq_len: int = 2048,
    norm_eps: float = 1e-5,
    rope_base: int = 10_000,
    tie_word_embeddings: bool = True,
) -> TransformerDecoder:
    """:func:`tiny_llama` with LoRA adapters; arguments as there and in :func:`lora_smollm2_135m`.

    Returns:
        A ``TransformerDecoder`` whose non-adapter state dict keys equal those
        of ``tiny_llama`` with the same architecture arguments.

    Raises:
        ValueError: if ``apply_lora_to_output`` is True; torchtune's llama3_2
            LoRA builder rejects it even for untied embeddings.
    """
    return lora_llama3_2(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        rope_base=rope_base,
        scale_factor=_NO_ROPE_SCALING,
        tie_word_embeddings=tie_word_embeddings,
    )
