"""Distillation is exact under any split of a step (torchtune_ext.train.distill).

A reference computed here from whole-sample forwards of both models (no
padding, no packing, torch's own cross-entropy and KL): the mean over every
trainable next-token position of the step of ``(1 - r) * CE + r * KD``. The
library's step must give the same loss, ``ce_loss``, ``kd_loss`` and
gradient for batch N, batch 1 x N accumulation and N simulated ranks, on
padded, prompt-masked and packed data, with a short last window and a
micro-batch with nothing to learn.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torchtune.datasets import PackedDataset

from tests.support.helpers import (
    IGNORE,
    backward_mode,
    clone,
    collate,
    instruct_samples,
    text_samples,
    tiny_lora_model,
    tiny_model,
    windows,
)
from tests.support.threads import one_thread  # noqa: F401  (autouse: one CPU thread)
from torchtune_ext.data import collate_packed
from torchtune_ext.errors import ConfigError
from torchtune_ext.train.distill import DistillationObjective, KDLoss, build_kd_loss, divergence_sum
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
TOL = 1e-5


def teacher_model():
    teacher = tiny_model(seed=7, embedding_std=0.3)
    teacher.requires_grad_(False)
    return teacher.eval()


def objective_for(student, teacher, divergence="forward_kl", temperature=1.0, kd_ratio=0.5, chunks=2):
    """The recipes' wiring: the CE loss owns the student's projection, a second one the teacher's."""
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=chunks, ignore_index=IGNORE)
    loss_fn.take_output_projection(student)
    head = SummedCrossEntropyLoss(ignore_index=IGNORE)
    head.take_output_projection(teacher)
    return DistillationObjective(loss_fn, teacher, head.project, KDLoss(divergence, temperature), kd_ratio)


def reference_kd(student_logits, teacher_logits, divergence, t):
    """Sum over rows, written with torch's kl_div and probabilities (not the library's formula)."""
    s = F.log_softmax(student_logits / t, dim=-1)
    q = F.log_softmax(teacher_logits / t, dim=-1)
    if divergence == "forward_kl":
        kd = F.kl_div(s, q, log_target=True, reduction="sum")
    elif divergence == "reverse_kl":
        kd = F.kl_div(q, s, log_target=True, reduction="sum")
    else:
        m = (s.exp() + q.exp()) / 2
        kd = 0.5 * (F.kl_div(m.log(), q, log_target=True, reduction="sum")
                    + F.kl_div(m.log(), s, log_target=True, reduction="sum"))
    return kd * t * t


def reference(student, teacher, documents, divergence="forward_kl", temperature=1.0, kd_ratio=0.5):
    """(loss, ce_loss, kd_loss, grad norm, count) of one step over ``documents``, each forwarded alone."""
    student.zero_grad(set_to_none=True)
    ce = kd = 0.0
    count = 0
    for doc in documents:
        tokens = torch.tensor([doc["tokens"]])
        labels = torch.tensor(doc["labels"])[1:]
        keep = labels != IGNORE
        if not keep.any():
            continue
        s_logits = student(tokens)[0, :-1][keep]
        with torch.no_grad():
            t_logits = teacher(tokens)[0, :-1][keep]
        ce = ce + F.cross_entropy(s_logits, labels[keep], reduction="sum")
        kd = kd + reference_kd(s_logits, t_logits, divergence, temperature)
        count += int(keep.sum())
    loss = ((1 - kd_ratio) * ce + kd_ratio * kd) / count
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in student.parameters() if p.grad is not None))
    student.zero_grad(set_to_none=True)
    return loss.item(), ce.item() / count, kd.item() / count, norm.item(), count


def library_step(student, teacher, micro_batches, once=True, **kd):
    objective = objective_for(student, teacher, **kd)
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.0)
    r = train_step(student, opt, objective, micro_batches, device=CPU, backward=backward_mode(once))
    return r.loss, r.metrics["ce_loss"], r.metrics["kd_loss"], r.grad_norm, r.num_tokens


