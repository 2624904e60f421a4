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

Records: :func:`preference_dataset` (also what torchtune's
``preference_dataset`` component builds here) reads torchtune's records
(``chosen`` and ``rejected`` message lists, the prompt repeated in both) and
TRL's preference format: ``prompt``, ``chosen`` and ``rejected`` as plain
strings, or as message lists (TRL's conversational format, the prompt apart).

Truncation: torchtune's ``PreferenceDataset`` cuts the chosen and the
rejected sequence each at ``tokenizer.max_seq_len``; a pair one of whose
responses has no trainable token left (cut away, or empty) is refused here
with its index, before the model loads.
"""

import hashlib
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import ConcatDataset, Dataset
from torchtune.data import Message
from torchtune.datasets import PreferenceDataset

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
RECORD_COLUMNS = ("prompt", "chosen", "rejected")  # what column_map may rename; prompt is optional
# torchtune's builder, read here by preference_dataset (the same records, and TRL's)
TORCHTUNE_PREFERENCE_DATASETS = ("torchtune.datasets.preference_dataset",
                                 "torchtune.datasets._preference.preference_dataset")


class PreferenceRecordToMessages:
    """One preference record as torchtune's ``{"chosen": [Message], "rejected": [Message]}``.

    A record is, by its columns (renamed with ``column_map``):

    * torchtune's: ``chosen`` and ``rejected`` message lists (``{"role", "content"}``), each holding the
      prompt too; no ``prompt`` column. (TRL calls it conversational with an implicit prompt.)
    * TRL's standard format: ``prompt``, ``chosen`` and ``rejected`` strings; the prompt becomes a user
      message, each response an assistant message.
    * TRL's conversational format: ``prompt``, ``chosen`` and ``rejected`` message lists; the prompt's
      messages come before each response's.

    Any mix of strings and lists under a ``prompt`` reads alike. Non-assistant messages are masked unless
    ``train_on_input``; ``new_system_prompt`` replaces every system message (torchtune's rules).

    Raises:
        ValueError: at construction, a ``column_map`` key other than prompt, chosen and rejected; per
            record, a string response without a ``prompt`` (TRL's implicit-prompt strings: where the
            prompt ends is not known), or a value that is neither a string nor a message list.
        KeyError: a missing column (its name: the data check turns it into the ``column_map`` hint).
    """

    def __init__(self, train_on_input: bool = False, column_map: Optional[Mapping[str, str]] = None,
                 new_system_prompt: Optional[str] = None):
        column_map = dict(column_map or {})
        unknown = sorted(set(column_map) - set(RECORD_COLUMNS))
        if unknown:
            raise ValueError(f"column_map keys must be among {', '.join(RECORD_COLUMNS)}, got {', '.join(unknown)}")
        self.columns = {name: column_map.get(name, name) for name in RECORD_COLUMNS}
        self.train_on_input = train_on_input
        self.new_system_prompt = new_system_prompt

    def _messages(self, value: Any, role: str, column: str) -> List[Message]:
        if isinstance(value, str):
            return [Message(role=role, content=value, masked=role != "assistant" and not self.train_on_input)]
        if not isinstance(value, (list, tuple)) or not all(isinstance(m, Mapping) for m in value):
            raise ValueError(f"column '{column}' holds {type(value).__name__}: expected a string or a list of "
                             "messages ({'role', 'content'})")
        out = []
        for message in value:
            if message["role"] == "system" and self.new_system_prompt is not None:
                continue
            masked = message["role"] != "assistant" and not self.train_on_input
            out.append(Message.from_dict({**message, "masked": masked}))
        return out

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, List[Message]]:
        prompt_column = self.columns["prompt"]
        prompt: List[Message] = []
        if prompt_column in sample and sample[prompt_column] is not None:
            prompt = self._messages(sample[prompt_column], "user", prompt_column)
        elif prompt_column != "prompt":  # named in column_map: it must be there
            raise KeyError(prompt_column)
        out = {}
        for side in ("chosen", "rejected"):
            column = self.columns[side]
            value = sample[column]
            if isinstance(value, str) and not prompt:
                raise ValueError(f"column '{column}' is a string and the record has no '{prompt_column}': "
                                 "TRL's implicit-prompt strings do not say where the prompt ends; give the "
                                 "prompt its own column (or map it with column_map.prompt)")
            messages = prompt + self._messages(value, "assistant", column)
            if self.new_system_prompt is not None:
                messages = [Message(role="system", content=self.new_system_prompt, masked=True, eot=True)] + messages
            out[side] = messages
        return out


def preference_dataset(tokenizer: Any, *, source: str, column_map: Optional[Dict[str, str]] = None,
                       train_on_input: bool = False, new_system_prompt: Optional[str] = None,
                       filter_fn: Optional[Callable] = None, split: str = "train",
                       **load_dataset_kwargs: Any) -> PreferenceDataset:
    """torchtune's ``preference_dataset``, arguments alike, reading the records of
    :class:`PreferenceRecordToMessages` (torchtune's message lists, TRL's strings and conversations).

    ``source`` and ``load_dataset_kwargs`` go to ``datasets.load_dataset`` (``source: json`` or
    ``parquet`` with ``data_files`` for local files). Each item: ``chosen_input_ids``, ``chosen_labels``,
    ``rejected_input_ids``, ``rejected_labels`` (lists of token ids; a masked label is
    ``CROSS_ENTROPY_IGNORE_INDEX``), each sequence cut at ``tokenizer.max_seq_len``.

    Raises:
        ValueError: as :class:`PreferenceRecordToMessages`.
    """
    transform = PreferenceRecordToMessages(train_on_input, column_map, new_system_prompt)
    return PreferenceDataset(source=source, message_transform=transform, tokenizer=tokenizer, filter_fn=filter_fn,
                             split=split, **load_dataset_kwargs)


def _read_by_us(cfg: Any) -> Any:
    """torchtune's ``preference_dataset`` config built by :func:`preference_dataset` (same arguments, a
    superset of its records); any other config unchanged."""
    if not isinstance(cfg, DictConfig) or cfg.get("_component_") not in TORCHTUNE_PREFERENCE_DATASETS:
        return cfg
    ours = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    ours._component_ = f"{__name__}.preference_dataset"
    return ours


def pair_sample(pair: Dict[str, Any]) -> Dict[str, Any]:
    """A torchtune preference sample as one step-loader sample: ``tokens``, ``labels`` (chosen then
    rejected) and ``chosen_len``."""
    return {"tokens": list(pair["chosen_input_ids"]) + list(pair["rejected_input_ids"]),
            "labels": list(pair["chosen_labels"]) + list(pair["rejected_labels"]),
            "chosen_len": len(pair["chosen_input_ids"])}


class PairDataset(Dataset):
    """A preference dataset whose items are :func:`pair_sample`'s, each with its ``pair_index``:
    ``index_offset + index``, where precomputed reference log-probabilities are looked up
    (:class:`torchtune_ext.train.preference.PrecomputedReference`; validation pairs follow the training pairs)."""

    def __init__(self, dataset: Dataset, index_offset: int = 0):
        self.dataset, self.index_offset = dataset, index_offset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return {**pair_sample(self.dataset[index]), "pair_index": self.index_offset + index}


def pairs_fingerprint(dataset: Dataset) -> str:
    """SHA-256 (hex) of every pair's token ids, labels and chosen length, in order: what the tokenizer, its
    ``max_seq_len`` and the data made of the dataset. One more pass over ``dataset`` (:class:`PairDataset`)."""
    digest = hashlib.sha256()
    for index in range(len(dataset)):
        sample = dataset[index]
        values = [[int(t) for t in sample["tokens"]], [int(t) for t in sample["labels"]], int(sample["chosen_len"])]
        digest.update(json.dumps(values).encode())
    return digest.hexdigest()


def collate_pairs(samples: List[Dict[str, Any]], padding_idx: int = 0, ignore_idx: int = -100) -> Dict[str, Any]:
    """``P`` pair samples as ``2P`` right-padded rows: the chosen responses, then the rejected ones.

    Returns:
        dict: ``tokens`` and ``labels`` ``[2P, longest]`` (``labels`` unshifted, padding
        ``ignore_idx``), ``lengths`` ``[2P]`` the non-padding tokens of each row, and where the samples
        have one, ``pair_index`` ``[P]`` (:class:`PairDataset`).
    """
    rows = [(s["tokens"][:s["chosen_len"]], s["labels"][:s["chosen_len"]]) for s in samples]
    rows += [(s["tokens"][s["chosen_len"]:], s["labels"][s["chosen_len"]:]) for s in samples]
    longest = max(len(tokens) for tokens, _ in rows)
    tokens = torch.full((len(rows), longest), padding_idx, dtype=torch.long)
    labels = torch.full((len(rows), longest), ignore_idx, dtype=torch.long)
    for i, (row_tokens, row_labels) in enumerate(rows):
        tokens[i, :len(row_tokens)] = torch.as_tensor(row_tokens, dtype=torch.long)
        labels[i, :len(row_labels)] = torch.as_tensor(row_labels, dtype=torch.long)
    batch = {"tokens": tokens, "labels": labels, "lengths": torch.tensor([len(t) for t, _ in rows])}
    if all("pair_index" in s for s in samples):
        batch["pair_index"] = torch.tensor([int(s["pair_index"]) for s in samples])
    return batch


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
                       model_max_seq_len: Optional[int] = None, vocabulary: Optional[ModelVocabulary] = None,
                       index_offset: int = 0) -> PairDataset:
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
        datasets.append(instantiate_dataset(_read_by_us(cfg), tokenizer, item))
        reports.append(check_pairs(datasets[-1], item, ignore_index=ignore_index,
                                   model_max_seq_len=model_max_seq_len, cfg_dataset=cfg))
    check_token_ids(reports, vocabulary)
    dataset = datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    if len(dataset) == 0:
        raise ConfigError(key, "the dataset yields zero pairs")
    return PairDataset(dataset, index_offset)


def build_pair_loader(cfg: Any, tokenizer: Any, *, seed: int, ignore_index: int,
                      model_max_seq_len: Optional[int] = None, model_vocab_size: Optional[int] = None,
                      dp_rank: int = 0, dp_world_size: int = 1, key: str = "dataset",
                      training: bool = True, index_offset: int = 0) -> StepLoader:
    """The :class:`~torchtune_ext.data.step_loader.StepLoader` of a preference recipe's ``key`` dataset.

    ``batch_size`` counts pairs per micro-batch per rank (``2 x batch_size`` rows);
    ``group_by_length`` and ``max_tokens_per_micro_batch`` see a pair's two
    sequences together. Training reads ``batch_size``, ``gradient_accumulation_steps``, ``shuffle`` and
    ``max_steps_per_epoch``; validation (``training=False``) ``batch_size_val`` and ``max_val_samples``,
    in dataset order. ``model_vocab_size``: the rows of the model's token embedding (None: unknown), a larger
    token id is refused as :func:`build_pair_dataset` says. ``index_offset``: the first pair's ``pair_index``.
    """
    dataset: Dataset = build_pair_dataset(cfg[key], tokenizer, key, ignore_index=ignore_index,
                                          model_max_seq_len=model_max_seq_len,
                                          vocabulary=model_vocabulary(cfg, model_vocab_size),
                                          index_offset=index_offset)
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
