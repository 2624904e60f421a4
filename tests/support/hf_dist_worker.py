"""torchrun worker for the data-parallel test of transformers models.

    torchrun --nproc_per_node N -m tests.support.hf_dist_worker OUT.pt FOLDER CASES_JSON
    python -m tests.support.hf_dist_worker OUT.pt FOLDER CASES_JSON      # one rank

(tests/integration/distributed/test_hf_distributed.py; tests/integration/distributed/test_hf_tensor_parallel.py,
whose cases
name their own ``folder``, ``tp`` ranks per tensor-parallel group, and may
``count_all_ranks``: reduce the step's token count over every rank instead of
the data-parallel group, the mistake its test must catch; ``in_backward``:
torchtune's ``optimizer_in_bwd``, which needs no clipping; ``clip``: None
turns clipping off, default 1.0).

Each case builds the tiny HF model of FOLDER the way the distributed recipes
will: ``causal_lm`` on the meta device, optionally activation checkpointing
(``ac``), LoRA (``lora``: torchtune's LoRA keys, adapters from one seed, B
made nonzero by the first steps), ``torchtune_ext.model.hf.shard_model`` (FSDP2 per decoder layer, with
``cpu_offload``), the HF checkpointer's state dict loaded with
``distributed.load_full_model_state_dict``, the loss owning the output
projection, then a few SGD steps of ``train_step`` over the step's samples
split over ranks (``batch_size`` per rank, ``grad_accum`` micro-batches,
``once``: backward once per step). Rank 0 saves, per case, the step results,
the full trained weights and the FSDP units.
"""

import json
import sys
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from tests.support.helpers import IGNORE, backward_mode
from torchtune_ext import parallel as distributed
from torchtune_ext import ranks
from torchtune_ext.data import StepLoader, build_dataset, make_collate
from torchtune_ext.model import hf
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.optim_in_bwd import build_optimizer
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")


def run_case(folder: str, case: dict) -> dict:
    folder = case.get("folder", folder)
    rank = ranks.rank()
    state = hf.HFCheckpointer(folder, f"{folder}/../worker_out_{rank}").load_checkpoint()["model"]
    lora = case.get("lora")
    with torch.device("meta"):
        model = hf.lora_causal_lm(folder, dtype="fp32", **lora) if lora else hf.causal_lm(folder, dtype="fp32")
    if lora:
        hf.initialize_adapters(model, seed=7)  # on CPU, the same on every rank
        state = hf.model_keys(model, state)
    if case.get("ac"):
        hf.set_activation_checkpointing(model)
    offload = case.get("cpu_offload", False)
    parallelism = distributed.build_parallelism(CPU, case.get("tp", 1))  # tp > 1: the model's own tp_plan
    units = hf.shard_model(model, CPU, cpu_offload=offload, parallelism=parallelism)
    missing, _ = distributed.load_full_model_state_dict(model, state, CPU, cpu_offload=offload, source=folder,
                                                        strict=not lora)
    assert all(".lora_" in key for key in missing), missing
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)

    dataset = OmegaConf.create({"_component_": "tests.support.helpers.synthetic_sft_dataset", "num_samples": 8})
    samples, packed = build_dataset(dataset, SimpleNamespace(pad_id=0))
    loader = StepLoader(samples, make_collate(packed, 0, IGNORE), batch_size=case["batch_size"],
                        gradient_accumulation_steps=case["grad_accum"], seed=5, ignore_index=IGNORE,
                        dp_rank=parallelism.dp_rank, dp_world_size=parallelism.dp_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.5}), trainable,
                                in_backward=case.get("in_backward", False))
    steps = []
    for i, step_data in enumerate(loader.epoch(0)):
        r = train_step(model, optimizer, loss_fn, step_data.micro_batches, device=CPU,
                       backward=backward_mode(case["once"]), clip_grad_norm=case.get("clip", 1.0), step=i + 1,
                       dp_group=None if case.get("count_all_ranks") else parallelism.dp_group)
        steps.append({"loss": r.loss, "grad_norm": r.grad_norm, "num_tokens": r.num_tokens})
    unit_names = [name for name, module in model.named_modules() if module in units]
    checkpointed = sum(1 for name, _ in model.named_modules() if name.endswith("_checkpoint_wrapped_module"))
    full = distributed.gather_full_model_state_dict(model, CPU)
    base_moved = [key for key in state if key in full and not torch.equal(full[key], state[key].float())]
    return {"steps": steps, "params": full, "units": unit_names, "checkpointed": checkpointed,
            "base_moved": base_moved, "mesh": (parallelism.dp_size, parallelism.tp_size)}


def main(out_path: str, folder: str, cases_json: str) -> None:
    rank, _world_size = distributed.init_process_group(CPU)
    results = {case["name"]: run_case(folder, case) for case in json.loads(cases_json)}
    if rank == 0:
        torch.save(results, out_path)
    distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
