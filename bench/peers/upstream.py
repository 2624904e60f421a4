"""Run upstream torchtune 0.6.1's distillation or DPO recipe with the benchmark's probes, in this process.

    python -m bench.peers.upstream --out <dir/probe.json> [--adapter-seed 0] \
        knowledge_distillation_single_device --config bench/configs/upstream_kd_lora_single_device.yaml [key=value ...]
    python -m bench.peers.upstream --out <dir/probe.json> [--adapter-seed 0] \
        lora_dpo_single_device --config bench/configs/upstream_lora_dpo_single_device.yaml [key=value ...]

Not a training entry point: ``python -m bench.distillation`` and
``python -m bench.preference`` start it. As ``bench.launch --upstream``
(whose probes it installs: step ends at the metric logger, peak RSS from the
first micro-batch, no end-of-epoch checkpoint), plus:

* **Micro-batches.** SFT batches (distillation) through ``padded_collate_sft``,
  preference batches through ``padded_collate_dpo``: each pair counts its chosen
  and rejected sequences, unpadded (:func:`bench.peers.probes.sequences_of_pairs`).
* **The teacher's forward** (distillation): the recipe is loaded as a module,
  its ``_setup_teacher_model`` wrapped so that the teacher it returns is timed
  (:class:`bench.peers.probes.TeacherTimer`), then its ``recipe_main`` runs.
* **Our initial adapter** (``--adapter-seed``): :class:`bench.launch.OurInitialAdapter`,
  the LoRA draw our recipes (and the TRL runs of this benchmark) start from.
"""

import argparse
import atexit
import functools
import os
import runpy
import sys
from pathlib import Path
from typing import List, Optional

from bench.launch import OurInitialAdapter, Probe, install_upstream, recipe_path
from bench.peers.probes import TeacherTimer, sequences_of_pairs


def _wrap_collates(probe: Probe) -> None:
    """Record every micro-batch that torchtune's SFT and DPO collates build (recipes bind them at import)."""
    import torchtune.data
    import torchtune.data._collate as collate_module

    sft, dpo = collate_module.padded_collate_sft, collate_module.padded_collate_dpo

    @functools.wraps(sft)
    def padded_collate_sft(batch, *args, **kwargs):
        collated = sft(batch, *args, **kwargs)
        probe.micro_batch(batch, collated)
        return collated

    @functools.wraps(dpo)
    def padded_collate_dpo(batch, *args, **kwargs):
        collated = dpo(batch, *args, **kwargs)
        sequences = sequences_of_pairs([b["chosen_input_ids"] for b in batch], [b["chosen_labels"] for b in batch],
                                       [b["rejected_input_ids"] for b in batch], [b["rejected_labels"] for b in batch])
        probe.micro_batch(sequences, {"tokens": collated[0]})
        return collated

    for module in (collate_module, torchtune.data):
        module.padded_collate_sft, module.padded_collate_dpo = padded_collate_sft, padded_collate_dpo


def _time_the_teacher(recipe_globals: dict, timer: TeacherTimer) -> None:
    """Wrap ``_setup_teacher_model`` of the recipe class that has one, so its teacher is timed."""
    for value in list(recipe_globals.values()):
        setup = getattr(value, "_setup_teacher_model", None)
        if isinstance(value, type) and setup is not None:
            @functools.wraps(setup)
            def setup_teacher(self, *args, _setup=setup, **kwargs):
                return timer.attach(_setup(self, *args, **kwargs))

            value._setup_teacher_model = setup_teacher
            return
    raise SystemExit("bench.peers.upstream: the recipe has no _setup_teacher_model to time")


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.peers.upstream")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--adapter-seed", type=int, help="start LoRA from the adapter our recipes draw with this seed")
    parser.add_argument("recipe", help="an upstream recipe name, e.g. knowledge_distillation_single_device")
    args, recipe_args = parser.parse_known_args(argv)

    probe = Probe(args.out, "upstream", args.recipe, recipe_args)
    atexit.register(probe.write)
    _wrap_collates(probe)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(probe.optimizer_step)
    install_upstream(probe)
    if args.adapter_seed is not None:
        adapter = OurInitialAdapter(args.adapter_seed)
        adapter.install()
        probe.data["initial_adapter"] = {"seed": args.adapter_seed}
        atexit.register(lambda: probe.data["initial_adapter"].update(applied=adapter.applied))

    path = recipe_path(args.recipe, upstream=True)
    sys.argv = [path, *recipe_args]
    sys.path.append(os.getcwd())  # as tune run does
    # loaded under another name, so its `if __name__ == "__main__"` does not start it before the teacher is hooked
    recipe = runpy.run_path(path, run_name="bench_peers_upstream_recipe")
    if "distillation" in args.recipe:
        _time_the_teacher(recipe, TeacherTimer(probe))
    sys.exit(recipe["recipe_main"]())


if __name__ == "__main__":
    main()
