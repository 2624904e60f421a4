"""Exact accounting with LoRA: the shared step loop on a tiny LoRA model.

The recipe trains adapters through ``torchtune_ext.train.step.train_step`` like the
full fine-tune does; these tests check that splitting a step into
micro-batches changes nothing for the adapters either, and that the frozen
base weights never move.
"""

import pytest
import torch

from tests.support.helpers import (
    backward_mode,
    clone,
    instruct_samples,
    rel_diff,
    text_samples,
    tiny_lora_model,
    windows,
)
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import forward_backward, train_step

CPU = torch.device("cpu")
TOL = 1e-5
IGNORE = -100

DATASETS = {
    # text completion: every label trainable, varied lengths
    "text": lambda: text_samples([6, 21, 3, 28, 10, 17, 12, 5, 25, 14, 8, 19], seed=3),
    # instruct: masked prompts of varied length
    "instruct": lambda: instruct_samples([9, 2, 18, 7, 14, 3, 11, 24, 5, 13, 8, 4],
                                         [5, 19, 3, 12, 2, 27, 6, 4, 15, 7, 11, 20], seed=4),
}


def adapter_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_sgd(model, step_windows, once, lr=0.5):
    """Train the trainable parameters with SGD; per-step (loss, grad_norm, tokens)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    history = []
    for i, w in enumerate(step_windows):
        r = train_step(model, opt, loss_fn, w, device=CPU, backward=backward_mode(once), step=i + 1)
        history.append((r.loss, r.grad_norm, r.num_tokens))
    return history


@pytest.mark.parametrize("data", sorted(DATASETS))
@pytest.mark.parametrize("once", [True, False], ids=["once_per_step", "per_micro_batch"])
def test_lora_batch_split_invariance(data, once):
    """Batch N, batch 1 x N accumulation, batch N/2 x 2: same losses, norms and adapters."""
    samples = DATASETS[data]()
    n = 4  # 12 samples -> 3 optimizer steps
    base = tiny_lora_model()
    frozen = {n_: p.detach().clone() for n_, p in base.named_parameters() if not p.requires_grad}
    start = adapter_state(base)
    results = {}
    for name, (bs, ga) in {"bN": (n, 1), "b1_gaN": (1, n), "bN/2_ga2": (n // 2, 2)}.items():
        model = clone(base)
        results[name] = (run_sgd(model, windows(samples, bs, ga), once), adapter_state(model))
        # the base never moves and never holds a gradient
        for k, p in model.named_parameters():
            if not p.requires_grad:
                assert torch.equal(p, frozen[k]) and p.grad is None, (name, k)
    ref_hist, ref_adapter = results["bN"]
    assert len(ref_hist) == 3
    # both LoRA factors learned something (B != 0 gives A a gradient)
    assert all(not torch.equal(ref_adapter[k], start[k]) for k in start)
    for name, (hist, adapter) in results.items():
        for (l, g, t), (rl, rg, rt) in zip(hist, ref_hist):
            assert t == rt
            assert abs(l - rl) <= TOL * abs(rl), (name, l, rl)
            assert abs(g - rg) <= TOL * abs(rg), (name, g, rg)
        for k in adapter:
            assert rel_diff(adapter[k], ref_adapter[k]) <= TOL, (name, k)


def test_grad_norm_covers_only_the_adapter():
    """grad_norm is the norm over the optimizer's (adapter) parameters, and only they get gradients."""
    model = tiny_lora_model()
    (w,) = windows(text_samples([7, 12]), 2, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    model.set_num_output_chunks(1)
    forward_backward(model, loss_fn, w, device=CPU)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    model.zero_grad(set_to_none=True)
    r = train_step(model, opt, loss_fn, w, device=CPU)
    assert r.grad_norm == pytest.approx(expected, rel=1e-6)
