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

from typing import Any

import torch
from torch import nn
from torchtune import config as tt_config
from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_ext import checkpoint, distributed
from torchtune_ext.config import lora_settings
from torchtune_ext.errors import ConfigError, UserError

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


def smollm2_135m(max_seq_len: int = 8192) -> TransformerDecoder:
    """SmolLM2-135M (base or Instruct; same architecture), 134.5M parameters.

    Load weights with ``FullModelHFCheckpointer(model_type="LLAMA3_2")`` from
    ``assets/SmolLM2-135M-Instruct``.

    Args:
        max_seq_len: longest sequence the RoPE cache and KV cache are sized for,
            in tokens. SmolLM2 was trained with 8192.

    Returns:
        A torchtune ``TransformerDecoder``; ``model(tokens)`` maps ``[b, s]``
        token ids to ``[b, s, 49152]`` fp32 logits.
    """
    return llama3_2(max_seq_len=max_seq_len, **_SMOLLM2_135M)


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
        **_SMOLLM2_135M,
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


# torchao's NF4 (torchtune's QLoRA): weights are quantized in blocks of 64 values
# whose scales are quantized again in blocks of 256 (to_nf4's defaults).
NF4_BLOCK = 64 * 256


def quantizes_base(cfg_model) -> bool:
    """Whether a ``model`` config is a QLoRA model (``quantize_base``, or a ``qlora_*`` builder)."""
    try:
        return lora_settings(cfg_model).quantize_base
    except ConfigError:  # not a LoRA model
        return False


def nf4_error(err: BaseException):
    """The config error for torchao's NF4 refusing a weight shape (``AssertionError`` from ``to_nf4``)."""
    return ConfigError("model.quantize_base", f"torchao's NF4 cannot quantize this model's weights ({err}): it "
                       f"needs each weight's size to be a multiple of {NF4_BLOCK:,} values; use quantize_base=false "
                       "(LoRA) for this model")


# ``model`` components under this package are transformers models (torchtune_ext.hf); the rest torchtune's.
HF_COMPONENTS = "torchtune_ext.hf."


