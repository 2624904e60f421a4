"""Will backward once per optimizer step fit? An estimate before each step.

A backward once per step keeps every micro-batch's autograd graph until the
step's one backward, so its activation memory grows with the number of
micro-batches; the per-micro-batch backward gives the same gradients with the
memory of one micro-batch. :class:`MemoryGuard` estimates, before any forward
of a step, what the once-per-step backward would hold at its peak, compares
it with the memory free on the device, and under ``backward: auto`` lets the
step fall back to the per-micro-batch backward when it would not fit (a DEBUG
line when the mode changes: the choice is auto's to make); under
``backward: once_per_step`` it only warns, once, that the device may lack the
memory.

By default (``limit="torchtune"``) a step must also need no more than
torchtune's own recipe would for the same samples: a backward per micro-batch
of ``batch_size`` samples in sampler order, each padded to its longest
sample, with logits for every position (``baseline``, from
:class:`torchtune_ext.data.step_loader.StepLoader`). So a config that fits with
torchtune's recipe fits with ours, whatever the data; once per step runs
where it is cheap (a step whose micro-batches are small next to one padded
micro-batch with its vocabulary-wide logits). ``limit="device"`` drops that
bound: once per step whenever the device has the memory. The estimate is an
upper bound by design: falling back costs little
(the same work, one backward per micro-batch); running out of memory costs the
run (on CPU the kernel kills the process; a CUDA out-of-memory error is caught
by the training step and the step redone per micro-batch, single process only).

How much of the free memory a step may plan to use (:data:`HEADROOM`) depends on
the device. On CPU the process's peak RSS exceeds the count of what autograd
keeps: measured on SmolLM2-135M, fp32, 2 cores, batch 4-8 x GA 4 x 512 tokens
(``python -m bench --realistic``), by 7-25%; glibc's allocator keeps freed
blocks and the forward's transient tensors come on top. A once-per-step LoRA
step estimated at 18 GiB with 21.7 GiB free was killed at 23.9 GiB RSS with
the earlier 0.85, so CPU plans with 0.7 (covers an estimate 43% low). CUDA's
caching allocator returns what PyTorch frees to PyTorch, and an out-of-memory
error there is caught and the step redone, so 0.85.

What one micro-batch keeps for backward (:func:`activation_bytes`) was counted
for torchtune's ``TransformerSelfAttentionLayer`` (RMSNorm, GQA attention with
RoPE and SDPA, SwiGLU MLP) by summing the distinct tensors autograd saves,
with ``torch.autograd.graph.saved_tensors_hooks``, over hidden width, MLP
width, heads, LoRA rank and dropout, fp32 and bf16; ``tests/test_memory.py``
checks the formula against such counts.
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune import utils

from torchtune_ext import ranks
from torchtune_ext.text import format_bytes
from torchtune_ext.train.allocator import allocator_free_bytes
from torchtune_ext.train.loss import output_width, rows_per_output_chunk

# torchtune's logger: the recipes' lines show; a mode change under backward=auto is DEBUG (log_level: DEBUG)
log = utils.get_logger("INFO")


# Fraction of the available memory a step may plan to use, per device type (see the module docstring).
HEADROOM = {"cpu": 0.7, "cuda": 0.85}

# What bounds a once-per-step step (config key once_per_step_memory_limit, see the module docstring).
LIMITS = ("torchtune", "device")


@dataclass(frozen=True)
class MicroBatchShape:
    """What the estimate needs to know about one micro-batch.

    Attributes:
        batch (int): rows of ``tokens``.
        seq_len (int): columns of ``tokens`` (padded length).
        trainable_rows (int): positions with a trainable label (after the shift).
        masked (bool): an explicit attention mask is passed (packed data): SDPA
            then keeps a ``[batch, heads, seq, seq]`` mask for backward.
    """

    batch: int
    seq_len: int
    trainable_rows: int
    masked: bool = False


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a torchtune ``TransformerDecoder`` that set its activation memory.

    Attributes:
        num_layers, hidden_dim, num_heads, intermediate_dim, vocab_size: the architecture.
        element_bytes (int): bytes per activation element (2 for bf16, 4 for fp32).
        activation_checkpointing (bool): layers keep only their input for backward.
        lora_bytes_per_token (int): what the adapters of one layer add per token
            (see :func:`model_shape`).
        lora_bytes_per_layer (int): what they add per layer whatever the
            tokens (DoRA builds its adapter's weight from an identity matrix).
        gradient_bytes (int): gradients of the trainable parameters on this rank.
        unsharded_gradient_bytes (int): the same unsharded (equal to
            ``gradient_bytes`` without FSDP): what a rank holds between
            micro-batches while FSDP2's gradient sync is deferred.
        optimizer_state_bytes (int): optimizer state still to be allocated by
            the first ``optimizer.step()`` (0 once it exists).
    """

    num_layers: int
    hidden_dim: int
    num_heads: int
    intermediate_dim: int
    vocab_size: int
    element_bytes: int = 4
    activation_checkpointing: bool = False
    lora_bytes_per_token: int = 0
    lora_bytes_per_layer: int = 0
    gradient_bytes: int = 0
    unsharded_gradient_bytes: int = 0
    optimizer_state_bytes: int = 0


