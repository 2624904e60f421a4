"""Mixture-of-experts transformers models: the router load-balancing loss, training and saving.

The router loss (``model.output_router_logits: true``) is a mean over a
micro-batch's positions of a product of two per-expert means, not a sum over
tokens: it cannot be split exactly. It is added per micro-batch, weighted by
the micro-batch's share of the step's trainable tokens, in the gradient
only; the logged loss stays the cross-entropy, which stays exact.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.support.helpers import IGNORE, instruct_samples, rel_diff, windows
from tests.support.hf_tiny import TinyFolders, build_loaded
from torchtune_ext.model.hf import HFCheckpointer
from torchtune_ext.train.loss import SummedCrossEntropyLoss, shift_labels
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
TOL = 1e-5
SAMPLES = instruct_samples([3, 0, 7, 2], [5, 9, 2, 11])
COEF = 1.0  # large enough for the router's gradient to show in the grad norm


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return TinyFolders(tmp_path_factory.mktemp("hf_moe"))


def one_step(model, window, lr=0.0):
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return train_step(model, optimizer, loss_fn, window, device=CPU, backward="once_per_step"), loss_fn


def test_router_loss_is_off_by_default(folders):
    model = build_loaded(folders("qwen3_moe"))
    result, loss_fn = one_step(model, windows(SAMPLES, 1, 4)[0])
    assert "router_aux_loss" not in loss_fn.metric_names and "router_aux_loss" not in result.metrics
    with_router = build_loaded(folders("qwen3_moe"), output_router_logits=True, router_aux_loss_coef=COEF)
    on, _ = one_step(with_router, windows(SAMPLES, 1, 4)[0])
    assert on.loss == pytest.approx(result.loss, rel=TOL)  # the logged loss is the cross-entropy either way
    assert abs(on.grad_norm - result.grad_norm) > 1e-3 * result.grad_norm  # the router loss reached the gradient


def test_router_loss_weighs_each_micro_batch_by_its_tokens(folders):
    """Against transformers' own forward: loss = sum of cross-entropies / N; router_aux_loss metric =
    sum over micro-batches of n_mb * aux_mb / N; gradient = that of (sum CE + coef * sum n_mb aux_mb) / N."""
    window = windows(SAMPLES, 1, 4)[0]
    model = build_loaded(folders("qwen3_moe"), output_router_logits=True, router_aux_loss_coef=COEF)
    ours, _ = one_step(model, window)

    reference = AutoModelForCausalLM.from_pretrained(str(folders("qwen3_moe")), dtype=torch.float32)
    total, cross_entropy, weighted_aux, n = 0, 0.0, 0.0, 0
    for micro_batch in window:
        out = reference(input_ids=micro_batch["tokens"], output_router_logits=True)
        shifted = shift_labels(micro_batch["labels"], IGNORE)
        keep = shifted != IGNORE
        count = int(keep.sum())
        ce = F.cross_entropy(out.logits[keep], shifted[keep], reduction="sum")
        total = total + ce + COEF * count * out.aux_loss
        cross_entropy += ce.item()
        weighted_aux += count * out.aux_loss.item()
        n += count
    (total / n).backward()
    grad_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in reference.parameters() if p.grad is not None))
    assert ours.num_tokens == n
    assert ours.loss == pytest.approx(cross_entropy / n, rel=TOL)
    assert ours.metrics["router_aux_loss"] == pytest.approx(weighted_aux / n, rel=TOL)
    assert ours.grad_norm == pytest.approx(grad_norm.item(), rel=TOL)


def test_cross_entropy_stays_exact_with_the_router_loss_on(folders):
    """batch 4 x GA 1 and batch 1 x GA 4 log the same loss with the router loss on; the router loss
    itself depends on the split (why it is not folded into the logged loss)."""
    def first_step(batch_size, grad_accum):
        model = build_loaded(folders("qwen3_moe"), output_router_logits=True, router_aux_loss_coef=COEF)
        return one_step(model, windows(SAMPLES, batch_size, grad_accum)[0])[0]

    whole, split = first_step(4, 1), first_step(1, 4)
    assert whole.num_tokens == split.num_tokens
    assert abs(whole.loss - split.loss) <= TOL * split.loss
    assert abs(whole.metrics["router_aux_loss"] - split.metrics["router_aux_loss"]) > 1e-6


@pytest.mark.parametrize("name,router", [("qwen3_moe", True), ("gpt_oss", False), ("gpt_oss", True)])
def test_moe_model_trains_and_saves(name, router, folders, tmp_path):
    """Two optimizer steps move the experts and the router; the saved folder loads in transformers with
    the trained model's logits."""
    folder = folders(name)
    kwargs = dict(output_router_logits=True, router_aux_loss_coef=COEF) if router else {}
    model = build_loaded(folder, **kwargs)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for i, window in enumerate(windows(SAMPLES, 1, 2)):
        result = train_step(model, optimizer, loss_fn, window, device=CPU, step=i + 1)
        assert result.skipped is None and torch.isfinite(torch.tensor(result.loss))
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(".experts." in k for k in moved) and any((".gate." in k or ".router." in k) for k in moved)

    checkpointer = HFCheckpointer(folder, tmp_path)
    checkpointer.load_checkpoint()
    saved = checkpointer.save_checkpoint({"model": {k: v.detach().clone() for k, v in after.items()}}, epoch=2)
    reloaded = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    tokens = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_diff(reloaded(tokens).logits, model(input_ids=tokens).logits) <= 1e-6
