"""Run one recipe (ours or upstream torchtune's) with benchmark probes, in this process.

    python -m bench.launch --out <probe.json> [--upstream] <recipe> --config <cfg> [key=value ...]
    torchrun --standalone --nproc_per_node 2 bench/launch.py --out <dir/probe.json> ...

Not a training entry point: the benchmark (``python -m bench``) starts it.
Like ``tune run``, it runs the recipe as ``__main__`` in this process
(``<recipe>`` is a file path; ours: ``recipes/x.py``, upstream: the
installed ``recipes/x.py`` of torchtune's wheel), after installing probes
that time and measure both kinds of recipe the same way:

* **Step ends.** The wall-clock time and the peak memory so far at every
  step's metric-logging call (ours: ``MetricLogger.log``; upstream:
  ``DiskLogger.log_dict``). The period between two consecutive step ends
  is the step time: fetching and collating the step's micro-batches,
  forward, backward, optimizer step and logging, for both recipes alike.
* **Tokens.** Every micro-batch passes through torchtune's
  ``padded_collate_sft`` (both recipes use it); a wrapper records its
  non-padding tokens and its trainable labels before and after the
  next-token shift, so tokens/sec is computed from the same definition for
  both, and the two runs can be checked to have seen the same data.
* **Peak memory.** Reset when the first micro-batch is collated (so model
  loading does not count) and read after every optimizer step, on every
  rank: CUDA max memory allocated, or the process's peak RSS (Linux VmHWM). Our recipes' own
  per-step reset is switched off so the two are measured alike.
* **Accounting cost** (ours only): wall time spent in the token count,
  the global sums over ranks, building the step record and logging. With
  several ranks, the wait for the slowest rank at the step's first
  collective is timed apart, as ``peer_wait`` (see :func:`_peer_wait_then`).
* **Fixed shapes** (``--pad-to N``): every micro-batch is right-padded to N
  tokens (labels ``ignore_index``), so peak memory does not depend on which
  samples a run happens to draw; tokens/sec still counts non-padding tokens.
* **Our initial adapter** (``--adapter-seed N``, upstream LoRA runs): the
  adapters of upstream's model are set to the ones our recipes start from
  (:class:`OurInitialAdapter`), so a loss difference measures the training
  step, not two different random draws of LoRA's A matrices.

Upstream's end-of-epoch checkpoint is not written (its checkpointer's save
is a no-op here): it happens after the last step and would only cost time
and 0.5 GB of disk per run. Ours runs with ``save_final_checkpoint=false``.

With torchrun, every rank writes ``<out stem>_rank<r>.json``.
"""

import argparse
import atexit
import copy
import functools
import gc
import json
import os
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from torchtune_ext.model.build import initialize_adapters

IGNORE_INDEX = -100


def _vm_hwm_bytes() -> Optional[int]:
    from torchtune_ext.run.metrics import lifetime_peak_rss_bytes

    return lifetime_peak_rss_bytes()


def _reset_cpu_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