def simulated_ranks(student, teacher, rank_micro_batches, **kd):
    """N data-parallel ranks in one process: each rank's local sums over the GLOBAL count, gradients summed
    (what FSDP2 with a divide factor of 1 does)."""
    objective = objective_for(student, teacher, **kd)
    prepared = [[objective.prepare(mb, CPU) for mb in rank] for rank in rank_micro_batches]
    count = sum(p.count for rank in prepared for p in rank)
    student.zero_grad(set_to_none=True)
    totals = torch.zeros(3, dtype=torch.float64)
    for rank in prepared:
        for p in rank:
            sums = objective(student, p)
            (sums.loss / count).backward()
            totals += torch.tensor([sums.loss.item(), sums.metrics["ce_loss"].item(), sums.metrics["kd_loss"].item()],
                                   dtype=torch.float64)
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in student.parameters() if p.grad is not None))
    student.zero_grad(set_to_none=True)
    return (*(totals / count).tolist(), norm.item(), count)


def assert_same(got, ref):
    names = ("loss", "ce_loss", "kd_loss", "grad_norm")
    for name, a, b in zip(names, got[:4], ref[:4]):
        assert math.isfinite(a), name
        assert abs(a - b) <= TOL * abs(b), (name, a, b)
    assert got[4] == ref[4]


DATA = {
    "padded_text": lambda: text_samples([5, 17, 2, 30, 9, 23, 11, 4]),
    # prompt-masked; the third has a one-token answer whose only label is its first token: nothing after the shift
    "prompt_masked": lambda: instruct_samples([10, 3, 20, 6, 15, 2, 8, 25], [4, 20, 1, 11, 1, 30, 7, 3]),
}


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_any_split_equals_the_reference(data, divergence):
    """batch 8 == batch 1 x 8 (backward once and per micro-batch) == 8 ranks x batch 1 == 4 x 2 == the
    reference of whole samples; a temperature of 2 on the JSD, kd_ratio 0.3."""
    samples = DATA[data]()
    teacher, student = teacher_model(), tiny_model(seed=0, embedding_std=0.3)
    kd = dict(divergence=divergence, temperature=2.0 if divergence == "jsd" else 1.0, kd_ratio=0.3)
    ref = reference(clone(student), clone(teacher), samples, **kd)
    assert ref[2] > 0.01 and ref[1] > 0.01  # both terms matter
    assert_same(library_step(clone(student), clone(teacher), [collate(samples)], **kd), ref)
    one_by_eight = [collate([s]) for s in samples]
    assert_same(library_step(clone(student), clone(teacher), one_by_eight, once=True, **kd), ref)
    assert_same(library_step(clone(student), clone(teacher), one_by_eight, once=False, **kd), ref)
    assert_same(simulated_ranks(clone(student), clone(teacher), [[mb] for mb in one_by_eight], **kd), ref)
    four_by_two = windows(samples, batch_size=2, grad_accum=4, pad_to=40)[0]
    assert_same(library_step(clone(student), clone(teacher), four_by_two, **kd), ref)


def test_packed_lora_student_equals_the_reference():
    """Documents packed into 64-token rows (no prediction across documents), a LoRA student, 2 ranks."""
    samples = DATA["prompt_masked"]()
    teacher, student = teacher_model(), tiny_lora_model(seed=0)
    packs = list(PackedDataset(samples, max_seq_len=64, padding_idx=0))
    assert 2 < len(packs) < len(samples)
    ref = reference(clone(student), clone(teacher), samples)
    assert_same(library_step(clone(student), clone(teacher), [collate_packed(packs)]), ref)
    ranks = [[collate_packed(packs[:1]), collate_packed(packs[1:2])], [collate_packed(packs[2:])]]
    assert_same(simulated_ranks(clone(student), clone(teacher), ranks), ref)


def test_short_last_window_and_a_micro_batch_with_nothing_to_learn():
    """Ten samples at batch 2 x 3: the last window is 2 micro-batches; one micro-batch has only masked labels.
    Every step equals its own reference, and the empty micro-batch adds 0 (no NaN)."""
    samples = instruct_samples([6, 9, 4, 12, 5, 7, 3, 8, 10, 2], [5, 1, 9, 4, 3, 6, 8, 2, 7, 5])
    samples[2] = {"tokens": samples[2]["tokens"], "labels": [IGNORE] * len(samples[2]["tokens"])}
    samples[3] = {"tokens": samples[3]["tokens"], "labels": [IGNORE] * len(samples[3]["tokens"])}
    teacher, student = teacher_model(), tiny_model(seed=0, embedding_std=0.3)
    steps = windows(samples, batch_size=2, grad_accum=3)
    assert [len(w) for w in steps] == [3, 2]
    for i, window in enumerate(steps):
        ref = reference(clone(student), clone(teacher), samples[6 * i:6 * i + 2 * len(window)])
        for once in (True, False):
            assert_same(library_step(clone(student), clone(teacher), window, once=once), ref)


