"""torchrun worker (tests/integration/distributed/test_sharded_checkpoint.py): a sharded save whose write fails on
rank 1 only.

    torchrun --nproc_per_node 2 -m tests.support.sharded_failure_worker OUT_DIR

Saves step 1 (every rank writes), then step 2 synchronously and step 3
asynchronously with rank 1's writes failing (a full disk). Each rank writes
the messages it got to ``OUT_DIR/outcome.<rank>.json``.
"""

import errno
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemWriter

from tests.support.sharded_state import llama, progress, trained
from torchtune_ext import parallel as distributed
from torchtune_ext.checkpoint import CheckpointManager
from torchtune_ext.errors import CheckpointSaveError


def main(out: str) -> None:
    rank, _ = distributed.init_process_group(torch.device("cpu"))
    torch.set_num_threads(1)
    model = llama()
    distributed.shard_model(model, torch.device("cpu"))
    optimizer = trained(model)
    manager = CheckpointManager(OmegaConf.create({}), out, sharded_saves=True, asynchronous=True)
    manager.save_sharded(model, optimizer, progress(1))
    if rank == 1:
        def disk_full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        FileSystemWriter.write_data = disk_full
    outcome = {}
    for step, asynchronous in ((2, False), (3, True)):
        try:
            manager.save_sharded(model, optimizer, progress(step), asynchronous=asynchronous)
            manager.wait()
            outcome[step] = None
        except CheckpointSaveError as err:
            outcome[step] = str(err)
    manager.close()
    Path(out, f"outcome.{rank}.json").write_text(json.dumps(outcome))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
