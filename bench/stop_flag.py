"""What the per-step stop check costs under torchrun (``GracefulStop.requested``).

    python -m bench.stop_flag                  # 2 processes, gloo on CPU
    python -m bench.stop_flag --cuda --nproc 8 # one GPU per process, nccl

Every rank asks, before every optimizer step, whether a signal asked the run
to stop; the ranks agree with one all-reduce (MAX) of a one-element tensor on
the training device (:mod:`torchtune_ext.run.control.preemption`). This starts the
processes with torchrun, times ``--iters`` checks after a warm-up, and prints
the median and mean per check, with an empty ``barrier`` for scale. Compare
with a step time (``step_seconds`` in ``metrics.jsonl``).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def _time(fn, iters: int, device: torch.device) -> list:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def worker(iters: int, cuda: bool) -> None:
    from torchtune_ext.parallel import mesh as distributed
    from torchtune_ext.run.control.preemption import GracefulStop

    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank, world = distributed.init_process_group(device)
    stop = GracefulStop(device, rank)
    _time(stop.requested, 50, device)  # warm-up
    check = _time(stop.requested, iters, device)
    barrier = _time(dist.barrier, iters, device)
    if rank == 0:
        for name, times in (("stop check (all-reduce MAX, 1 element)", check), ("empty barrier", barrier)):
            print(f"{name:40s} median {1e6 * statistics.median(times):8.1f} us   "
                  f"mean {1e6 * statistics.fmean(times):8.1f} us   ({world} ranks, {device.type}, {iters} calls)")
    stop.close()
    distributed.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stop_flag", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--cuda", action="store_true", help="one CUDA device per process (nccl)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        worker(args.iters, args.cuda)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           "-m", "bench.stop_flag", "--iters", str(args.iters)] + (["--cuda"] if args.cuda else [])
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
