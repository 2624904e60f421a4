"""Preference pairs as one sample each, checked once, and the collation of a micro-batch of pairs.

torchtune's preference datasets (``preference_dataset``,
``stack_exchange_paired_dataset``, ...) yield ``chosen_input_ids``,
``chosen_labels``, ``rejected_input_ids`` and ``rejected_labels`` per pair.
:class:`PairDataset` makes each pair ONE sample of the step loader
(:mod:`torchtune_ext.data.step_loader`): its ``tokens`` and ``labels`` are the
chosen response's followed by the rejected one's, and ``chosen_len`` says
where they meet. So the loader's plans, resume positions, length grouping
and stand-ins work on pairs unchanged, and a pair is never split across
micro-batches or ranks. :func:`collate_pairs` unfolds a micro-batch of ``P``
pairs into ``2P`` padded rows, chosen first (what
:class:`torchtune_ext.train.preference.PreferenceObjective` reads).

Packing is refused for pairs (``pack_micro_batches``, ``dataset.packed``):
the two responses of a pair must stay two rows, each attending only to its
own prompt (:mod:`torchtune_ext.config.preference`).

Truncation: torchtune's ``PreferenceDataset`` cuts the chosen and the
rejected sequence each at ``tokenizer.max_seq_len``; a pair one of whose
responses has no trainable token left (cut away, or empty) is refused here
with its index, before the model loads.
"""

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import ConcatDataset, Dataset

from torchtune_ext.data.check import (
    DataReport,
    ModelVocabulary,
    check_token_ids,
    dataset_source,
    explain_unreadable,
    model_vocabulary,
)
from torchtune_ext.data.datasets import dataset_configs, dataset_items, instantiate_dataset
from torchtune_ext.data.step_loader import StepLoader
from torchtune_ext.errors import ConfigError

PAIR_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def pair_sample(pair: Dict[str, Any]) -> Dict[str, Any]:
    """A torchtune preference sample as one step-loader sample: ``tokens``, ``labels`` (chosen then
    rejected) and ``chosen_len``."""
    return {"tokens": list(pair["chosen_input_ids"]) + list(pair["rejected_input_ids"]),
            "labels": list(pair["chosen_labels"]) + list(pair["rejected_labels"]),
            "chosen_len": len(pair["chosen_input_ids"])}