def is_hf_config(cfg_model: Any) -> bool:
    """Whether a ``model`` config builds a transformers model (``torchtune_ext.hf.causal_lm`` / ``lora_causal_lm``)."""
    return str(cfg_model.get("_component_", "")).startswith(HF_COMPONENTS)


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` was built by :func:`torchtune_ext.hf.causal_lm` (a transformers model, our call convention)."""
    return getattr(model, "_ext_hf_class", None) is not None


def _hf():
    # transformers and PEFT take 1.6 s to import: only runs of transformers models pay for it
    from torchtune_ext import hf

    return hf


def build_model(cfg_model: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the ``model`` config with ``dtype`` as default dtype, on ``device``, ready for its weights.

    torchtune's models are built on ``device`` (random values until
    :func:`torchtune_ext.checkpoint.load_model_state`). transformers models
    are always built on the meta device: their weights, buffers and
    adapters reach ``device`` when loaded, with no random initialization
    drawn on the way (:func:`torchtune_ext.hf.load_state`).

    Raises:
        ConfigError: (key ``model.quantize_base``) if QLoRA cannot quantize a
            weight of this architecture: torchao's NF4 needs every quantized
            weight to hold a multiple of 64 * 256 = 16,384 values (SmolLM2's
            576 x 576 attention projections hold 331,776 = 20.25 x 16,384).
    """
    from torchtune import training

    if is_hf_config(cfg_model):
        device = torch.device("meta")
    with training.set_default_dtype(dtype), device:
        try:
            return tt_config.instantiate(cfg_model)
        except AssertionError as err:
            if quantizes_base(cfg_model):
                raise nf4_error(err) from None
            raise


def instantiate_lora_model(cfg_model, dtype, device) -> nn.Module:
    """:func:`build_model` for a LoRA ``model`` config (kept for its callers)."""
    return build_model(cfg_model, dtype, device)


def decoder_layer_classes(model: nn.Module) -> tuple:
    """The classes of the model's repeated decoder layers, the units of activation checkpointing and FSDP2.

    torchtune's ``TransformerSelfAttentionLayer``; for a transformers model
    the classes its ``_no_split_modules`` names (:func:`torchtune_ext.hf.decoder_layer_classes`).
    """
    if is_hf_model(model):
        return _hf().decoder_layer_classes(model)
    from torchtune.modules import TransformerSelfAttentionLayer

    return (TransformerSelfAttentionLayer,)


def initialize_adapters(model: nn.Module, seed: int) -> None:
    """Initialize every LoRA/DoRA adapter of ``model`` from ``seed`` alone, on CPU.

    torchtune's models: :func:`initialize_torchtune_adapters`; transformers
    models (PEFT's adapters): :func:`torchtune_ext.hf.initialize_adapters`.
    Either way every recipe, device and world size starts from the same adapter.
    """
    if is_hf_model(model):
        _hf().initialize_adapters(model, seed)
    else:
        initialize_torchtune_adapters(model, seed)


def shard_model(model: nn.Module, device: torch.device, **kwargs) -> list:
    """FSDP2 over the model's decoder layers, then the root, gradients summed over ranks.

    :func:`torchtune_ext.distributed.shard_model` (torchtune's ``layers.<i>``)
    or :func:`torchtune_ext.hf.shard_model` (the ``_no_split_modules`` layers);
    the keyword arguments are theirs.
    """
    if is_hf_model(model):
        return _hf().shard_model(model, device, **kwargs)
    return distributed.shard_model(model, device, **kwargs)


def check_tensor_parallel(model: nn.Module, plan: Any, tensor_parallel_dim: int, model_component: str,
                          world_size: Any = None) -> None:
    """Whether ``plan`` splits ``model`` (on meta) over ``tensor_parallel_dim`` ranks; None: a transformers
    model's own ``tp_plan``.

    :func:`torchtune_ext.distributed.check_tensor_parallel` or
    :func:`torchtune_ext.hf.tensor_parallel.check_tensor_parallel`; the
    arguments and errors are theirs.
    """
    if is_hf_model(model):
        return _hf().tensor_parallel.check_tensor_parallel(model, plan, tensor_parallel_dim, model_component,
                                                           world_size)
    return distributed.check_tensor_parallel(model, plan, tensor_parallel_dim, model_component, world_size)


def load_model_state(model: nn.Module, state_dict: dict, device: torch.device, source: Any, *,
                     strict: bool = True, model_name: Any = None):
    """Load a full state dict into an unsharded model; a misfit is one config line naming the checkpoint.

    torchtune's models: :func:`torchtune_ext.checkpoint.load_model_state` (the
    model is on ``device`` already); transformers models, built on meta:
    :func:`torchtune_ext.hf.load_state`, which moves them to ``device``.

    Returns:
        ``(missing_keys, unexpected_keys)``.

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) a key or shape that does not fit.
    """
    if is_hf_model(model):
        if model_name:
            checkpoint.check_model_fits(model, state_dict, source, model_name)
        return _hf().load_state(model, state_dict, device, strict=strict, source=str(source))
    return checkpoint.load_model_state(model, state_dict, source, strict=strict, model_name=model_name)


def load_sharded_model_state(model: nn.Module, state_dict: dict, device: torch.device, **kwargs):
    """:func:`torchtune_ext.distributed.load_full_model_state_dict` (the keyword arguments are its own), then
    a transformers model's tied weights tied again.

    The loader gives every key a new sharded parameter, so a tied ``lm_head``
    would become a parameter of its own, trained apart from the token
    embedding (and unknown to the optimizer's view of the model).

    A sharded checkpoint's :class:`torchtune_ext.checkpoint.ShardedStateDict`
    is loaded shard by shard instead (:func:`torchtune_ext.checkpoint.load_model_shards`):
    each rank reads only its own part, at any world size.

    Returns:
        ``(missing_keys, unexpected_keys)``.
    """
    if isinstance(state_dict, checkpoint.ShardedStateDict):
        keys = checkpoint.load_model_shards(model, state_dict, device, cpu_offload=kwargs.get("cpu_offload", False),
                                            strict=kwargs.get("strict", True), model_name=kwargs.get("model_name"))
    else:
        keys = distributed.load_full_model_state_dict(model, state_dict, device, **kwargs)
    if is_hf_model(model):
        model.tie_weights()  # a no-op for untied models
    return keys


def adapter_params(model: nn.Module) -> dict:
    """The adapter parameters by name (LoRA A/B, DoRA magnitudes): what a LoRA recipe trains."""
    if is_hf_model(model):
        return _hf().adapter_params(model)
    from torchtune.modules.peft import get_adapter_params

    return get_adapter_params(model)


# The keys of torchtune's tokenizer builders that name files: llama3/gemma/mistral/phi `path`, qwen
# `path` (vocab) and `merges_file`, phi4 `vocab_path`/`merges_path`, HF `tokenizer_json_path`.
_TOKENIZER_FILE_KEYS = ("path", "tokenizer_json_path", "vocab_path", "merges_file", "merges_path",
                        "special_tokens_path")


def build_tokenizer(cfg_tokenizer: Any) -> Any:
    """Build the config's ``tokenizer``; files it cannot read are a config error, not a traceback.

    The one tokenizer load the recipes and ``python -m torchtune_ext.evaluate``
    share: a file that exists but is not a tokenizer (a truncated or garbage
    ``tokenizer.json``, another format) fails inside the tokenizers library
    with a bare ``Exception`` that names neither the key nor the file.

    Args:
        cfg_tokenizer: the ``tokenizer`` config (``_component_`` plus its arguments).

    Returns:
        the tokenizer (a torchtune ``ModelTokenizer``).

    Raises:
        UserError: the builder's own (a missing asset names the download command);
        ConfigError: (key ``tokenizer.path`` or the file key the config
            gives) naming the file and the reader's error.
    """
    try:
        return tt_config.instantiate(cfg_tokenizer)
    except UserError:
        raise
    except Exception as err:
        given = [k for k in _TOKENIZER_FILE_KEYS if cfg_tokenizer.get(k) is not None]
        key = f"tokenizer.{given[0]}" if given else "tokenizer"
        files = ", ".join(f"{k}='{cfg_tokenizer[k]}'" for k in given) or "its arguments"
        reason = " ".join(str(err).split()) or "no message"
        why = ("a file it needs is missing" if isinstance(err, FileNotFoundError)
               else "the file is damaged or not a tokenizer of this kind")
        raise ConfigError(key, f"{cfg_tokenizer.get('_component_')} cannot build a tokenizer from {files} "
                          f"({type(err).__name__}: {reason}): {why}; point it at the model's own tokenizer "
                          "files") from None
