"""Exactness of the shared micro-batch loop (torchtune_ext.train.step) on a tiny model."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.helpers import (
    IGNORE,
    VOCAB,
    ConstantLossModel,
    backward_mode,
    clone,
    collate,
    constant_loss_sample,
    instruct_samples,
    rel_diff,
    text_samples,
    tiny_model,
    windows,
)
from torchtune_ext.errors import NonFiniteError
from torchtune_ext.model.runtime import embedding_rows_into_grad
from torchtune_ext.train.grad_norm import grad_norm_and_clip
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import StepHealth, forward_backward, train_step

CPU = torch.device("cpu")
TOL = 1e-5


def reference_step(model, samples):
    """Independent reference: per-sample forward without padding, plain CE.

    Returns the mean CE over every trainable next-token position of the
    samples, and the gradient of that mean.
    """
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for s in samples:
        tokens = torch.tensor([s["tokens"]])
        labels = torch.tensor(s["labels"])[1:]
        logits = model(tokens)[0, :-1]
        keep = labels != IGNORE
        if keep.any():
            total = total + F.cross_entropy(logits[keep], labels[keep], reduction="sum")
        count += int(keep.sum())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def attach_loss(model, chunks=1, output="loss"):
    """The loss for ``model``: applying the output projection itself (``"loss"``, as the
    recipes do) or on the logits the model returns (``"model"``)."""
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=chunks, ignore_index=IGNORE)
    if output == "loss":
        loss_fn.take_output_projection(model)
    else:
        model.set_num_output_chunks(chunks if isinstance(chunks, int) else 0)
    return loss_fn


def run_steps(model, step_windows, once, lr=0.5, chunks=1, output="loss"):
    """Train with SGD over the windows; return per-step (loss, grad_norm) and params."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = attach_loss(model, chunks, output)
    history = []
    for i, w in enumerate(step_windows):
        r = train_step(model, opt, loss_fn, w, device=CPU, backward=backward_mode(once), step=i + 1)
        history.append((r.loss, r.grad_norm, r.num_tokens))
    return history, {n: p.detach().clone() for n, p in model.named_parameters()}


DATASETS = {
    # (a) text completion, every label trainable, varied lengths
    "text": lambda: text_samples([5, 17, 2, 30, 9, 23, 11, 4, 26, 13, 7, 19]),
    # (b) instruct with masked prompts of varied length
    "instruct": lambda: instruct_samples([10, 3, 20, 6, 15, 2, 8, 25, 4, 12, 9, 5],
                                         [4, 20, 2, 11, 1, 30, 7, 3, 16, 5, 10, 22]),
}


@pytest.mark.parametrize("data", sorted(DATASETS))
@pytest.mark.parametrize("once", [True, False], ids=["once_per_step", "per_micro_batch"])
@pytest.mark.parametrize("pad_to", [0, 64], ids=["tight", "heavy_padding"])
@pytest.mark.parametrize("output", ["loss", "model"], ids=["loss_projects", "model_logits"])
def test_batch_split_invariance(data, once, pad_to, output):
    """Batch N, batch 1 x N accumulation, batch N/2 x 2: same losses, norms, params."""
    samples = DATASETS[data]()
    n = 4  # global batch; 12 samples -> 3 optimizer steps
    base = tiny_model()
    splits = {"bN": (n, 1), "b1_gaN": (1, n), "bN/2_ga2": (n // 2, 2)}
    results = {}
    for name, (bs, ga) in splits.items():
        results[name] = run_steps(clone(base), windows(samples, bs, ga, pad_to), once, output=output)
    (ref_hist, ref_params) = results["bN"]
    assert len(ref_hist) == 3
    for name, (hist, params) in results.items():
        for (l, g, t), (rl, rg, rt) in zip(hist, ref_hist):
            assert t == rt
            assert abs(l - rl) <= TOL * abs(rl), (name, l, rl)
            assert abs(g - rg) <= TOL * abs(rg), (name, g, rg)
        for k in params:
            assert rel_diff(params[k], ref_params[k]) <= TOL, (name, k)


@pytest.mark.parametrize("once", [True, False])
@pytest.mark.parametrize("chunks", [1, 8, "auto"])
@pytest.mark.parametrize("output", ["loss", "model"], ids=["loss_projects", "model_logits"])
def test_matches_independent_reference(once, chunks, output):
    """Loss and gradient equal an unpadded per-sample computation of the token mean."""
    samples = instruct_samples([3, 9, 1], [12, 2, 30])
    model = tiny_model()
    ref_loss, ref_grads = reference_step(model, samples)
    loss_fn = attach_loss(model, chunks, output)
    micro = [collate(samples[:2], pad_to=50), collate(samples[2:])]
    totals = forward_backward(model, loss_fn, micro, device=CPU, backward=backward_mode(once))
    # tokens counted after the shift: one fewer per row than label entries when all are trainable
    trainable = sum(sum(label != IGNORE for label in s["labels"][1:]) for s in samples)
    assert totals.num_tokens == totals.local_num_tokens == trainable
    assert abs(totals.mean("loss") - ref_loss) <= TOL * ref_loss
    for name, p in model.named_parameters():
        assert rel_diff(p.grad, ref_grads[name]) <= TOL, name


def test_count_is_after_shift():
    """A row whose only trainable label is the first token has nothing to predict."""
    # labels[0] is trainable but no position predicts it; labels[1:] are masked.
    micro = [{"tokens": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, IGNORE, IGNORE]])},
             collate(text_samples([6]))]
    model = tiny_model()
    loss_fn = attach_loss(model)
    # 0 from the first row, 6 - 1 from the second
    assert forward_backward(model, loss_fn, micro, device=CPU).num_tokens == 5


