"""Packing is one more way to batch: no prediction across documents, and packed = unpacked, exactly."""

import json

import pytest
import torch
from torchtune.datasets import PackedDataset

from tests.support.helpers import (
    IGNORE,
    backward_mode,
    clone,
    collate,
    instruct_samples,
    rel_diff,
    text_samples,
    tiny_lora_model,
    tiny_model,
)
from torchtune_ext.data import collate_packed
from torchtune_ext.train.accounting import count_trainable_tokens
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.objective import prepare_micro_batch
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
TOL = 1e-5


def packed_count(packs):
    _, labels = prepare_micro_batch(collate_packed(list(packs)), CPU, IGNORE)
    return count_trainable_tokens(labels, IGNORE)


def test_two_lines_of_hamlet_have_ten_predictions_not_eleven(smollm2_assets, tmp_path):
    """The issue's example: "To be or not to be" (6 predictions) and "That is the question" (4), packed."""
    from torchtune.datasets import text_completion_dataset

    from torchtune_ext.data.tokenizer import smollm2_tokenizer

    data = tmp_path / "hamlet.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ["To be or not to be", "That is the question"]))
    tokenizer = smollm2_tokenizer(str(smollm2_assets / "SmolLM2-135M-Instruct"), max_seq_len=32)
    unpacked = text_completion_dataset(tokenizer, source="json", data_files=str(data), split="train")
    assert [len(s["tokens"]) for s in unpacked] == [7, 5]  # with <|endoftext|> at the end of each
    packs = text_completion_dataset(tokenizer, source="json", data_files=str(data), split="train", packed=True)
    assert len(packs) == 1
    assert packed_count(packs) == 10
    # what a shift over the whole pack would count: the first document's <|endoftext|> "predicts" "That"
    naive = torch.nn.functional.pad(packs[0]["labels"][1:], (0, 1), value=IGNORE)
    assert count_trainable_tokens(naive, IGNORE) == 11


DOCUMENTS = {
    "text": lambda: text_samples([5, 17, 2, 30, 9, 23, 11, 4, 26, 13, 7, 19]),
    "instruct": lambda: instruct_samples([10, 3, 20, 6, 15, 2, 8, 25, 4, 12, 9, 5],
                                         [4, 20, 2, 11, 1, 30, 7, 3, 16, 5, 10, 22]),
}


def packs_of(samples, max_seq_len=64, **kwargs):
    return list(PackedDataset(samples, max_seq_len=max_seq_len, padding_idx=0, **kwargs))


def run_step(model, micro_batches, once):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss_fn = SummedCrossEntropyLoss(2, IGNORE)
    loss_fn.take_output_projection(model)
    result = train_step(model, opt, loss_fn, micro_batches, device=CPU, backward=backward_mode(once))
    return result, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("data", sorted(DOCUMENTS))
