"""Knowledge distillation as sums over trainable tokens: what a distillation step optimizes.

The step loss of a distillation run (torchtune's ``kd_ratio`` definition) is

    loss = ((1 - kd_ratio) * sum_t CE_t + kd_ratio * sum_t KD_t) / N

where ``t`` runs over the trainable positions of the whole optimizer step
(labels *after* the next-token shift, never across the documents of a pack,
every micro-batch and data-parallel rank) and ``N`` is their number. Each
micro-batch returns the two sums (:class:`DistillationObjective`); the
shared step (:mod:`torchtune_ext.train.step`) counts ``N`` before any
forward and divides once, through the same tally as fine-tuning. So the
result does not depend on how the step was split, and a micro-batch with
nothing to learn adds exactly 0 (never 0/0).

``KD_t`` is a divergence between the teacher's and the student's next-token
distributions at position ``t``, both at temperature ``T`` and scaled by
``T**2`` so that its gradient keeps its size as ``T`` changes (Hinton, Vinyals
and Dean 2015, "Distilling the knowledge in a neural network", section 2):

* ``forward_kl``: KL(p_teacher || p_student) (torchtune's ``ForwardKLLoss``;
  torchtune logs the cross-entropy ``-sum_v p_T log p_S``, which exceeds this by
  the teacher's entropy and has the same gradient);
* ``reverse_kl``: KL(p_student || p_teacher), mode-seeking;
* ``jsd``: the Jensen-Shannon divergence, ``(KL(p_T || m) + KL(p_S || m)) / 2``
  with ``m = (p_T + p_S) / 2`` (the generalized JSD of Agarwal et al. 2024,
  arXiv 2306.13649, at beta = 0.5).

On-policy distillation (``on_policy_ratio`` > 0, :mod:`torchtune_ext.train.on_policy`): a
share of the step's samples is completed by the student itself before any
forward; their generated tokens are the trainable tokens of those samples,
counted in ``N`` like any other, and each contributes ``CE_t = 0`` (the
student's own sample is no target) and ``KD_t = KL(p_student || p_teacher)``
at temperature 1 (the reverse KL of the student's policy, the on-policy
divergence of Agarwal et al. 2024), whatever ``kd_loss`` says for the
offline tokens. So ``loss = (1 - kd_ratio) * ce_loss + kd_ratio * kd_loss``
still holds exactly; with ``kd_ratio`` 1 a generated token weighs as much as
an offline one.

Memory: both models return hidden states; the output projections run here on
the trainable rows only, in chunks of rows (the SFT loss's technique,
:class:`torchtune_ext.train.loss.SummedCrossEntropyLoss`), so a chunk's
``[rows, vocab]`` logits of either model are the largest vocabulary-wide
tensors alive. When the graph must wait for a later backward
(``recompute_output``), each chunk keeps only its hidden rows and is
recomputed in backward, the teacher's projection included (under no_grad).
"""

import logging
import time
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtune_ext.errors import ConfigError
from torchtune_ext.train import accounting
from torchtune_ext.train.loss import SummedCrossEntropyLoss, TokenSums, rows_per_output_chunk
from torchtune_ext.train.objective import Prepared, prepare_micro_batch
from torchtune_ext.train.on_policy import OnPolicySettings, complete_micro_batch

log = logging.getLogger(__name__)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")

# The metric sums a distillation forward returns besides ``loss`` (each divided by the step's count: means).
KD_METRICS: Tuple[str, ...] = ("ce_loss", "kd_loss")


def divergence_sum(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, divergence: str) -> torch.Tensor:
    """The divergence of each row, summed over rows (formulas in the module docstring).

    Args:
        student_log_probs: ``[rows, vocab]`` fp32 log-softmax of the student (with its graph).
        teacher_log_probs: ``[rows, vocab]`` fp32 log-softmax of the teacher (no graph).
        divergence: one of :data:`DIVERGENCES`.

    Returns:
        fp32 scalar in nats; 0 for zero rows.

    Raises:
        ValueError: an unknown ``divergence``.
    """
    s, t = student_log_probs, teacher_log_probs
    if divergence == "forward_kl":
        per_entry = t.exp() * (t - s)
    elif divergence == "reverse_kl":
        per_entry = s.exp() * (s - t)
    elif divergence == "jsd":
        mixture = torch.logsumexp(torch.stack([s, t]), dim=0) - torch.log(torch.tensor(2.0, device=s.device))
        per_entry = 0.5 * (t.exp() * (t - mixture) + s.exp() * (s - mixture))
    else:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
    return per_entry.sum(dtype=torch.float32)