def test_a_step_with_nothing_to_learn_is_skipped_not_nan():
    teacher, student = teacher_model(), tiny_model(seed=0)
    empty = {"tokens": [5, 6, 7], "labels": [IGNORE] * 3}
    objective = objective_for(student, teacher)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    r = train_step(student, opt, objective, [collate([empty])], device=CPU)
    assert r.skipped == "empty" and r.loss is None
    assert all(torch.equal(p, before[n]) for n, p in student.named_parameters())
    sums = objective(student, objective.prepare(collate([empty]), CPU))
    assert sums.loss.item() == 0.0 and sums.metrics["kd_loss"].item() == 0.0


def test_kd_ratio_weights_the_two_terms_and_one_is_pure_kd():
    """kd_ratio 0 is fine-tuning's CE; 1 is the divergence alone; the loss is (1 - r) * ce + r * kd."""
    samples = DATA["prompt_masked"]()
    teacher, student = teacher_model(), tiny_model(seed=0, embedding_std=0.3)
    for r in (0.0, 0.25, 1.0):
        loss, ce, kd, _, _ = library_step(clone(student), clone(teacher), [collate(samples)], kd_ratio=r)
        assert abs(loss - ((1 - r) * ce + r * kd)) <= TOL * loss
    ce_only = SummedCrossEntropyLoss(2, IGNORE)
    model = clone(student)
    ce_only.take_output_projection(model)
    plain = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), ce_only, [collate(samples)], device=CPU)
    assert abs(ce - plain.loss) <= TOL * plain.loss


def test_the_same_model_has_no_divergence():
    """Student == teacher: every divergence is 0, the loss is (1 - r) * CE."""
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    lp = torch.log_softmax(logits, -1)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        assert abs(divergence_sum(lp, lp, divergence).item()) < 1e-6
        assert divergence_sum(torch.log_softmax(torch.randn(7, 50), -1), lp, divergence).item() > 0


def test_padded_teacher_vocabulary_is_compared_on_the_real_one():
    """A teacher whose output has extra (padding) rows: the KD term uses the shared width only."""
    torch.manual_seed(0)
    student, teacher = torch.randn(5, 40), torch.randn(5, 40)
    padded = torch.cat([teacher, torch.full((5, 8), 3.0)], dim=-1)
    kd = KDLoss("forward_kl")
    assert torch.allclose(kd(student, padded), kd(student, teacher))


def test_torchtune_kd_losses_are_accepted_and_others_refused():
    from omegaconf import OmegaConf

    for name in ("ForwardKLLoss", "ForwardKLWithChunkedOutputLoss"):
        kd = build_kd_loss(OmegaConf.create({"_component_": f"torchtune.modules.loss.{name}"}), IGNORE)
        assert kd.divergence == "forward_kl" and kd.temperature == 1.0
    ours = build_kd_loss(OmegaConf.create({"_component_": "torchtune_ext.train.distill.KDLoss",
                                           "divergence": "jsd", "temperature": 2.0}), IGNORE)
    assert (ours.divergence, ours.temperature) == ("jsd", 2.0)
    with pytest.raises(ConfigError, match="kd_loss"):
        build_kd_loss(OmegaConf.create({"_component_": "torchtune.modules.loss.ReverseKLLoss"}), IGNORE)
    with pytest.raises(ConfigError, match="kd_loss.ignore_index"):
        build_kd_loss(OmegaConf.create({"_component_": "torchtune.modules.loss.ForwardKLLoss",
                                        "ignore_index": 0}), IGNORE)
    with pytest.raises(ConfigError, match="kd_loss"):
        build_kd_loss(OmegaConf.create({"_component_": "torchtune_ext.train.distill.KDLoss",
                                        "divergence": "kl"}), IGNORE)

