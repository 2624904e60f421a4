"""The samples of every optimizer step, at any world size.

An epoch is a permutation of the dataset's sample indices, the same on every
rank and at every world size for a seed (``DistributedSampler``'s). Optimizer
step ``k`` of an epoch trains on the next ``global_batch_size`` samples of
that order, where

    global_batch_size = dp_world_size * batch_size * gradient_accumulation_steps

and the last step of an epoch takes what is left (a real, shorter step;
nothing carries into the next epoch). The position in an epoch is counted in
samples, so a run resumes at the right sample whatever batch size,
accumulation or world size it resumes with.

How one step's samples are arranged into micro-batches and spread over ranks
does not change the step's loss or gradient: both are sums over the step's
trainable tokens divided by their global count (:mod:`torchtune_ext.train.accounting`);
only the floating-point summation order changes. :func:`plan_step` uses that
freedom: ``group_by_length`` puts samples of similar length into the same
micro-batch (less padding) and gives every rank's k-th micro-batch a similar
size (ranks wait less for each other at FSDP's collectives);
``max_tokens_per_micro_batch`` fills micro-batches up to a token budget
instead of a sample count, so memory per micro-batch is bounded whatever the
lengths. Every rank runs the same number of micro-batches per step (FSDP's
collectives must match); a rank with nothing left gets a label-masked copy of
a sample, which adds no token and no loss.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils.data import Dataset
from torchtune.config._utils import _get_component_from_path

from torchtune_ext.data.check import model_vocabulary
from torchtune_ext.data.datasets import Sample, build_dataset, collate_as_pack, make_collate, masked_copy
from torchtune_ext.errors import ConfigError
from torchtune_ext.train.memory import MicroBatchShape

# plan[rank][micro_batch] -> sample indices; an empty micro-batch is a label-masked stand-in
StepPlan = List[List[List[int]]]

def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> List[int]:
    """The epoch's sample order: ``DistributedSampler``'s permutation for ``seed + epoch``."""
    if not shuffle:
        return list(range(size))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()

def plan_step(
    num_samples: int,
    lengths: Optional[Sequence[int]] = None,
    *,
    dp_world_size: int = 1,
    batch_size: int,
    group_by_length: bool = False,
    max_tokens_per_micro_batch: Optional[int] = None,
    pack: bool = False,
) -> StepPlan:
    """Arrange one optimizer step's samples into micro-batches on each rank.

    Samples are referred to by their position ``0 .. num_samples - 1`` in the
    step. Every position appears exactly once in the plan; every rank gets the
    same number of micro-batches; an empty micro-batch means "a label-masked
    stand-in" (a rank with nothing left to train on in that slot).

    * Default: rank ``r`` takes positions ``r, r + W, r + 2W, ...``
      (``W = dp_world_size``) in order, ``batch_size`` per micro-batch:
      ``DistributedSampler``'s split, so one rank with batch ``N`` and ``N``
      ranks with batch 1 see the same samples.
    * ``group_by_length``: positions sorted by length, longest first; the
      k-th ``W * batch_size`` of them form every rank's k-th micro-batch,
      dealt round-robin so the ranks' micro-batches have similar lengths.
    * ``max_tokens_per_micro_batch`` (``B``): positions sorted by length,
      longest first, are dealt to the rank with the fewest tokens so far;
      each rank then fills micro-batches in that order while
      ``samples * longest <= B`` (the padded size of a micro-batch);
      ``batch_size`` no longer bounds a micro-batch. Micro-batches are
      ordered largest first on every rank, so slot ``k`` costs about the
      same everywhere.
    * ``pack`` (with a budget): a micro-batch is one row of concatenated
      samples (:func:`collate_as_pack`), so its cost is the sum of its
      lengths, not samples x longest: each rank fills its micro-batches first
      fit, longest first, while that sum stays ``<= B``.

    Args:
        num_samples: samples in the step, >= 1.
        lengths: token count of each sample (``len(sample["tokens"])``); needed
            for ``group_by_length`` and ``max_tokens_per_micro_batch``.
        dp_world_size: data-parallel ranks.
        batch_size: samples per micro-batch per rank.
        group_by_length: see above.
        max_tokens_per_micro_batch: see above; None: no budget.
        pack: see above; needs ``max_tokens_per_micro_batch``.

    Returns:
        ``plan[rank][micro_batch]``: lists of positions.

    Raises:
        ValueError: ``lengths`` missing where needed, a sample longer than
            ``max_tokens_per_micro_batch``, or ``pack`` without a budget.
    """
    if pack and not max_tokens_per_micro_batch:
        raise ValueError("plan_step: pack needs max_tokens_per_micro_batch (the length of a packed row)")
    world = dp_world_size
    if (group_by_length or max_tokens_per_micro_batch) and (lengths is None or len(lengths) != num_samples):
        raise ValueError("plan_step: grouping and token budgets need one length per sample")
    longest_first = sorted(range(num_samples), key=lambda i: (-lengths[i], i)) if lengths is not None else None
    plan: StepPlan
    if max_tokens_per_micro_batch:
        budget = max_tokens_per_micro_batch
        too_long = [i for i in range(num_samples) if lengths[i] > budget]
        if too_long:
            raise ValueError(f"a sample of {lengths[too_long[0]]} tokens does not fit in "
                             f"max_tokens_per_micro_batch={budget}")
        shares: List[List[int]] = [[] for _ in range(world)]
        loads = [0] * world
        for i in longest_first:
            rank = min(range(world), key=lambda r: (loads[r], r))
            shares[rank].append(i)
            loads[rank] += lengths[i]
        plan = []
        for share in shares:
            micro_batches: List[List[int]] = []
            if pack:
                used: List[int] = []
                for i in share:  # first fit, longest first
                    fit = next((k for k, n in enumerate(used) if n + lengths[i] <= budget), None)
                    if fit is None:
                        micro_batches.append([i])
                        used.append(lengths[i])
                    else:
                        micro_batches[fit].append(i)
                        used[fit] += lengths[i]
                micro_batches.sort(key=lambda mb: (-sum(lengths[i] for i in mb), mb[0]))
            else:
                for i in share:  # longest first: the first sample of a micro-batch sets its padded length
                    if micro_batches and (len(micro_batches[-1]) + 1) * lengths[micro_batches[-1][0]] <= budget:
                        micro_batches[-1].append(i)
                    else:
                        micro_batches.append([i])
                micro_batches.sort(key=lambda mb: (-len(mb) * lengths[mb[0]], mb[0]))
            plan.append(micro_batches)
    elif group_by_length:
        slot = world * batch_size
        plan = [[] for _ in range(world)]
        for start in range(0, num_samples, slot):
            group = longest_first[start:start + slot]
            for rank in range(world):
                plan[rank].append(group[rank::world])
    else:
        plan = []
        for rank in range(world):
            mine = list(range(rank, num_samples, world))
            plan.append([mine[i:i + batch_size] for i in range(0, len(mine), batch_size)])
    slots = max(len(micro_batches) for micro_batches in plan)
    for micro_batches in plan:
        micro_batches.extend([] for _ in range(slots - len(micro_batches)))
    return plan

@dataclass
class StepData:
    """One optimizer step's data on this rank.

    Attributes:
        micro_batches: collated micro-batches of this rank, in order.
        num_samples (int): samples in the step, all ranks.
        end_sample (int): the epoch position after this step, in samples.
        num_padded_positions (int): token positions of this rank's micro-batches
            as collated (real tokens plus padding, ``batch * seq_len`` summed),
            stand-ins for empty slots included.
        num_real_tokens (int): non-padding input tokens of this rank's samples
            (stand-ins excluded).
        last_in_epoch (bool): no step of the epoch follows this one.
        padded_squared_lengths (int): sum over this rank's collated rows of
            the padded row length squared (what attention computes, stand-ins
            included; for FLOP counts, :mod:`torchtune_ext.run.metrics.flops`).
        real_squared_lengths (int): sum over this rank's real sequences
            (samples, or the documents of a pack) of their length squared.
        baseline: this rank's micro-batches of the same samples as
            torchtune's recipe runs them (the epoch order split over ranks as
            ``DistributedSampler`` does, i.e. :func:`plan_step`'s default,
            ``batch_size`` samples padded to the longest, logits for every
            position; :class:`torchtune_ext.train.memory.MicroBatchShape`): what
            the memory guard's default limit compares a once-per-step step with
            (:class:`torchtune_ext.train.memory.MemoryGuard`).
        load_seconds (float): wall time spent reading, tokenizing and collating
            the step's samples (:meth:`StepLoader.epoch`): training waits for
            it, as the loader runs in the training process.
    """

    micro_batches: List[Dict[str, Any]]
    num_samples: int
    end_sample: int
    num_padded_positions: int
    num_real_tokens: int
    last_in_epoch: bool = False
    padded_squared_lengths: int = 0
    real_squared_lengths: int = 0
    baseline: List[MicroBatchShape] = field(default_factory=list)
    load_seconds: float = 0.0

def _real_documents(sample: Sample, ignore_index: int) -> List[int]:
    """Lengths of the real (non-padding) documents of a sample: its length, or a pack's documents.

    torchtune's ``PackedDataset`` pads a pack with one extra ``seq_lens`` entry
    whose labels are all ``ignore_index``; a pack's last document whose labels
    are all masked would be counted as padding too (rare, and it trains nothing).
    """
    if "seq_lens" not in sample:
        return [len(sample["tokens"])]
    seq_lens = [int(n) for n in sample["seq_lens"]]
    tail = torch.as_tensor(sample["labels"])[len(sample["tokens"]) - seq_lens[-1]:]
    if len(seq_lens) > 1 and bool((tail == ignore_index).all()):
        return seq_lens[:-1]
    return seq_lens

class StepLoader:
    """This rank's micro-batches for each optimizer step of an epoch.

    Args:
        dataset: map-style dataset of torchtune samples (``tokens``, ``labels``,
            and for packs ``input_pos``, ``seq_lens``).
        collate_fn: builds a micro-batch from a list of samples (:func:`make_collate`).
        batch_size: samples per micro-batch per rank.
        gradient_accumulation_steps: micro-batches per optimizer step per rank
            (without a token budget).
        seed, shuffle: the epoch order (:func:`epoch_order`).
        ignore_index: label value of masked positions (for stand-ins).
        dp_rank, dp_world_size: this rank and the number of data-parallel ranks.
        group_by_length, max_tokens_per_micro_batch, pack: see :func:`plan_step`;
            with ``pack``, micro-batches are collated by :func:`collate_as_pack`
            instead of ``collate_fn``.
        max_steps_per_epoch: stop an epoch after this many optimizer steps.
        require_sample_per_rank: refuse a dataset with fewer samples than
            ranks (training); False lets such ranks run stand-ins only
            (evaluation, where that costs time but changes no number).

    Raises:
        ConfigError: (key ``dataset``) fewer samples than ``dp_world_size``.
    """

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[List[Sample]], Dict[str, Any]],
        *,
        batch_size: int,
        gradient_accumulation_steps: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        ignore_index: int = -100,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        group_by_length: bool = False,
        max_tokens_per_micro_batch: Optional[int] = None,
        pack: bool = False,
        max_steps_per_epoch: Optional[int] = None,
        require_sample_per_rank: bool = True,
    ):
        if require_sample_per_rank and len(dataset) < dp_world_size:
            # Stand-ins would be all a rank trains on: a run that cannot learn there.
            raise ConfigError("dataset", f"the dataset yields {len(dataset)} sample(s), fewer than the "
                              f"{dp_world_size} data-parallel ranks; use fewer processes or more data")
        self.dataset, self.collate_fn = dataset, collate_fn
        self.batch_size, self.gradient_accumulation_steps = batch_size, gradient_accumulation_steps
        self.seed, self.shuffle, self.ignore_index = seed, shuffle, ignore_index
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.group_by_length, self.max_tokens_per_micro_batch = group_by_length, max_tokens_per_micro_batch
        self.pack = pack
        self.max_steps_per_epoch = max_steps_per_epoch

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, all ranks."""
        return self.dp_world_size * self.batch_size * self.gradient_accumulation_steps

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of a whole epoch (the last one possibly shorter), at most ``max_steps_per_epoch``."""
        return self.remaining_steps(0, 0)

    def remaining_steps(self, start_sample: int, steps_done: int) -> int:
        """Optimizer steps left in an epoch at sample ``start_sample`` after ``steps_done`` steps."""
        steps = math.ceil(max(len(self.dataset) - start_sample, 0) / self.global_batch_size)
        if self.max_steps_per_epoch is not None:
            steps = min(steps, max(self.max_steps_per_epoch - steps_done, 0))
        return steps

    def epoch(self, epoch: int, start_sample: int = 0, steps_done: int = 0) -> Iterator[StepData]:
        """The steps of ``epoch`` from sample ``start_sample`` on, ``steps_done`` steps into it."""
        order = epoch_order(len(self.dataset), epoch, self.seed, self.shuffle)
        position = start_sample
        steps = self.remaining_steps(start_sample, steps_done)
        for i in range(steps):
            indices = order[position:position + self.global_batch_size]
            position += len(indices)
            start = time.perf_counter()
            step = self.load_step(indices, end_sample=position)
            step.load_seconds = time.perf_counter() - start
            step.last_in_epoch = i == steps - 1
            yield step

    def load_step(self, indices: Sequence[int], end_sample: int = 0) -> StepData:
        """Plan and collate this rank's micro-batches for the step made of ``indices``."""
        needs_lengths = self.group_by_length or bool(self.max_tokens_per_micro_batch)
        cache: Dict[int, Sample] = {}

        def sample(position: int) -> Sample:
            if position not in cache:
                cache[position] = self.dataset[indices[position]]
            return cache[position]

        lengths = [len(sample(p)["tokens"]) for p in range(len(indices))] if needs_lengths else None
        try:
            plan = plan_step(len(indices), lengths, dp_world_size=self.dp_world_size, batch_size=self.batch_size,
                             group_by_length=self.group_by_length,
                             max_tokens_per_micro_batch=self.max_tokens_per_micro_batch, pack=self.pack)
        except ValueError as err:
            raise ConfigError("max_tokens_per_micro_batch", f"{err}; raise it, or lower tokenizer.max_seq_len "
                              "so that samples are truncated to fit") from None
        micro_batches, padded, real, padded_squares, real_squares = [], 0, 0, 0, 0
        for positions in plan[self.dp_rank]:
            if positions:
                samples = [sample(p) for p in positions]
                documents = [n for s in samples for n in _real_documents(s, self.ignore_index)]
                real += sum(documents)
                real_squares += sum(n * n for n in documents)
            else:  # nothing left for this rank in this slot: a stand-in that adds no token
                known = sorted(cache) or [0]
                shortest = min(known, key=lambda p: (len(sample(p)["tokens"]), p))
                samples = [masked_copy(sample(shortest), self.ignore_index)]
            batch = collate_as_pack(samples) if self.pack else self.collate_fn(samples)
            rows, length = batch["tokens"].shape
            padded += rows * length
            padded_squares += rows * length * length
            micro_batches.append(batch)
        # torchtune's recipe: the default plan, each micro-batch padded to its longest sample
        baseline = []
        for positions in plan_step(len(indices), dp_world_size=self.dp_world_size,
                                   batch_size=self.batch_size)[self.dp_rank]:
            if positions:
                samples = [sample(p) for p in positions]
                rows, length = len(samples), max(len(s["tokens"]) for s in samples)
                baseline.append(MicroBatchShape(rows, length, rows * length, any("seq_lens" in s for s in samples)))
        return StepData(micro_batches, len(indices), end_sample, padded, real,
                        padded_squared_lengths=padded_squares, real_squared_lengths=real_squares, baseline=baseline)


