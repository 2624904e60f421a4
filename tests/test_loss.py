"""Sum-reduced, shifted, chunked cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import IGNORE
from torchtune_ext.accounting import count_trainable_tokens, global_sum
from torchtune_ext.loss import SummedCrossEntropyLoss, shift_labels


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3], [IGNORE, 5, IGNORE]])
    assert shift_labels(labels, IGNORE).tolist() == [[2, 3, IGNORE], [5, IGNORE, IGNORE]]
    with pytest.raises(ValueError):
        shift_labels(torch.tensor([1, 2, 3]))


def test_count_trainable_tokens():
    shifted = torch.tensor([[2, 3, IGNORE], [5, IGNORE, IGNORE]])
    assert count_trainable_tokens(shifted, IGNORE) == 3
    assert count_trainable_tokens(torch.full((2, 4), IGNORE), IGNORE) == 0


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_sum_equals_mean_times_count_reference(chunks):
    torch.manual_seed(0)
    logits = torch.randn(3, 10, 17)
    labels = torch.randint(0, 17, (3, 10))
    labels[0, :4] = IGNORE
    labels[2, 7:] = IGNORE
    expected = F.cross_entropy(logits.reshape(-1, 17), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=chunks, ignore_index=IGNORE)
    got = loss_fn(list(logits.chunk(chunks, dim=1)), labels).loss
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_all_ignored_is_zero_not_nan():
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=2, ignore_index=IGNORE)
    logits = torch.randn(2, 4, 5, requires_grad=True)
    sums = loss_fn(list(logits.chunk(2, dim=1)), torch.full((2, 4), IGNORE))
    sums.loss.backward()
    assert sums.loss.item() == 0.0
    assert {k: v.item() for k, v in sums.metrics.items()} == {"token_accuracy": 0.0, "entropy": 0.0}
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bf16_logits_are_upcast():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 6))
    out = SummedCrossEntropyLoss(1, IGNORE)(logits, labels).loss
    ref = F.cross_entropy(logits.float().reshape(-1, 11), labels.reshape(-1), reduction="sum")
    assert out.dtype == torch.float32 and out.item() == pytest.approx(ref.item(), rel=1e-6)


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="positions"):
        SummedCrossEntropyLoss(1, IGNORE)(torch.randn(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))


def test_global_sum_single_process_is_identity_copy():
    t = torch.tensor(3.0)
    s = global_sum(t)
    assert s.item() == 3.0 and s is not t


@pytest.mark.parametrize("chunks", [1, 4])
def test_token_metrics_are_sums_over_trainable_positions(chunks):
    """token_accuracy counts argmax hits and entropy sums -sum p log p, over exactly the counted positions."""
    torch.manual_seed(1)
    logits = torch.randn(2, 8, 13)
    labels = logits.argmax(-1)
    labels[0, :3] = IGNORE            # masked prompt
    labels[1, 5:] = IGNORE            # padding
    labels[0, 6] = (labels[0, 6] + 1) % 13   # one wrong prediction
    sums = SummedCrossEntropyLoss(chunks, IGNORE)(list(logits.chunk(chunks, dim=1)), labels)
    keep = labels != IGNORE
    probs = logits[keep].softmax(-1)
    assert sums.metrics["token_accuracy"].item() == keep.sum().item() - 1
    expected_entropy = -(probs * probs.log()).sum()
    assert sums.metrics["entropy"].item() == pytest.approx(expected_entropy.item(), rel=1e-5)
    # uniform logits: entropy of each position is ln(vocab)
    uniform = SummedCrossEntropyLoss(1, IGNORE)(torch.zeros(1, 4, 13), torch.zeros(1, 4, dtype=torch.long))
    assert uniform.metrics["entropy"].item() == pytest.approx(4 * math.log(13), rel=1e-6)


def test_token_metrics_can_be_turned_off():
    loss_fn = SummedCrossEntropyLoss(1, IGNORE, token_metrics=False)
    assert loss_fn.metric_names == ()
    assert loss_fn(torch.randn(1, 3, 5), torch.zeros(1, 3, dtype=torch.long)).metrics == {}


def test_shift_never_crosses_documents():
    """Inside a pack, the last position of a document predicts nothing (not the next document's first token)."""
    labels = torch.tensor([[10, 11, 12, 20, 21, IGNORE]])
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert shift_labels(labels, IGNORE).tolist() == [[11, 12, 20, 21, IGNORE, IGNORE]]
    assert shift_labels(labels, IGNORE, document_ids).tolist() == [[11, 12, IGNORE, 21, IGNORE, IGNORE]]
    with pytest.raises(ValueError, match="document_ids"):
        shift_labels(labels, IGNORE, document_ids[:, :3])


def test_torchtune_losses_become_summed():
    """torchtune's mean-reduced CE configs map to ours with the same chunking and ignore_index."""
    from omegaconf import OmegaConf

    from torchtune_ext.config import ConfigError
    from torchtune_ext.loss import build_loss

    upstream = OmegaConf.create({"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss",
                                 "num_output_chunks": 4, "ignore_index": -1})
    loss_fn = build_loss(upstream)
    assert isinstance(loss_fn, SummedCrossEntropyLoss)
    assert (loss_fn.num_output_chunks, loss_fn.ignore_index) == (4, -1)
    plain = build_loss(OmegaConf.create({"_component_": "torch.nn.CrossEntropyLoss"}))
    assert isinstance(plain, SummedCrossEntropyLoss) and plain.ignore_index == IGNORE
    with pytest.raises(ConfigError, match="loss.label_smoothing"):
        build_loss(OmegaConf.create({"_component_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1}))
    with pytest.raises(ConfigError, match="cannot be normalized exactly"):
        build_loss(OmegaConf.create({"_component_": "torch.nn.MSELoss"}))
