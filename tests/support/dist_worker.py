"""torchrun worker for the data-parallel exactness tests (tests/integration/distributed/test_distributed.py).

    torchrun --nproc_per_node N -m tests.support.dist_worker OUT.pt CASES_JSON
    python -m tests.support.dist_worker OUT.pt CASES_JSON      # one rank, no torchrun

(from the repository root, which must be on PYTHONPATH: tests.support.helpers.run_worker does both)

Each case trains a freshly initialised tiny Llama (same seed on every rank
and in every case) for a few SGD steps, through the same pieces the
distributed recipe uses: ``StepLoader`` (the step's samples over ranks,
stand-ins), ``torchtune_ext.parallel.fsdp.shard_model`` and
``load_full_model_state_dict``, and ``train_step``. Rank 0 saves, per case,
the per-step results, the full trained parameters and how many gradient
reduce-scatters each step ran. All cases share one process group, so one
launch serves many cases.

A case is a dict with ``name``, ``batch_size``, ``grad_accum``, ``once``
(``once``: backward once per step, else per micro-batch), ``num_samples``, ``model`` ("full" or "lora") and
optionally ``clip`` (max grad norm), ``max_steps``, ``cpu_offload``,
``grouped`` (group_by_length), ``budget`` (max_tokens_per_micro_batch),
``pack`` (pack_micro_batches: the step's samples in rows of at most ``budget`` tokens),
``packed`` (the same samples packed into 64-token rows), ``logits`` (the model
returns logits instead of the loss applying the output projection, as the
recipes do), ``guard_veto_rank`` (a ``MemoryGuard`` whose available
memory is 0 on that rank only: every rank must fall back to the
per-micro-batch backward together), ``guard_baseline`` (a ``MemoryGuard``
with the default limit, given each step's torchtune baseline as the recipes
give it; every rank's figures per step are saved), ``arch`` (a key of
:data:`ARCHS`: the tiny Llama by default, or a Qwen2 with q/k/v biases and
its own output projection, or a Gemma with scaled embeddings, GeGLU and one
KV head), ``optim_in_bwd`` (one SGD per parameter, stepped in backward) and
``sharded`` (custom_sharded_layers: modules with an FSDP unit of their own).

An evaluation case (``kind: "eval"``) instead runs one validation pass
(:func:`torchtune_ext.run.evaluate.evaluate`) over ``helpers.synthetic_val_dataset``
with ``batch_size`` samples per micro-batch per rank (and optionally
``packed``, ``grouped``, ``budget``, ``chunks``: output chunks of the model),
on the same initial weights, and saves what it measured.
"""

import faulthandler
import json
import sys
import time
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from tests.support.helpers import IGNORE, VOCAB, backward_mode
from torchtune_ext import parallel as distributed
from torchtune_ext.data import StepLoader, build_dataset, make_collate
from torchtune_ext.model.builders import lora_tiny_llama, tiny_llama
from torchtune_ext.run.evaluate import build_eval_loader, evaluate
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.memory import MemoryGuard
from torchtune_ext.train.optim_in_bwd import OptimizerInBackward
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
EVAL_EMBEDDING_STD = 0.3
LATE_SECONDS = 0.5  # a ``late_rank`` case: that rank starts each step this much later
ARCH = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
            intermediate_dim=64, max_seq_len=128)


# A native crash prints every thread's Python stack (rank 0 of this launch once died of
# SIGSEGV under a loaded machine, with nothing to show where).
faulthandler.enable()


def _qwen2(lora: bool) -> torch.nn.Module:
    from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2

    dims = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                max_seq_len=128, tie_word_embeddings=False)
    if not lora:
        return qwen2(**dims)
    return lora_qwen2(lora_attn_modules=["q_proj", "k_proj"], apply_lora_to_mlp=True, apply_lora_to_output=True,
                      lora_rank=4, lora_alpha=8, **dims)


def _gemma(lora: bool) -> torch.nn.Module:
    from torchtune.models.gemma._component_builders import gemma, lora_gemma

    dims = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, head_dim=16, num_kv_heads=1, embed_dim=32,
                intermediate_dim=64, max_seq_len=128)
    if not lora:
        return gemma(**dims)
    return lora_gemma(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                      lora_rank=4, lora_alpha=8, **dims)


ARCHS = {
    "llama": lambda lora: (lora_tiny_llama(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True,
                                           lora_rank=4, lora_alpha=8, **ARCH) if lora else tiny_llama(**ARCH)),
    "qwen2": _qwen2,
    "gemma": _gemma,
}


def build(kind: str, arch: str = "llama") -> torch.nn.Module:
    return ARCHS[arch](kind == "lora")


