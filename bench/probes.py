"""Measurements the benchmark takes outside the training runs: peak FLOP/s, model size, all-reduce latency.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/probes.py allreduce <out.json>
    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/probes.py sync_cost <out.json>

run the two-process probes (``allreduce_main``: one scalar's all-reduce;
``sync_cost_main``: one gradient reduce-scatter); the rest is imported by ``python -m bench``.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

import torch


def peak_flops(device: str, dtype: torch.dtype, n: int, iters: int) -> Dict[str, Any]:
    """Best FLOP/s of an ``n x n`` matmul on ``device`` (all of this process's threads).

    The best of ``iters`` timed products after two untimed ones: the peak
    the machine reaches on the operation the model is made of, to divide the
    model's FLOP/s by (MFU).
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    flops = 2.0 * n**3
    return {"flops_per_second": flops / best, "n": n, "dtype": str(dtype).replace("torch.", ""),
            "device": device, "threads": torch.get_num_threads(), "best_seconds": best, "iters": iters}


def model_counts(kind: str, config_path: str) -> Dict[str, Any]:
    """Trainable and frozen matmul weights, layers and attention width of the config's model, built on meta.

    The count the recipes' ``mfu`` uses (:class:`torchtune_ext.run.metrics.flops.ModelFlops`):
    a tied embedding counts once (it is the output projection's weight), norm
    scales do not count.
    """
    from dataclasses import asdict

    from omegaconf import OmegaConf
    from torchtune import config

    from torchtune_ext.run.metrics.flops import ModelFlops

    cfg = OmegaConf.load(config_path)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    if kind == "lora":
        from torchtune.modules.peft import get_adapter_params, set_trainable_params

        set_trainable_params(model, get_adapter_params(model))
    return asdict(ModelFlops.from_model(model))


def machine() -> Dict[str, Any]:
    """What the numbers were measured on."""
    info: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torchtune

        info["torchtune"] = torchtune.__version__
    except Exception:  # pragma: no cover - reported, not needed
        pass
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
                               "Hypervisor vendor", "L3 cache"):
                info[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 1024**2, 1)
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 1024**3, 1)
    return info


def allreduce_main(out: str, iters: int = 300) -> None:
    """Latency of the accounting's collective: ``torchtune_ext.train.accounting.global_sum`` of one scalar (gloo)."""
    import torch.distributed as dist

    from torchtune_ext.train.accounting import global_sum

    dist.init_process_group("gloo")
    value = torch.tensor(123)
    for _ in range(20):
        global_sum(value)
    dist.barrier()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        int(global_sum(value).item())
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({
            "iters": iters, "median_us": 1e6 * statistics.median(times), "min_us": 1e6 * min(times),
            "p90_us": 1e6 * sorted(times)[int(0.9 * iters)], "world_size": dist.get_world_size(), "backend": "gloo",
        }))
    dist.destroy_process_group()


def grad_norm_cost(repeats: int = 7) -> Dict[str, Any]:
    """Seconds to take the gradient norm of SmolLM2-135M three ways, and how far each is from exact.

    Ours (``torchtune_ext.train.step.grad_norm_and_clip``: blocks of 1024 in fp32,
    block sums in float64), upcasting every entry to float64, and upstream's
    ``torch.nn.utils.clip_grad_norm_`` (fp32). Random gradients of the real
    shapes (scale 1e-3); ``max_norm`` large so nothing is clipped. Median of
    ``repeats`` calls; error relative to an exact float64 norm.
    """
    from torchtune_ext.model.build import smollm2_135m
    from torchtune_ext.train.grad_norm import grad_norm_and_clip

    torch.manual_seed(0)
    params = list(smollm2_135m().parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    exact = torch.cat([p.grad.reshape(-1).double() for p in params]).norm().item()
    ways = {
        "ours_blocked": lambda: grad_norm_and_clip(params, 1e9).item(),
        "float64_per_entry": lambda: sum(torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
                                         for p in params).sqrt().item(),
        "upstream_clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, 1e9).item(),
    }
    out: Dict[str, Any] = {"params": sum(p.numel() for p in params), "threads": torch.get_num_threads()}
    for name, fn in ways.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            value = fn()
            times.append(time.perf_counter() - start)
        out[name] = {"seconds": statistics.median(times), "relative_error": abs(value - exact) / exact}
    return out


def sync_cost_main(out: str, seq_len: int = 256, iters: int = 3) -> None:
    """What one gradient reduce-scatter costs: a micro-batch's forward + backward with and without sync.

    SmolLM2-135M (random weights: the cost does not depend on the values),
    sharded like the distributed recipes (:func:`torchtune_ext.parallel.fsdp.shard_model`),
    one sample of ``seq_len`` tokens. Alternates ``set_requires_gradient_sync(False)``
    and ``(True)``; the difference of the medians is what a per-micro-batch
    reduce-scatter adds, i.e. what syncing once per step saves on each of the
    other ``gradient_accumulation_steps - 1`` micro-batches.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtune_ext.model.build import smollm2_135m
    from torchtune_ext.parallel.fsdp import shard_model

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = smollm2_135m()
    shard_model(model, torch.device("cpu"))
    tokens = torch.randint(0, 49152, (1, seq_len))
    labels = torch.randint(0, 49152, (1, seq_len))

    def micro_batch(sync: bool) -> float:
        model.set_requires_gradient_sync(sync)
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum").backward()
        dist.barrier()
        return time.perf_counter() - start

    micro_batch(True)  # warm-up
    times: Dict[bool, list] = {False: [], True: []}
    for _ in range(iters):
        for sync in (False, True):
            times[sync].append(micro_batch(sync))
    if dist.get_rank() == 0:
        no_sync, with_sync = statistics.median(times[False]), statistics.median(times[True])
        Path(out).write_text(json.dumps({
            "seq_len": seq_len, "iters": iters, "world_size": dist.get_world_size(), "backend": "gloo",
            "threads_per_process": torch.get_num_threads(),
            "no_sync_seconds": no_sync, "sync_seconds": with_sync, "sync_cost_seconds": with_sync - no_sync,
            "samples": {"no_sync": times[False], "sync": times[True]},
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    {"allreduce": allreduce_main, "sync_cost": sync_cost_main}[sys.argv[1]](sys.argv[2])
