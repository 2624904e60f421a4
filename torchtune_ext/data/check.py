"""One pass over a dataset before training: samples that would train on garbage or on nothing.

Problems that do not stop a data loader, and so would silently train on
garbage, are counted per configured dataset, with the first sample index:

* **no trainable token**: every label is masked after the shift, e.g. a
  prompt that fills ``tokenizer.max_seq_len`` so the answer is cut away
  entirely, or an empty answer. The sample costs compute and teaches nothing.
* **replacement characters** (U+FFFD) in a record's text: bytes that were not
  valid UTF-8 were replaced when the file was decoded.
* **cut at tokenizer.max_seq_len** (reported, never an error): the end of the
  sample is not trained.

With ``data_errors: error`` the first two stop the run before any model is
loaded; with ``warn`` (default) they are reported and training goes on.
A record that cannot be read at all (a column the dataset needs is missing,
bytes that cannot be decoded) always stops the run with its index: it would
crash training when reached. The pass also gives the first record's columns
a check before any log, checkpoint or W&B run exists.

Cost: one transform of every sample (torchtune's packing makes the same
pass); for packed datasets the packs are read, not re-tokenized.
"""

import codecs
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from torchtune_ext import ranks
from torchtune_ext.errors import ConfigError

log = logging.getLogger(__name__)

REPLACEMENT_CHARACTER = "\ufffd"


@dataclass
class Finding:
    """Samples of one dataset with one kind of problem."""

    what: str
    count: int = 0
    first: Optional[int] = None
    is_error: bool = True  # counts under data_errors=error

    def add(self, index: int) -> None:
        self.count += 1
        if self.first is None:
            self.first = index


@dataclass
class DataReport:
    """What :func:`check_dataset` found in one configured dataset.

    Attributes:
        key: the config key (``dataset`` or ``dataset[i]``).
        source: the data file(s) or hub source, for messages.
        num_samples: samples (for a packed dataset: documents in the packs).
        num_tokens: trainable label tokens after the shift, all samples.
        findings: problem kind -> :class:`Finding`.
        unit: ``sample`` or ``document`` (a document inside a pack).
    """

    key: str
    source: str
    num_samples: int = 0
    num_tokens: int = 0
    unit: str = "sample"
    findings: Dict[str, Finding] = field(default_factory=dict)
    max_token_id: int = -1
    max_token_at: Optional[int] = None  # the sample (pack, for packed data) holding it

    def see_tokens(self, tokens: Sequence[int], index: int) -> None:
        """Remember the largest token id so far (:func:`check_token_ids` compares it with the embedding)."""
        top = max((int(t) for t in tokens), default=-1)
        if top > self.max_token_id:
            self.max_token_id, self.max_token_at = top, index

    def finding(self, kind: str, what: str, is_error: bool = True) -> Finding:
        return self.findings.setdefault(kind, Finding(what, is_error=is_error))

    def problems(self, errors_only: bool = False) -> List[str]:
        """One phrase per finding, e.g. ``2 samples with no trainable token (first: index 7)``."""
        out = []
        for f in self.findings.values():
            if f.count and (f.is_error or not errors_only):
                out.append(f"{f.count} {self.unit}{'s' if f.count > 1 else ''} {f.what} (first: {self.unit} "
                           f"{f.first})")
        return out


def dataset_source(cfg_dataset: Any) -> str:
    """The data file(s) or hub source a dataset config reads, for messages (``?`` when it names none)."""
    files = cfg_dataset.get("data_files")
    if files is None:
        return str(cfg_dataset.get("source", "?"))
    return ", ".join(str(f) for f in files) if not isinstance(files, str) else files


def first_invalid_utf8(path: str) -> Optional[str]:
    """Where a local file first fails to decode as UTF-8 (``line L, byte 0xE9``), or None."""
    if not os.path.isfile(path):
        return None
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                line += chunk[:err.start].count(b"\n")
                return f"line {line}, byte 0x{chunk[err.start]:02X}"
            line += chunk.count(b"\n")
    return None


