"""How the model runs, as torchtune's configs ask: activation checkpointing, offloading, compiling, QLoRA's hook.

* :func:`wrap_model` (``enable_activation_checkpointing``, ``compile``) and
  :func:`offload_activations` (``enable_activation_offloading``): torchtune's
  ``OffloadActivations`` saved-tensor hooks around every forward of the model;
* :func:`use_low_cpu_ram` (``low_cpu_ram``): torchtune's switch for the QLoRA
  state-dict hook that dequantizes through a memory-mapped file;
* :func:`embedding_rows_into_grad`: on CPU, a tied token embedding adds its
  rows to the weight's gradient in place instead of through a dense
  vocabulary-sized tensor per micro-batch.

None of them changes what is computed: the step's token count, loss and
gradients are the same with or without them (up to the order of a
floating-point sum).
"""

from typing import Optional

import torch
from torch import nn

from torchtune_ext.model.build import decoder_layer_classes, is_hf_model


def wrap_model(model: nn.Module, *, checkpointing: bool, offloading: bool, compile: bool) -> None:
    """Activation checkpointing per decoder layer, offloading and compiling, as the config keys ask.

    ``enable_activation_checkpointing``: each decoder layer
    (:func:`torchtune_ext.model.build.decoder_layer_classes`: torchtune's
    ``TransformerSelfAttentionLayer``, or a transformers model's
    ``_no_split_modules``) recomputes its forward in backward instead of
    keeping its activations (torchtune's ``set_activation_checkpointing``);
    ``enable_activation_offloading``: :func:`offload_activations`; ``compile``:
    torchtune's ``compile_model`` (each layer compiled at its first forward).
    Call before FSDP sharding.
    """
    from torchtune import training

    if checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy=set(decoder_layer_classes(model)))
    offload_activations(model, offloading)
    if compile:
        training.compile_model(model)

def offload_activations(model: nn.Module, enabled: bool) -> None:
    """Offload the activations saved for backward to CPU memory during ``model``'s forward.

    Uses ``torchtune.training.get_act_offloading_ctx_manager`` (which keeps the
    output projection's activations on the device). Its context is entered by a
    forward pre-hook and left by a forward hook, so every forward of the model,
    however the training step calls it, runs inside it, as in torchtune's
    recipes. Saved tensors are brought back in backward, whether backward
    runs once per step or once per micro-batch.

    Args:
        model: the model to train (before FSDP sharding or compiling is fine).
        enabled: the ``enable_activation_offloading`` key; False does nothing.
            Needs CUDA and activation checkpointing (checked by the config).
    """
    if not enabled:
        return
    from torchtune import training

    context = training.get_act_offloading_ctx_manager(model, True)
    model.register_forward_pre_hook(lambda *_: context.__enter__())
    model.register_forward_hook(lambda *_: context.__exit__(None, None, None), always_call=True)

def use_low_cpu_ram(enabled: bool) -> None:
    """Choose torchtune's QLoRA state-dict hook: dequantize NF4 weights through a
    memory-mapped file (``low_cpu_ram=true``, Linux) or in memory. Call before
    building the model: the LoRA builders register the hook they find set."""
    from torchtune.modules import common_utils

    common_utils._use_low_cpu_ram = bool(enabled)

class _EmbeddingRowsIntoGrad(torch.autograd.Function):
    """Token embedding lookup whose backward adds the used rows straight into ``weight.grad``.

    ``padding_idx`` as ``nn.Embedding``'s: that row's lookups add nothing to the gradient.
    """

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        ctx.padding_idx = padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        ids = ids.reshape(-1)
        rows = grad_output.reshape(-1, grad_output.size(-1)).to(weight.grad.dtype)
        if ctx.padding_idx is not None:
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        weight.grad.index_add_(0, ids, rows)
        # No gradient through autograd: the weight's accumulator still runs after
        # this node (the edge exists), with the tied output projection's gradient.
        return None, None, None

