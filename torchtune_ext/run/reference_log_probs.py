"""Reference log-probabilities computed once before training and stored with the run.

With ``precompute_reference_log_probs: true`` a preference run
(:class:`torchtune_ext.run.preference.PreferenceRun`) runs its reference
model over every training and validation pair once, before the first step,
and keeps ``[pairs, 2]`` summed log-probabilities (chosen, rejected; fp32
nats) in ``<output_dir>/reference_log_probs.pt``. Training and validation then
read them (:class:`torchtune_ext.train.preference.PrecomputedReference`) and
never run the reference; a resumed run reads the file and builds no reference
model at all.

The file carries a fingerprint of what its numbers depend on: the pairs as
tokenized (the data, the tokenizer and its ``max_seq_len``), the model config,
its base checkpoint files and the dtype. A file whose fingerprint differs
from the run's is refused in one line before the model is built.

Several data-parallel ranks share the work: each runs the reference on every
``world``-th micro-batch of pairs (a rank without one runs a masked stand-in,
as FSDP2 needs every rank in every forward), and one sum over the ranks gives
each rank the whole table; rank 0 writes the file.
"""

import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from torchtune_ext import ranks
from torchtune_ext.data.datasets import masked_copy
from torchtune_ext.errors import ConfigError
from torchtune_ext.train.objective import Prepared
from torchtune_ext.train.preference import reference_table

FILE_NAME = "reference_log_probs.pt"
KEY = "precompute_reference_log_probs"
PARTS = {"pairs": "pairs (data, tokenizer or tokenizer.max_seq_len)", "model": "model (config, base weights or dtype)"}


def run_fingerprint(cfg: Any, pairs_digest: str) -> Dict[str, str]:
    """What the reference's log-probabilities of a run depend on.

    Args:
        cfg: the validated recipe config (``model``, ``dtype``, ``checkpointer``).
        pairs_digest: :func:`torchtune_ext.data.preference.pairs_fingerprint` of the training pairs, then the
            validation pairs.

    Returns:
        dict: ``pairs`` (the digest) and ``model`` (the model config, dtype and the base checkpoint files'
        names and sizes, as text).
    """
    checkpoint_dir = Path(str(cfg.checkpointer.checkpoint_dir))
    files = cfg.checkpointer.get("checkpoint_files") or []
    names = list(files) if not hasattr(files, "keys") else [str(files)]
    sizes = {str(name): (checkpoint_dir / str(name)).stat().st_size if (checkpoint_dir / str(name)).is_file()
             else None for name in names}
    model = OmegaConf.to_yaml(cfg.model, resolve=True)
    return {"pairs": pairs_digest,
            "model": f"{model}dtype: {cfg.dtype}\ncheckpoint: {checkpoint_dir.resolve()} {sorted(sizes.items())}"}


def load_table(path: Path, fingerprint: Dict[str, str], num_pairs: int) -> Optional[torch.Tensor]:
    """The ``[num_pairs, 2]`` table of ``path`` if it exists and was computed for ``fingerprint``; None if
    there is no file.

    Raises:
        ConfigError: (key ``precompute_reference_log_probs``) a file that cannot be read, or whose
            fingerprint names other pairs or another model.
    """
    if not path.is_file():
        return None
    try:
        stored = torch.load(path, weights_only=True)
        table, theirs = stored["table"], stored["fingerprint"]
    except Exception as err:  # noqa: BLE001 -- any damage: one line
        raise ConfigError(KEY, f"'{path}' cannot be read ({type(err).__name__}): not a table a run wrote; "
                          "delete it to compute the reference log-probabilities again") from None
    other = [PARTS[part] for part in PARTS if theirs.get(part) != fingerprint[part]]
    if other or tuple(table.shape) != (num_pairs, 2):
        what = " and ".join(other) or f"number of pairs ({table.shape[0]}, this run {num_pairs})"
        raise ConfigError(KEY, f"'{path}' holds reference log-probabilities of other {what} than this run's; "
                          "delete it to compute them for this run, or train into another output_dir")
    return table.float()


def save_table(path: Path, table: torch.Tensor, fingerprint: Dict[str, str]) -> None:
    """Rank 0 writes ``{"table", "fingerprint"}`` to ``path`` atomically (a temporary file, then a rename)."""
    if not ranks.is_rank_zero():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save({"table": table.cpu(), "fingerprint": dict(fingerprint)}, partial)
    os.replace(partial, path)


def compute_table(reference: Callable[[Prepared], torch.Tensor], prepare: Callable[[Dict[str, Any]], Prepared],
                  loaders: Sequence[Any], collate: Callable[[List[Dict[str, Any]]], Dict[str, Any]], *,
                  batch_size: int, num_pairs: int, ignore_index: int, dp_rank: int = 0, dp_world_size: int = 1,
                  dp_group: Any = None) -> torch.Tensor:
    """``[num_pairs, 2]`` fp32 nats: ``reference`` over every pair of the ``loaders``' datasets (the training
    loader, then the validation loader: :class:`~torchtune_ext.data.step_loader.StepLoader` of pair samples
    with their ``pair_index``); every rank returns the whole table.

    First each loader's epoch 0 on this rank, the very micro-batches training (its first epoch) and
    validation will see: the sums are those a reference run inside the step would give, bit for bit (a
    sum of a few hundred fp32 log-probabilities depends on the rows it is computed with at the 1e-7
    relative level). Then the pairs epoch 0 leaves out (``max_steps_per_epoch``), ``batch_size`` at a
    time, dealt out over the ranks. Each rank's table is summed over ``dp_group``.
    """
    datasets = [loader.dataset for loader in loaders]

    def first_epochs():
        for loader in loaders:
            for step in loader.epoch(0):
                for micro_batch in step.micro_batches:
                    yield prepare(micro_batch)

    table, filled = _summed(*reference_table(reference, first_epochs(), num_pairs), dp_world_size, dp_group)
    missing = set((filled == 0).nonzero()[:, 0].tolist())
    if not missing:
        return table
    by_index = {}  # pair_index -> (dataset, item), for the pairs epoch 0 left out
    for dataset in datasets:
        for i in range(len(dataset)):
            pair_index = int(dataset[i]["pair_index"])
            if pair_index in missing:
                by_index[pair_index] = (dataset, i)
    chunks = [sorted(by_index)[start:start + batch_size] for start in range(0, len(by_index), batch_size)]

    def the_rest():
        for r in range(math.ceil(len(chunks) / dp_world_size)):
            k = r * dp_world_size + dp_rank
            if k < len(chunks):
                samples = [by_index[p][0][by_index[p][1]] for p in chunks[k]]
            else:  # this rank has no pairs left: a stand-in whose pairs are not counted
                dataset, i = by_index[chunks[0][0]]
                samples = [masked_copy(dataset[i], ignore_index)]
            yield prepare(collate(samples))

    rest, _ = _summed(*reference_table(reference, the_rest(), num_pairs), dp_world_size, dp_group)
    return torch.where((filled > 0).unsqueeze(1), table, rest)


def _summed(table: torch.Tensor, filled: torch.Tensor, dp_world_size: int, dp_group: Any):
    """Both summed over the data-parallel ranks (each pair was filled on one rank only)."""
    if dp_world_size == 1:
        return table, filled
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(dp_group) == "nccl" else "cpu"
    both = torch.cat([table, filled.unsqueeze(1)], dim=1).to(device)
    dist.all_reduce(both, group=dp_group)
    both = both.cpu()
    return both[:, :2].contiguous(), both[:, 2].contiguous()
