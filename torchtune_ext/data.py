"""Dataset and DataLoader construction shared by the recipes."""

import itertools
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from omegaconf import ListConfig
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torchtune import config as tt_config
from torchtune.data import padded_collate_packed, padded_collate_sft

from torchtune_ext.config import ConfigError
from torchtune_ext.step import micro_batch_windows


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch part-way and never repeats a sample.

    ``set_epoch(epoch, start)`` makes the next iteration skip the first
    ``start`` indices of this rank's order for ``epoch`` without loading them.

    When the dataset size is not a multiple of the number of ranks,
    ``DistributedSampler`` (``drop_last=False``) tops the order up by repeating
    its first samples, so every rank gets the same number of samples and
    therefore of micro-batches (all ranks must run the same collectives).
    Counting a repeated sample twice would make a multi-rank step differ from
    the same step on one rank. This sampler keeps the top-up positions (so
    the counts stay equal) but yields them as ``index + len(dataset)``, which
    :class:`PaddingSamples` turns into a copy of the sample whose labels are
    all ``ignore_index``: it runs forward and backward like any sample and
    adds no token and no loss. With one rank nothing is topped up and the
    order is exactly ``DistributedSampler``'s.
    """

    _start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self._start = start

    def __iter__(self):
        size = len(self.dataset)
        # position in the topped-up global order of each index this rank gets
        positions = range(self.rank, self.total_size, self.num_replicas)
        order = (index + size if position >= size else index
                 for position, index in zip(positions, super().__iter__()))
        return itertools.islice(order, self._start, None)

    def __len__(self) -> int:
        return max(super().__len__() - self._start, 0)


class PaddingSamples(Dataset):
    """A dataset plus label-masked copies of its samples at ``len(dataset) + i``.

    Index ``i < len(dataset)`` returns sample ``i`` unchanged; index
    ``len(dataset) + i`` returns sample ``i`` with every label set to
    ``ignore_index`` (a list or tensor of the same length), so it contributes
    zero trainable tokens. ``len`` is the real sample count.

    Args:
        dataset: map-style dataset whose samples are dicts with ``labels``.
        ignore_index (int): the loss's ignore index.
    """

    def __init__(self, dataset: Dataset, ignore_index: int):
        self.dataset = dataset
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        size = len(self.dataset)
        if index < size:
            return self.dataset[index]
        sample = dict(self.dataset[index - size])
        labels = sample["labels"]
        if isinstance(labels, torch.Tensor):
            sample["labels"] = torch.full_like(labels, self.ignore_index)
        else:
            sample["labels"] = [self.ignore_index] * len(labels)
        return sample


def build_dataloader(
    cfg_dataset: Any,
    tokenizer: Any,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    ignore_index: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
) -> Tuple[DataLoader, ResumableSampler]:
    """Build the micro-batch DataLoader and its sampler.

    Every sample is used once (``drop_last=False``): a short last micro-batch
    is fine because the loss is normalized by tokens, not by batch size. With
    several ranks and a dataset size that does not divide evenly, some ranks
    get label-masked top-up samples (see :class:`ResumableSampler`). The
    sampler is a ``DistributedSampler`` even on one rank, so a run with
    ``dp_world_size`` ranks and one with a single rank draw the same
    permutation for the same ``seed`` and epoch (call ``sampler.set_epoch``).

    Args:
        cfg_dataset: a dataset config (``_component_`` plus arguments, e.g.
            ``packed: true``) or a list of them, concatenated.
        tokenizer: the model tokenizer passed to the dataset builders; its
            ``pad_id`` pads the tokens of unpacked batches.
        batch_size (int): samples per micro-batch on this rank.
        ignore_index (int): label padding value (the loss's ignore_index).

    Returns:
        (DataLoader, ResumableSampler)

    Raises:
        ConfigError: if the dataset yields no sample or fewer samples than
            ``dp_world_size``, or packed and unpacked datasets are mixed.
    """
    cfgs = list(cfg_dataset) if isinstance(cfg_dataset, (list, ListConfig)) else [cfg_dataset]
    packed = {bool(c.get("packed", False)) for c in cfgs}
    if len(packed) > 1:
        raise ConfigError("dataset", "packed and unpacked datasets cannot be mixed")
    datasets = []
    for i, c in enumerate(cfgs):
        try:
            datasets.append(tt_config.instantiate(c, tokenizer))
        except Exception as err:  # the datasets library raises many types for unreadable files
            key = "dataset" if len(cfgs) == 1 else f"dataset[{i}]"
            source = c.get("data_files") or c.get("source")
            raise ConfigError(key, f"could not load '{source}': {type(err).__name__}: {err}") from err
    dataset = datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    if len(dataset) == 0:
        raise ConfigError("dataset", "the dataset yields zero samples")
    if len(dataset) < dp_world_size:
        # Top-up copies would be all a rank trains on: a run that cannot learn there.
        raise ConfigError("dataset", f"the dataset yields {len(dataset)} sample(s), fewer than the "
                          f"{dp_world_size} data-parallel ranks; use fewer processes or more data")

    collate = (
        padded_collate_packed
        if packed.pop()
        else partial(padded_collate_sft, padding_idx=tokenizer.pad_id, ignore_idx=ignore_index)
    )
    dataset = PaddingSamples(dataset, ignore_index)
    sampler = ResumableSampler(
        dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=False
    )
    # A private generator: starting an epoch's iterator draws a seed from it,
    # which would otherwise come from the global RNG and shift dropout masks
    # after a mid-epoch resume.
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=False,
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler



def epoch_windows(
    loader: DataLoader, sampler: ResumableSampler, epoch: int, steps_done: int,
    gradient_accumulation_steps: int, max_steps_per_epoch: Optional[int] = None,
) -> Iterator[List[Dict[str, Any]]]:
    """The optimizer-step windows of ``epoch`` that remain after ``steps_done``.

    Reshuffles for ``epoch`` (same order on every rank and at every world size
    for the seed), skips the samples of the first ``steps_done`` windows
    without loading them (resume), and yields windows of
    ``gradient_accumulation_steps`` micro-batches, the last possibly shorter,
    at most ``max_steps_per_epoch`` per epoch in total.
    """
    sampler.set_epoch(epoch, start=steps_done * gradient_accumulation_steps * loader.batch_size)
    remaining = None if max_steps_per_epoch is None else max_steps_per_epoch - steps_done
    return micro_batch_windows(loader, gradient_accumulation_steps, remaining)