class _RowsIntoGradEmbedding(nn.Embedding):
    """``nn.Embedding`` whose backward adds its rows to ``weight.grad`` (see :func:`embedding_rows_into_grad`).

    Set as the class of an existing embedding (no closure over the module):
    a ``copy.deepcopy`` of the model uses its own weight, and the state dict
    is unchanged.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _EmbeddingRowsIntoGrad.apply(ids, self.weight, self.padding_idx)

def _tied_token_embedding(model: nn.Module) -> Optional[nn.Module]:
    """The token embedding whose weight the model's output projection shares; None if untied or unknown.

    torchtune: ``model.output`` is a ``TiedLinear`` over ``model.tok_embeddings``.
    transformers (:func:`torchtune_ext.model.hf.causal_lm`): ``lm_head`` (an
    ``nn.Linear``) holds the input embedding's weight itself (``tie_word_embeddings``).
    """
    if is_hf_model(model):
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = type(head) is nn.Linear and embedding is not None and head.weight is embedding.weight
        return embedding if tied else None
    from torchtune.modules import TiedLinear

    embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    return embedding if isinstance(output, TiedLinear) and output.tied_module is embedding else None

def embedding_rows_into_grad(model: nn.Module, device: torch.device, compiled: bool = False) -> bool:
    """Let a tied token embedding add its gradient rows to the weight's ``.grad`` in place, on CPU.

    With the output projection tied to the token embedding, every backward
    sends the shared weight two gradients: the projection's, ``[vocab,
    embed_dim]``, and the embedding's, which ``nn.Embedding``'s backward
    builds as a zero-filled ``[vocab, embed_dim]`` tensor holding the
    micro-batch's few rows; autograd then adds the two out of place before
    accumulating the sum into ``.grad``. For SmolLM2-135M that is three passes
    over 113 MB per micro-batch for a few hundred rows of 576 values
    (``python -m bench.embedding_grad`` times it). Here the embedding's
    backward adds its rows to ``.grad`` directly (``index_add_``; ``.grad`` is
    created as zeros on the first micro-batch of a step) and returns no
    gradient through autograd. The weight's gradient accumulator still runs
    after this node, since the forward linked them, so it adds the projection's
    gradient in place, and its hooks (``optimizer_in_bwd``) see the whole
    gradient. ``.grad`` is an ordinary dense tensor; only the order of a
    floating-point sum differs from the default.

    What it gives up: the embedding's share reaches ``.grad`` only, not
    autograd's other consumers. ``torch.autograd.grad(loss, [weight])``,
    ``backward(inputs=...)`` and a tensor hook on the weight
    (``weight.register_hook``) see the projection's share alone (and the rows
    still land in ``.grad``). The recipes use none of them;
    post-accumulate-grad hooks (``optimizer_in_bwd``) see the whole gradient.

    Applied only where that holds and was measured: the output projection is
    torchtune's ``TiedLinear`` over ``model.tok_embeddings``, or a transformers
    model's ``lm_head`` (an ``nn.Linear``) holding its input embedding's weight
    (so every backward reaches the accumulator: the loss keeps an empty chunk
    even when a micro-batch has no trainable token), a plain ``nn.Embedding``
    (no ``max_norm``, frequency scaling or sparse gradient; a ``padding_idx``
    row gets no gradient from its lookups, as in ``nn.Embedding``: transformers'
    Llama sets it to ``pad_token_id``, which SmolLM2's config makes its
    ``<|im_end|>``) that trains (not LoRA's frozen base), the weight is a plain
    tensor (not an FSDP2 shard), the device is a CPU and the model is not compiled.

    Args:
        model: a torchtune ``TransformerDecoder`` or a transformers model of
            :func:`torchtune_ext.model.hf.causal_lm`, weights loaded.
        device: where it trains.
        compiled: the ``compile`` key.

    Returns:
        True if the embedding's backward now writes into ``.grad``.
    """
    embedding = _tied_token_embedding(model)
    if (device.type != "cpu" or compiled or type(embedding) is not nn.Embedding
            or embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse
            or not embedding.weight.requires_grad or type(embedding.weight.data) is not torch.Tensor):
        return False
    embedding.__class__ = _RowsIntoGradEmbedding
    return True