def build_step_loader(cfg: Any, tokenizer: Any, *, seed: int, ignore_index: int,
                      model_max_seq_len: Optional[int] = None, dp_rank: int = 0, dp_world_size: int = 1,
                      model_vocab_size: Optional[int] = None) -> StepLoader:
    """The training :class:`StepLoader` of a validated recipe config.

    ``model_max_seq_len``: the longest input the model takes (the caller reads it off the model,
    :func:`torchtune_ext.run.preflight.model_max_seq_len`); None: unknown. ``model_vocab_size``: the rows of
    its token embedding; a larger token id in the data is refused (None: unknown).

    Reads ``dataset``, ``data_errors``, ``collate_fn``, ``batch_size``, ``gradient_accumulation_steps``,
    ``shuffle``, ``group_by_length``, ``max_tokens_per_micro_batch``, ``pack_micro_batches`` and
    ``max_steps_per_epoch``.

    Raises:
        ConfigError: as :func:`build_dataset` and :class:`StepLoader`.
    """
    dataset, packed = build_dataset(cfg.dataset, tokenizer, ignore_index=ignore_index, data_errors=cfg.data_errors,
                                    model_max_seq_len=model_max_seq_len, training=True,
                                    vocabulary=model_vocabulary(cfg, model_vocab_size))
    return StepLoader(
        dataset, make_collate(packed, tokenizer.pad_id, ignore_index,
                              _get_component_from_path(cfg.get("collate_fn") or "torchtune.data.padded_collate_sft")),
        batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, seed=seed, shuffle=cfg.shuffle,
        ignore_index=ignore_index, dp_rank=dp_rank, dp_world_size=dp_world_size,
        group_by_length=cfg.group_by_length, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        # its combinations with packed data and collate_fn are checked by config.validate
        pack=bool(cfg.get("pack_micro_batches", False)), max_steps_per_epoch=cfg.max_steps_per_epoch,
    )
