"""Sum-reduced, shifted, chunked cross-entropy."""

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
    got = loss_fn(list(logits.chunk(chunks, dim=1)), labels)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_all_ignored_is_zero_not_nan():
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=2, ignore_index=IGNORE)
    logits = torch.randn(2, 4, 5, requires_grad=True)
    out = loss_fn(list(logits.chunk(2, dim=1)), torch.full((2, 4), IGNORE))
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bf16_logits_are_upcast():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 6))
    out = SummedCrossEntropyLoss(1, IGNORE)(logits, labels)
    ref = F.cross_entropy(logits.float().reshape(-1, 11), labels.reshape(-1), reduction="sum")
    assert out.dtype == torch.float32 and out.item() == pytest.approx(ref.item(), rel=1e-6)


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="positions"):
        SummedCrossEntropyLoss(1, IGNORE)(torch.randn(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))


def test_global_sum_single_process_is_identity_copy():
    t = torch.tensor(3.0)
    s = global_sum(t)
    assert s.item() == 3.0 and s is not t