@pytest.mark.parametrize("batch_size,grad_accum", [(2, 1), (1, 2)])
@pytest.mark.parametrize("once", [True, False])
def test_worked_example(batch_size, grad_accum, once):
    """10 tokens at 0.1 and 100 tokens at 0.9 give (0.1*10 + 0.9*100)/110 = 0.82727."""
    model = ConstantLossModel([0.1, 0.9])
    samples = [constant_loss_sample(0, 10), constant_loss_sample(1, 100)]
    (w,) = windows(samples, batch_size, grad_accum)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = train_step(model, opt, SummedCrossEntropyLoss(1, IGNORE), w, device=CPU, backward=backward_mode(once))
    assert result.num_tokens == 110
    assert result.loss == pytest.approx((0.1 * 10 + 0.9 * 100) / 110, rel=1e-6)
    assert result.loss == pytest.approx(0.82727, abs=1e-5)
    # the mean of per-sample means would be 0.5: far from the exact value
    assert abs(result.loss - 0.5) > 0.3


def test_empty_micro_batch_adds_nothing():
    """A micro-batch with no trainable token changes neither loss nor gradient, no NaN."""
    samples = text_samples([8, 12])
    empty = {"tokens": torch.tensor([[4, 5, 6, 7]]), "labels": torch.full((1, 4), IGNORE)}
    single = {"tokens": torch.tensor([[9]]), "labels": torch.tensor([[9]])}  # one token: nothing to predict
    base = tiny_model()
    h1, p1 = run_steps(clone(base), [[collate(samples)]], once=True)
    for once in (True, False):
        h2, p2 = run_steps(clone(base), [[empty, collate(samples), single]], once=once)
        assert math.isfinite(h2[0][0]) and h2[0][2] == h1[0][2]
        assert abs(h2[0][0] - h1[0][0]) <= TOL * h1[0][0]
        for k in p1:
            assert rel_diff(p2[k], p1[k]) <= TOL


def test_empty_step_is_skipped():
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    empty = {"tokens": torch.tensor([[4, 5, 6]]), "labels": torch.full((1, 3), IGNORE)}
    r = train_step(model, opt, SummedCrossEntropyLoss(1, IGNORE), [empty, empty], device=CPU, step=7)
    assert r.skipped == "empty" and r.loss is None and r.num_tokens == 0
    assert not opt.state  # no optimizer step taken
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None


def test_nonfinite_raises_or_skips():
    model = tiny_model()
    with torch.no_grad():
        model.tok_embeddings.weight[3] = float("nan")
    micro = [{"tokens": torch.tensor([[3, 4, 5]]), "labels": torch.tensor([[3, 4, 5]])}]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = SummedCrossEntropyLoss(1, IGNORE)
    with pytest.raises(NonFiniteError, match="step 12"):
        train_step(model, opt, loss_fn, micro, device=CPU, step=12)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    r = train_step(model, opt, loss_fn, micro, device=CPU, health=StepHealth(skip_nonfinite_steps=True))
    assert r.skipped == "non-finite"
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) or torch.isnan(before[n]).any()


def test_grad_norm_is_before_clipping():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 0.0, 4.0, 0.0])
    assert grad_norm_and_clip([p], max_norm=1.0).item() == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    p.grad = torch.tensor([3.0, 0.0, 4.0, 0.0])
    assert grad_norm_and_clip([p], max_norm=None).item() == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(5.0)


def test_grad_norm_is_float64_accurate_on_large_gradients():
    torch.manual_seed(0)
    # one large gradient (as an embedding's) plus odd-sized ones that leave partial blocks
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (20_000_000, 1_000_003, 7, 0)]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
    exact = torch.cat([p.grad.double() for p in params]).norm().item()
    assert abs(grad_norm_and_clip(params, None).item() - exact) / exact < 1e-8
    # a single fp32 reduction is not good enough at this size: the blocks are what make the difference
    fp32 = torch.cat([p.grad for p in params]).norm().item()
    assert abs(fp32 - exact) / exact > 1e-6


