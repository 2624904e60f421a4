"""Model FLOPs of a training step and the device's peak: MFU on every step.

Model FLOPs utilization (MFU, Chowdhery et al. 2022, "PaLM", appendix B) is
the FLOP/s a step achieves on the model's own arithmetic -- a count from the
architecture, not from the kernels that ran -- divided by the device's peak
FLOP/s. The count, per token of a decoder-only transformer, forward and
backward:

* a trainable weight costs 6 FLOPs per token: 2 in the forward
  multiply-add, 2 for the gradient of its input, 2 for its own gradient
  (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", the "6N");
* a frozen weight costs 4: the forward and the input gradient, which backward
  still needs to reach the trainable weights below it (LoRA); no weight gradient;
* attention scores and the weighted sum of values have no weights:
  ``12 * num_layers * attn_dim * seq_len`` per token (forward ``4 * attn_dim *
  seq_len`` per layer, backward twice that), PaLM's convention, not halved for
  the causal mask.

Only weights that take part in matrix products count: an embedding tied to
the output projection counts once (it is that projection's weight); the
lookup of an untied input embedding and the norms' scales cost nothing here.

The peak comes from the config (``peak_tflops_per_device``), else from a
table of dense (no sparsity) datasheet numbers for common GPUs
(:data:`PEAK_TFLOPS`), else, on CPU, from a timed matrix product at start-up.
An unknown GPU gets no MFU (one warning), never a failed run.
"""

import logging
import re
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

log = logging.getLogger(__name__)


