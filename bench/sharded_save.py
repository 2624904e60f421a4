"""Each rank's peak memory and the time of one checkpoint save: sharded (DCP) against gathered.

    python -m bench.sharded_save                     # SmolLM2-135M, 4 ranks, fp32, AdamW (about 2 min)
    python -m bench.sharded_save --nproc 2 --config configs/smollm2/135M_full.yaml

Run from the repository root with the assets downloaded
(``python -m torchtune_ext.download``). Each mode is its own ``torchrun``
launch of this module: every rank builds the config's model under FSDP2
(as the distributed recipe does: meta device, sharded, base weights loaded),
gives AdamW its moments (one step with zero gradients: the state a training
run saves), then saves once, as the recipe would:

* ``gathered``: every rank gathers the model and the optimizer state onto
  rank 0 (torchtune's ``gather_cpu_state_dict``, ``get_full_optimizer_state_dict``),
  which writes them (:meth:`torchtune_ext.checkpoint.CheckpointManager.save`);
* ``sharded``: every rank writes its own shards
  (:meth:`torchtune_ext.checkpoint.CheckpointManager.save_sharded`), no
  final-checkpoint export (a periodic save).

Memory is each process's peak resident set during the save: the kernel's
high-water mark (``VmHWM`` of ``/proc/self/status``), reset just before the
save (``echo 5 > /proc/self/clear_refs``), minus the resident set just
before it; the table gives both. Time: the save call, on every rank, from
its start to its return (the gathered save's includes the gathers).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("sharded", "gathered")


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _worker(config: str, mode: str, out: str, result: str) -> None:
    """One rank of one launch: build, save once, write ``{rank, rss_before, peak, seconds, bytes}`` to ``result``."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    from torchtune_ext import parallel as distributed
    from torchtune_ext.checkpoint import CheckpointManager, Progress
    from torchtune_ext.checkpoint.sharded import local_bytes, local_state
    from torchtune_ext.config import DISTRIBUTED_KEYS, validate

    torch.set_num_threads(1)
    device = torch.device("cpu")
    cfg = OmegaConf.load(config)
    cfg.output_dir = out
    cfg = validate(cfg, extra_keys=DISTRIBUTED_KEYS)
    rank, world = distributed.init_process_group(device)
    with torch.device("meta"):
        model = tt_config.instantiate(cfg.model)
    distributed.shard_model(model, device)
    manager = CheckpointManager.from_config(cfg, dp_world_size=world, distributed=True)
    base = manager.load()  # each rank reads the base checkpoint once, as the recipe does
    distributed.load_full_model_state_dict(model, base["model"], device)
    del base
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():  # the moments a run saves: a step with zero gradients creates them
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    progress = Progress()
    progress.step = 1
    shard_bytes = local_bytes(local_state(model, optimizer))
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current resident set
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    if mode == "sharded":
        manager.save_sharded(model, optimizer, progress, rng_by_rank=distributed.gather_rng_states())
    else:
        manager.save({"model": distributed.gather_full_model_state_dict(model, device)}, progress,
                     distributed.gather_full_optimizer_state_dict(model, optimizer),
                     rng_by_rank=distributed.gather_rng_states())
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    dist.barrier()
    Path(f"{result}.{rank}").write_text(json.dumps({"rank": rank, "rss_before_kib": before, "peak_kib": peak,
                                                    "seconds": seconds, "shard_bytes": shard_bytes}))
    dist.destroy_process_group()


def _launch(nproc: int, config: str, mode: str, work: Path) -> list:
    out = work / mode
    out.mkdir()
    result = work / f"{mode}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "bench.sharded_save", "--worker", mode, "--config", config, "--out", str(out),
           "--result", str(result)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the {mode} launch failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(nproc)]
    step = out / "step_1"
    size = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    for row in rows:
        row["checkpoint_bytes"] = size
    return rows


def _mib(kib: int) -> str:
    return f"{kib / 1024:,.0f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--config", default="configs/smollm2/135M_full.yaml")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.config, args.worker, args.out, args.result)
        return
    work = Path(tempfile.mkdtemp(prefix="sharded_save_"))
    try:
        rows = {mode: _launch(args.nproc, args.config, mode, work) for mode in MODES}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.config}, {args.nproc} ranks, CPU (gloo), fp32, AdamW; one save each")
    print("| save | rank | RSS before (MiB) | peak during the save (MiB) | increase (MiB) | save time (s) |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        for row in rows[mode]:
            print(f"| {mode} | {row['rank']} | {_mib(row['rss_before_kib'])} | {_mib(row['peak_kib'])} | "
                  f"{_mib(row['peak_kib'] - row['rss_before_kib'])} | {row['seconds']:.2f} |")
    for mode in MODES:
        print(f"{mode}: checkpoint {rows[mode][0]['checkpoint_bytes'] / 2**20:,.0f} MiB; this rank's shards "
              f"{rows[mode][0]['shard_bytes'] / 2**20:,.0f} MiB (rank 0)")
    zero = {mode: rows[mode][0]["peak_kib"] - rows[mode][0]["rss_before_kib"] for mode in MODES}
    print(f"rank 0's increase, sharded / gathered: {zero['sharded'] / max(zero['gathered'], 1):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
