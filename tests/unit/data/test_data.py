"""The samples of every optimizer step: order, arrangement into micro-batches and ranks, resume."""

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.support.helpers import IGNORE
from torchtune_ext.config import ConfigError
from torchtune_ext.data import StepLoader, collate_packed, epoch_order, make_collate, masked_copy, plan_step


def flat(plan):
    return [i for rank in plan for mb in rank for i in mb]


@pytest.mark.parametrize("size", [1, 7, 12])
def test_epoch_order_is_distributed_samplers(size):
    reference = DistributedSampler(list(range(size)), num_replicas=1, rank=0, seed=7, drop_last=False)
    reference.set_epoch(3)
    assert epoch_order(size, 3, seed=7, shuffle=True) == list(reference)
    assert epoch_order(size, 3, seed=7, shuffle=False) == list(range(size))
    if size > 2:
        assert epoch_order(size, 4, seed=7, shuffle=True) != epoch_order(size, 3, seed=7, shuffle=True)


def test_default_plan_is_distributed_samplers_split():
    """Rank r takes positions r, r+W, ...; batch_size of them per micro-batch, in order."""
    assert plan_step(8, dp_world_size=1, batch_size=2) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert plan_step(8, dp_world_size=2, batch_size=2) == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    # uneven: rank 1 has one sample fewer; every rank still runs two micro-batches
    assert plan_step(3, dp_world_size=2, batch_size=1) == [[[0], [2]], [[1], []]]


CASES = list(itertools.product([1, 5, 8, 13], [1, 2, 3], [1, 2, 4]))


@pytest.mark.parametrize("num_samples,world,batch_size", CASES)
@pytest.mark.parametrize("mode", ["default", "grouped", "budget"])
def test_every_sample_once_and_same_slot_count(num_samples, world, batch_size, mode):
    lengths = [(7 * i) % 23 + 2 for i in range(num_samples)]
    kwargs = {"grouped": {"group_by_length": True}, "budget": {"max_tokens_per_micro_batch": 40}}.get(mode, {})
    plan = plan_step(num_samples, lengths, dp_world_size=world, batch_size=batch_size, **kwargs)
    assert len(plan) == world
    assert sorted(flat(plan)) == list(range(num_samples))
    assert len({len(rank) for rank in plan}) == 1  # FSDP: every rank runs the same number of micro-batches
    if mode == "budget":
        for mb in (mb for rank in plan for mb in rank if mb):
            assert len(mb) * max(lengths[i] for i in mb) <= 40
    else:
        assert all(len(mb) <= batch_size for rank in plan for mb in rank)


@pytest.mark.parametrize("num_samples,world", [(1, 1), (5, 2), (13, 3), (32, 2)])
def test_packed_plan_fills_rows_up_to_the_budget(num_samples, world):
    lengths = [(7 * i) % 23 + 2 for i in range(num_samples)]
    plan = plan_step(num_samples, lengths, dp_world_size=world, batch_size=1, max_tokens_per_micro_batch=40,
                     pack=True)
    assert sorted(flat(plan)) == list(range(num_samples))
    assert len({len(rank) for rank in plan}) == 1
    assert all(sum(lengths[i] for i in mb) <= 40 for rank in plan for mb in rank)
    padded = plan_step(num_samples, lengths, dp_world_size=world, batch_size=1, max_tokens_per_micro_batch=40)
    assert max(len(rank) for rank in plan) <= max(len(rank) for rank in padded)
    with pytest.raises(ValueError, match="pack needs max_tokens_per_micro_batch"):
        plan_step(num_samples, lengths, batch_size=1, pack=True)


def padded_positions(plan, lengths):
    return sum(len(mb) * max(lengths[i] for i in mb) for rank in plan for mb in rank if mb)


def test_grouping_cuts_padding_and_balances_ranks():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 400, (32,), generator=g).tolist()
    default = plan_step(32, lengths, dp_world_size=2, batch_size=4)
    grouped = plan_step(32, lengths, dp_world_size=2, batch_size=4, group_by_length=True)
    assert padded_positions(grouped, lengths) < 0.8 * padded_positions(default, lengths)
    # slot k holds similar lengths on both ranks: the longest of each slot differ by little
    for mb0, mb1 in zip(*grouped):
        assert abs(max(lengths[i] for i in mb0) - max(lengths[i] for i in mb1)) <= 0.2 * max(lengths)


def test_budget_balances_tokens_over_ranks():
    lengths = [300, 20, 20, 20, 20, 20, 20, 280, 10, 10]
    plan = plan_step(10, lengths, dp_world_size=2, batch_size=1, max_tokens_per_micro_batch=300)
    tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert abs(tokens[0] - tokens[1]) <= 20
    with pytest.raises(ValueError, match="301 tokens"):
        plan_step(2, [301, 5], batch_size=1, max_tokens_per_micro_batch=300)


