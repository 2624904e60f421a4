"""Datasets as the config names them, checked sample by sample, and the collators of their micro-batches.

:func:`build_dataset` instantiates a ``dataset`` config (several are
concatenated), packs it when asked, and checks every sample once
(:mod:`torchtune_ext.data.check`); :func:`make_collate` pads or packs a
micro-batch. Which samples make up each optimizer step is
:mod:`torchtune_ext.data.step_loader`.
"""

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import ListConfig
from torch.utils.data import ConcatDataset, Dataset
from torchtune import config as tt_config
from torchtune.data import padded_collate_packed, padded_collate_sft

from torchtune_ext.data.check import (
    ModelVocabulary,
    act_on_reports,
    check_dataset,
    check_token_ids,
    explain_unreadable,
)
from torchtune_ext.errors import ConfigError
from torchtune_ext.train.loss import CROSS_ENTROPY_IGNORE_INDEX

Sample = Dict[str, Any]

def masked_copy(sample: Sample, ignore_index: int) -> Sample:
    """``sample`` with every label set to ``ignore_index``: it runs forward and
    backward like any sample and adds no token and no loss."""
    masked = dict(sample)
    labels = sample["labels"]
    if isinstance(labels, torch.Tensor):
        masked["labels"] = torch.full_like(labels, ignore_index)
    else:
        masked["labels"] = [ignore_index] * len(labels)
    return masked

def collate_packed(batch: List[Sample]) -> Dict[str, torch.Tensor]:
    """torchtune's ``padded_collate_packed`` plus ``document_ids``.

    ``document_ids[b, t]`` numbers the documents of pack ``b`` (from the pack's
    ``seq_lens``; the padding at the end of a pack is a document of its own),
    so that the label shift can stop at document boundaries
    (:func:`torchtune_ext.train.loss.shift_labels`). The block-causal ``mask`` and
    the per-document ``input_pos`` already keep attention inside a document.

    Returns:
        dict with ``tokens``, ``labels``, ``input_pos``, ``document_ids``
        ``[batch, seq_len]`` and ``mask`` (as torchtune builds it).
    """
    out = padded_collate_packed(batch)
    ids = []
    for pack in batch:
        seq_lens = torch.as_tensor(pack["seq_lens"], dtype=torch.long)
        ids.append(torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens))
    out["document_ids"] = torch.stack(ids)
    if out["document_ids"].shape != out["labels"].shape:
        raise ValueError("a pack's seq_lens do not add up to its length")
    return out

def collate_as_pack(samples: List[Sample]) -> Dict[str, torch.Tensor]:
    """Unpacked samples concatenated into one row, collated as a pack (``pack_micro_batches``).

    Each sample becomes a document of the pack: positions restart at 0, the
    block-causal ``mask`` keeps attention inside it and ``document_ids`` stop
    the label shift at its end, so every sample is computed as it would be
    in a row of its own, with no padding.

    Args:
        samples: dicts with ``tokens`` and ``labels`` (lists or 1-D tensors, same length).

    Returns:
        :func:`collate_packed` of the one pack: ``[1, sum of lengths]`` tensors and ``mask``.
    """
    lengths = [len(s["tokens"]) for s in samples]
    pack = {
        "tokens": torch.cat([torch.as_tensor(s["tokens"], dtype=torch.long) for s in samples]),
        "labels": torch.cat([torch.as_tensor(s["labels"], dtype=torch.long) for s in samples]),
        "input_pos": torch.cat([torch.arange(n) for n in lengths]),
        "seq_lens": torch.tensor(lengths, dtype=torch.long),
    }
    return collate_packed([pack])

def dataset_configs(cfg_dataset: Any) -> List[Any]:
    """A dataset key's configs: the one it holds, or each of a list (concatenated by the caller)."""
    return list(cfg_dataset) if isinstance(cfg_dataset, (list, ListConfig)) else [cfg_dataset]


def dataset_items(cfgs: List[Any], key: str) -> List[Tuple[str, Any]]:
    """(the name errors give it, config) per dataset config: ``key``, or ``key[i]`` in a list."""
    return [(key if len(cfgs) == 1 else f"{key}[{i}]", c) for i, c in enumerate(cfgs)]


def instantiate_dataset(cfg: Any, tokenizer: Any, item: str) -> Dataset:
    """``cfg`` built with ``tokenizer``; an unreadable file is one :class:`ConfigError` naming ``item``."""
    try:
        return tt_config.instantiate(cfg, tokenizer)
    except Exception as err:  # the datasets library raises many types for unreadable files
        raise explain_unreadable(err, item, cfg) from err


def build_dataset(cfg_dataset: Any, tokenizer: Any, key: str = "dataset", *,
                  ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX, data_errors: str = "warn",
                  model_max_seq_len: Optional[int] = None, training: bool = False,
                  vocabulary: Optional[ModelVocabulary] = None) -> Tuple[Dataset, bool]:
    """Instantiate a dataset config (one dataset or a list, concatenated) and check every sample once.

    Each configured dataset goes through :func:`torchtune_ext.data.check.check_dataset`:
    samples with no trainable token or with replacement characters are
    reported (``data_errors="warn"``) or refused (``"error"``).

    Args:
        key: the config key it came from (``dataset``, ``dataset_val``), for errors.
        model_max_seq_len: the longest input the model takes; a longer sample
            is refused (None: not checked).
        training: data to train on: not one trainable token in it is an error
            (every step would be skipped), whatever ``data_errors`` says.
        vocabulary: the model's token embedding; a token id past it is refused
            (:func:`torchtune_ext.data.check.check_token_ids`; None: not checked).

    Returns:
        (dataset, packed)

    Raises:
        ConfigError: if a dataset cannot be loaded, has a record that cannot be
            read (e.g. a missing column), has a sample longer than
            ``model_max_seq_len``, yields no sample (or, with ``training``, no
            trainable token), mixes packed and
            unpacked datasets, or has data errors with ``data_errors="error"``.
    """
    cfgs = dataset_configs(cfg_dataset)
    packed = {bool(c.get("packed", False)) for c in cfgs}
    if len(packed) > 1:
        raise ConfigError(key, "packed and unpacked datasets cannot be mixed")
    datasets, reports = [], []
    for item, c in dataset_items(cfgs, key):
        datasets.append(instantiate_dataset(c, tokenizer, item))
        reports.append(check_dataset(datasets[-1], c, item, ignore_index=ignore_index,
                                     max_seq_len=getattr(tokenizer, "max_seq_len", None),
                                     model_max_seq_len=model_max_seq_len))
    check_token_ids(reports, vocabulary)
    act_on_reports(reports, data_errors, require_tokens=training)
    dataset = datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    if len(dataset) == 0:
        raise ConfigError(key, "the dataset yields zero samples")
    return dataset, packed.pop()

def make_collate(packed: bool, pad_id: int, ignore_index: int,
                 collate_fn: Optional[Callable[..., Dict[str, Any]]] = None
                 ) -> Callable[[List[Sample]], Dict[str, Any]]:
    """The collator for a dataset: :func:`collate_packed`, or for unpacked data
    ``collate_fn`` (torchtune's right-padding ``padded_collate_sft`` by default,
    the ``collate_fn`` key), called with ``padding_idx`` and ``ignore_idx``."""
    if packed:
        return collate_packed
    return partial(collate_fn or padded_collate_sft, padding_idx=pad_id, ignore_idx=ignore_index)
