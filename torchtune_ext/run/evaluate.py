"""Exact evaluation: the loss and token metrics of a whole dataset, however it is batched.

The validation loss is the mean cross-entropy over every trainable token of
the validation set,

    val_loss = (sum over all samples, all ranks, of per-token CE) / (number of those tokens)

counted and reduced by :class:`torchtune_ext.train.accounting.TokenTally` exactly as
a training step is: labels shifted once (never across the documents of a
pack), tokens counted from that shifted tensor, the loss's sums accumulated in
float64 and summed over ranks in one all-reduce at the end, one division.
``val_token_accuracy`` and ``val_entropy`` are sums over the same tokens from
the same logits. So the numbers do not depend on ``batch_size_val``, on the
number of ranks, on padding or on packing, and a sample without a trainable
token (or a rank's label-masked stand-in) adds nothing. A mean of per-batch
means is not this quantity: it weighs the tokens of a short batch more.

Evaluation runs in eval mode under ``no_grad`` (no graph, no gradient: it
needs no memory beyond one micro-batch's forward), restores each module's
train/eval mode afterwards, and restores the RNG states it found, so training
continues with the same random stream and data order as without validation.
Under FSDP every rank runs the same number of forwards (the data is planned
by :class:`torchtune_ext.data.step_loader.StepLoader`, with stand-ins for ranks that run
out of samples).

In the recipes (:class:`Validator`): validation before training
(``run_val_at_start``), every ``run_val_every_n_steps`` optimizer steps, and
after the last step, each logged as one record with ``val_*`` keys.

A checkpoint folder can be evaluated on its own, with the same numbers::

    python -m torchtune_ext.evaluate --config <recipe config> \\
        checkpointer.checkpoint_dir=<output_dir>/step_<N> [--output result.json] [key=value ...]

It loads the folder with the recipes' own checks (:class:`~torchtune_ext.checkpoint.CheckpointManager`'s
load, :func:`~torchtune_ext.checkpoint.load_model_state` against the configured model,
:func:`~torchtune_ext.model.build.build_tokenizer`; a step folder is first checked against its
manifest, sizes and SHA-256), so a bad folder is one line and exit status 2. The JSON result
is printed and written to ``--output``, by default to the run's
``logs/evaluate/<folder>_<dataset>.json`` (a second evaluation of the same folder goes beside
the first, never over it); an ``--output`` file that exists is refused.
"""

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torch.utils.data import Dataset, Subset
from torchtune import utils
from tqdm import tqdm

from torchtune_ext import ranks
from torchtune_ext.checkpoint import (
    ADAPTER_WEIGHTS,
    MANIFEST,
    CheckpointManager,
    Progress,
    is_sharded,
    load_model_state,
    verify_checkpoint,
)
from torchtune_ext.config import COMMON_KEYS, DISTRIBUTED_KEYS, LORA_KEYS, validate, validation_enabled
from torchtune_ext.config.upstream import describe_model
from torchtune_ext.data.check import model_vocabulary
from torchtune_ext.data.datasets import build_dataset, make_collate
from torchtune_ext.data.step_loader import StepLoader
from torchtune_ext.data.tokenizer import build_tokenizer
from torchtune_ext.errors import EXIT_IO_ERROR, EXIT_USER_ERROR, ConfigError, UserError
from torchtune_ext.train.accounting import TokenTally, TokenTotals, count_trainable_tokens
from torchtune_ext.train.loss import SummedCrossEntropyLoss, build_loss, shift_labels
from torchtune_ext.train.objective import as_objective

log = utils.get_logger("INFO")


def perplexity(loss: float) -> float:
    """``exp(loss)``, the perplexity of a mean cross-entropy in nats (inf past float range)."""
    return math.exp(loss) if loss < 709.0 else math.inf