def layer_bytes_per_token(shape: ModelShape, seq_len: int = 0, masked: bool = False) -> int:
    """Bytes one transformer layer keeps for backward per token (no activation checkpointing).

    Fitted to counts of the tensors autograd saves in torchtune's Llama-style
    layer (see the module docstring), exact for fp32 and bf16:
    ``4 * (4 * hidden + heads + 2)`` in fp32 (RMSNorm computes in fp32: four
    hidden-wide tensors and one scale per norm; SDPA's log-sum-exp per head),
    plus ``e * (6 * hidden + 4 * intermediate)`` in the activation dtype of
    ``e`` bytes (the attention's and the MLP's normed inputs, q, k and v with
    k and v expanded to every head, the attention output; four SwiGLU
    tensors). With an explicit attention mask, ``heads * seq_len * e`` more
    (SDPA keeps the mask per head; an upper bound for a boolean one).
    Adapters add ``lora_bytes_per_token``.

    Returns:
        int: bytes per token per layer.
    """
    d, i, h, e = shape.hidden_dim, shape.intermediate_dim, shape.num_heads, shape.element_bytes
    total = 4 * (4 * d + h + 2) + e * (6 * d + 4 * i) + shape.lora_bytes_per_token
    if masked:
        total += h * seq_len * e
    return total


def activation_bytes(shape: ModelShape, micro_batch: MicroBatchShape, recompute_output: bool) -> int:
    """Bytes one micro-batch's forward keeps alive until its backward.

    The layers (:func:`layer_bytes_per_token`, or only each layer's input with
    activation checkpointing), the token embedding's output and the final
    norm (``8 * hidden + 12`` per token), and the loss: the trainable rows'
    hidden states with ``recompute_output`` (:class:`torchtune_ext.train.loss.SummedCrossEntropyLoss`),
    else their fp32 log-probabilities (``4 * vocab`` per row), plus 32 bytes
    of indices per row.

    Returns:
        int: bytes.
    """
    tokens = micro_batch.batch * micro_batch.seq_len
    if shape.activation_checkpointing:
        per_layer = shape.element_bytes * shape.hidden_dim
    else:
        per_layer = layer_bytes_per_token(shape, micro_batch.seq_len, micro_batch.masked)
    layers = shape.num_layers * (tokens * per_layer + shape.lora_bytes_per_layer)
    base = tokens * (8 * shape.hidden_dim + 12)
    # per trainable row, besides the hidden state or log-probabilities: the
    # int64 positions and targets the row selections keep (32 bytes)
    if recompute_output:
        loss = micro_batch.trainable_rows * (shape.hidden_dim * shape.element_bytes + 32)
    else:
        loss = micro_batch.trainable_rows * (shape.vocab_size * 4 + 32)
    return layers + base + loss


def backward_transient_bytes(shape: ModelShape, micro_batches: Sequence[MicroBatchShape], chunk_rows: int) -> int:
    """Memory a backward adds on top of what the forwards kept.

    The gradients (allocated during backward: the step sets them to None
    after the optimizer step), the optimizer state the first step allocates,
    one output chunk recomputed (logits, log-probabilities and their gradient:
    ``3 * 4 * vocab`` per row) and, with activation checkpointing, one
    layer's activations recomputed for the largest micro-batch.
    """
    total = shape.gradient_bytes + shape.optimizer_state_bytes + 3 * 4 * shape.vocab_size * chunk_rows
    if shape.activation_checkpointing and micro_batches:
        largest = max(micro_batches, key=lambda mb: mb.batch * mb.seq_len)
        total += largest.batch * largest.seq_len * layer_bytes_per_token(shape, largest.seq_len, largest.masked)
    return total