@pytest.mark.parametrize("once", [True, False], ids=["once_per_step", "per_micro_batch"])
def test_embedding_rows_into_grad_gives_the_same_gradients_and_updates(once):
    """The tied embedding's rows go straight into .grad: same gradient and AdamW update as autograd's dense way,
    with a micro-batch that has nothing to learn among them; .grad stays one dense tensor."""

    samples = instruct_samples([10, 3, 20, 6, 15, 2], [4, 20, 2, 11, 1, 30])
    nothing = {"tokens": [7, 8, 9, 10], "labels": [IGNORE] * 4}
    step_windows = windows(samples[:2] + [nothing] + samples[2:], batch_size=1, grad_accum=7)
    step_windows += windows(samples[::-1], batch_size=2, grad_accum=3)
    default, rows = tiny_model(), tiny_model()
    assert embedding_rows_into_grad(rows, CPU)
    probe_ids = torch.tensor([[1, 2, 3]])
    assert type(rows.tok_embeddings(probe_ids).grad_fn).__name__ == "_EmbeddingRowsIntoGradBackward"
    assert type(default.tok_embeddings(probe_ids).grad_fn).__name__ == "EmbeddingBackward0"
    seen = []
    for model in (default, rows):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        loss_fn = attach_loss(model)
        grads = []
        for w in step_windows:
            forward_backward(model, loss_fn, w, device=CPU, backward=backward_mode(once))
            assert model.tok_embeddings.weight.grad.layout == torch.strided
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        seen.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (grads_d, params_d), (grads_r, params_r) = seen
    for step_d, step_r in zip(grads_d, grads_r):
        assert step_d["tok_embeddings.weight"].abs().sum() > 0
        for n in step_d:
            assert rel_diff(step_r[n], step_d[n]) <= 1e-6, n
    # After Adam updates, summation-order differences in the gradients (1 OpenMP thread sums in another order
    # than 2) are amplified where Adam divides by a tiny second moment: the project's 1e-5 bound applies.
    for n in params_d:
        assert rel_diff(params_r[n], params_d[n]) <= 1e-5, n


def test_embedding_rows_into_grad_reach_optimizer_in_backward():
    """The weight's gradient hook runs after the embedding's rows are in: the in-backward update equals the normal
    one."""
    from torchtune_ext.train.optim_in_bwd import OptimizerInBackward

    step_windows = windows(instruct_samples([3, 10, 6, 2, 8, 5], [12, 2, 5, 9, 1, 14]), batch_size=2, grad_accum=3)
    reference, rows = tiny_model(), tiny_model()
    assert embedding_rows_into_grad(rows, CPU)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    for model, opt in ((reference, adamw(reference.parameters())),
                       (rows, OptimizerInBackward(rows.parameters(), adamw))):
        loss_fn = attach_loss(model)
        for w in step_windows:
            train_step(model, opt, loss_fn, w, device=CPU)
    for (name, p), q in zip(reference.named_parameters(), rows.parameters()):
        assert rel_diff(q.detach(), p.detach()) <= 1e-6, name


def test_embedding_rows_into_grad_only_where_it_is_safe():
    """Untied, frozen, on a GPU or compiled: the embedding keeps autograd's backward. (A padding_idx is
    kept exactly: tests/unit/model/hf/test_hf_tied_embedding.py.)"""
    from torchtune_ext.model.builders import tiny_llama

    untied = tiny_llama(vocab_size=VOCAB, embed_dim=32, tie_word_embeddings=False)
    frozen = tiny_model()
    frozen.tok_embeddings.weight.requires_grad_(False)
    cases = [(untied, CPU, False), (frozen, CPU, False),
             (tiny_model(), torch.device("cuda"), False), (tiny_model(), CPU, True)]
    for model, device, compiled in cases:
        assert not embedding_rows_into_grad(model, device, compiled=compiled)
        assert type(model.tok_embeddings) is torch.nn.Embedding


def test_a_copy_of_a_model_with_embedding_rows_into_grad_trains_its_own_weight():
    """deepcopy (tests' clone) keeps working: the copy's rows go into the copy's .grad."""
    model = tiny_model()
    assert embedding_rows_into_grad(model, CPU)
    assert not embedding_rows_into_grad(model, CPU)  # once is enough
    copy = clone(model)
    loss_fn = attach_loss(copy)
    forward_backward(copy, loss_fn, windows(instruct_samples([3], [5]), 1, 1)[0], device=CPU)
    assert model.tok_embeddings.weight.grad is None
    assert copy.tok_embeddings.weight.grad.abs().sum() > 0


def test_a_skipped_first_step_advances_the_schedule_without_torchs_warning():
    """A skipped step counts on the LR schedule; torch's 'lr_scheduler.step() before optimizer.step()' warning,
    shown when the run's first step is skipped, would read as a recipe bug."""
    import warnings

    from omegaconf import OmegaConf

    from torchtune_ext.train.step import build_lr_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    cfg = OmegaConf.create({"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                            "num_warmup_steps": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = build_lr_scheduler(cfg, optimizer, num_training_steps=10)
        scheduler.step()  # step 1 was skipped: no optimizer.step()
        warnings.warn("another UserWarning", UserWarning)  # still shown
    assert [str(w.message) for w in caught] == ["another UserWarning"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # the warmup went on