@dataclass
class EvalResult:
    """What an evaluation pass measured.

    Attributes:
        totals: global token count and sums (all ranks).
        num_samples (int): samples evaluated (all ranks, stand-ins excluded).
        seconds (float): wall time of the pass.
    """

    totals: TokenTotals
    num_samples: int
    seconds: float
    unit: str = "tokens"

    def metrics(self) -> Dict[str, Any]:
        """``loss`` (nats per trainable token), ``perplexity``, the loss's token
        metrics (``token_accuracy``: fraction; ``entropy``: nats per token),
        ``num_tokens``, ``num_samples``, ``seconds``. Without a trainable token
        the means are absent (never 0 or NaN).

        Unit ``"pairs"`` (a preference objective): ``loss`` and the pair metrics as means over the pairs,
        ``num_pairs``, ``num_tokens`` (non-padding tokens of both responses), no perplexity."""
        if self.unit == "pairs":
            sums = dict(self.totals.sums)
            tokens = int(round(sums.pop("num_tokens", 0.0)))
            pairs = self.totals.num_tokens
            out = {name: value / pairs for name, value in sums.items()} if pairs else {}
            out.update(num_pairs=pairs, num_tokens=tokens, num_samples=self.num_samples, seconds=self.seconds)
            return out
        out: Dict[str, Any] = {}
        means = self.totals.means()
        if means:
            out["loss"] = means.pop("loss")
            out["perplexity"] = perplexity(out["loss"])
            out.update(means)
        out.update(num_tokens=self.totals.num_tokens, num_samples=self.num_samples, seconds=self.seconds)
        return out


def evaluate(model: nn.Module, objective: Any, loader: StepLoader, *,
             device: torch.device, dp_group: Optional[dist.ProcessGroup] = None,
             progress_bar: bool = False) -> EvalResult:
    """One pass over ``loader``'s dataset: the exact mean loss and token metrics.

    Args:
        model: the model (possibly LoRA, FSDP2-sharded); every rank must call this.
        objective: what the pass measures (:class:`~torchtune_ext.train.objective.Objective`), or
            a sum-reduced token loss (then :class:`~torchtune_ext.train.objective.TokenObjective`):
            the same sums and count as training's, so validation is exact in the same way.
        loader: plans this rank's micro-batches (one pass of ``epoch(0)``, in
            dataset order when built with ``shuffle=False``).
        device: where the model lives.
        dp_group: data-parallel group (None: default group, or none).
        progress_bar: show a ``validation`` bar of the passes' steps (rank 0; a
            pass over a large set takes minutes, and the training bar stands still).

    Returns:
        EvalResult, identical on every rank.
    """
    start = time.perf_counter()
    objective = as_objective(objective)
    tally = TokenTally(objective.metric_names, device, objective.ignore_index)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), _random_state_unchanged(device):
            bar = tqdm(total=len(loader), desc="validation", leave=False, dynamic_ncols=True,
                       disable=not (progress_bar and ranks.is_rank_zero()))
            for step_data in loader.epoch(0):
                for micro_batch in step_data.micro_batches:
                    prepared = objective.prepare(micro_batch, device)
                    tally.add_count(prepared.count)
                    # every rank forwards every slot (FSDP's all-gathers must match), stand-ins included
                    tally.add(objective(model, prepared))
                bar.update()
        bar.close()
    finally:
        for module, training in modes:
            module.training = training
    return EvalResult(tally.totals(dp_group), len(loader), time.perf_counter() - start, unit=objective.unit)