def step_peak_bytes(shape: ModelShape, micro_batches: Sequence[MicroBatchShape], *, once_per_step: bool) -> int:
    """Estimated peak memory of a step's forwards and backwards, beyond what is allocated before it.

    ``once_per_step``: every micro-batch's graph is kept (output recomputed)
    until the one backward; otherwise one micro-batch's graph (output kept)
    at a time.
    """
    if not micro_batches:
        return 0
    chunk_rows = min(max(mb.trainable_rows for mb in micro_batches),
                     rows_per_output_chunk("auto", 0, shape.vocab_size))
    if once_per_step:
        kept = sum(activation_bytes(shape, mb, recompute_output=True) for mb in micro_batches)
    else:
        kept = max(activation_bytes(shape, mb, recompute_output=False) for mb in micro_batches)
    return kept + backward_transient_bytes(shape, micro_batches, chunk_rows)


def _cgroup_headroom() -> Optional[int]:
    """Bytes left under this process's cgroup v2 memory limit, None without one."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(int(limit) - int(f.read().strip()), 0)
    except (OSError, ValueError):
        return None


def available_memory_bytes(device: torch.device, *, per_process: bool = True) -> Optional[int]:
    """Memory this process could still allocate on ``device``, in bytes; None if unknown.

    CUDA: free device memory (``torch.cuda.mem_get_info``) plus what
    PyTorch's caching allocator holds but does not use. CPU: ``MemAvailable``
    of ``/proc/meminfo`` (Linux), or less if a cgroup v2 memory limit is closer,
    divided among the job's processes on this host (``LOCAL_WORLD_SIZE``;
    not with ``per_process=False``, for what one process alone will need),
    plus what glibc's allocator holds free for this process
    (:func:`torchtune_ext.train.allocator.allocator_free_bytes`, the CPU analogue of
    CUDA's cached blocks).
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    headroom = _cgroup_headroom()
    if headroom is not None:
        available = headroom if available is None else min(available, headroom)
    # Processes of one job on this host share its memory (torchrun sets LOCAL_WORLD_SIZE).
    local_processes = max(ranks.local_world_size() or 1, 1) if per_process else 1
    return None if available is None else available // local_processes + allocator_free_bytes()


def _local_numel(param: torch.Tensor) -> int:
    to_local = getattr(param, "to_local", None)  # an FSDP2 shard (DTensor): this rank's part
    return to_local().numel() if to_local is not None else param.numel()


def model_shape(model: nn.Module, activation_dtype: Optional[torch.dtype] = None,
                optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[ModelShape]:
    """Read a :class:`ModelShape` off a torchtune ``TransformerDecoder`` (possibly LoRA, FSDP2, on meta).

    Adapters (torchtune's ``LoRALinear`` / ``DoRALinear``, found by their
    ``lora_a``) add, per adapted linear and token, the rank (``lora_a``'s
    output), the input again with dropout (``in_dim`` plus a 1-byte mask),
    and for DoRA the input and output once more, and per layer, whatever the
    tokens, an identity matrix and its ``lora_a`` image (``in_dim * (in_dim +
    rank)``; measured, see the module docstring). The optimizer state yet to be allocated counts 2 tensors per
    trainable parameter (Adam's moments) while ``optimizer.state`` is empty.

    Returns:
        ModelShape, or None when ``model`` is not a layered decoder this
        module knows (no guard then).
    """
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    layer = layers[0]
    attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    w1 = getattr(mlp, "w1", None)
    if attn is None or w1 is None:
        return None
    e = torch.finfo(activation_dtype or next(model.parameters()).dtype).bits // 8
    lora = lora_fixed = 0
    for module in layer.modules():
        if hasattr(module, "lora_a") and hasattr(module, "in_dim"):
            rank = module.lora_a.out_features
            lora += e * rank
            if not isinstance(getattr(module, "dropout", None), nn.Identity):
                lora += (e + 1) * module.in_dim
            if hasattr(module, "magnitude"):
                lora += e * (module.in_dim + module.out_dim)
                lora_fixed += e * module.in_dim * (module.in_dim + rank)
    trainable = [p for p in model.parameters() if p.requires_grad]
    gradient_bytes = sum(_local_numel(p) * p.element_size() for p in trainable)
    unsharded_gradient_bytes = sum(p.numel() * p.element_size() for p in trainable)  # a DTensor's numel is global
    vocab = output_width(getattr(model, "output", None)) or model.tok_embeddings.num_embeddings
    checkpointed = any("checkpoint" in type(m).__name__.lower() for m in layer.modules()) or \
        "checkpoint" in type(layer).__name__.lower()
    return ModelShape(
        num_layers=len(layers), hidden_dim=attn.embed_dim, num_heads=attn.num_heads,
        intermediate_dim=w1.out_features if hasattr(w1, "out_features") else w1.out_dim,
        vocab_size=vocab, element_bytes=e, activation_checkpointing=checkpointed,
        lora_bytes_per_token=lora, lora_bytes_per_layer=lora_fixed, gradient_bytes=gradient_bytes,
        unsharded_gradient_bytes=unsharded_gradient_bytes,
        optimizer_state_bytes=2 * gradient_bytes if optimizer is not None and not optimizer.state else 0,
    )


class MemoryGuard:
    """Per step: backward once per step if it fits, else once per micro-batch.

    Args:
        model: the training model (read once with :func:`model_shape`).
        device: the training device.
        optimizer: to count its state while it is not yet allocated.
        activation_dtype: the model's compute dtype (default: its parameters').
        headroom (float, optional): use at most this fraction of the available
            memory; default :data:`HEADROOM` of the device type (0.85 for others).
        available (callable, optional): ``device -> bytes or None``; default
            :func:`available_memory_bytes`.
        limit (str): ``"torchtune"`` (default): once per step only if it needs
            no more than the step's ``baseline`` (torchtune's recipe) and fits
            the device; ``"device"``: only the device's free memory bounds it.

    Raises:
        ValueError: ``limit`` is not one of :data:`LIMITS`.
    """

    def __init__(self, model: nn.Module, device: torch.device, optimizer: Optional[torch.optim.Optimizer] = None,
                 *, activation_dtype: Optional[torch.dtype] = None, headroom: Optional[float] = None,
                 available: Optional[Callable[[torch.device], Optional[int]]] = None, limit: str = "torchtune"):
        if limit not in LIMITS:
            raise ValueError(f"MemoryGuard: limit must be one of {LIMITS}, got {limit!r}")
        self.device, self.limit = device, limit
        self._why_not: Optional[str] = None  # why the last decision of this rank was no
        self._job_needs = (0, 0)  # (once per step, torchtune's recipe): the bytes of the last decision
        self._own_shortage = False  # this rank's own device lacked the memory at the last estimate
        self.headroom = HEADROOM.get(torch.device(device).type, 0.85) if headroom is None else headroom
        self._available = available or (lambda dev: available_memory_bytes(dev))
        self._model, self._optimizer, self._dtype = model, optimizer, activation_dtype
        self.shape = model_shape(model, activation_dtype, optimizer)
        self.once_per_step = True  # the mode of the last decision, for the log line on a change
        self._failed_at: Optional[int] = None  # an estimate that ran out of memory (CUDA) before
        self.warned_once_per_step = False  # backward=once_per_step: a shortage was found (and said) once

    def refresh(self) -> None:
        """Re-read the model shape (the optimizer state now exists after the first step)."""
        if self.shape is not None and self.shape.optimizer_state_bytes and self._optimizer is not None \
                and self._optimizer.state:
            self.shape = model_shape(self._model, self._dtype, self._optimizer)

    def step_needs(self, micro_batches: Sequence[MicroBatchShape],
                   baseline: Optional[Sequence[MicroBatchShape]] = None) -> List[int]:
        """This rank's figures for the step's decision; no collective.

        Under several ranks each rank computes them, the recipe takes their
        element-wise maximum over ranks (one all-reduce) and every rank calls
        :meth:`decide_step` with the same result. So the default limit bounds the
        job: no rank plans more than the largest rank of torchtune's recipe
        would need for the same step (a rank's own share may exceed its own
        baseline). The device bound stays per rank: each rank checks its own
        memory, and a shortage on any rank is a shortage for all.

        Args:
            micro_batches: this rank's micro-batches of the step, as they will run.
            baseline: the same samples as torchtune's recipe would run them on
                this rank (:attr:`torchtune_ext.data.step_loader.StepData.baseline`; every
                position counted as a logits row); None: no such bound.

        Returns:
            List[int]: ``[once_short, deferred_short, once_bytes, deferred_bytes,
            torchtune_bytes]``: 1/0 whether this rank's device lacks the memory
            for backward once per step / for deferring FSDP2's gradient sync;
            the estimated peak bytes of both; the baseline's estimated peak
            (0: no baseline). All 0 when the model's shape is unknown.
        """
        if self.shape is None:
            return [0, 0, 0, 0, 0]
        self.refresh()
        available = self._available(self.device)
        once_bytes = step_peak_bytes(self.shape, micro_batches, once_per_step=True)
        once_short = (self._failed_at is not None and once_bytes >= self._failed_at) or \
            not decide(once_bytes, available, self.headroom)
        extra = self.shape.unsharded_gradient_bytes - self.shape.gradient_bytes
        deferred_bytes = 0
        if extra > 0:  # FSDP2 keeps the unsharded gradients between micro-batches
            deferred_bytes = step_peak_bytes(self.shape, micro_batches, once_per_step=False) + extra
        deferred_short = not decide(deferred_bytes, available, self.headroom)
        torchtune_bytes = step_peak_bytes(self.shape, baseline, once_per_step=False) if baseline else 0
        self._own_shortage = once_short
        return [int(once_short), int(deferred_short), once_bytes, deferred_bytes, torchtune_bytes]

    def decide_step(self, needs: Sequence[int]) -> Tuple[bool, bool]:
        """Whether the step runs backward once per step, and whether a backward per micro-batch defers FSDP2's sync.

        Once per step if no rank is short of device memory for it and, with
        the ``torchtune`` limit, its estimate is at most torchtune's need
        (``torchtune_bytes`` 0: no bound; under several ranks that is so only
        when every rank sent 0, e.g. a rank with no samples left at the end of
        the data is bounded by the others'). A backward per micro-batch may
        defer FSDP2's gradient sync to the last micro-batch under the same
        two conditions for its own estimate (always without sharding:
        ``deferred_bytes`` 0). Also records, for :meth:`report`, why the
        answer was no and the bytes it compared.

        Args:
            needs: the 5 integers of :meth:`step_needs` (flags 0/1, bytes),
                or their element-wise maximum over the data-parallel ranks.

        Returns:
            Tuple[bool, bool]: ``(once_per_step, defer_sync)``.

        Raises:
            ValueError: ``needs`` does not hold 5 values.
        """
        if len(needs) != 5:
            raise ValueError(f"MemoryGuard.decide_step: expected the 5 values of step_needs, got {len(needs)}")
        once_short, deferred_short, once_bytes, deferred_bytes, torchtune_bytes = (int(v) for v in needs)
        bounded = self.limit == "torchtune" and torchtune_bytes > 0
        self._why_not = None
        self._job_needs = (once_bytes, torchtune_bytes)
        if once_short:
            self._why_not = "device" if self._own_shortage else "peer"
            once = False
        else:
            once = not (bounded and once_bytes > torchtune_bytes)
            if not once:
                self._why_not = "torchtune"
        defer = deferred_bytes == 0 or not (deferred_short or (bounded and deferred_bytes > torchtune_bytes))
        return once, defer

    def fits_once_per_step(self, micro_batches: Sequence[MicroBatchShape],
                           baseline: Optional[Sequence[MicroBatchShape]] = None) -> bool:
        """One rank's decision alone (one process): :meth:`decide_step` of its own :meth:`step_needs`."""
        return self.decide_step(self.step_needs(micro_batches, baseline))[0]

    def fits_deferred_sync(self, micro_batches: Sequence[MicroBatchShape],
                           baseline: Optional[Sequence[MicroBatchShape]] = None) -> bool:
        """Whether a backward per micro-batch may defer FSDP2's gradient sync to the last micro-batch.

        Deferring saves a reduce-scatter per micro-batch but keeps the
        unsharded gradients between micro-batches
        (``unsharded_gradient_bytes - gradient_bytes`` more than syncing every
        micro-batch, as torchtune's recipe does). One rank's decision alone,
        as :meth:`fits_once_per_step`.
        """
        return self.decide_step(self.step_needs(micro_batches, baseline))[1]

    def note_out_of_memory(self, micro_batches: Sequence[MicroBatchShape]) -> None:
        """A once-per-step backward of this size ran out of memory: do not try that size again."""
        if self.shape is not None:
            need = step_peak_bytes(self.shape, micro_batches, once_per_step=True)
            self._failed_at = need if self._failed_at is None else min(self._failed_at, need)

    def report(self, once_per_step: bool, micro_batches: Sequence[MicroBatchShape], step: int) -> None:
        """A DEBUG line when ``backward: auto`` changes mode, with the numbers it decided on.

        Only at DEBUG (``log_level: DEBUG``): under ``auto`` the choice is the
        one asked for, and the step's ``once_per_step`` metric records it. A
        fallback for lack of device memory is said by the rank short of it
        (with its rank under several processes), the others by rank 0.
        """
        if once_per_step == self.once_per_step:
            return
        self.once_per_step = once_per_step
        if self.shape is None:
            return
        rank = ranks.rank() if ranks.in_process_group() else None
        several = ranks.several_processes()
        why = self._why_not or "peer"
        if once_per_step:
            if rank in (None, 0):
                log.debug("Step %d: backward=auto runs backward once per step again (estimated %s%s, %s "
                          "available).", step, format_bytes(self._job_needs[0]),
                          " on the largest rank" if several else "", _size_or_unknown(self._available(self.device)))
        elif why == "device":
            need = step_peak_bytes(self.shape, micro_batches, once_per_step=True)  # this rank's own
            where = "" if rank is None else f" on rank {rank}"
            log.debug("Step %d: backward=auto runs backward per micro-batch (same gradients): once per step "
                      "would need about %s, %s available%s.", step, format_bytes(need),
                      _size_or_unknown(self._available(self.device)), where)
        elif rank in (None, 0):
            if why == "torchtune":
                once_bytes, torchtune_bytes = self._job_needs  # the largest rank's, under several
                log.debug("Step %d: backward=auto runs backward per micro-batch (same gradients): once per step "
                          "would need about %s, more than torchtune's recipe needs for the same samples (about "
                          "%s, backward per padded micro-batch); once_per_step_memory_limit=device lifts this "
                          "bound.", step, format_bytes(once_bytes), format_bytes(torchtune_bytes))
            else:
                log.debug("Step %d: backward=auto runs backward per micro-batch (same gradients) on every rank: "
                          "another rank lacks the memory for once per step.", step)

    def warn_once_per_step(self, needs: Sequence[int], micro_batches: Sequence[MicroBatchShape], step: int) -> None:
        """``backward: once_per_step``: say once if a step may not fit the device (it still runs once per step).

        Args:
            needs: the 5 integers of :meth:`step_needs`, or their element-wise
                maximum over the data-parallel ranks (the same on every rank).
            micro_batches: this rank's micro-batches of the step.
            step: the optimizer step, for the message.

        The rank whose own device is short says so, with its rank under
        several processes; afterwards :attr:`warned_once_per_step` is set on
        every rank (from ``needs``, which all ranks share), so that all stop
        estimating at the same step.
        """
        if len(needs) != 5:
            raise ValueError(f"MemoryGuard.warn_once_per_step: expected the 5 values of step_needs, got {len(needs)}")
        if not int(needs[0]) or self.shape is None:
            return
        self.warned_once_per_step = True
        if not self._own_shortage:
            return
        rank = ranks.rank() if ranks.in_process_group() else None
        where = "" if rank is None else f" on rank {rank}"
        need = step_peak_bytes(self.shape, micro_batches, once_per_step=True)
        log.warning("Step %d: backward=once_per_step needs about %s (estimated), %s available%s (a step plans "
                    "with at most %d%% of it): it may run out of memory. It still runs once per step, as asked; "
                    "backward=auto runs such steps per micro-batch (same gradients). Said once.", step,
                    format_bytes(need), _size_or_unknown(self._available(self.device)), where,
                    round(self.headroom * 100))


def _size_or_unknown(value: Optional[int]) -> str:
    return "unknown" if value is None else format_bytes(value)


def decide(need_bytes: int, available_bytes: Optional[int], headroom: float = 0.85) -> bool:
    """True when a step estimated to need ``need_bytes`` more fits in ``headroom * available_bytes``.

    Unknown availability (None) means yes: there is nothing to compare with.
    """
    return available_bytes is None or need_bytes <= headroom * available_bytes


def shapes_of(prepared: Sequence[Any]) -> List[MicroBatchShape]:
    """:class:`MicroBatchShape` of prepared micro-batches (:class:`torchtune_ext.train.objective.Prepared`:
    ``inputs["tokens"]``, ``trainable_rows``)."""
    shapes = []
    for micro_batch in prepared:
        batch, seq_len = micro_batch.inputs["tokens"].shape[:2]
        shapes.append(MicroBatchShape(int(batch), int(seq_len), int(micro_batch.trainable_rows),
                                      micro_batch.inputs.get("mask") is not None))
    return shapes
