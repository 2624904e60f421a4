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
  vocabulary-sized tensor per micro-batch;
* :func:`keep_freed_cpu_memory`: on CPU with glibc, memory that tensors free
  is kept for the next ones instead of being returned to the kernel and
  faulted in again every step (:func:`allocator_free_bytes` tells how much
  is held that way).

None of them changes what is computed: the step's token count, loss and
gradients are the same with or without them (up to the order of a
floating-point sum).
"""

import ctypes
import functools
import os
import platform
from typing import Any, Optional

import torch
from torch import nn


def wrap_model(model: nn.Module, *, checkpointing: bool, offloading: bool, compile: bool) -> None:
    """Activation checkpointing per decoder layer, offloading and compiling, as the config keys ask.

    ``enable_activation_checkpointing``: each decoder layer
    (:func:`torchtune_ext.models.decoder_layer_classes`: torchtune's
    ``TransformerSelfAttentionLayer``, or a transformers model's
    ``_no_split_modules``) recomputes its forward in backward instead of
    keeping its activations (torchtune's ``set_activation_checkpointing``);
    ``enable_activation_offloading``: :func:`offload_activations`; ``compile``:
    torchtune's ``compile_model`` (each layer compiled at its first forward).
    Call before FSDP sharding.
    """
    from torchtune import training

    from torchtune_ext.models import decoder_layer_classes  # in here: importing runtime stays torch only

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
    transformers (:func:`torchtune_ext.hf.causal_lm`): ``lm_head`` (an
    ``nn.Linear``) holds the input embedding's weight itself (``tie_word_embeddings``).
    """
    from torchtune_ext.models import is_hf_model  # in here: importing runtime stays torch only

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
            :func:`torchtune_ext.hf.causal_lm`, weights loaded.
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


# glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=None)
def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_kept = False  # set once keep_freed_cpu_memory has applied the settings in this process


def keep_freed_cpu_memory(device: torch.device) -> bool:
    """On CPU with glibc, keep the memory that tensors free for the next tensors of the process.

    Why: glibc's malloc gives large blocks (from 128 KiB, adaptively up to
    32 MiB, and always above) pages fresh from the kernel (``mmap``) and
    hands them back when they are freed, and it returns the free top of its
    heap to the kernel too. Activations and gradients are such blocks, so
    every step faults in and zero-fills its memory again: SmolLM2-135M at
    batch 1 x 4 accumulation steps x 256 tokens, fp32, 2 threads, took
    about 300,000 minor page faults and 1 s of system CPU time per step
    (``getrusage``). With ``mmap`` off (``M_MMAP_MAX`` 0) and the heap not
    trimmed (``M_TRIM_THRESHOLD`` at its maximum, 2 GiB of free top), a step
    reuses the pages of the one before: from the third step on, a few dozen
    faults per step. Numbers are unchanged (only where tensors live).

    The cost: the process's resident memory stays at its high-water mark
    (plus fragmentation: peak RSS +5% and +12% in two runs, flat over 25 steps) instead of shrinking
    between steps; :func:`allocator_free_bytes` reports the free part, which
    :func:`torchtune_ext.memory.available_memory_bytes` counts as available
    to this process.

    Memory freed after a checkpoint save or an evaluation stays with the
    process too (later steps reuse it), and on CPU ``peak_memory_gib`` (the
    process's peak RSS) includes what is kept. :func:`allocator_free_bytes`
    counts free chunks wherever they lie, so fragmented holes count as
    available; CPU plans with 70% of the available memory
    (:data:`torchtune_ext.memory.HEADROOM`).

    Not applied on other devices (the host memory is not the step's), off
    Linux/glibc or before glibc 2.33 (no ``mallinfo2``), or when the user
    configured the allocator: ``GLIBC_TUNABLES`` naming ``glibc.malloc``, any
    ``MALLOC_*`` variable, or an ``LD_PRELOAD`` (jemalloc, tcmalloc). To keep glibc's defaults, start the
    run with ``GLIBC_TUNABLES=glibc.malloc.check=0`` (a tunable at its default).

    Args:
        device: where the run trains.

    Returns:
        True if the allocator now keeps freed memory (also when already set
        by an earlier call in this process).
    """
    global _kept
    if device.type != "cpu":
        return False
    if _kept:
        return True
    # The user's allocator settings win: glibc tunables, glibc's MALLOC_* variables, a preloaded allocator.
    if ("glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or os.environ.get("LD_PRELOAD")
            or any(name.startswith("MALLOC_") for name in os.environ)):
        return False
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return False  # before glibc 2.33 the memory guard could not see what is kept
    # mallopt returns 1 on success; the trim threshold is an int in this interface
    _kept = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _kept


def allocator_free_bytes() -> int:
    """Bytes that glibc's allocator holds free for this process (``mallinfo2().fordblks``); 0 if unknown.

    Memory this process can reuse without asking the kernel; the kernel's
    ``MemAvailable`` does not include it. Only counted once
    :func:`keep_freed_cpu_memory` has applied its settings (otherwise glibc
    returns large free blocks to the kernel by itself).
    """
    if not _kept:
        return 0
    mallinfo2 = _glibc().mallinfo2  # present: keep_freed_cpu_memory checked
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)