def first_invalid_json(path: str) -> Optional[str]:
    """Where a local JSON or JSON Lines file first fails to parse (``line L, column C: what``), or None.

    The datasets library names an Arrow block's row and a pandas offset instead ("row 97", "position
    1682"), which lead nowhere in the file. A file that parses as one document is valid; otherwise, when
    it is one record per line (its first document is followed by "Extra data"), each line is parsed
    alone, and the first that fails is named with its line of the file and its column.
    """
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as whole:
        if whole.msg != "Extra data":  # one document, broken at this place (or the first line of a JSONL file)
            return f"line {whole.lineno}, column {whole.colno}: {whole.msg}"
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                return f"line {number}, column {err.colno}: {err.msg}"
    return None


def explain_unreadable(err: BaseException, key: str, cfg_dataset: Any, index: Optional[int] = None,
                       columns: Optional[Sequence[str]] = None) -> ConfigError:
    """A :class:`ConfigError` for a record (or a whole file) the dataset could not read."""
    source = dataset_source(cfg_dataset)
    where = f"record {index} of '{source}'" if index is not None else f"'{source}'"
    chain, e = [], err
    while e is not None and len(chain) < 5:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if isinstance(err, KeyError) and err.args:
        have = f" (its columns: {', '.join(map(str, columns))})" if columns else ""
        return ConfigError(key, f"{where} has no column '{err.args[0]}'{have}; map the file's columns to the "
                           f"ones the dataset needs with {key}.column_map")
    if any(isinstance(c, StopIteration) or "corresponds to no data" in str(c) for c in chain):
        # the datasets library's words for a file without records (StopIteration: an empty JSON Lines file)
        return ConfigError(key, f"{where} has no records; check that {key}.data_files is the file with the data "
                           "(JSON: a list of records, or one record per line)")
    if any(isinstance(c, PermissionError) for c in chain):
        return ConfigError(key, f"{where} cannot be read (permission denied): {_short_chain(chain)}")
    if any(isinstance(c, UnicodeDecodeError) or "UTF-8" in str(c) or "utf-8" in str(c) for c in chain):
        files = cfg_dataset.get("data_files")
        for path in ([files] if isinstance(files, str) else list(files or [])):
            bad = first_invalid_utf8(str(path))
            if bad:
                return ConfigError(key, f"'{path}' is not valid UTF-8 ({bad}); convert it to UTF-8 "
                                   f"(e.g. iconv -f latin1 -t utf-8)")
    files = cfg_dataset.get("data_files")
    for path in ([files] if isinstance(files, str) else list(files or [])):
        if str(path).endswith((".json", ".jsonl")) or cfg_dataset.get("source") == "json":
            bad = first_invalid_json(str(path))
            if bad:
                return ConfigError(key, f"'{path}' is not valid JSON at {bad}; fix that line (JSON Lines: one "
                                   "complete record per line)")
    return ConfigError(key, f"could not load {where}: {_short_chain(chain) or type(err).__name__}")


def _short_chain(chain: Sequence[BaseException]) -> str:
    return "; ".join(f"{type(c).__name__}: {' '.join(str(c).split())}" for c in chain if str(c))


def _trainable(labels: Sequence[int], ignore_index: int) -> int:
    """Trainable positions after the next-token shift: labels 1.. that are not masked."""
    return sum(1 for label in list(labels)[1:] if int(label) != ignore_index)


def _hf_data(dataset: Any) -> Any:
    """The Hugging Face ``datasets.Dataset`` under a torchtune dataset, if there is one."""
    inner = getattr(dataset, "ds", dataset)  # PackedDataset wraps the unpacked one
    data = getattr(inner, "_data", None)
    return data if hasattr(data, "column_names") else None