def flops_per_token(trainable_params: int, frozen_params: int, num_layers: int, attn_dim: int,
                    seq_len: float) -> float:
    """Training FLOPs per token (forward + backward), see the module docstring.

    Args:
        trainable_params: matmul weights that receive gradients (all of them in
            a full fine-tune; the adapters in LoRA).
        frozen_params: matmul weights that do not (the base model in LoRA).
        num_layers: transformer layers.
        attn_dim: ``num_heads * head_dim``.
        seq_len: length of the sequence the token attends over (tokens).

    Returns:
        float: FLOPs per token.
    """
    return 6.0 * trainable_params + 4.0 * frozen_params + 12.0 * num_layers * attn_dim * seq_len


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOP count needs to know about a model.

    Attributes:
        trainable_params (int): matmul weights that receive gradients.
        frozen_params (int): matmul weights that do not.
        num_layers (int): transformer layers.
        attn_dim (int): ``num_heads * head_dim`` of the attention.
    """

    trainable_params: int
    frozen_params: int
    num_layers: int
    attn_dim: int

    @classmethod
    def from_model(cls, model: nn.Module) -> Optional["ModelFlops"]:
        """Count a torchtune ``TransformerDecoder`` (full or LoRA; FSDP2 shards count in full; meta works).

        Matmul weights are the parameters with two or more dimensions, less an
        input embedding that is not also the output projection. Returns None
        for a model without ``layers[0].attn``.
        """
        layers = getattr(model, "layers", None)
        attn = getattr(layers[0], "attn", None) if layers else None
        if attn is None:
            return None
        embedding = getattr(getattr(model, "tok_embeddings", None), "weight", None)
        output = getattr(model, "output", None)
        tied = getattr(getattr(output, "tied_module", None), "weight", None) is embedding
        trainable = frozen = 0
        for param in model.parameters():  # a tied weight appears once
            if param.dim() < 2 or (param is embedding and not tied):
                continue
            if param.requires_grad:
                trainable += param.numel()
            else:
                frozen += param.numel()
        # the query projection's whole width: under tensor parallelism num_heads counts this rank's heads only
        query = getattr(getattr(attn, "q_proj", None), "weight", None)
        attn_dim = int(query.shape[0]) if query is not None else attn.num_heads * attn.head_dim
        return cls(trainable, frozen, len(layers), attn_dim)

    def step_flops(self, positions: int, squared_lengths: int) -> float:
        """FLOPs of ``positions`` tokens in sequences whose squared lengths add up to ``squared_lengths``.

        The sum of :func:`flops_per_token` over the tokens: for a sequence of
        length ``s``, ``s`` tokens each attending over ``s``, hence the
        attention term ``12 * num_layers * attn_dim * sum(s ** 2)``.
        """
        weights = 6.0 * self.trainable_params + 4.0 * self.frozen_params
        return weights * positions + 12.0 * self.num_layers * self.attn_dim * squared_lengths


# Dense (no sparsity) peak TFLOP/s per device from the vendors' datasheets, by
# torch.cuda.get_device_name: (pattern, bf16/fp16 tensor cores, fp32 without
# TF32). PyTorch runs fp32 matmuls without TF32 unless
# torch.backends.cuda.matmul.allow_tf32 is set, hence the plain fp32 column.
# More specific names come first.
PEAK_TFLOPS: Tuple[Tuple[str, float, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", 756.0, 51.0),
    (r"\bH100\b.*\bNVL\b", 835.0, 60.0),
    (r"\b(H100|H200|H800|GH200)\b", 989.0, 67.0),
    (r"\b(A100|A800)\b", 312.0, 19.5),
    (r"\bL40S\b", 362.0, 91.6),
    (r"\bL40\b", 181.0, 90.5),
    (r"\bL4\b", 121.0, 30.3),
    (r"\bA10\b", 125.0, 31.2),
    (r"\bRTX 4090\b", 165.2, 82.6),
    (r"\bRTX A6000\b", 154.8, 38.7),
    (r"\bMI300X\b", 1307.4, 163.4),
)


def table_peak_tflops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Datasheet peak of a GPU named ``device_name`` for ``dtype`` (bf16/fp16 or fp32); None if unknown."""
    for pattern, half, single in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return single if dtype == torch.float32 else half
    return None


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3, n: int = 1024) -> float:
    """Best TFLOP/s of an ``n x n`` matrix product on ``device`` in ``dtype``, timed for about ``seconds``.

    The operation the model is made of, with all of this process's threads:
    the ceiling a CPU run can reach. Two untimed products warm up first. The
    global random state is not used (a resumed run draws what it would have).
    """
    generator = torch.Generator().manual_seed(0)  # its own: training's random stream stays untouched
    a = torch.randn(n, n, generator=generator).to(device, dtype)
    b = torch.randn(n, n, generator=generator).to(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        torch.mm(a, b)
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e12


_MEASURED_PEAKS: dict = {}  # (device, dtype, threads) -> TFLOP/s, see peak_tflops_per_device


def peak_tflops_per_device(device: torch.device, dtype: torch.dtype,
                           configured: Optional[float] = None) -> Tuple[Optional[float], str]:
    """The peak MFU is measured against, and where it came from.

    Args:
        device: the training device.
        dtype: the compute dtype.
        configured: ``peak_tflops_per_device`` from the config, if set.

    Returns:
        (TFLOP/s or None, a short description of the source). None (no MFU)
        for a GPU missing from :data:`PEAK_TFLOPS` without a configured peak;
        a warning says so. A CPU's peak is measured (:func:`measure_peak_tflops`)
        the first time a process asks for that device, dtype and thread count.
    """
    if configured:
        return float(configured), "peak_tflops_per_device"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak_tflops(name, dtype)
        if peak is None:
            log.warning("MFU not logged: no peak FLOP/s known for %s; set peak_tflops_per_device to the "
                        "device's dense %s TFLOP/s.", name, str(dtype).replace("torch.", ""))
            return None, "unknown"
        return peak, f"datasheet, {name}"
    # Measured once per process for a device, dtype and thread count: a process that runs the recipe
    # again (a notebook, the tests) would only measure the same machine again, 0.4 s each time.
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _MEASURED_PEAKS:
        _MEASURED_PEAKS[key] = measure_peak_tflops(device, dtype)
    return _MEASURED_PEAKS[key], f"measured {str(dtype).replace('torch.', '')} matmul on {device.type}"