def dataset(n, lengths=None):
    lengths = lengths or [3 + (5 * i) % 11 for i in range(n)]
    return [{"tokens": list(range(1, L + 1)), "labels": list(range(1, L + 1)), "id": i}
            for i, L in enumerate(lengths)]


def collate_ids(samples):
    batch = make_collate(False, 0, IGNORE)(samples)
    batch["ids"] = [s["id"] if s["labels"][0] != IGNORE else None for s in samples]
    return batch


def step_sets(loader_per_rank, epoch=0, start=0, steps_done=0):
    """The set of sample ids trained in each step (all ranks), and the stand-in count."""
    steps = zip(*(loader.epoch(epoch, start, steps_done) for loader in loader_per_rank))
    out = []
    for per_rank in steps:
        ids = [i for data in per_rank for mb in data.micro_batches for i in mb["ids"] if i is not None]
        assert len(ids) == len(set(ids)) == per_rank[0].num_samples
        assert len({len(d.micro_batches) for d in per_rank}) == 1
        out.append(sorted(ids))
    return out


def loaders(ds, world, **kwargs):
    return [StepLoader(ds, collate_ids, dp_rank=r, dp_world_size=world, seed=5, **kwargs) for r in range(world)]


@pytest.mark.parametrize("grouped", [False, True])
def test_elastic_step_sets(grouped):
    """1 rank x batch 4, 2 ranks x batch 2 and 1 rank x batch 1 x 4 steps train the same samples per step."""
    ds = dataset(11)
    reference = step_sets(loaders(ds, 1, batch_size=4, group_by_length=grouped))
    assert [len(s) for s in reference] == [4, 4, 3]  # the short last step is a real step
    assert sorted(i for s in reference for i in s) == list(range(11))
    assert step_sets(loaders(ds, 2, batch_size=2, group_by_length=grouped)) == reference
    assert step_sets(loaders(ds, 1, batch_size=1, gradient_accumulation_steps=4, group_by_length=grouped)) == reference
    assert step_sets(loaders(ds, 2, batch_size=1, gradient_accumulation_steps=2,
                             max_tokens_per_micro_batch=30)) == reference


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kwargs", [dict(group_by_length=True), dict(max_tokens_per_micro_batch=40),
                                    dict(max_tokens_per_micro_batch=40, pack=True)])
def test_baseline_is_the_ungrouped_padded_step(world, kwargs):
    """StepData.baseline: each rank's micro-batches as the default arrangement (torchtune's recipe) collates
    the same samples, every position a logits row, whatever arrangement runs."""
    ds = dataset(11)
    plain = [list(loader.epoch(0)) for loader in loaders(ds, world, batch_size=2, gradient_accumulation_steps=2,
                                                        group_by_length=False)]
    arranged = [list(loader.epoch(0)) for loader in loaders(ds, world, batch_size=2, gradient_accumulation_steps=2,
                                                           **kwargs)]
    for rank in range(world):
        assert len(plain[rank]) == len(arranged[rank]) > 1
        for default, other in zip(plain[rank], arranged[rank]):
            expected = [tuple(mb["tokens"].shape) for mb in default.micro_batches if any(mb["ids"])]
            for steps in (default, other):
                assert [(b.batch, b.seq_len) for b in steps.baseline] == expected
                assert all(b.trainable_rows == b.batch * b.seq_len and not b.masked for b in steps.baseline)


def test_resume_at_a_sample_position_with_other_settings():
    """Resuming at sample 6 trains samples 6.. of the same order, whatever the new batch layout."""
    ds = dataset(13)
    order = epoch_order(13, 0, seed=5, shuffle=True)
    (loader,) = loaders(ds, 1, batch_size=2, gradient_accumulation_steps=3)
    resumed = step_sets(loaders(ds, 2, batch_size=1, gradient_accumulation_steps=2), start=6)
    assert resumed == [sorted(order[6:10]), sorted(order[10:13])]
    steps = list(loader.epoch(0))
    assert [s.end_sample for s in steps] == [6, 12, 13]


def test_max_steps_per_epoch_counts_steps_done():
    ds = dataset(20)
    (loader,) = loaders(ds, 1, batch_size=2, max_steps_per_epoch=3)
    assert loader.steps_per_epoch == 3
    assert len(list(loader.epoch(0, start_sample=4, steps_done=2))) == 1
    assert loader.remaining_steps(4, 3) == 0


