"""Sharded saves that fail where only a process of their own can: killed during an asynchronous save, and a write
that fails on one rank of two (torchrun, tests/support/sharded_failure_worker.py).

The checks in one process: tests/unit/checkpoint/test_sharded_checkpoint.py; the multi-rank
resumes and the export: tests/integration/recipes/test_sharded_resume.py.
"""

import json
import os
import subprocess
import sys

from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT, run_worker
from tests.support.sharded_state import llama, progress, trained
from torchtune_ext.checkpoint import CheckpointManager, list_checkpoints, verify_checkpoint

KILLED_DURING_ASYNC_SAVE = """
import threading
from omegaconf import OmegaConf
from tests.support.sharded_state import llama, progress, trained
from torchtune_ext.checkpoint import CheckpointManager

manager = CheckpointManager(OmegaConf.create({{}}), {out!r}, sharded_saves=True, asynchronous=True)
model = llama()
optimizer = trained(model)
manager.save_sharded(model, optimizer, progress(1))
complete = CheckpointManager._complete

def killed_here(self, *args, **kwargs):  # every shard of step 2 is written; its manifest is not
    print("shards written", flush=True)
    threading.Event().wait()

CheckpointManager._complete = killed_here
manager.save_sharded(model, optimizer, progress(2), asynchronous=True)
threading.Event().wait()
"""


def test_a_kill_during_an_asynchronous_save_leaves_the_previous_checkpoint_the_latest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = KILLED_DURING_ASYNC_SAVE.format(out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT)))
    try:
        assert proc.stdout.readline() == "shards written\n"
        assert any((out / ".staging").rglob("*.distcp"))
    finally:
        proc.kill()
        proc.wait()
    assert [c.name for c in list_checkpoints(str(out))] == ["step_1"]
    verify_checkpoint(out / "step_1", content=True)
    # the next run's first save clears the dead save's staging folder and counts as usual
    manager = CheckpointManager(OmegaConf.create({}), str(out), sharded_saves=True)
    model = llama()
    manager.save_sharded(model, trained(model), progress(2))
    assert [c.name for c in list_checkpoints(str(out))] == ["step_1", "step_2"]
    assert not (out / ".staging").exists()
    verify_checkpoint(out / "step_2", content=True)


def test_a_write_that_fails_on_one_rank_fails_the_save_on_every_rank_with_the_same_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_worker(2, "sharded_failure_worker", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = [json.loads((out / f"outcome.{rank}.json").read_text()) for rank in (0, 1)]
    assert outcomes[0] == outcomes[1]  # every rank stops with the same line (the recipes exit 74 on it)
    for step in ("2", "3"):  # synchronous, then asynchronous
        message = outcomes[0][step]
        assert message.startswith(f"the disk filled up while saving step_{step} in output_dir '{out}' on rank 1 "
                                  "(OSError: [Errno 28] No space left on device)"), message
        assert f"{out / 'step_1'} is intact" in message and "\n" not in message
    assert [c.name for c in list_checkpoints(str(out))] == ["step_1"] and not (out / ".staging").exists()
    verify_checkpoint(out / "step_1", content=True)
