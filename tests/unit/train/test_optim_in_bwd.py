"""optimizer_in_bwd: the update made in each parameter's gradient hook equals the normal step."""

import pytest
import torch

from tests.support.helpers import clone, instruct_samples, rel_diff, tiny_lora_model, tiny_model, windows
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.memory import MemoryGuard
from torchtune_ext.train.optim_in_bwd import OptimizerInBackward
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
# Prompt-masked samples of very different lengths: the step normalization matters.
SAMPLES = instruct_samples([3, 10, 0, 6, 2, 8, 5, 1, 7, 4, 9, 2], [12, 2, 20, 5, 9, 1, 14, 3, 6, 11, 2, 8])


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def run(model, optimizer, steps, backward="once_per_step", loss_projects=False, memory_guard=None):
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1)
    if loss_projects:  # as the recipes: the loss applies the (tied) output projection, recomputed in backward
        loss_fn.take_output_projection(model)
    results = []
    for window in steps:
        results.append(train_step(model, optimizer, loss_fn, window, device=CPU,
                                  backward=backward, memory_guard=memory_guard))
    return results


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_optimizer_in_backward_equals_normal_step(kind):
    build = tiny_model if kind == "full" else tiny_lora_model
    base = build()
    steps = windows(SAMPLES, batch_size=4, grad_accum=1)  # one micro-batch per step: 3 steps
    ref_model, bwd_model = clone(base), clone(base)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    ref = run(ref_model, adamw(trainable(ref_model)), steps)
    optimizer = OptimizerInBackward(trainable(bwd_model), adamw)
    got = run(bwd_model, optimizer, steps)
    for r, g in zip(ref, got):
        assert g.loss == pytest.approx(r.loss, rel=1e-6) and g.num_tokens == r.num_tokens
        assert g.grad_norm == pytest.approx(r.grad_norm, rel=1e-9)  # hooks sum the same squares in another order
    for (name, p), q in zip(ref_model.named_parameters(), bwd_model.parameters()):
        assert rel_diff(q.detach(), p.detach()) <= 1e-6, name
    assert all(p.grad is None for p in bwd_model.parameters())  # updated and freed in backward


@pytest.mark.parametrize("loss_projects", [False, True], ids=["model_logits", "loss_projects"])
def test_several_micro_batches_get_one_backward(loss_projects):
    """A token budget can split a step into micro-batches even at gradient_accumulation_steps=1:
    the in-backward path backpropagates them together, so each hook sees the whole step's gradient
    (also when the loss applies the tied output projection and recomputes it in that backward)."""
    base = tiny_model()
    steps = windows(SAMPLES, batch_size=3, grad_accum=2)  # 2 micro-batches per step
    ref_model, bwd_model = clone(base), clone(base)
    ref = run(ref_model, adamw(list(ref_model.parameters())), steps, backward="per_micro_batch",
              loss_projects=loss_projects)
    optimizer = OptimizerInBackward(bwd_model.parameters(), adamw)
    # a memory guard that finds no memory for once per step (the recipes always pass one) is not
    # followed either: a backward per micro-batch would update with the first micro-batch's gradient
    guard = MemoryGuard(bwd_model, CPU, optimizer, available=lambda _device: 0)
    got = run(bwd_model, optimizer, steps, backward="per_micro_batch", loss_projects=loss_projects,
              memory_guard=guard)
    assert [g.loss for g in got] == pytest.approx([r.loss for r in ref], rel=1e-6)
    for p, q in zip(ref_model.parameters(), bwd_model.parameters()):
        assert rel_diff(q.detach(), p.detach()) <= 1e-6


def test_lr_scheduler_reaches_every_parameter():
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    model = tiny_model()
    optimizer = OptimizerInBackward(model.parameters(), adamw)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=10)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    lrs = [g["lr"] for opt in optimizer.optimizers for g in opt.param_groups]
    assert len(lrs) == len(list(model.parameters())) and lrs == pytest.approx([1e-2 * 2 / 4] * len(lrs))


def test_state_dict_resumes_exactly():
    base = tiny_model()
    steps = windows(SAMPLES, batch_size=4, grad_accum=1)
    straight = clone(base)
    run(straight, OptimizerInBackward(straight.parameters(), adamw), steps)

    first = clone(base)
    optimizer = OptimizerInBackward(first.parameters(), adamw)
    run(first, optimizer, steps[:2])
    saved_state, saved_weights = optimizer.state_dict(), {k: v.clone() for k, v in first.state_dict().items()}
    assert sorted(saved_state["state"]) == list(range(len(list(first.parameters()))))

    resumed = clone(base)
    resumed.load_state_dict(saved_weights)
    optimizer = OptimizerInBackward(resumed.parameters(), adamw)
    optimizer.load_state_dict(saved_state)
    run(resumed, optimizer, steps[2:])
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_non_finite_gradient_stops_the_run():
    from torchtune_ext.errors import NonFiniteError

    model = tiny_model()
    optimizer = OptimizerInBackward(model.parameters(), adamw)
    with torch.no_grad():
        model.norm.scale.fill_(float("inf"))
    with pytest.raises(NonFiniteError):
        run(model, optimizer, windows(SAMPLES[:4], batch_size=4, grad_accum=1))