@contextlib.contextmanager
def _random_state_unchanged(device: torch.device) -> Iterator[None]:
    """Restore the Python, NumPy, torch CPU and (this rank's) accelerator RNG states on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    accelerators = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=accelerators, device_type=device.type if accelerators else None):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def has_trainable_token(dataset: Dataset, collate_fn, ignore_index: int) -> bool:
    """Whether any sample of ``dataset`` has a trainable token after the label shift.

    Stops at the first one found, so it usually reads a single sample.
    """
    for i in range(len(dataset)):
        batch = collate_fn([dataset[i]])
        labels = shift_labels(batch["labels"], ignore_index, batch.get("document_ids"))
        if count_trainable_tokens(labels, ignore_index) > 0:
            return True
    return False


def build_eval_loader(cfg: DictConfig, tokenizer: Any, key: str, *, ignore_index: int,
                      dp_rank: int = 0, dp_world_size: int = 1, model_vocab_size: Optional[int] = None) -> StepLoader:
    """A loader for one evaluation pass over the dataset of config key ``key``.

    Reads ``batch_size_val`` (samples per micro-batch per rank), ``data_errors``,
    ``max_val_samples`` (the first N samples in dataset order: the same samples
    whatever the batch size or number of ranks), ``group_by_length`` and
    ``max_tokens_per_micro_batch``. No shuffling: every pass sees the same samples. ``model_vocab_size``:
    the rows of the model's token embedding; a larger token id in the data is refused (None: unknown).

    Raises:
        ConfigError: (naming ``key``) as :func:`torchtune_ext.data.datasets.build_dataset`.
    """
    dataset, packed = build_dataset(cfg[key], tokenizer, key=key, ignore_index=ignore_index,
                                    data_errors=cfg.data_errors, vocabulary=model_vocabulary(cfg, model_vocab_size))
    if cfg.max_val_samples is not None and cfg.max_val_samples < len(dataset):
        dataset = Subset(dataset, range(cfg.max_val_samples))
    return StepLoader(
        dataset, make_collate(packed, tokenizer.pad_id, ignore_index), batch_size=cfg.batch_size_val,
        shuffle=False, ignore_index=ignore_index, dp_rank=dp_rank, dp_world_size=dp_world_size,
        group_by_length=cfg.group_by_length, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        require_sample_per_rank=False,
    )


def build_val_loader(cfg: DictConfig, tokenizer: Any, *, ignore_index: int, dp_rank: int = 0,
                     dp_world_size: int = 1, model_vocab_size: Optional[int] = None) -> Optional[StepLoader]:
    """The recipe's validation loader: None when validation is off, or (with a
    warning) when no sample of ``dataset_val`` has a trainable token.

    Raises:
        ConfigError: (key ``dataset_val``) if it cannot be loaded or is empty.
    """
    if not validation_enabled(cfg):
        return None
    loader = build_eval_loader(cfg, tokenizer, "dataset_val", ignore_index=ignore_index, dp_rank=dp_rank,
                               dp_world_size=dp_world_size, model_vocab_size=model_vocab_size)
    if not has_trainable_token(loader.dataset, loader.collate_fn, ignore_index):
        utils.log_rank_zero(log, f"dataset_val: none of its {len(loader)} samples has a trainable token after "
                                 "the label shift (every label masked, or one token long): no validation runs "
                                 "and val_loss is not logged", level=logging.WARNING)
        return None
    return loader


class Validator:
    """Validation on the recipe's schedule: before training (``run_val_at_start``),
    every ``run_val_every_n_steps`` optimizer steps, and after the last step.

    Each pass logs one record (see :meth:`run`). The schedule counts global
    optimizer steps, so a resumed run validates at the same steps as an
    uninterrupted one. With ``loader`` None it does nothing.

    Args:
        cfg: the validated recipe config.
        loader: from :func:`build_val_loader`.
        model, objective, logger, device: the recipe's (``objective``: as in :func:`evaluate`).
        dp_group: the data-parallel group the sums are reduced over (:func:`evaluate`).
    """

    def __init__(self, cfg: DictConfig, loader: Optional[StepLoader], model: nn.Module,
                 objective: Any, logger: Any, device: torch.device,
                 dp_group: Optional[dist.ProcessGroup] = None):
        self._loader, self._model, self._objective = loader, model, objective
        self._logger, self._device, self._dp_group = logger, device, dp_group
        self.every_n_steps: Optional[int] = cfg.run_val_every_n_steps
        self.at_start_enabled: bool = cfg.run_val_at_start
        self.epochs: int = cfg.epochs

    def is_due(self, step: int, epoch: int = 0, end_of_epoch: bool = False) -> bool:
        """Validation is due after optimizer step ``step`` (0: before training)."""
        if self._loader is None:
            return False
        if step == 0:
            return self.at_start_enabled
        final = end_of_epoch and epoch == self.epochs - 1
        return final or bool(self.every_n_steps and step % self.every_n_steps == 0)

    def at_start(self, progress: Progress) -> Optional[Dict[str, Any]]:
        """Before the first step of a new run (not on resume), if ``run_val_at_start``."""
        return self.run(progress) if progress.step == 0 and self.is_due(0) else None

    def after_step(self, progress: Progress, end_of_epoch: bool) -> Optional[Dict[str, Any]]:
        """After an optimizer step (``progress`` already counts it); ``end_of_epoch``:
        no step of this epoch follows."""
        if self.is_due(progress.step, progress.epoch, end_of_epoch):
            return self.run(progress)
        return None

    def run(self, progress: Progress) -> Dict[str, Any]:
        """Evaluate now and log ``step``, ``epoch``, ``tokens_seen`` and ``val_loss``,
        ``val_perplexity``, ``val_token_accuracy``, ``val_entropy``, ``val_num_tokens``,
        ``val_num_samples``, ``val_seconds``. Returns the record."""
        result = evaluate(self._model, self._objective, self._loader, device=self._device, dp_group=self._dp_group,
                          progress_bar=True)
        record: Dict[str, Any] = {"step": progress.step, "epoch": progress.epoch, "tokens_seen": progress.tokens_seen}
        record.update({f"val_{k}": v for k, v in result.metrics().items()})
        self._logger.log(record)
        utils.log_rank_zero(log, f"Validation after step {progress.step}: {describe(result)}")
        return record


def describe(result: EvalResult) -> str:
    """One line: loss, perplexity, accuracy, tokens, samples."""
    m = result.metrics()
    if "loss" not in m:
        return f"no trainable token in {m['num_samples']} samples"
    if "num_pairs" in m:
        return (f"loss {m['loss']:.4f}, rewards/accuracies {m['rewards/accuracies']:.4f}, rewards/margins "
                f"{m['rewards/margins']:.4f} over {m['num_pairs']} pairs ({m['seconds']:.1f} s)")
    accuracy = f", token_accuracy {m['token_accuracy']:.4f}" if "token_accuracy" in m else ""  # loss.token_metrics
    return (f"loss {m['loss']:.4f}, perplexity {m['perplexity']:.4g}{accuracy} over {m['num_tokens']} tokens of "
            f"{m['num_samples']} samples ({m['seconds']:.1f} s)")


# ---------------------------------------------------------------------------
# Evaluating a checkpoint folder from the command line

# Arguments of torchtune's LoRA model builders that the plain builder does not take.
_LORA_ARGS = ("lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output", "lora_rank", "lora_alpha",
              "lora_dropout", "use_dora", "quantize_base")


def base_model_config(cfg_model: DictConfig) -> DictConfig:
    """The plain model config of a LoRA model config (``lora_X`` -> ``X``, LoRA arguments dropped).

    A merged LoRA checkpoint holds plain weights W + (alpha / r) B A, and a
    LoRA config's base checkpoint plain weights: both load into the plain model.
    Any other config is returned as it is.

    Raises:
        ConfigError: (key ``model``) if the plain builder cannot be found.
    """
    component = str(cfg_model._component_)
    module_name, _, name = component.rpartition(".")
    prefix = next((p for p in ("lora_", "qlora_") if name.startswith(p)), None)
    if prefix is None:
        return cfg_model
    base = name[len(prefix):]
    try:
        getattr(importlib.import_module(module_name), base)
    except (ImportError, AttributeError):
        raise ConfigError("model", f"{component} is a LoRA model and '{module_name}.{base}' does not exist to load "
                          "the merged weights into; pass the plain model, e.g. model._component_=<module>.<name> "
                          "and remove the lora_* arguments") from None
    args = {k: v for k, v in OmegaConf.to_container(cfg_model).items() if k not in _LORA_ARGS}
    args["_component_"] = f"{module_name}.{base}"
    return OmegaConf.create(args)


def _configured_files_exist(cfg_checkpointer: DictConfig) -> bool:
    """Whether every file of a list ``checkpoint_files`` is in ``checkpoint_dir`` (other forms: assumed so)."""
    files = cfg_checkpointer.get("checkpoint_files")
    if not isinstance(files, (list, ListConfig)):
        return True
    return all((Path(str(cfg_checkpointer.get("checkpoint_dir"))) / str(f)).is_file() for f in files)


def prepare_checkpoint_config(cfg: DictConfig) -> DictConfig:
    """Point the config at the weights in ``checkpointer.checkpoint_dir``, as a plain model.

    A folder written by the recipes (``step_<N>/`` with ``checkpoint.json``)
    lists its weight files in the manifest; they replace ``checkpoint_files``.
    A Hugging Face folder with a safetensors index (an export) whose configured
    ``checkpoint_files`` are not in it: the files its index names.
    LoRA configs get their plain model (:func:`base_model_config`): a LoRA step
    folder holds the merged model, a base folder the base model.

    The folder is checked against its manifest first: sizes, and the SHA-256 of
    every file unless ``verify_checkpoint_hashes`` is false.

    Raises:
        ConfigError: (key ``checkpointer.checkpoint_dir``) if the folder holds
            only a LoRA adapter (``save_adapter_weights_only=true``) or does not
            match its manifest.
    """
    cfg = cfg.copy()
    folder = Path(str(cfg.checkpointer.get("checkpoint_dir")))
    if (folder / MANIFEST).is_file():
        verify = cfg.get("verify_checkpoint_hashes", COMMON_KEYS["verify_checkpoint_hashes"].default)
        COMMON_KEYS["verify_checkpoint_hashes"].check("verify_checkpoint_hashes", verify)
        files = verify_checkpoint(folder, content=verify, key="checkpointer.checkpoint_dir")["files"]
        weights = sorted(n for n in files if n.endswith(".safetensors") and not n.startswith("adapter"))
        if not weights and is_sharded(folder):  # a periodic or stop's sharded step: shards only
            raise ConfigError("checkpointer.checkpoint_dir", f"'{folder}' is a sharded checkpoint (its weights are "
                              "dcp/ shards, not a Hugging Face folder): export it first with python -m "
                              f"torchtune_ext.checkpoint.export {folder} {folder}_hf, then evaluate with "
                              f"checkpointer.checkpoint_dir={folder}_hf")
        if not weights:
            hint = " (saved with save_adapter_weights_only=true)" if ADAPTER_WEIGHTS in files else ""
            raise ConfigError("checkpointer.checkpoint_dir", f"'{folder}' holds no model weights{hint}; evaluate a "
                              "checkpoint saved with the merged model (save_adapter_weights_only=false)")
        cfg.checkpointer.checkpoint_files = weights
    elif (folder / "model.safetensors.index.json").is_file() and not _configured_files_exist(cfg.checkpointer):
        # a Hugging Face folder (an export of a sharded step): its index names its weight files
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text()).get("weight_map", {})
        cfg.checkpointer.checkpoint_files = sorted(set(weight_map.values()))
    cfg.model = base_model_config(cfg.model)
    return cfg


@dataclass
class CheckpointEvaluation:
    """A checkpoint loaded for evaluation (:func:`load_checkpoint_for_evaluation`)."""

    cfg: DictConfig
    dataset_key: str
    model: nn.Module
    loss_fn: SummedCrossEntropyLoss
    loader: StepLoader
    device: torch.device


def load_checkpoint_for_evaluation(cfg: DictConfig, dataset_key: Optional[str] = None) -> CheckpointEvaluation:
    """Check the config and load the weights in ``cfg.checkpointer.checkpoint_dir`` (one process).

    Args:
        cfg: a recipe config (YAML plus overrides), not yet validated.
        dataset_key: ``dataset_val`` or ``dataset``; default ``dataset_val`` if
            the config has one, else ``dataset``.

    Raises:
        ConfigError: a bad config value or input file, naming the key.
    """
    from torchtune import config as tt_config
    from torchtune import training

    key = dataset_key or ("dataset_val" if cfg.get("dataset_val") is not None else "dataset")
    cfg = prepare_checkpoint_config(cfg)
    extra = {**DISTRIBUTED_KEYS, "save_adapter_weights_only": LORA_KEYS["save_adapter_weights_only"]}
    cfg = validate(cfg, extra_keys=extra, evaluate_on=key)
    device = utils.get_device(None if cfg.device == "auto" else cfg.device)
    dtype = training.get_dtype(cfg.dtype, device=device)

    tokenizer = build_tokenizer(cfg.tokenizer)
    loss_fn = build_loss(cfg.loss)
    loader = build_eval_loader(cfg, tokenizer, key, ignore_index=loss_fn.ignore_index)  # data first: fails early
    with tempfile.TemporaryDirectory() as scratch:  # the checkpointer wants an output folder; it writes nothing here
        # the recipes' load, with their one-line errors (truncated weights, a config.json that is garbage,
        # missing or does not fit the weights)
        state = CheckpointManager(cfg.checkpointer, scratch).load()[training.MODEL_KEY]
    with training.set_default_dtype(dtype), device:
        model = tt_config.instantiate(cfg.model)
    # another model's folder: its first mismatching key, not torch's list of every key
    load_model_state(model, state, str(cfg.checkpointer.checkpoint_dir), model_name=describe_model(cfg))
    del state
    loss_fn.take_output_projection(model)  # the model returns hidden states; the loss projects
    return CheckpointEvaluation(cfg, key, model, loss_fn, loader, device)


def evaluate_checkpoint(cfg: DictConfig, dataset_key: Optional[str] = None) -> Dict[str, Any]:
    """Evaluate the weights in ``cfg.checkpointer.checkpoint_dir`` on a dataset of the config.

    Args: as :func:`load_checkpoint_for_evaluation`.

    Returns:
        ``checkpoint_dir``, ``dataset`` (the key) and :meth:`EvalResult.metrics`.

    Raises:
        ConfigError: a bad config value or input file, naming the key.
    """
    run = load_checkpoint_for_evaluation(cfg, dataset_key)
    result = evaluate(run.model, run.loss_fn, run.loader, device=run.device)
    folder = str(run.cfg.checkpointer.checkpoint_dir)
    log.info(f"{folder} on {run.dataset_key}: {describe(result)}")
    return {"checkpoint_dir": folder, "dataset": run.dataset_key, **result.metrics()}


def default_output(cfg: DictConfig, dataset_key: str) -> Optional[Path]:
    """Where the command writes its result without ``--output``: the run's ``logs/evaluate/`` folder.

    For a step folder a recipe saved (it has a manifest), the logs of the run
    it belongs to (its parent folder); for another folder, those of the
    config's ``output_dir``; None if the config has none. The file is
    ``<folder name>_<dataset key>.json``; when that exists, ``.2.json``,
    ``.3.json``, ...: an earlier result is never overwritten.
    """
    folder = Path(str(cfg.checkpointer.checkpoint_dir))
    if (folder / MANIFEST).is_file():
        run_dir = folder.parent
    elif cfg.get("output_dir"):
        run_dir = Path(str(cfg.output_dir))
    else:
        return None
    target = run_dir / "logs" / "evaluate" / f"{folder.resolve().name}_{dataset_key}.json"
    index = 1
    while target.exists():
        index += 1
        target = target.with_name(f"{folder.resolve().name}_{dataset_key}.{index}.json")
    return target


def _check_output(path: str) -> Optional[str]:
    """Why ``--output`` cannot be written, checked before any work (None: it can)."""
    if os.path.lexists(path):
        return f"--output '{path}' exists: nothing is overwritten; remove it or choose another file"
    parent = Path(path).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"--output '{path}' cannot be created: '{parent}' is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--output '{path}' cannot be created: '{parent}' is not writable"
    return None


def _write_result(path: Path, text: str) -> None:
    """Write ``text`` to a new file (exclusive create: a file that appeared since the check is not overwritten)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x") as f:
        f.write(text + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m torchtune_ext.evaluate``: print and write one JSON object; exit 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_ext.evaluate",
        description="Evaluate a checkpoint folder on a dataset of a recipe config: exact loss, perplexity, "
                    "token accuracy and entropy over every trainable token (the numbers the recipes log as val_*).")
    parser.add_argument("--config", required=True, help="a recipe config (YAML)")
    parser.add_argument("--dataset", choices=("dataset_val", "dataset"), default=None,
                        help="the config key of the dataset to evaluate on (default: dataset_val if set, else dataset)")
    parser.add_argument("--output", default=None,
                        help="write the JSON result to this new file (default: the run's "
                             "logs/evaluate/<folder>_<dataset>.json; an existing file is never overwritten)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. checkpointer.checkpoint_dir=outputs/run/step_6")
    args = parser.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides are key=value, got {bad[0]!r}")
    if not Path(args.config).is_file():
        print(f"error: --config '{args.config}' does not exist", file=sys.stderr)
        return EXIT_USER_ERROR
    refused = _check_output(args.output) if args.output else None
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))
        result = evaluate_checkpoint(cfg, args.dataset)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    text = json.dumps(result)
    print(text)
    output = Path(args.output) if args.output else default_output(cfg, result["dataset"])
    if output is None:
        print("The result is not written to a file (the config has no output_dir): --output FILE writes it",
              file=sys.stderr)
        return 0
    try:
        _write_result(output, text)
    except OSError as err:
        print(f"error: the result could not be written to '{output}' ({type(err).__name__}: {err}); it is "
              "printed above", file=sys.stderr)
        return EXIT_IO_ERROR  # as a failed checkpoint save
    print(f"Result written to {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
