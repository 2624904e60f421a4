"""Where a training step's time goes on each model path: torchtune's SmolLM2 and transformers' of the same folder.

    python -m bench.model_paths [--batch-size 2] [--ga 4] [--max-seq-len 512] [--repeats 5] [--top 15] [--threads N]

Both models are built and loaded as the single-device full recipe does
(``torchtune_ext.model.build.build_model`` and ``load_model_state``, torchtune's
``FullModelHFCheckpointer`` and ``torchtune_ext.model.hf.HFCheckpointer`` on
``assets/SmolLM2-135M-Instruct``, fp32, CPU, the recipe's
``embedding_rows_into_grad`` and the loss applying the output projection),
and take turns (the order alternating every repeat) training optimizer steps
with :func:`torchtune_ext.train.step.train_step` (backward per micro-batch, fused
AdamW, clipping at 1.0) on the same micro-batches: the first ``--ga`` x
``--batch-size`` samples of the Alpaca demo data in the recipes' epoch order
(seed 0), tokenized by torchtune_ext's SmolLM2 tokenizer, prompts masked, in
``padded_collate_sft``'s padding. Each path has its own optimizer; the losses
of their first step are printed as the check that they compute the same.

Prints, per path, the median and shortest step time over ``--repeats``
steps after one warm-up step and the median CPU time of the process per
step, then torch.profiler's self time per operator (the ``--top`` operators
with the largest difference between the paths), each operator's shortest
over ``--profile-steps`` profiled steps per path. On a machine other jobs
share, the shortest times and, with ``--threads 1`` (no worker threads
that spin while they wait for a core), the CPU times are the least
disturbed. Both models live in this one process, so memory is not measured
here: ``python -m bench --hf`` measures each path's peak RSS in a process of
its own. Nothing is written.
"""

import argparse
import statistics
import time
from typing import Dict, List

import torch
from omegaconf import OmegaConf

PATHS = ("torchtune", "transformers")
FOLDER = "assets/SmolLM2-135M-Instruct"
MODEL_CONFIGS = {
    "torchtune": {"_component_": "torchtune_ext.model.build.smollm2_135m"},
    "transformers": {"_component_": "torchtune_ext.model.hf.causal_lm", "path": FOLDER},
}


def _state_dict(path: str, out: str) -> Dict[str, torch.Tensor]:
    if path == "torchtune":
        from torchtune.training import FullModelHFCheckpointer

        checkpointer = FullModelHFCheckpointer(checkpoint_dir=FOLDER, checkpoint_files=["model.safetensors"],
                                               model_type="LLAMA3_2", output_dir=out)
    else:
        from torchtune_ext.model.hf import HFCheckpointer

        checkpointer = HFCheckpointer(FOLDER, out)
    return checkpointer.load_checkpoint()["model"]


def build(path: str, out: str):
    """The model of ``path`` as the single-device full recipe sets it up (fp32, CPU), and its loss."""
    from torchtune_ext.model.build import build_model, load_model_state
    from torchtune_ext.model.runtime import embedding_rows_into_grad
    from torchtune_ext.train.loss import SummedCrossEntropyLoss

    cpu = torch.device("cpu")
    model = build_model(OmegaConf.create(MODEL_CONFIGS[path]), torch.float32, cpu)
    load_model_state(model, _state_dict(path, out), cpu, FOLDER)
    rows_into_grad = embedding_rows_into_grad(model, cpu)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks="auto")
    loss_fn.take_output_projection(model)
    return model, loss_fn, rows_into_grad