class KDLoss:
    """The ``kd_loss`` component: which divergence, at which temperature (see the module docstring).

    Args:
        divergence (str): ``forward_kl`` (default), ``reverse_kl`` or ``jsd``.
        temperature (float): > 0; both distributions are softened by it and the term is scaled by its square.

    Raises:
        ValueError: another divergence, or a temperature <= 0.
    """

    def __init__(self, divergence: str = "forward_kl", temperature: float = 1.0):
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        self.divergence, self.temperature = divergence, float(temperature)

    def __call__(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 student_log_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``T**2 * sum_rows D(teacher, student)`` of ``[rows, vocab]`` logits; the wider vocabulary is cut to the
        narrower (padding rows of an embedding that no token id reaches). ``student_log_probs``: the student's
        fp32 log-softmax at temperature 1 if already computed (reused when it is the one needed)."""
        width = min(student_logits.size(-1), teacher_logits.size(-1))
        t = self.temperature
        if student_log_probs is not None and t == 1.0 and width == student_logits.size(-1):
            student = student_log_probs  # one vocabulary-wide log-softmax less per chunk
        else:
            student = torch.log_softmax(student_logits[:, :width].float() / t, dim=-1)
        teacher = torch.log_softmax(teacher_logits[:, :width].float() / t, dim=-1)
        return divergence_sum(student, teacher, self.divergence) * (t * t)


# torchtune's KD losses (mean-reduced forward KL as a cross-entropy) and the arguments they take; a config naming
# one gets KDLoss("forward_kl"): the chunks come from `loss`, ignore_index must be the loss's.
_TORCHTUNE_KD_LOSSES = {
    "torchtune.modules.loss.ForwardKLLoss": ("ignore_index",),
    "torchtune.modules.loss.ForwardKLWithChunkedOutputLoss": ("num_output_chunks", "ignore_index"),
    "torchtune.modules.loss.kd_losses.ForwardKLLoss": ("ignore_index",),
    "torchtune.modules.loss.kd_losses.ForwardKLWithChunkedOutputLoss": ("num_output_chunks", "ignore_index"),
}


def build_kd_loss(cfg_kd_loss: Any, ignore_index: int, log_replacement: bool = True) -> KDLoss:
    """Instantiate the ``kd_loss`` config as a :class:`KDLoss`.

    torchtune's ``ForwardKLLoss`` and ``ForwardKLWithChunkedOutputLoss`` become
    ``KDLoss("forward_kl")`` (their ``num_output_chunks`` is the ``loss``'s
    business here: one chunking serves both terms), logged once.

    Raises:
        ConfigError: (key ``kd_loss``) neither ours nor torchtune's forward KL, or
            bad arguments; (``kd_loss.ignore_index``) another value than ``loss``'s.
    """
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    component = str(cfg_kd_loss.get("_component_"))
    args = {k: v for k, v in OmegaConf.to_container(cfg_kd_loss).items() if k != "_component_"}
    if component in _TORCHTUNE_KD_LOSSES:
        unsupported = sorted(set(args) - set(_TORCHTUNE_KD_LOSSES[component]))
        if unsupported:
            raise ConfigError(f"kd_loss.{unsupported[0]}", f"is not an argument of {component}")
        if args.get("ignore_index", ignore_index) != ignore_index:
            raise ConfigError("kd_loss.ignore_index", f"must equal loss.ignore_index ({ignore_index}): both terms "
                              "sum over the same trainable tokens")
        if log_replacement:
            log.info("kd_loss: %s is computed as torchtune_ext.train.distill.KDLoss(divergence=forward_kl): the "
                     "KL summed per token and divided once by the optimizer step's trainable tokens", component)
        return KDLoss("forward_kl")
    try:
        kd = tt_config.instantiate(cfg_kd_loss)
    except ValueError as err:
        raise ConfigError("kd_loss", str(err)) from None
    if not isinstance(kd, KDLoss):
        raise ConfigError("kd_loss", f"{component} cannot be normalized exactly across micro-batches; use "
                          "torchtune_ext.train.distill.KDLoss or torchtune.modules.loss.ForwardKLWithChunkedOutputLoss")
    return kd


class DistillationObjective:
    """Cross-entropy and a divergence from a frozen teacher, summed over trainable tokens: the unit is a token.

    An :class:`~torchtune_ext.train.objective.Objective`: :meth:`prepare` shifts and
    counts exactly as fine-tuning does; :meth:`__call__` runs the teacher under
    ``torch.no_grad`` on the same inputs, then the student, and returns
    ``loss = (1 - kd_ratio) * CE + kd_ratio * KD`` with ``ce_loss`` and
    ``kd_loss`` as metric sums (all over the micro-batch's trainable tokens).

    Args:
        loss_fn: the run's sum-reduced CE loss, owning the student's output
            projection (:meth:`SummedCrossEntropyLoss.take_output_projection`)
            before the first forward; its ``num_output_chunks`` and
            ``ignore_index`` apply to both terms.
        teacher: the frozen teacher, returning final hidden states ``[batch,
            seq_len, hidden_T]`` (:func:`torchtune_ext.model.teacher.teacher_head`).
        teacher_project: ``[rows, hidden_T]`` -> ``[rows, vocab_T]`` teacher logits.
        kd_loss: the divergence and temperature.
        kd_ratio: weight of the KD term, in [0, 1].
        on_policy: on-policy settings (None or a ratio of 0: offline, as if absent).
        student: the student, which generates on-policy completions (required when ``on_policy.ratio`` > 0).

    Attributes:
        teacher_seconds (float): wall time of the teacher's forwards so far
            (CUDA synchronized), for the step record.
        generated_tokens (int), generation_seconds (float): the student's
            completions so far (on-policy only), for the step record.

    Raises:
        ValueError: ``kd_ratio`` outside [0, 1]; on-policy without a student.
    """

    unit = "tokens"
    metric_names = KD_METRICS

    def __init__(self, loss_fn: SummedCrossEntropyLoss, teacher: nn.Module,
                 teacher_project: Callable[[torch.Tensor], torch.Tensor], kd_loss: KDLoss, kd_ratio: float,
                 on_policy: Optional[OnPolicySettings] = None, student: Optional[nn.Module] = None):
        if not 0.0 <= float(kd_ratio) <= 1.0:
            raise ValueError(f"kd_ratio must be in [0, 1], got {kd_ratio!r}")
        self.loss_fn, self.teacher, self.teacher_project = loss_fn, teacher, teacher_project
        self.kd_loss, self.kd_ratio = kd_loss, float(kd_ratio)
        self.on_policy = on_policy if on_policy is not None and on_policy.ratio > 0 else None
        if self.on_policy is not None and student is None:
            raise ValueError("on-policy distillation needs the student, which generates")
        self.student = student
        self.reverse_kl = KDLoss("reverse_kl")  # the divergence of a generated token
        self.teacher_seconds = 0.0
        self.generated_tokens, self.generation_seconds = 0, 0.0
        self._step: Optional[int] = None  # the training step being prepared; None: validation (offline)

    @property
    def ignore_index(self) -> int:
        return self.loss_fn.ignore_index

    def begin_step(self, step: int) -> None:
        """The loop starts training step ``step`` (1-based): its micro-batches get on-policy completions
        (seeded by it) until :meth:`step_metrics` ends it; validation's stay offline."""
        self._step = int(step)

    def prepare(self, micro_batch: dict, device: torch.device) -> Prepared:
        """Shift and count as fine-tuning does; in a training step with on-policy distillation, first replace
        the chosen samples by their prompt and the student's completion (``extra["generated"]``: the
        ``[batch, seq_len]`` bool mask of the shifted positions whose label is a generated token)."""
        generated = None
        if self.on_policy is not None and self._step is not None:
            start = time.perf_counter()
            micro_batch, generated, num_generated = complete_micro_batch(
                self.student, self.loss_fn.project, micro_batch, self.on_policy, self._step, self.ignore_index)
            self.generation_seconds += time.perf_counter() - start
            self.generated_tokens += num_generated
        inputs, labels = prepare_micro_batch(micro_batch, device, self.ignore_index)
        count = accounting.count_trainable_tokens(labels, self.ignore_index)  # the tensor the sums run over
        if generated is None:
            return Prepared(inputs, labels, count, count)
        return Prepared(inputs, labels, count, count, extra={"generated": generated.to(device)})

    def step_metrics(self) -> dict:
        """``{"teacher_seconds": ...}``: the teacher's forward time since the last call (the loop calls it
        before and after each optimizer step; the step record logs it); with on-policy distillation also
        ``generated_tokens`` (this rank's) and ``generation_seconds``. Ends the step :meth:`begin_step` began."""
        seconds, self.teacher_seconds = self.teacher_seconds, 0.0
        self._step = None
        if self.on_policy is None:
            return {"teacher_seconds": seconds}
        record = {"teacher_seconds": seconds, "generated_tokens": self.generated_tokens,
                  "generation_seconds": self.generation_seconds}
        self.generated_tokens, self.generation_seconds = 0, 0.0
        return record

    def teacher_hidden(self, tokens: torch.Tensor, **inputs) -> torch.Tensor:
        """The teacher's final hidden states under ``torch.no_grad`` (timed in :attr:`teacher_seconds`)."""
        start = time.perf_counter()
        with torch.no_grad():
            hidden = self.teacher(tokens, **inputs)
        if hidden.device.type == "cuda":
            torch.cuda.synchronize(hidden.device)
        self.teacher_seconds += time.perf_counter() - start
        return hidden

    def __call__(self, model: nn.Module, prepared: Prepared, *, recompute_output: bool = False) -> TokenSums:
        inputs = dict(prepared.inputs)
        tokens = inputs.pop("tokens")
        teacher_hidden = self.teacher_hidden(tokens, **inputs)
        return self.sums(model(tokens, **inputs), teacher_hidden, prepared.labels, recompute_output,
                         generated=prepared.extra.get("generated"))

    def _chunk(self, student_rows: torch.Tensor, teacher_rows: torch.Tensor, targets: torch.Tensor,
               generated: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[ce_sum, kd_sum]`` of one chunk of rows (fp32, with the student's graph); ``generated``: ``[rows]``
        bool, the rows whose target the student generated (no CE, reverse KL at temperature 1)."""
        logits = self.loss_fn.project(student_rows)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        with torch.no_grad():
            teacher_logits = self.teacher_project(teacher_rows)
        if generated is None:
            ce = -log_probs[torch.arange(targets.numel(), device=targets.device), targets].sum(dtype=torch.float32)
            return torch.stack([ce, self.kd_loss(logits, teacher_logits, log_probs)])
        offline = ~generated
        picked = log_probs[torch.arange(targets.numel(), device=targets.device), targets]
        ce = -picked[offline].sum(dtype=torch.float32)
        kd = (self.kd_loss(logits[offline], teacher_logits[offline], log_probs[offline])
              + self.reverse_kl(logits[generated], teacher_logits[generated], log_probs[generated]))
        return torch.stack([ce, kd])

    def sums(self, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, shifted_labels: torch.Tensor,
             recompute_output: bool = False, generated: Optional[torch.Tensor] = None) -> TokenSums:
        """The sums of one micro-batch from both models' hidden states.

        Args:
            student_hidden: ``[batch, seq_len, hidden_S]`` (with its graph).
            teacher_hidden: ``[batch, seq_len, hidden_T]`` (no graph).
            shifted_labels: ``[batch, seq_len]``, ``ignore_index`` where nothing is learnt.
            recompute_output: keep each chunk's hidden rows, not its log-probabilities, for backward.
            generated: ``[batch, seq_len]`` bool, the positions whose label the student generated
                (on-policy; see the module docstring); None: all offline.

        Returns:
            :class:`TokenSums`: ``loss`` (graph), ``ce_loss`` and ``kd_loss`` (detached); all
            exactly 0 with no trainable position, ``loss`` still reaching every trainable parameter.
        """
        trainable = shifted_labels != self.ignore_index
        student_rows, teacher_rows = student_hidden[trainable], teacher_hidden[trainable]
        targets = shifted_labels[trainable]
        flags = None if generated is None else generated[trainable]
        vocab = max(self.loss_fn.vocab_size or 0, 1) if self.loss_fn.owns_output_projection else None
        size = rows_per_output_chunk(self.loss_fn.num_output_chunks, targets.numel(), vocab)
        checkpointed = recompute_output and torch.is_grad_enabled()
        totals = torch.zeros(2, dtype=torch.float32, device=shifted_labels.device)
        # An empty micro-batch still gives one empty chunk: a zero loss connected to the student's parameters.
        chunks = zip(student_rows.split(size), teacher_rows.split(size), targets.split(size),
                     [None] * len(targets.split(size)) if generated is None else flags.split(size))
        for s_rows, t_rows, ids, gen in chunks:
            if checkpointed:
                totals = totals + checkpoint(self._chunk, s_rows, t_rows, ids, gen, use_reentrant=False,
                                             preserve_rng_state=True)
            else:
                totals = totals + self._chunk(s_rows, t_rows, ids, gen)
        ce, kd = totals[0], totals[1]
        loss = (1.0 - self.kd_ratio) * ce + self.kd_ratio * kd
        return TokenSums(loss=loss, metrics={"ce_loss": ce.detach(), "kd_loss": kd.detach()})