class PairDataset(Dataset):
    """A preference dataset whose items are :func:`pair_sample`'s."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return pair_sample(self.dataset[index])


def collate_pairs(samples: List[Dict[str, Any]], padding_idx: int = 0, ignore_idx: int = -100) -> Dict[str, Any]:
    """``P`` pair samples as ``2P`` right-padded rows: the chosen responses, then the rejected ones.

    Returns:
        dict: ``tokens`` and ``labels`` ``[2P, longest]`` (``labels`` unshifted, padding
        ``ignore_idx``), ``lengths`` ``[2P]`` the non-padding tokens of each row.
    """
    rows = [(s["tokens"][:s["chosen_len"]], s["labels"][:s["chosen_len"]]) for s in samples]
    rows += [(s["tokens"][s["chosen_len"]:], s["labels"][s["chosen_len"]:]) for s in samples]
    longest = max(len(tokens) for tokens, _ in rows)
    tokens = torch.full((len(rows), longest), padding_idx, dtype=torch.long)
    labels = torch.full((len(rows), longest), ignore_idx, dtype=torch.long)
    for i, (row_tokens, row_labels) in enumerate(rows):
        tokens[i, :len(row_tokens)] = torch.as_tensor(row_tokens, dtype=torch.long)
        labels[i, :len(row_labels)] = torch.as_tensor(row_labels, dtype=torch.long)
    return {"tokens": tokens, "labels": labels, "lengths": torch.tensor([len(t) for t, _ in rows])}


def _trainable_after_shift(labels: Sequence[int], ignore_index: int) -> int:
    return sum(1 for label in list(labels)[1:] if label != ignore_index)


def check_pairs(dataset: Dataset, key: str, *, ignore_index: int, model_max_seq_len: Optional[int] = None,
                cfg_dataset: Any = None) -> DataReport:
    """Read every pair once: both responses present, each with a trainable token, none longer than the model.

    Returns:
        DataReport: the pairs' largest token id and the pair holding it, for
        :func:`torchtune_ext.data.check.check_token_ids` (the check the SFT data makes).

    Raises:
        ConfigError: (key ``key``) a record the dataset cannot read (a missing ``chosen`` or ``rejected``
            column: map it with ``column_map``), samples without the chosen/rejected fields (not a preference dataset),
            a response with no trainable token (empty, or cut away at ``tokenizer.max_seq_len``), a
            sequence longer than ``model_max_seq_len``; each naming the first sample's index.
    """
    report = DataReport(key, dataset_source(cfg_dataset or {}))
    for index in range(len(dataset)):
        try:
            pair = dataset[index]
        except Exception as err:  # a record without the columns its transform reads (chosen, rejected)
            raise explain_unreadable(err, key, cfg_dataset or {}, index) from err
        missing = [name for name in PAIR_KEYS if name not in pair]
        if missing:
            raise ConfigError(key, f"sample {index} has no {', '.join(missing)}: not a preference dataset; use "
                              "torchtune.datasets.preference_dataset (chosen/rejected message lists)")
        for side in ("chosen", "rejected"):
            report.see_tokens(pair[f"{side}_input_ids"], index)
            if _trainable_after_shift(pair[f"{side}_labels"], ignore_index) == 0:
                raise ConfigError(key, f"pair {index}: the {side} response has no trainable token (empty, or "
                                  "cut away at tokenizer.max_seq_len); remove the pair or raise max_seq_len")
            length = len(pair[f"{side}_input_ids"])
            if model_max_seq_len is not None and length > model_max_seq_len:
                raise ConfigError(key, f"pair {index}: the {side} sequence has {length} tokens, more than the "
                                  f"model's {model_max_seq_len}; set tokenizer.max_seq_len <= {model_max_seq_len}")
    return report



def build_pair_dataset(cfg_dataset: Any, tokenizer: Any, key: str = "dataset", *, ignore_index: int = -100,
                       model_max_seq_len: Optional[int] = None,
                       vocabulary: Optional[ModelVocabulary] = None) -> PairDataset:
    """Instantiate a preference dataset config (or a list, concatenated), check every pair, wrap it.

    ``vocabulary``: the model's token embedding; a token id of either response at or past its rows is
    refused (:func:`torchtune_ext.data.check.check_token_ids`, the SFT data's check; None: not checked).

    Raises:
        ConfigError: (key ``key``) a dataset that cannot be loaded, or as :func:`check_pairs`; (key
            ``tokenizer``) a token id the model has no embedding for, naming the tokenizer, the model and
            both sizes.
    """
    datasets, reports = [], []
    for item, cfg in dataset_items(dataset_configs(cfg_dataset), key):
        datasets.append(instantiate_dataset(cfg, tokenizer, item))
        reports.append(check_pairs(datasets[-1], item, ignore_index=ignore_index,
                                   model_max_seq_len=model_max_seq_len, cfg_dataset=cfg))
    check_token_ids(reports, vocabulary)
    dataset = datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    if len(dataset) == 0:
        raise ConfigError(key, "the dataset yields zero pairs")
    return PairDataset(dataset)


def build_pair_loader(cfg: Any, tokenizer: Any, *, seed: int, ignore_index: int,
                      model_max_seq_len: Optional[int] = None, model_vocab_size: Optional[int] = None,
                      dp_rank: int = 0, dp_world_size: int = 1, key: str = "dataset",
                      training: bool = True) -> StepLoader:
    """The :class:`~torchtune_ext.data.step_loader.StepLoader` of a preference recipe's ``key`` dataset.

    ``batch_size`` counts pairs per micro-batch per rank (``2 x batch_size`` rows);
    ``group_by_length`` and ``max_tokens_per_micro_batch`` see a pair's two
    sequences together. Training reads ``batch_size``, ``gradient_accumulation_steps``, ``shuffle`` and
    ``max_steps_per_epoch``; validation (``training=False``) ``batch_size_val`` and ``max_val_samples``,
    in dataset order. ``model_vocab_size``: the rows of the model's token embedding (None: unknown), a larger
    token id is refused as :func:`build_pair_dataset` says.
    """
    dataset: Dataset = build_pair_dataset(cfg[key], tokenizer, key, ignore_index=ignore_index,
                                          model_max_seq_len=model_max_seq_len,
                                          vocabulary=model_vocabulary(cfg, model_vocab_size))
    common = dict(ignore_index=ignore_index, dp_rank=dp_rank, dp_world_size=dp_world_size,
                  group_by_length=cfg.group_by_length, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)

    def collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        return collate_pairs(samples, tokenizer.pad_id, ignore_index)

    if not training:
        if cfg.max_val_samples is not None and cfg.max_val_samples < len(dataset):
            dataset = torch.utils.data.Subset(dataset, range(cfg.max_val_samples))
        return StepLoader(dataset, collate, batch_size=cfg.batch_size_val, shuffle=False,
                          require_sample_per_rank=False, **common)
    return StepLoader(dataset, collate, batch_size=cfg.batch_size,
                      gradient_accumulation_steps=cfg.gradient_accumulation_steps, seed=seed, shuffle=cfg.shuffle,
                      max_steps_per_epoch=cfg.max_steps_per_epoch, **common)
