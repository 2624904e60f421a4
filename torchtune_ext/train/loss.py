"""Sum-reduced next-token losses: the component the accounting divides once.

Two pieces live here:

* :func:`shift_labels`, the one place where labels are aligned with the
  logits that predict them. Inside a packed sequence it never lets the last
  position of one document predict the first token of the next.
* :class:`SummedCrossEntropyLoss`, which returns *sums* over the trainable
  positions of a micro-batch (:class:`TokenSums`): the cross-entropy (with
  gradient) and, without a second pass over the model, the token metrics
  (correct argmax predictions, entropy of the predicted distribution).

Any loss that returns a :class:`TokenSums` over exactly the positions whose
shifted label is not ``ignore_index`` can be used by the training step and the
evaluation loop: they count those positions themselves (before any forward),
sum everything over micro-batches and data-parallel ranks, and divide once
(:mod:`torchtune_ext.train.accounting`). Because every value is a sum over exactly
the counted positions, ``sum / num_tokens`` is the mean over every trainable
token however the data was split into micro-batches or ranks.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtune_ext.config import check_output_chunks, resolve_component
from torchtune_ext.errors import ConfigError

CROSS_ENTROPY_IGNORE_INDEX = -100

# Names of the token metrics :class:`SummedCrossEntropyLoss` sums, in a fixed
# order (every rank reduces them in one vector).
TOKEN_METRICS: Tuple[str, ...] = ("token_accuracy", "entropy")


def shift_labels(
    labels: torch.Tensor,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Align labels with the logits that predict them.

    Position ``i`` of a causal LM predicts token ``i + 1``, so the label of
    position ``i`` is ``labels[:, i + 1]``; the last position predicts nothing
    and gets ``ignore_index``. In a packed sequence (several documents in one
    row, each attending only to itself), position ``i`` predicts nothing when
    ``i + 1`` starts another document: the model cannot see the next document
    from there, and the unpacked documents have no such prediction either.

    Args:
        labels (torch.Tensor): ``[batch, seq_len]`` integer labels as produced by
            torchtune's datasets and collators (masked prompt and padding
            positions hold ``ignore_index``).
        ignore_index (int): label value excluded from the loss.
        document_ids (torch.Tensor, optional): ``[batch, seq_len]`` integers,
            equal for the positions of one document of a pack (see
            :func:`torchtune_ext.data.datasets.collate_packed`). None: every row is one
            document.

    Returns:
        torch.Tensor: ``[batch, seq_len]`` shifted labels, same dtype and device.

    Raises:
        ValueError: if ``labels`` is not 2-D or ``document_ids`` has another shape.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq_len], got shape {tuple(labels.shape)}")
    shifted = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if document_ids is not None:
        if document_ids.shape != labels.shape:
            raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}, labels {tuple(labels.shape)}")
        crosses = document_ids[:, 1:] != document_ids[:, :-1]
        shifted[:, :-1] = shifted[:, :-1].masked_fill(crosses.to(shifted.device), ignore_index)
    return shifted


@dataclass
class TokenSums:
    """Sums over the trainable positions of one micro-batch.

    Attributes:
        loss (torch.Tensor): fp32 scalar, the sum of per-token losses in nats;
            differentiable (backward runs on it after division by the step's
            token count).
        metrics (dict): name -> detached fp32 scalar, a sum over the same
            positions (e.g. ``token_accuracy``: number of positions whose
            argmax is the label). Divided by the token count they are means.
    """

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor] = field(default_factory=dict)


# How ``num_output_chunks: auto`` sizes the chunks of the output projection
# (:func:`rows_per_output_chunk`). The fp32 logits of one chunk stay under
# AUTO_CHUNK_BYTES (a chunk's recompute in backward holds about three such
# tensors: logits, log-probabilities and their gradient), but a chunk never has
# fewer than MIN_CHUNK_ROWS rows: below that the [rows, hidden] x [hidden,
# vocab] product runs far from peak (on the 2-core CPU of docs/benchmarks.md, a
# 32-row product of SmolLM2's output layer reached 42 GFLOP/s, 1024 rows 85).
AUTO_CHUNK_BYTES = 256 * 2**20
MIN_CHUNK_ROWS = 1024


def rows_per_output_chunk(num_output_chunks: Union[int, str], num_rows: int, vocab_size: Optional[int]) -> int:
    """How many trainable positions go through the output projection at once.

    Args:
        num_output_chunks: an integer ``n``: ``n`` chunks of equal size;
            ``"auto"``: chunks of ``max(MIN_CHUNK_ROWS, AUTO_CHUNK_BYTES // (4 * vocab_size))``
            rows, i.e. each chunk's fp32 logits stay under 256 MiB unless that
            would mean fewer than 1024 rows (SmolLM2, vocabulary 49,152: 1365
            rows; Llama 3, 128,256: 1024 rows, 501 MiB).
        num_rows: trainable positions of the micro-batch.
        vocab_size: output width (None if unknown: ``MIN_CHUNK_ROWS`` rows).

    Returns:
        int: rows per chunk, >= 1.
    """
    if num_output_chunks == "auto":
        return max(MIN_CHUNK_ROWS, AUTO_CHUNK_BYTES // (4 * vocab_size)) if vocab_size else MIN_CHUNK_ROWS
    return max(1, math.ceil(num_rows / num_output_chunks))


# On CPU the token metrics go through the log-probabilities in blocks of rows
# of about this size: exp(log_probs) of a whole chunk is a [rows, vocab]
# temporary written to and read back from main memory, while a block's stays
# in a core's L2 cache. On the 2-core CPU of docs/benchmarks.md this cut the
# metrics of 600 SmolLM2 rows from 0.22 s to 0.07 s (the output projection of
# the same rows: 0.3 s). GPUs take the chunk whole (one kernel per op).
METRIC_BLOCK_BYTES = 512 * 2**10


def token_metric_sums(log_probs: torch.Tensor, targets: torch.Tensor) -> List[torch.Tensor]:
    """Correct argmax predictions and summed entropy of ``[rows, vocab]`` log-probabilities.

    Args:
        log_probs: ``[rows, vocab]`` log-softmax output (fp32); rows may be 0.
        targets: ``[rows]`` label ids (no ``ignore_index`` among them).

    Returns:
        [correct, entropy]: fp32 scalars; ``correct`` counts rows whose argmax
        is the target, ``entropy`` is ``-sum_rows sum_v p_v log p_v`` in nats.
        Call under ``no_grad``.
    """
    correct = torch.zeros((), dtype=torch.float32, device=log_probs.device)
    entropy = torch.zeros((), dtype=torch.float32, device=log_probs.device)
    if log_probs.device.type == "cpu":
        block = max(1, METRIC_BLOCK_BYTES // max(1, log_probs.size(-1) * log_probs.element_size()))
    else:
        block = max(1, log_probs.size(0))
    for rows, ids in zip(log_probs.split(block), targets.split(block)):
        correct += (rows.argmax(dim=-1) == ids).sum(dtype=torch.float32)
        entropy -= torch.linalg.vecdot(rows.exp(), rows).sum(dtype=torch.float32)
    return [correct, entropy]


@dataclass
class OutputProjection:
    """What a model that is not a torchtune decoder hands to :meth:`SummedCrossEntropyLoss.take_output_projection`.

    A model offers it with a method ``hand_over_output_projection()``, which
    also switches the model to return its final hidden states
    (:mod:`torchtune_ext.model.hf` does this for transformers models).

    Attributes:
        project: ``[rows, hidden]`` hidden states -> ``[rows, vocab]`` logits,
            everything the model's head does included (e.g. a soft cap).
        vocab_size: output width.
        auxiliary: name -> (value, coefficient): per-micro-batch auxiliary
            losses of the model's last forward (a MoE router's load
            balancing), each a mean over the micro-batch's positions. The
            loss adds ``coefficient * n * value`` (``n``: the micro-batch's
            trainable tokens) to the gradient only and reports
            ``n * value`` as a metric sum under ``name``: divided by the
            step's tokens, each micro-batch's value weighs by its share of
            the step's tokens, and the reported ``loss`` stays the
            cross-entropy.
    """

    project: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: Optional[int]
    auxiliary: Dict[str, Tuple[Callable[[], Optional[torch.Tensor]], float]] = field(default_factory=dict)


def output_width(output: Any) -> Optional[int]:
    """Vocabulary size of a torchtune output projection (``nn.Linear``, LoRA/DoRA linear, ``TiedLinear``)."""
    for name in ("out_features", "out_dim"):
        if isinstance(getattr(output, name, None), int):
            return getattr(output, name)
    tied = getattr(output, "tied_module", None)
    weight = getattr(tied, "weight", None) if tied is not None else getattr(output, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


class SummedCrossEntropyLoss(nn.Module):
    """Next-token cross-entropy summed (not averaged) over the trainable positions.

    Two ways to use it:

    * **On logits** (any model that returns them): ``loss(logits, shifted_labels)``,
      where logits may be a list of chunks as torchtune's ``TransformerDecoder``
      returns after ``set_num_output_chunks(n)``. Each chunk's trainable rows
      are upcast to fp32 on their own.
    * **Owning the output projection** (what the recipes do): after
      :meth:`take_output_projection`, the model returns its final normed hidden
      states ``[batch, seq_len, hidden]`` and this loss applies the model's
      output projection itself, to the trainable positions only (masked
      prompts and padding cost no vocabulary-wide product) and in chunks of
      rows (:func:`rows_per_output_chunk`). With ``recompute_output=True`` each
      chunk's projection and log-softmax run under ``torch.utils.checkpoint``:
      what a micro-batch keeps for backward is its ``[rows, hidden]`` hidden
      states, not ``[rows, vocab]`` fp32 log-probabilities, and backward
      recomputes one chunk at a time (one more forward of the output layer).
      The training step asks for this when a micro-batch's graph must wait for
      a later backward (``backward=once_per_step`` with several micro-batches).

    With ``token_metrics`` the same log-probabilities also give, under
    ``no_grad`` and computed once (never in the recompute):

    * ``token_accuracy``: the number of positions whose argmax is the label;
    * ``entropy``: the sum over positions of the entropy of the predicted
      distribution, ``H = -sum_v p_v log p_v`` in nats (Shannon's definition).

    Args:
        num_output_chunks (int | "auto"): chunks of trainable rows per
            micro-batch, see :func:`rows_per_output_chunk`. On logits given as
            a list, the model's chunks are used as they come.
        ignore_index (int): label value excluded from the loss and the count.
        token_metrics (bool): also sum ``token_accuracy`` and ``entropy``.

    Shapes:
        outputs: logits ``[batch, seq_len, vocab]`` or a list of chunks
        ``[batch, seq_len_i, vocab]`` whose lengths add up to ``seq_len``; or,
        after :meth:`take_output_projection`, hidden states ``[batch, seq_len, hidden]``.
        shifted_labels: ``[batch, seq_len]`` from :func:`shift_labels`.
        output: :class:`TokenSums`; with no trainable position every sum is
        exactly 0 (never NaN) and ``loss`` still reaches every parameter in
        backward (with zero gradient), so data-parallel ranks stay in step.

    Raises:
        ValueError: ``num_output_chunks`` neither ``"auto"`` nor >= 1; in
            ``forward``, outputs that do not cover the labels' positions.
    """

    def __init__(
        self,
        num_output_chunks: Union[int, str] = "auto",
        ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
        token_metrics: bool = True,
    ):
        super().__init__()
        if num_output_chunks != "auto" and (isinstance(num_output_chunks, bool)
                                            or not isinstance(num_output_chunks, int) or num_output_chunks < 1):
            raise ValueError(f"num_output_chunks must be 'auto' or an integer >= 1, got {num_output_chunks!r}")
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index
        self.token_metrics = token_metrics
        # The model's output projection once taken over. A plain function, not
        # an attribute holding the module: nn.Module would register the model's
        # output layer as a submodule of the loss.
        self._project: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.vocab_size: Optional[int] = None
        self._auxiliary: Dict[str, Tuple[Callable[[], Optional[torch.Tensor]], float]] = {}

    @property
    def metric_names(self) -> Tuple[str, ...]:
        """Names of the metric sums every ``forward`` returns, in a fixed order."""
        return (TOKEN_METRICS if self.token_metrics else ()) + tuple(self._auxiliary)

    @property
    def owns_output_projection(self) -> bool:
        """True after :meth:`take_output_projection`: ``forward`` expects hidden states."""
        return self._project is not None

    def take_output_projection(self, model: nn.Module) -> None:
        """Let this loss apply ``model``'s output projection; the model returns hidden states.

        The model must be a torchtune ``TransformerDecoder`` (``norm``,
        ``output``, ``unembed``). Its ``unembed`` is overridden on this
        instance only: ``model(tokens)`` returns ``norm(h)``, ``[batch,
        seq_len, hidden]``, in the model's dtype. The weights, the state dict
        and checkpoints are unchanged; the output projection (an
        ``nn.Linear``, a LoRA/DoRA linear, or ``TiedLinear`` sharing the token
        embedding) is called here, so its parameters train as before. Call it
        once, before the first forward; under FSDP2 the root unit, which holds
        the output projection, must not reshard after forward
        (:func:`torchtune_ext.parallel.fsdp.shard_model` sees to that).

        A model with a ``hand_over_output_projection()`` method (a
        transformers model built by :func:`torchtune_ext.model.hf.causal_lm`)
        switches itself to hidden states and hands over an
        :class:`OutputProjection` instead.

        Raises:
            TypeError: ``model`` has no ``norm`` / ``output`` / ``unembed``.
        """
        hand_over = getattr(model, "hand_over_output_projection", None)
        if callable(hand_over):
            handed = hand_over()
            self._project, self.vocab_size, self._auxiliary = handed.project, handed.vocab_size, dict(handed.auxiliary)
            return
        if not all(hasattr(model, name) for name in ("norm", "output", "unembed")):
            raise TypeError(f"{type(model).__name__} is not a torchtune TransformerDecoder "
                            "(needs norm, output and unembed)")
        output, norm = model.output, model.norm
        model.unembed = lambda h: norm(h)  # instance attribute: the class's unembed is untouched
        self._project = lambda rows: output(rows)
        self.vocab_size = output_width(output)

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` logits (the model's dtype) of ``[rows, hidden]`` hidden states after
        :meth:`take_output_projection`; ``rows`` unchanged before (they are logits already)."""
        return self._project(rows) if self._project is not None else rows

    def _log_probs(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` fp32 log-probabilities of ``[rows, hidden]`` hidden states or ``[rows, vocab]`` logits."""
        if self._project is not None:
            rows = self._project(rows)
        return torch.log_softmax(rows.float(), dim=-1)

    def log_probs(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` fp32 log-probabilities of ``[rows, hidden]`` hidden states (after
        :meth:`take_output_projection`) or ``[rows, vocab]`` logits; the compiled chunk with ``compile``.
        What a loss over whole sequences builds on (:mod:`torchtune_ext.train.preference`)."""
        return self._log_probs(rows)

    def compile_chunk(self) -> None:
        """Compile the per-chunk projection and log-softmax with ``torch.compile`` (``compile: true``)."""
        self._log_probs = torch.compile(self._log_probs, dynamic=True)

    def _chunk_sums(self, log_probs: torch.Tensor, targets: torch.Tensor) -> List[torch.Tensor]:
        # Indexing saves only the indices for backward (nll_loss would keep the
        # whole [rows, vocab] log_probs alive until backward).
        picked = log_probs[torch.arange(targets.numel(), device=targets.device), targets]
        sums = [-picked.sum(dtype=torch.float32)]
        if self.token_metrics:
            with torch.no_grad():
                sums += token_metric_sums(log_probs, targets)
        return sums

    def forward(self, outputs: Union[torch.Tensor, List[torch.Tensor]], shifted_labels: torch.Tensor,
                recompute_output: bool = False) -> TokenSums:
        """Sums over the trainable positions; see the class docstring.

        Args:
            outputs: logits (or chunks of them), or hidden states after
                :meth:`take_output_projection`.
            shifted_labels: ``[batch, seq_len]``.
            recompute_output: with hidden states and gradients enabled,
                recompute each chunk's projection in backward instead of
                keeping its log-probabilities.
        """
        if self._project is not None:
            if not isinstance(outputs, torch.Tensor) or outputs.dim() != 3:
                raise ValueError("after take_output_projection the model must return hidden states "
                                 "[batch, seq_len, hidden]")
            pieces = [outputs]
        else:
            pieces = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        lengths = [piece.size(1) for piece in pieces]
        if sum(lengths) != shifted_labels.size(1):
            raise ValueError(f"outputs cover {sum(lengths)} positions but labels have {shifted_labels.size(1)}")
        totals = [torch.zeros((), dtype=torch.float32, device=shifted_labels.device)
                  for _ in range(1 + len(TOKEN_METRICS if self.token_metrics else ()))]
        checkpointed = recompute_output and self._project is not None and torch.is_grad_enabled()
        for piece, labels in zip(pieces, shifted_labels.split(lengths, dim=1)):
            trainable = labels != self.ignore_index
            # Only trainable rows: masked prompts and padding cost no softmax (and no projection).
            rows, targets = piece[trainable], labels[trainable]
            if len(pieces) == 1:
                vocab = self.vocab_size if self._project is not None else piece.size(-1)
                size = rows_per_output_chunk(self.num_output_chunks, rows.size(0), vocab)
            else:  # the model's own chunks, as they come
                size = max(rows.size(0), 1)
            # An empty split still yields one empty chunk: its zero loss keeps the graph
            # connected to every parameter (data-parallel ranks run the same backward).
            for chunk_rows, chunk_targets in zip(rows.split(size), targets.split(size)):
                if checkpointed:
                    # The recompute replays the forward's RNG state: a LoRA output's dropout draws the same mask.
                    log_probs = checkpoint(self._log_probs, chunk_rows, use_reentrant=False, preserve_rng_state=True)
                else:
                    log_probs = self._log_probs(chunk_rows)
                totals = [total + part for total, part in zip(totals, self._chunk_sums(log_probs, chunk_targets))]
                del log_probs
        for name, (value, coefficient) in self._auxiliary.items():
            aux = value()
            weighted = (shifted_labels != self.ignore_index).sum() * aux if aux is not None else totals[0] * 0
            # In the gradient only: the reported loss stays the cross-entropy (see OutputProjection).
            totals[0] = totals[0] + coefficient * (weighted - weighted.detach())
            totals.append(weighted.detach().float())
        return TokenSums(loss=totals[0], metrics=dict(zip(self.metric_names, totals[1:])))


# torchtune's cross-entropy losses, which average over tokens, and the
# arguments they share with ours. A config naming one gets our sum-reduced
# loss with the same chunking and ignore_index.
_TORCHTUNE_CE_LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": ("num_output_chunks", "ignore_index"),
    "torchtune.modules.loss.ce_chunked_output_loss.CEWithChunkedOutputLoss": ("num_output_chunks", "ignore_index"),
    "torch.nn.CrossEntropyLoss": ("ignore_index",),
}


def build_loss(cfg_loss, compile: bool = False, log_replacement: bool = True) -> SummedCrossEntropyLoss:
    """Instantiate the recipe's ``loss`` config as a sum-reduced loss.

    torchtune's mean-reduced cross-entropy losses (``CEWithChunkedOutputLoss``,
    ``torch.nn.CrossEntropyLoss``) are replaced by :class:`SummedCrossEntropyLoss`
    with the same ``num_output_chunks`` and ``ignore_index``, and the
    replacement is logged once: a mean cannot be normalized exactly over
    micro-batches, the sum can, and the logged loss is the same mean per token.

    Args:
        cfg_loss: the ``loss`` config node (``_component_`` plus arguments).
        compile (bool): compile the per-chunk loss (the recipe's ``compile`` key).
        log_replacement (bool): log the replacement of torchtune's loss
            (off for the config check before setup, which builds it once more).

    Raises:
        ConfigError: (key ``loss``) if it is neither ours nor a torchtune
            cross-entropy we can replace, or has arguments we cannot honour
            (e.g. ``reduction``, ``label_smoothing``, class weights);
            (``loss.num_output_chunks``) neither ``auto`` nor a positive integer.
    """
    from omegaconf import OmegaConf
    from torchtune import config as tt_config
    from torchtune import utils

    component = str(cfg_loss.get("_component_"))
    not_exact = ConfigError("loss", f"{component} cannot be normalized exactly across micro-batches; use "
                            "torchtune_ext.train.loss.SummedCrossEntropyLoss or "
                            "torchtune.modules.loss.CEWithChunkedOutputLoss")
    if component not in _TORCHTUNE_CE_LOSSES:
        target = resolve_component(component)
        if isinstance(target, type) and not issubclass(target, SummedCrossEntropyLoss):
            raise not_exact  # before its arguments: ours (num_output_chunks) would not be its own
    check_output_chunks("loss.num_output_chunks", cfg_loss.get("num_output_chunks", "auto"))
    if component in _TORCHTUNE_CE_LOSSES:
        args = {k: v for k, v in OmegaConf.to_container(cfg_loss).items() if k != "_component_"}
        unsupported = sorted(set(args) - set(_TORCHTUNE_CE_LOSSES[component]))
        if unsupported:
            raise ConfigError(f"loss.{unsupported[0]}", f"is not supported with {component}, which runs as "
                              f"torchtune_ext.train.loss.SummedCrossEntropyLoss (per-token cross-entropy summed and "
                              f"divided once by the step's token count); it takes "
                              f"{' and '.join(_TORCHTUNE_CE_LOSSES[component])}")
        if log_replacement:
            utils.get_logger().info(  # torchtune's logger: the recipes' INFO lines are shown
                "loss: %s is computed as torchtune_ext.train.loss.SummedCrossEntropyLoss(%s): summed per token and "
                "divided once by the optimizer step's trainable tokens (the same mean per token, exact under "
                "gradient accumulation)", component, ", ".join(f"{k}={v}" for k, v in args.items()))
        loss_fn = SummedCrossEntropyLoss(**args)
    else:
        loss_fn = tt_config.instantiate(cfg_loss)
    if not isinstance(loss_fn, SummedCrossEntropyLoss):
        raise not_exact
    if compile:
        loss_fn.compile_chunk()
    return loss_fn