def test_stand_ins_add_no_token_and_fewer_samples_than_ranks_is_refused():
    ds = dataset(3)
    rank0, rank1 = [list(loader.epoch(0)) for loader in loaders(ds, 2, batch_size=1)]
    assert [len(s.micro_batches) for s in rank0] == [len(s.micro_batches) for s in rank1] == [1, 1]
    (stand_in,) = rank1[-1].micro_batches  # 3 samples over 2 ranks: rank 1 has none left in step 2
    assert stand_in["ids"] == [None] and (stand_in["labels"] == IGNORE).all()
    assert (rank0[-1].micro_batches[0]["labels"] != IGNORE).any()
    assert rank1[-1].num_real_tokens == 0
    with pytest.raises(ConfigError, match="fewer than the 4 data-parallel ranks"):
        StepLoader(ds, collate_ids, batch_size=1, dp_world_size=4)


def test_budget_longer_sample_is_a_config_error():
    ds = dataset(4, lengths=[5, 50, 5, 5])
    (loader,) = loaders(ds, 1, batch_size=4, max_tokens_per_micro_batch=20)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch.*tokenizer.max_seq_len"):
        list(loader.epoch(0))


def test_padding_statistics():
    ds = dataset(4, lengths=[2, 10, 3, 5])
    (loader,) = loaders(ds, 1, batch_size=4, shuffle=False)
    (data,) = loader.epoch(0)
    assert data.num_real_tokens == 20 and data.num_padded_positions == 40
    # what attention computes: 4 rows of 10; what the samples need: their own lengths
    assert data.padded_squared_lengths == 4 * 10 * 10 and data.real_squared_lengths == 4 + 100 + 9 + 25


def test_padding_statistics_of_packs_count_documents():
    """A pack's attention stays inside each document: its real squared lengths are the documents'."""
    pack = {"tokens": torch.tensor([1, 2, 3, 4, 5, 0]), "labels": torch.tensor([1, 2, 3, 4, 5, IGNORE]),
            "input_pos": torch.tensor([0, 1, 2, 0, 1, 0]), "seq_lens": torch.tensor([3, 2, 1])}
    (loader,) = [StepLoader([pack, pack], make_collate(True, 0, IGNORE), batch_size=2, seed=0)]
    (data,) = loader.epoch(0)
    assert (data.num_padded_positions, data.num_real_tokens) == (12, 10)
    assert (data.padded_squared_lengths, data.real_squared_lengths) == (2 * 36, 2 * (9 + 4))


@pytest.mark.parametrize("kwargs", [{"batch_size": 2, "gradient_accumulation_steps": 2},
                                    {"batch_size": 2, "gradient_accumulation_steps": 2, "group_by_length": True},
                                    {"batch_size": 1, "gradient_accumulation_steps": 3,
                                     "max_tokens_per_micro_batch": 25}])
@pytest.mark.parametrize("world", [1, 2])
def test_no_sample_dropped_or_repeated_across_epochs_and_resumes(kwargs, world):
    """Every epoch trains every sample exactly once, also when the run stops after any step and resumes
    (from the sample position saved with the checkpoint) with grouping or a token budget."""
    ds = dataset(11)
    for epoch in (0, 1):
        straight = step_sets(loaders(ds, world, **kwargs), epoch)
        assert sorted(i for step in straight for i in step) == list(range(11))
        ends = [data.end_sample for data in loaders(ds, world, **kwargs)[0].epoch(epoch)]
        for stop, end in enumerate(ends[:-1], start=1):  # stopped after step `stop`, saved at sample `end`
            resumed = step_sets(loaders(ds, world, **kwargs), epoch, start=end, steps_done=stop)
            assert straight[:stop] + resumed == straight
    assert step_sets(loaders(ds, world, **kwargs), 0) != step_sets(loaders(ds, world, **kwargs), 1)


def test_masked_copy_masks_every_label():
    base = {"tokens": [5, 6, 7], "labels": [5, 6, 7]}
    assert masked_copy(base, IGNORE) == {"tokens": [5, 6, 7], "labels": [IGNORE] * 3}
    assert base["labels"] == [5, 6, 7]
    pack = {"tokens": torch.tensor([1, 2]), "labels": torch.tensor([1, 2])}
    assert torch.equal(masked_copy(pack, IGNORE)["labels"], torch.full((2,), IGNORE))


def test_collate_packed_numbers_documents():
    pack = {"tokens": torch.tensor([1, 2, 3, 4, 5, 0]), "labels": torch.tensor([1, 2, 3, 4, 5, IGNORE]),
            "input_pos": torch.tensor([0, 1, 2, 0, 1, 2]), "seq_lens": torch.tensor([3, 2, 1])}
    batch = collate_packed([pack, pack])
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2]] * 2
    assert set(batch) == {"tokens", "labels", "input_pos", "mask", "document_ids"}