def initial_state(kind: str, embedding_std: Optional[float] = None, arch: str = "llama") -> dict:
    """Deterministic full weights; LoRA B is made nonzero so adapters matter from step 1.

    ``embedding_std``: redraw the (tied) embedding with this std. torchtune's std 1
    makes every prediction near certain (entropy ~0); 0.3 gives a few nats.
    The Qwen2 and Gemma models get HF's 0.02 for their embedding and output
    projection (torchtune's N(0, 1) gives logits of tens of nats).
    """
    torch.manual_seed(0)
    state = build(kind, arch).state_dict()
    g = torch.Generator().manual_seed(1)
    for key in state:
        if "lora_b" in key:
            state[key] = torch.randn(state[key].shape, generator=g) * 0.1
        elif arch != "llama" and key in ("tok_embeddings.weight", "output.weight"):
            state[key] = torch.randn(state[key].shape, generator=g) * 0.02
    if embedding_std is not None:
        weight = state["tok_embeddings.weight"]
        state["tok_embeddings.weight"] = torch.randn(weight.shape, generator=g) * embedding_std
    return state


def run_case(case: dict, rank: int, world_size: int) -> dict:
    arch = case.get("arch", "llama")
    with torch.device("meta"):
        model = build(case["model"], arch)
    if case["model"] == "lora":
        set_trainable_params(model, get_adapter_params(model))
    offload = case.get("cpu_offload", False)
    units = distributed.shard_model(model, CPU, cpu_offload=offload, custom_sharded_layers=case.get("sharded"))
    distributed.load_full_model_state_dict(model, initial_state(case["model"], arch=arch), CPU, cpu_offload=offload)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    if case.get("logits"):
        model.set_num_output_chunks(1)
    else:
        loss_fn.take_output_projection(model)

    reduce_scatters = [0]
    for unit in units:
        # FSDP2 calls this once per reduce-scatter of the unit's gradients.
        unit.set_all_reduce_hook(lambda _output: reduce_scatters.__setitem__(0, reduce_scatters[0] + 1))

    dataset = OmegaConf.create({"_component_": "tests.support.helpers.synthetic_sft_dataset",
                                "num_samples": case["num_samples"], "packed": case.get("packed", False)})
    samples, packed = build_dataset(dataset, SimpleNamespace(pad_id=0))
    loader = StepLoader(samples, make_collate(packed, 0, IGNORE), batch_size=case["batch_size"],
                        gradient_accumulation_steps=case["grad_accum"], seed=5, ignore_index=IGNORE,
                        dp_rank=rank, dp_world_size=world_size, group_by_length=case.get("grouped", False),
                        max_tokens_per_micro_batch=case.get("budget"), pack=case.get("pack", False),
                        max_steps_per_epoch=case.get("max_steps"))
    params = [p for p in model.parameters() if p.requires_grad]
    if case.get("optim_in_bwd"):
        optimizer = OptimizerInBackward(params, lambda ps: torch.optim.SGD(ps, lr=0.5))
    else:
        optimizer = torch.optim.SGD(params, lr=0.5)
    guard, needs_by_step = None, []
    if "guard_veto_rank" in case:
        vetoes = case["guard_veto_rank"] == rank
        guard = MemoryGuard(model, CPU, optimizer, available=lambda _device: 0 if vetoes else 1 << 50)
    elif case.get("guard_baseline"):
        guard = MemoryGuard(model, CPU, optimizer, available=lambda _device: 1 << 50)
        own_needs = guard.step_needs

        def recording_needs(micro_batches, baseline=None):
            needs_by_step.append(own_needs(micro_batches, baseline))
            return needs_by_step[-1]

        guard.step_needs = recording_needs
    modes = []
    steps, scatters_per_step = [], []
    for i, step_data in enumerate(loader.epoch(0)):
        window = step_data.micro_batches
        before = reduce_scatters[0]
        if case.get("late_rank") == rank:  # this rank reaches the step's collectives later than the others
            time.sleep(LATE_SECONDS)
        r = train_step(model, optimizer, loss_fn, window, device=CPU, backward=backward_mode(case["once"]),
                       clip_grad_norm=case.get("clip"), step=i + 1, memory_guard=guard,
                       baseline=step_data.baseline if case.get("guard_baseline") else None)
        modes.append(None if guard is None else guard.once_per_step)
        steps.append({"loss": r.loss, "grad_norm": r.grad_norm, "num_tokens": r.num_tokens,
                      "local_num_tokens": r.local_num_tokens, "micro_batches": len(window),
                      "wait_seconds": r.wait_seconds, **r.metrics})
        scatters_per_step.append(reduce_scatters[0] - before)
    full = distributed.gather_full_model_state_dict(model, CPU)
    extra = {}
    if case.get("guard_baseline"):
        extra["step_needs_by_rank"] = [None] * world_size
        dist.all_gather_object(extra["step_needs_by_rank"], needs_by_step)
    if case.get("optim_in_bwd"):
        # the recipes' checkpoint path: gather the sharded per-parameter states, then load them back
        saved = [distributed.gather_full_optimizer_state_dict(model, optimizer)]
        dist.broadcast_object_list(saved, src=0)  # on resume every rank reads the file
        distributed.load_full_optimizer_state_dict(model, optimizer, saved[0], CPU)
        extra["optimizer_state"] = saved[0]
    # FSDP2 has no public getter for the policy a unit was built with
    policy = type(units[-1]._get_fsdp_state()._fsdp_param_groups[0].offload_policy).__name__
    return {"steps": steps, "params": full, "reduce_scatters": scatters_per_step, "fsdp_units": len(units),
            "once_per_step_modes": modes,
            "world_size": world_size, "offload_policy": policy, **extra}


