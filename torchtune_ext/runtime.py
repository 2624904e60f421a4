"""Run-time options torchtune's configs ask for, set up the way torchtune does.

* :func:`offload_activations` (``enable_activation_offloading``): torchtune's
  ``OffloadActivations`` saved-tensor hooks around every forward of the model;
* :func:`build_profiler` (``profiler``): torchtune's ``setup_torch_profiler``,
  or a profiler that does nothing when it is off;
* :func:`use_low_cpu_ram` (``low_cpu_ram``): torchtune's switch for the QLoRA
  state-dict hook that dequantizes through a memory-mapped file;
* :func:`set_log_level` (``log_level``): the level of torchtune's logger;
* :func:`embedding_rows_into_grad`: on CPU, a tied token embedding adds its
  rows to the weight's gradient in place instead of through a dense
  vocabulary-sized tensor per micro-batch.

None of them changes what is computed: the step's token count, loss and
gradients are the same with or without them (up to the order of a
floating-point sum).
"""

from typing import Any, Optional

import torch
from torch import nn


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


def build_profiler(cfg_profiler: Optional[Any]):
    """The ``profiler`` section as torchtune sets it up.

    Args:
        cfg_profiler: the ``profiler`` config (``_component_:
            torchtune.training.setup_torch_profiler``, ``enabled``, activities,
            schedule, ``output_dir``) or None.

    Returns:
        an object with ``start()``, ``step()`` (call once per optimizer step)
        and ``stop()``: a ``torch.profiler.profile`` writing traces to the
        section's ``output_dir``, or torchtune's ``DummyProfiler`` when
        ``enabled`` is false or the section is absent.
    """
    from omegaconf import OmegaConf
    from torchtune import training

    if cfg_profiler is None or not cfg_profiler.get("enabled", False):
        return training.DummyProfiler()
    args = {k: v for k, v in OmegaConf.to_container(cfg_profiler, resolve=True).items() if k != "_component_"}
    profiler, _ = training.setup_torch_profiler(**args)
    return profiler


def use_low_cpu_ram(enabled: bool) -> None:
    """Choose torchtune's QLoRA state-dict hook: dequantize NF4 weights through a
    memory-mapped file (``low_cpu_ram=true``, Linux) or in memory. Call before
    building the model: the LoRA builders register the hook they find set."""
    from torchtune.modules import common_utils

    common_utils._use_low_cpu_ram = bool(enabled)


def set_log_level(level: str) -> None:
    """Apply the ``log_level`` key (DEBUG, INFO, WARNING, ERROR) to torchtune's logger.

    Every line of the recipes and of ``torchtune_ext`` goes through that one
    logger (``torchtune.utils.get_logger``), whose level modules set when they
    are imported; call this after the imports, when the recipe starts.
    """
    from torchtune import utils

    utils.get_logger(level)


class _EmbeddingRowsIntoGrad(torch.autograd.Function):
    """Token embedding lookup whose backward adds the used rows straight into ``weight.grad``."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        rows = grad_output.reshape(-1, grad_output.size(-1)).to(weight.grad.dtype)
        weight.grad.index_add_(0, ids.reshape(-1), rows)
        # No gradient through autograd: the weight's accumulator still runs after
        # this node (the edge exists), with the tied output projection's gradient.
        return None, None


class _RowsIntoGradEmbedding(nn.Embedding):
    """``nn.Embedding`` whose backward adds its rows to ``weight.grad`` (see :func:`embedding_rows_into_grad`).

    Set as the class of an existing embedding (no closure over the module):
    a ``copy.deepcopy`` of the model uses its own weight, and the state dict
    is unchanged.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _EmbeddingRowsIntoGrad.apply(ids, self.weight)


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
    torchtune's ``TiedLinear`` over ``model.tok_embeddings`` (so every backward
    reaches the accumulator: the loss keeps an empty chunk even when a
    micro-batch has no trainable token), a plain ``nn.Embedding`` (no
    ``padding_idx``, ``max_norm``, frequency scaling or sparse gradient) that
    trains (not LoRA's frozen base), the weight is a plain tensor (not an FSDP2
    shard), the device is a CPU and the model is not compiled.

    Args:
        model: a torchtune ``TransformerDecoder``, weights loaded.
        device: where it trains.
        compiled: the ``compile`` key.

    Returns:
        True if the embedding's backward now writes into ``.grad``.
    """
    from torchtune.modules import TiedLinear

    embedding = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    if (device.type != "cpu" or compiled or type(embedding) is not nn.Embedding
            or not isinstance(output, TiedLinear) or output.tied_module is not embedding
            or embedding.padding_idx is not None or embedding.max_norm is not None
            or embedding.scale_grad_by_freq or embedding.sparse
            or not embedding.weight.requires_grad or type(embedding.weight.data) is not torch.Tensor):
        return False
    embedding.__class__ = _RowsIntoGradEmbedding
    return True