def micro_batches(batch_size: int, ga: int, max_seq_len: int) -> List[Dict[str, torch.Tensor]]:
    """The recipes' first optimizer step's micro-batches (seed 0, no grouping), collated as they collate them."""
    from torchtune.data import padded_collate_sft
    from torchtune.datasets import alpaca_dataset

    from torchtune_ext.data.step_loader import epoch_order
    from torchtune_ext.data.tokenizer import smollm2_tokenizer

    tokenizer = smollm2_tokenizer(FOLDER, max_seq_len=max_seq_len)
    data = alpaca_dataset(tokenizer, source="json", data_files="assets/data/alpaca_en_demo.json", split="train",
                          train_on_input=False)
    order = epoch_order(len(data), 0, 0, True)
    samples = [data[i] for i in order[:batch_size * ga]]
    return [padded_collate_sft(samples[i:i + batch_size], padding_idx=tokenizer.pad_id, ignore_idx=-100)
            for i in range(0, len(samples), batch_size)]


def _op_times(run_step) -> Dict[str, float]:
    """Self milliseconds per operator of one ``run_step()`` (torch.profiler's self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step()
    return {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}


def _shortest(samples: List[Dict[str, float]]) -> Dict[str, float]:
    """Per operator, its shortest time over the profiled steps (other jobs only ever lengthen one)."""
    return {k: min(s.get(k, 0.0) for s in samples) for k in set().union(*samples)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.model_paths")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--ga", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import tempfile

    from torchtune_ext.train.step import train_step

    batches = micro_batches(args.batch_size, args.ga, args.max_seq_len)
    tokens = sum(int((b["tokens"] != 0).sum()) for b in batches)
    runs = {}
    with tempfile.TemporaryDirectory() as out:
        for path in PATHS:
            model, loss_fn, rows = build(path, out)
            optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01, fused=True)
            runs[path] = (model, optimizer, loss_fn, rows)

    def step(path: str):
        model, optimizer, loss_fn, _ = runs[path]
        return train_step(model, optimizer, loss_fn, batches, device=torch.device("cpu"),
                          backward="per_micro_batch", clip_grad_norm=1.0)

    first = {path: step(path).loss for path in PATHS}  # warm-up; the same weights and data: the same loss
    times: Dict[str, List[float]] = {path: [] for path in PATHS}
    cpu: Dict[str, List[float]] = {path: [] for path in PATHS}
    for i in range(args.repeats):
        for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
            start, start_cpu = time.perf_counter(), time.process_time()
            step(path)
            times[path].append(time.perf_counter() - start)
            cpu[path].append(time.process_time() - start_cpu)
    profiled: Dict[str, List[Dict[str, float]]] = {path: [] for path in PATHS}
    for i in range(args.profile_steps):
        for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
            profiled[path].append(_op_times(lambda p=path: step(p)))
    ops = {path: _shortest(profiled[path]) for path in PATHS}

    print(f"SmolLM2-135M, {args.ga} micro-batches of {args.batch_size} x <= {args.max_seq_len} tokens "
          f"({tokens} tokens), fp32, {torch.get_num_threads()} threads, median of {args.repeats} steps; "
          f"first-step loss torchtune {first['torchtune']:.7f}, transformers {first['transformers']:.7f}")
    print("| path | step (s) | shortest (s) | CPU time (s) | embedding rows into .grad |")
    print("|---|---:|---:|---:|---|")
    for path in PATHS:
        print(f"| {path} | {statistics.median(times[path]):.3f} | {min(times[path]):.3f} | "
              f"{statistics.median(cpu[path]):.3f} | {runs[path][3]} |")
    print()
    print(f"Self time per operator, shortest of {args.profile_steps} profiled steps per path:")
    print("| operator | torchtune (ms) | transformers (ms) | difference (ms) |")
    print("|---|---:|---:|---:|")
    names = sorted(set(ops["torchtune"]) | set(ops["transformers"]),
                   key=lambda k: -abs(ops["transformers"].get(k, 0.0) - ops["torchtune"].get(k, 0.0)))
    for name in names[:args.top]:
        a, b = ops["torchtune"].get(name, 0.0), ops["transformers"].get(name, 0.0)
        print(f"| {name} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    print(f"| total | {sum(ops['torchtune'].values()):.1f} | {sum(ops['transformers'].values()):.1f} | "
          f"{sum(ops['transformers'].values()) - sum(ops['torchtune'].values()):+.1f} |")


if __name__ == "__main__":
    main()