def run_eval_case(case: dict, rank: int, world_size: int) -> dict:
    with torch.device("meta"):
        model = build(case["model"])
    distributed.shard_model(model, CPU)
    distributed.load_full_model_state_dict(model, initial_state(case["model"], EVAL_EMBEDDING_STD), CPU)
    chunks = case.get("chunks", 1)
    model.set_num_output_chunks(chunks)
    cfg = OmegaConf.create({
        "dataset_val": {"_component_": "tests.support.helpers.synthetic_val_dataset",
                        "packed": case.get("packed", False)},
        "batch_size_val": case["batch_size"], "max_val_samples": None, "group_by_length": case.get("grouped", False),
        "max_tokens_per_micro_batch": case.get("budget"), "data_errors": "warn",
    })
    loader = build_eval_loader(cfg, SimpleNamespace(pad_id=0), "dataset_val", ignore_index=IGNORE, dp_rank=rank,
                               dp_world_size=world_size)
    model.layers[0].eval()  # modules in eval mode before must stay so, the others return to train mode
    modes = [m.training for m in model.modules()]
    result = evaluate(model, SummedCrossEntropyLoss(num_output_chunks=chunks, ignore_index=IGNORE), loader, device=CPU)
    return {"eval": result.metrics(), "local_num_tokens": result.totals.local_num_tokens, "steps": [],
            "modes_restored": [m.training for m in model.modules()] == modes and any(modes) and not all(modes),
            "grads_after": sum(p.grad is not None for p in model.parameters()), "world_size": world_size}


def run_config_case(case: dict, rank: int, world_size: int) -> dict:
    """The start-up config comparison over the job's gloo group: the same config passes; rank 1's other
    ``optimizer.lr`` and ``max_steps_per_epoch`` are refused on every rank (the message each rank raised)."""
    from omegaconf import OmegaConf

    from torchtune_ext.config.agreement import check_same_config_on_every_rank
    from torchtune_ext.errors import ConfigError

    same = OmegaConf.create({"optimizer": {"lr": 1e-3}, "max_steps_per_epoch": None, "seed": 5})
    check_same_config_on_every_rank(same)  # raises if equal configs were taken for different
    mine = OmegaConf.create({"optimizer": {"lr": 5e-2 if rank == 1 else 1e-3},
                             "max_steps_per_epoch": 3 if rank == 1 else None, "seed": 5})
    try:
        check_same_config_on_every_rank(mine)
        refused = None
    except ConfigError as err:
        refused = str(err)
    return {"steps": [], "refused": refused}


def main(out_path: str, cases_json: str) -> None:
    rank, world_size = distributed.init_process_group(CPU)
    runners = {"eval": run_eval_case, "config": run_config_case}
    results = {case["name"]: runners.get(case.get("kind"), run_case)(case, rank, world_size)
               for case in json.loads(cases_json)}
    # every rank reports its own view of the step losses and evaluation results: they must agree
    views = [None] * world_size
    dist.all_gather_object(views, {n: ([s["loss"] for s in r["steps"]], r.get("eval")) for n, r in results.items()})
    refusals = [None] * world_size
    dist.all_gather_object(refusals, {n: r.get("refused") for n, r in results.items()})
    if rank == 0:
        for name in results:
            results[name]["refused_by_rank"] = [v[name] for v in refusals]
            results[name]["losses_by_rank"] = [v[name][0] for v in views]
            results[name]["evals_by_rank"] = [v[name][1] for v in views]
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
