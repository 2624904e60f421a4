"""The sampler splits every sample exactly once over ranks, with label-masked top-ups."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from helpers import IGNORE
from torchtune_ext.data import PaddingSamples, ResumableSampler


def samplers(size, world_size, shuffle=True, seed=7):
    dataset = PaddingSamples([{"tokens": [i], "labels": [i]} for i in range(size)], IGNORE)
    return [ResumableSampler(dataset, num_replicas=world_size, rank=r, shuffle=shuffle, seed=seed, drop_last=False)
            for r in range(world_size)]


@pytest.mark.parametrize("size", [1, 7, 8, 12])
def test_one_rank_order_is_distributed_samplers(size):
    (sampler,) = samplers(size, 1)
    sampler.set_epoch(3)
    reference = DistributedSampler(list(range(size)), num_replicas=1, rank=0, seed=7, drop_last=False)
    reference.set_epoch(3)
    assert list(sampler) == list(reference)


@pytest.mark.parametrize("size,world_size", [(7, 2), (11, 2), (5, 4), (2, 3), (8, 2)])
def test_every_sample_once_and_equal_counts(size, world_size):
    per_rank = []
    for s in samplers(size, world_size):
        s.set_epoch(1)
        per_rank.append(list(s))
    assert len({len(order) for order in per_rank}) == 1  # same number of micro-batches everywhere
    flat = [i for order in per_rank for i in order]
    assert sorted(i for i in flat if i < size) == list(range(size))
    assert sum(i >= size for i in flat) == len(flat) - size
    # rank r's k-th sample is position r + k * world_size of the one-rank order
    (one,) = samplers(size, 1)
    one.set_epoch(1)
    order = list(one)
    for r, ranks_order in enumerate(per_rank):
        for k, i in enumerate(ranks_order):
            if i < size:
                assert i == order[r + k * world_size]


def test_set_epoch_start_skips_and_reshuffles():
    s, _ = samplers(11, 2)
    s.set_epoch(0)
    full = list(s)
    s.set_epoch(0, start=2)
    assert list(s) == full[2:] and len(s) == len(full) - 2
    s.set_epoch(1)
    assert list(s) != full  # reshuffled per epoch


def test_padding_samples_mask_every_label():
    base = [{"tokens": [5, 6, 7], "labels": [5, 6, 7]},
            {"tokens": torch.tensor([1, 2]), "labels": torch.tensor([1, 2]), "input_pos": torch.tensor([0, 1])}]
    ds = PaddingSamples(base, IGNORE)
    assert len(ds) == 2 and ds[0] is base[0]
    assert ds[2] == {"tokens": [5, 6, 7], "labels": [IGNORE] * 3}
    assert torch.equal(ds[3]["labels"], torch.full((2,), IGNORE)) and torch.equal(ds[3]["tokens"], base[1]["tokens"])
    assert base[0]["labels"] == [5, 6, 7]  # the original sample is not modified