@pytest.mark.parametrize("once", [True, False], ids=["once_per_step", "per_micro_batch"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_packed_step_equals_unpacked_step(data, once, kind):
    """The same documents in one optimizer step: packed into 64-token rows, or one padded batch."""
    samples = DOCUMENTS[data]()
    base = tiny_model() if kind == "full" else tiny_lora_model()
    packs = packs_of(samples)
    assert 2 < len(packs) < len(samples)
    packed_micro_batches = [collate_packed(packs[:2]), collate_packed(packs[2:])]
    ref, ref_params = run_step(clone(base), [collate(samples)], once)
    got, params = run_step(clone(base), packed_micro_batches, once)
    assert got.num_tokens == ref.num_tokens == sum(sum(x != IGNORE for x in s["labels"][1:]) for s in samples)
    assert abs(got.loss - ref.loss) <= TOL * ref.loss
    assert abs(got.grad_norm - ref.grad_norm) <= TOL * ref.grad_norm
    for name in ("token_accuracy", "entropy"):
        assert abs(got.metrics[name] - ref.metrics[name]) <= TOL * abs(ref.metrics[name]) + 1e-7
    for key in ref_params:
        assert rel_diff(params[key], ref_params[key]) <= TOL, key


def test_document_split_across_packs_is_counted_once():
    """split_across_pack: a document cut in two loses the one prediction across the cut, none counted twice."""
    samples = text_samples([20, 30, 25])
    packs = packs_of(samples, max_seq_len=32, split_across_pack=True)
    assert len(packs) == 3
    per_document = [len(s["tokens"]) - 1 for s in samples]
    cuts = sum(1 for p in packs if p["input_pos"][0] != 0)  # a pack starting inside a document
    assert cuts == 2
    assert sum(packed_count([p]) for p in packs) == sum(per_document) - cuts
    # every label of every document is predicted at most once over all packs
    predicted = []
    for pack in packs:
        _, labels = prepare_micro_batch(collate_packed([pack]), CPU, IGNORE)
        predicted += labels[labels != IGNORE].tolist()
    all_labels = [t for s in samples for t in s["labels"][1:]]
    for token in set(predicted):
        assert predicted.count(token) <= all_labels.count(token)


@pytest.mark.parametrize("arrangement", [{}, {"group_by_length": True}, {"max_tokens_per_micro_batch": 128}],
                         ids=["default", "grouped", "budget"])
def test_packs_arranged_by_the_step_loader_equal_unpacked(arrangement):
    """Packing is one more arrangement of the same step: grouping and token budgets keep the invariant."""
    from torchtune_ext.data import StepLoader

    samples = DOCUMENTS["instruct"]()
    base = tiny_model()
    packs = packs_of(samples)
    loader = StepLoader(packs, collate_packed, batch_size=len(packs), shuffle=False, ignore_index=IGNORE,
                        **arrangement)
    (step,) = loader.epoch(0)
    if "max_tokens_per_micro_batch" in arrangement:
        assert len(step.micro_batches) == -(-len(packs) // 2)  # two 64-token packs per 128-token budget
    ref, _ = run_step(clone(base), [collate(samples)], once=True)
    got, _ = run_step(clone(base), step.micro_batches, once=True)
    assert got.num_tokens == ref.num_tokens
    assert abs(got.loss - ref.loss) <= TOL * ref.loss
    assert abs(got.grad_norm - ref.grad_norm) <= TOL * ref.grad_norm


@pytest.mark.parametrize("data", sorted(DOCUMENTS))
@pytest.mark.parametrize("once", [True, False], ids=["once_per_step", "per_micro_batch"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_pack_micro_batches_equals_the_padded_step(data, once, kind):
    """``pack_micro_batches``: the step's unpacked samples packed into rows of at most 80 tokens by the
    step loader train exactly as one padded batch of them, with no padding at all."""
    from torchtune_ext.data import StepLoader

    samples = DOCUMENTS[data]()
    base = tiny_model() if kind == "full" else tiny_lora_model()
    loader = StepLoader(samples, collate, batch_size=len(samples), shuffle=False, ignore_index=IGNORE,
                        max_tokens_per_micro_batch=80, pack=True)
    (step,) = loader.epoch(0)
    rows = [mb["tokens"].shape for mb in step.micro_batches]
    assert all(r[0] == 1 and r[1] <= 80 for r in rows) and 1 < len(rows) < len(samples)
    assert step.num_padded_positions == step.num_real_tokens == sum(len(s["tokens"]) for s in samples)
    ref, ref_params = run_step(clone(base), [collate(samples)], once)
    got, params = run_step(clone(base), step.micro_batches, once)
    assert got.num_tokens == ref.num_tokens == sum(sum(x != IGNORE for x in s["labels"][1:]) for s in samples)
    assert abs(got.loss - ref.loss) <= TOL * ref.loss
    assert abs(got.grad_norm - ref.grad_norm) <= TOL * ref.grad_norm
    for key in ref_params:
        assert rel_diff(params[key], ref_params[key]) <= TOL, key


def test_collate_as_pack_restarts_positions_and_stops_the_shift_at_each_sample():
    from torchtune_ext.data import collate_as_pack
    from torchtune_ext.train.objective import prepare_micro_batch

    samples = [{"tokens": [1, 2, 3], "labels": [IGNORE, 2, 3]}, {"tokens": [4, 5], "labels": [4, 5]}]
    batch = collate_as_pack(samples)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 5]]
    assert batch["input_pos"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["mask"][0, 3, :3].sum() == 0  # the second sample sees nothing of the first
    _, labels = prepare_micro_batch(batch, CPU, IGNORE)
    # the first sample's last token does not predict the second sample's first one
    assert labels.tolist() == [[2, 3, IGNORE, 5, IGNORE]]
