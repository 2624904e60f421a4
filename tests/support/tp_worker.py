"""torchrun worker for the tensor-parallel exactness tests (tests/integration/distributed/test_tensor_parallel.py).

    torchrun --nproc_per_node 4 -m tests.support.tp_worker OUT.pt CASES_JSON

Each case trains a tiny model of tests/support/dist_worker.py (``arch``: the tied
Llama, or the Qwen2 with its own output projection and q/k/v biases) from the
same initial weights for 4 AdamW steps (clipping active) on the same global
batch of 4 samples per step, through the pieces the distributed recipes use:
:func:`torchtune_ext.parallel.mesh.build_parallelism` (``tp`` ranks per
tensor-parallel group, the rest data parallel), ``shard_model`` (tensor
parallel, then FSDP2 over ``dp``), ``StepLoader`` on the data-parallel
coordinates, and ``train_step`` reducing over the data-parallel group.

Optional keys: ``model``: ``lora`` trains the LoRA variant of the model
(adapters on q/v and the MLP; Qwen2's on q/k, the MLP and its output
projection), the base frozen; ``then_tp``: after 2 steps the model and optimizer states are
gathered the way the recipes save a checkpoint (full state dicts on rank 0,
which every rank then reads), and training continues on a model built anew
with ``then_tp`` ranks per tensor-parallel group; ``count_all_ranks``: the
step reduces the token count and sums over every rank instead of the
data-parallel group (the mistake the tests must catch); ``once``: backward
once per step (default: per micro-batch).

Rank 0 saves, per case, the per-step results and the full trained parameters.
"""

import faulthandler
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from tests.support.dist_worker import build, initial_state
from tests.support.helpers import IGNORE
from torchtune_ext import parallel as distributed
from torchtune_ext.data import StepLoader, build_dataset, make_collate
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
PLAN_OF = {"llama": "torchtune_ext.model.builders.tiny_llama", "qwen2": "torchtune.models.qwen2.qwen2"}
SWITCH_AFTER = 2

faulthandler.enable()


def build_sharded(arch: str, tp: int, state: dict, kind: str = "full"):
    """The model under ``tp`` ranks per tensor-parallel group, loaded with the full ``state``; and its mesh."""
    plan = distributed.tensor_parallel_plan(None, PLAN_OF[arch]) if tp > 1 else None
    parallelism = distributed.build_parallelism(CPU, tp, plan)
    with torch.device("meta"):
        model = build(kind, arch)
    if kind == "lora":
        set_trainable_params(model, get_adapter_params(model))
    distributed.shard_model(model, CPU, parallelism=parallelism)
    distributed.load_full_model_state_dict(model, state, CPU)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=2, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    return model, loss_fn, parallelism


def step_loader(case: dict, parallelism) -> StepLoader:
    dataset = OmegaConf.create({"_component_": "tests.support.helpers.synthetic_sft_dataset", "num_samples": 16})
    samples, packed = build_dataset(dataset, SimpleNamespace(pad_id=0))
    per_rank = 4 // parallelism.dp_size  # a global batch of 4 samples per step
    return StepLoader(samples, make_collate(packed, 0, IGNORE), batch_size=max(per_rank // 2, 1),
                      gradient_accumulation_steps=min(per_rank, 2), seed=5, ignore_index=IGNORE,
                      dp_rank=parallelism.dp_rank, dp_world_size=parallelism.dp_size)


def run_case(case: dict) -> dict:
    arch, kind = case.get("arch", "llama"), case.get("model", "full")
    model, loss_fn, parallelism = build_sharded(arch, case["tp"], initial_state(kind, arch=arch), kind)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    steps_data = list(step_loader(case, parallelism).epoch(0))
    steps = []
    for i in range(len(steps_data)):
        if case.get("then_tp") and i == SWITCH_AFTER:
            # the recipes' checkpoint: gathered onto rank 0, written, read back by every rank
            saved = [{"model": distributed.gather_full_model_state_dict(model, CPU),
                      "optimizer": distributed.gather_full_optimizer_state_dict(model, optimizer)}]
            dist.broadcast_object_list(saved, src=0)
            model, loss_fn, parallelism = build_sharded(arch, case["then_tp"], saved[0]["model"], kind)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            distributed.load_full_optimizer_state_dict(model, optimizer, saved[0]["optimizer"], CPU)
            steps_data = list(step_loader(case, parallelism).epoch(0))  # the new layout's share of each step
        dp_group = None if case.get("count_all_ranks") else parallelism.dp_group
        r = train_step(model, optimizer, loss_fn, steps_data[i].micro_batches, device=CPU, clip_grad_norm=1.0,
                       backward="once_per_step" if case.get("once") else "per_micro_batch", dp_group=dp_group,
                       step=i + 1)
        steps.append({"loss": r.loss, "grad_norm": r.grad_norm, "num_tokens": r.num_tokens,
                      "local_num_tokens": r.local_num_tokens, **r.metrics})
    return {"steps": steps, "params": distributed.gather_full_model_state_dict(model, CPU),
            "dp_size": parallelism.dp_size, "tp_size": parallelism.tp_size}


def main(out_path: str, cases_json: str) -> None:
    rank, _world_size = distributed.init_process_group(CPU)
    results = {case["name"]: run_case(case) for case in json.loads(cases_json)}
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