def _contains_replacement(value: Any) -> bool:
    if isinstance(value, str):
        return REPLACEMENT_CHARACTER in value
    if isinstance(value, dict):
        return any(_contains_replacement(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_contains_replacement(v) for v in value)
    return False


def check_dataset(dataset: Any, cfg_dataset: Any, key: str, *, ignore_index: int,
                  max_seq_len: Optional[int], model_max_seq_len: Optional[int] = None) -> DataReport:
    """Read every sample of one configured dataset once and count its problems.

    Args:
        dataset: the instantiated torchtune dataset (map-style; possibly packed).
        cfg_dataset: its config (for ``data_files`` / ``source`` in messages).
        key: its config key, ``dataset`` or ``dataset[i]``.
        ignore_index: the loss's ignore index.
        max_seq_len: the tokenizer's truncation length (None: no truncation).
        model_max_seq_len: the longest input the model takes (None: not checked).

    Returns:
        DataReport

    Raises:
        ConfigError: a record cannot be read (missing column, undecodable), or
            a sample is longer than ``model_max_seq_len`` (the model would
            refuse it at its first forward).
    """
    report = DataReport(key, dataset_source(cfg_dataset))
    hf = _hf_data(dataset)
    columns = hf.column_names if hf is not None else None
    no_tokens = report.finding("no_tokens", "with no trainable token (all labels masked, e.g. an empty answer)")
    cut_away = report.finding(
        "cut_away", f"whose answer is cut away entirely at tokenizer.max_seq_len={max_seq_len} (no trainable token)")
    cut = report.finding("cut", f"cut at tokenizer.max_seq_len={max_seq_len} (their end is not trained)",
                         is_error=False)
    if hasattr(dataset, "packs"):
        # torchtune's PackedDataset: documents in order, each pack padded at the end (a last
        # document whose labels are all masked; see torchtune_ext.data.datasets._real_length). With
        # split_across_pack a full pack's last document may go on at the start of the next
        # pack: such boundary fragments are one sample, and a 1-token fragment that trains
        # nothing is the packing's doing, not the data's, so they are not judged alone.
        report.unit = "document"
        split = bool(getattr(dataset, "split_across_pack", False))
        continued = False
        for pack_index, pack in enumerate(dataset.packs):
            report.see_tokens(pack["tokens"], pack_index)
            labels = [int(x) for x in pack["labels"]]
            bounds, start = [], 0
            for n in (int(n) for n in pack["seq_lens"]):
                bounds.append((start, start + n))
                start += n
            padded = len(bounds) > 1 and all(x == ignore_index for x in labels[bounds[-1][0]:])
            if padded:
                bounds.pop()
            for j, (begin, end) in enumerate(bounds):
                count = _trainable(labels[begin:end], ignore_index)
                report.num_tokens += count
                fragment = split and ((j == 0 and continued) or (j == len(bounds) - 1 and not padded))
                if not (j == 0 and continued):
                    report.num_samples += 1
                if count == 0 and not fragment:
                    no_tokens.add(report.num_samples - 1)
            continued = split and not padded
    else:
        for i in range(len(dataset)):
            try:
                sample = dataset[i]
            except Exception as err:
                raise explain_unreadable(err, key, cfg_dataset, index=i, columns=columns) from err
            report.num_samples += 1
            report.see_tokens(sample["tokens"], i)
            if model_max_seq_len is not None and len(sample["tokens"]) > model_max_seq_len:
                raise ConfigError(key, f"'{report.source}': sample {i} has {len(sample['tokens'])} tokens, more "
                                  f"than the model's max_seq_len={model_max_seq_len}; set tokenizer.max_seq_len="
                                  f"{model_max_seq_len} (or less) to cut samples there")
            count = _trainable(sample["labels"], ignore_index)
            report.num_tokens += count
            at_limit = max_seq_len is not None and len(sample["tokens"]) >= max_seq_len
            if count == 0:
                (cut_away if at_limit else no_tokens).add(i)
            elif at_limit:
                cut.add(i)
    if hf is not None:
        bad = report.finding("replacement", "with replacement characters (U+FFFD): bytes that were not valid "
                             "UTF-8 in the source")
        batch_size = 1000
        for start in range(0, len(hf), batch_size):
            rows = hf[start:start + batch_size]
            for offset in range(len(next(iter(rows.values()), []))):
                if any(_contains_replacement(values[offset]) for values in rows.values()):
                    bad.add(start + offset)
    return report


@dataclass(frozen=True)
class ModelVocabulary:
    """The rows of the model's token embedding, and what to call the model and the tokenizer in messages."""

    size: int
    model: str
    tokenizer: str


def model_vocabulary(cfg: Any, size: Optional[int]) -> Optional[ModelVocabulary]:
    """:class:`ModelVocabulary` of a recipe config whose model's embedding has ``size`` rows (None: unknown)."""
    if size is None:
        return None
    tokenizer = cfg.tokenizer.get("path") or cfg.tokenizer.get("_component_")
    model = cfg.model.get("path") or cfg.model.get("_component_")
    return ModelVocabulary(int(size), str(model), f"{cfg.tokenizer.get('_component_')} ('{tokenizer}')")


def check_token_ids(reports: List[DataReport], vocabulary: Optional[ModelVocabulary]) -> None:
    """Refuse data whose token ids reach past the model's embedding (it would fail at the first forward
    that meets one, after start-up, with a long traceback; on CUDA an assert that ends the process).

    Raises:
        ConfigError: (key ``tokenizer``) naming the tokenizer, the model, both sizes, and the sample.
    """
    if vocabulary is None:
        return
    for report in reports:
        if report.max_token_id >= vocabulary.size:
            where = "pack" if report.unit == "document" else "sample"
            raise ConfigError("tokenizer", f"the tokenizer {vocabulary.tokenizer} gives token id "
                              f"{report.max_token_id} ({report.key} '{report.source}', {where} "
                              f"{report.max_token_at}), but the model '{vocabulary.model}' has "
                              f"{vocabulary.size} token embeddings (ids 0-{vocabulary.size - 1}): its vocabulary "
                              f"needs at least {report.max_token_id + 1}. Use the tokenizer that belongs to the "
                              "model, or a model whose vocab_size covers the tokenizer")


def act_on_reports(reports: List[DataReport], data_errors: str, require_tokens: bool = False) -> None:
    """Log the findings (rank 0) and, with ``data_errors='error'``, stop on a data error.

    ``require_tokens``: the data is for training; if no sample of any of the
    datasets has a trainable token, every optimizer step would be skipped
    (nothing learned, exit 0), so that is an error whatever ``data_errors`` says.

    Raises:
        ConfigError: (the dataset's key) ``require_tokens`` and no trainable
            token at all, or ``data_errors`` is ``error`` and a dataset has
            samples with no trainable token or replacement characters.
    """
    if require_tokens and reports and sum(r.num_tokens for r in reports) == 0:
        report = reports[0]
        key = report.key.split("[")[0]
        found = "; ".join(p for r in reports for p in r.problems()) or "all labels are masked after the shift"
        count = sum(r.num_samples for r in reports)
        raise ConfigError(key, f"no trainable token in any of its {count} {report.unit}s ({found}): every "
                          "optimizer step would be skipped. Raise "
                          "tokenizer.max_seq_len if answers are cut away, and check the dataset's columns "
                          "(column_map) and train_on_input")
    for report in reports:
        errors = report.problems(errors_only=True)
        if errors and data_errors == "error":
            raise ConfigError(report.key, f"'{report.source}': {'; '.join(errors)}. Fix the data, raise "
                              "tokenizer.max_seq_len, or set data_errors=warn to train anyway")
        problems = report.problems()
        if problems:
            _warn_once(f"Data check of {report.key} '{report.source}' ({report.num_samples} {report.unit}s"
                       f"{' in packs' if report.unit == 'document' else ''}, {report.num_tokens} trainable "
                       f"tokens): {'; '.join(problems)}." + (" Set data_errors=error to stop on these."
                                                            if errors else ""))


def _warn_once(message: str) -> None:
    if ranks.is_rank_zero():
        log.warning(message)