class Probe:
    """Collects the measurements of one process; written as JSON at exit."""

    def __init__(self, out: Path, impl: str, recipe: str, argv: List[str]):
        self.out = out
        self.rank = int(os.environ.get("RANK", "0"))
        self.data: Dict[str, Any] = {
            "impl": impl, "recipe": recipe, "argv": argv, "rank": self.rank,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "torch_threads": torch.get_num_threads(),
            "micro_batches": [],    # one dict per collated micro-batch, in order
            "step_ends": [],        # one dict per logged step (rank 0 of upstream's distributed recipes only)
            "optimizer_steps": [],  # peak memory after every optimizer step, on every rank
            "accounting": defaultdict(list),  # piece -> [(step index, seconds)]
            "start_time": time.time(),
        }
        self._peak_started = False
        self._cuda = False

    # ---------------------------------------------------------------- memory
    def start_peak_window(self) -> None:
        if self._peak_started:
            return
        self._peak_started = True
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_cpu_peak()

    def peak_bytes(self) -> Optional[int]:
        if self._cuda:
            return int(torch.cuda.max_memory_allocated())
        return _vm_hwm_bytes()

    # ----------------------------------------------------------------- hooks
    def step_end(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self.data["step_ends"].append({"time": time.perf_counter(), "peak_bytes": self.peak_bytes()})

    def optimizer_step(self, *_) -> None:
        self.data["optimizer_steps"].append({"time": time.perf_counter(), "peak_bytes": self.peak_bytes()})

    def micro_batch(self, batch: List[Dict[str, Any]], collated: Dict[str, Any],
                    step_index: Optional[int] = None) -> None:
        """Record a collated micro-batch; ``step_index`` (0-based optimizer step) defaults to the steps finished."""
        self.start_peak_window()
        non_padding = trainable_pre = trainable_post = 0
        for sample in batch:
            labels = list(sample["labels"])
            non_padding += len(sample["tokens"])
            trainable_pre += sum(1 for x in labels if x != IGNORE_INDEX)
            trainable_post += sum(1 for x in labels[1:] if x != IGNORE_INDEX)
        tokens = collated.get("tokens")
        self.data["micro_batches"].append({
            "samples": len(batch), "non_padding_tokens": non_padding,
            "trainable_tokens_pre_shift": trainable_pre, "trainable_tokens": trainable_post,
            "padded_shape": list(tokens.shape) if isinstance(tokens, torch.Tensor) else None,
            # the optimizer steps finished so far: the step this micro-batch belongs to (0-based);
            # counted by both hooks, since upstream's distributed recipes log (step_end) on rank 0 only
            "step_index": (max(len(self.data["step_ends"]), len(self.data["optimizer_steps"]))
                           if step_index is None else step_index),
        })

    def timed(self, piece: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.data["accounting"][piece].append((len(self.data["step_ends"]), time.perf_counter() - start))
        return wrapper

    def write(self) -> None:
        self.data["end_time"] = time.time()
        self.data["final_peak_bytes"] = self.peak_bytes()
        path = self.out
        if self.data["world_size"] > 1:
            path = self.out.with_name(f"{self.out.stem}_rank{self.rank}{self.out.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(path)


def _pad_to(collated: Dict[str, Any], length: int, padding_idx: int, ignore_idx: int) -> Dict[str, Any]:
    """Right-pad ``tokens`` and ``labels`` ``[batch, seq]`` to ``length`` (padding adds no trainable token)."""
    extra = length - collated["tokens"].size(1)
    if extra > 0:
        collated["tokens"] = torch.nn.functional.pad(collated["tokens"], (0, extra), value=padding_idx)
        collated["labels"] = torch.nn.functional.pad(collated["labels"], (0, extra), value=ignore_idx)
    return collated


def _wrap_collate(probe: Probe, pad_to: Optional[int] = None) -> None:
    import torchtune.data
    import torchtune.data._collate as collate_module

    original = collate_module.padded_collate_sft

    @functools.wraps(original)
    def padded_collate_sft(batch, *args, **kwargs):
        collated = original(batch, *args, **kwargs)
        if pad_to:
            # both recipes pass these by keyword
            collated = _pad_to(collated, pad_to, kwargs.get("padding_idx", 0), kwargs.get("ignore_idx", IGNORE_INDEX))
        probe.micro_batch(batch, collated)
        return collated

    collate_module.padded_collate_sft = padded_collate_sft
    torchtune.data.padded_collate_sft = padded_collate_sft


def _install_ours(probe: Probe) -> None:
    from torchtune_ext.data import datasets, step_loader
    from torchtune_ext.run.metrics import MetricLogger, reporter
    from torchtune_ext.train import accounting, objective

    if hasattr(datasets, "padded_collate_sft"):  # bound at import time
        datasets.padded_collate_sft = sys.modules["torchtune.data"].padded_collate_sft
    as_pack = step_loader.collate_as_pack

    @functools.wraps(as_pack)
    def collate_as_pack(batch):  # pack_micro_batches: looked up by StepLoader.load_step at run time
        collated = as_pack(batch)
        probe.micro_batch(batch, collated)
        return collated

    step_loader.collate_as_pack = collate_as_pack
    original_log = MetricLogger.log

    def log(self, record):
        probe.step_end()
        return original_log(self, record)

    MetricLogger.log = probe.timed("logging", log)
    # The recipes reset the peak at every step (the step reporter does); here it is measured from the first
    # micro-batch.
    reporter.reset_peak_memory = lambda device: None
    if hasattr(reporter, "step_record"):
        reporter.step_record = probe.timed("step_record", reporter.step_record)
    accounting.count_trainable_tokens = probe.timed("count_tokens", accounting.count_trainable_tokens)
    objective.prepare_micro_batch = probe.timed("prepare", objective.prepare_micro_batch)
    accounting.global_sum = _peer_wait_then(probe, probe.timed("global_sum", accounting.global_sum))


def _peer_wait_then(probe: Probe, timed_global_sum: Callable) -> Callable:
    """Time the wait for the other ranks apart from the all-reduce itself.

    The step's first collective is where a rank that finished its previous
    step (or its data loading) early waits for the slowest rank. Without our
    token all-reduce that wait would happen at FSDP's first all-gather of the
    forward instead (upstream's case): it is not a cost of the accounting. A
    barrier just before the first global sum of each step absorbs it, and is
    timed as ``peer_wait``; ``global_sum`` then times the collective alone.
    """
    import torch.distributed as dist

    waited_for = set()

    @functools.wraps(timed_global_sum)
    def global_sum(*args, **kwargs):
        step_index = len(probe.data["step_ends"])
        if dist.is_available() and dist.is_initialized() and step_index not in waited_for:
            waited_for.add(step_index)
            probe.timed("peer_wait", dist.barrier)()
        return timed_global_sum(*args, **kwargs)

    return global_sum


def install_upstream(probe: Probe) -> None:
    from torchtune.training import metric_logging
    from torchtune.training.checkpointing import _checkpoint_client, _checkpointer

    original_log_dict = metric_logging.DiskLogger.log_dict

    def log_dict(self, payload, step):
        probe.step_end()
        return original_log_dict(self, payload, step)

    metric_logging.DiskLogger.log_dict = log_dict

    def skip_save(self, *args, **kwargs):
        print("bench.launch: upstream checkpoint save skipped (benchmark)", file=sys.stderr)

    _checkpointer.FullModelHFCheckpointer.save_checkpoint = skip_save
    _checkpoint_client.CheckpointClient.save_checkpoint = skip_save

    if not torch.cuda.is_available():
        # Upstream's LoRA distributed recipe asks for "cuda:nccl,cpu:gloo", which a
        # CPU-only PyTorch refuses ("doesn't have NCCL built in"); its tensors are
        # all on CPU here, so plain gloo is what that backend string would use.
        import torch.distributed as dist

        original_init = dist.init_process_group

        @functools.wraps(original_init)
        def init_process_group(backend=None, *args, **kwargs):
            if isinstance(backend, str) and "nccl" in backend:
                backend = "gloo"
            return original_init(backend, *args, **kwargs)

        dist.init_process_group = init_process_group

        # Upstream's distributed recipes log CUDA memory stats after loading the
        # model whatever the device, and torchtune raises on CPU. Report zeros
        # (the benchmark measures memory itself).
        from torchtune import training

        original_stats = training.get_memory_stats

        @functools.wraps(original_stats)
        def get_memory_stats(device, reset_stats=True):
            if torch.device(device).type == "cpu":
                return {"peak_memory_active": 0.0, "peak_memory_alloc": 0.0, "peak_memory_reserved": 0.0}
            return original_stats(device, reset_stats)

        training.get_memory_stats = get_memory_stats
        # ... and empty the device cache before training: torch.cpu has no empty_cache.
        training.cleanup_before_training = lambda: gc.collect()


class OurInitialAdapter:
    """Start upstream's LoRA recipes from the adapter our recipes start from.

    Both sides draw LoRA's A matrices (kaiming-uniform) and set B to zero, but
    from different random streams: ours from a generator seeded with the run's
    seed alone (:func:`torchtune_ext.model.build.initialize_adapters`, the same
    adapter on any device and world size), upstream's single-device recipe
    from the global stream after the base weights drew from it, its
    distributed recipe after sharding. With B = 0 the losses agree until an
    update with a non-zero learning rate has moved B (with the configs'
    ``num_warmup_steps: 2`` the first one is step 2, so they part at step 3);
    from there on each side trains its own, equally valid, initial adapter.
    Replacing upstream's draw by ours makes the comparison one of the training
    steps alone. Only upstream's random draw is replaced: its model, loading,
    optimizer, schedule, clipping and loop run unchanged.

    Two hooks into torchtune functions both upstream LoRA recipes call by name:

    * ``set_trainable_params(model, ...)``, right after the model is built.
      Single device (model on its device): the adapters are re-initialized
      there with our function. Distributed (model on the meta device, sharded
      and initialized later): our adapter is computed on CPU from a copy and
      kept for the next hook.
    * ``load_from_full_model_state_dict`` (distributed only): after upstream
      loads the base weights (its adapters are initialized by then), the kept
      adapter is loaded through the same function, into the sharded model.

    DoRA magnitudes are left to upstream: both sides compute them from the
    base weights. ``applied`` counts the adapter tensors set from our draw.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self.applied = 0
        self._pending: Optional[Dict[str, torch.Tensor]] = None

    def wrap_set_trainable_params(self, original: Callable) -> Callable:
        """``torchtune.modules.peft.set_trainable_params``, our initial adapter set first."""
        @functools.wraps(original)
        def set_trainable_params(model, adapter_params, *args, **kwargs):
            adapters = [m for m in model.modules() if hasattr(m, "adapter_params") and hasattr(m, "lora_a")]
            if adapters and adapters[0].lora_a.weight.is_meta:
                # a copy of the meta model costs nothing; its adapters come back full size on CPU
                draft = copy.deepcopy(model)
                initialize_adapters(draft, self.seed)
                self._pending = {name: value.detach().clone() for name, value in draft.state_dict().items()
                                 if ".lora_a." in name or ".lora_b." in name}
            elif adapters:
                initialize_adapters(model, self.seed)
                self.applied = 2 * len(adapters)
            return original(model, adapter_params, *args, **kwargs)

        return set_trainable_params

    def wrap_load_from_full_model_state_dict(self, original: Callable) -> Callable:
        """``torchtune.training.load_from_full_model_state_dict``, the kept adapter loaded after the base weights."""

        @functools.wraps(original)
        def load_from_full_model_state_dict(model, full_sd, device, *args, **kwargs):
            result = original(model, full_sd, device, *args, **kwargs)
            if self._pending is not None and not any(".lora_" in name for name in full_sd):
                adapter, self._pending = self._pending, None
                original(model, adapter, device, *args, **kwargs)
                self.applied = len(adapter)
            return result  # the base load's missing keys, as upstream checks them

        return load_from_full_model_state_dict

    def install(self) -> None:
        """Patch both hooks; call before the recipe module is imported (it binds the names then)."""
        import torchtune.modules.peft as peft
        from torchtune import training

        peft.set_trainable_params = self.wrap_set_trainable_params(peft.set_trainable_params)
        training.load_from_full_model_state_dict = self.wrap_load_from_full_model_state_dict(
            training.load_from_full_model_state_dict)


def recipe_path(recipe: str, upstream: bool) -> str:
    """File of a recipe: ours as given, upstream's by name inside torchtune's wheel."""
    if not upstream:
        return recipe
    import torchtune

    site = Path(torchtune.__file__).resolve().parent.parent
    path = site / "recipes" / (recipe if recipe.endswith(".py") else f"{recipe}.py")
    if not path.is_file():
        raise SystemExit(f"bench.launch: upstream recipe {recipe!r} not found at {path}")
    return str(path)


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.launch")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--upstream", action="store_true", help="run torchtune's built-in recipe of that name")
    parser.add_argument("--pad-to", type=int, help="pad every micro-batch to this many tokens (fixed shapes)")
    parser.add_argument("--adapter-seed", type=int,
                        help="upstream LoRA: start from the adapter our recipes draw with this seed")
    parser.add_argument("recipe")
    args, recipe_args = parser.parse_known_args(argv)

    impl = "upstream" if args.upstream else "ours"
    probe = Probe(args.out, impl, args.recipe, recipe_args)
    atexit.register(probe.write)
    _wrap_collate(probe, args.pad_to)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(probe.optimizer_step)
    (install_upstream if args.upstream else _install_ours)(probe)
    if args.adapter_seed is not None:
        if not args.upstream:
            parser.error("--adapter-seed is for upstream's recipes (ours draw it from their seed)")
        adapter = OurInitialAdapter(args.adapter_seed)
        adapter.install()
        # recorded at exit (atexit runs this before probe.write, registered earlier):
        # a run whose hooks never fired compared two different adapters
        probe.data["initial_adapter"] = {"seed": args.adapter_seed}
        atexit.register(lambda: probe.data["initial_adapter"].update(applied=adapter.applied))

    path = recipe_path(args.recipe, args.upstream)
    sys.argv = [path, *recipe_args]
    sys.path.append(os.getcwd())  # as tune run does
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
