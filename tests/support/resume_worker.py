"""torchrun worker: many recipe runs in one launch (tests/integration/recipes/: test_resume_chain.py,
test_sharded_resume.py, and the runs of test_distributed_recipes.py, test_hf.py and test_tensor_parallel_recipe.py).

    torchrun --nproc_per_node 2 -m tests.support.resume_worker SETUP_YAML JOBS_JSON

Each job is ``{"recipe", "out", "overrides", "stops", "stop_ranks"}``: a fresh
run on the tiny setup of SETUP_YAML (tests/support/resume_jobs.py) stopped by
SIGTERM after ``stops[0]`` (on rank ``stop_ranks[0]``), then one resume per
further stop, then a resume to the end (``stops`` empty: one uninterrupted run;
``"finish": false`` leaves the last stop unresumed; a job with ``"resume": true``
only resumes ``out`` to the end). A job with ``"config"`` instead runs ``recipe``
(a key of resume_jobs.RECIPES) once on that YAML file, which a test wrote whole
(SETUP_YAML is not read then). A job with ``"copy"`` copies that folder to
``"to"`` (rank 0), as a test copies a checkpoint before a resume. A job with
``"held": true`` checks that every rank refuses ``out``, which another process
holds: it writes each rank's two error messages (the start-up probe, then
taking the lock) to ``<out>/refused.<rank>.json``.
The process group is kept between runs (the recipes' cleanup would destroy
it), so one launch serves every job.
"""

import faulthandler
import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from tests.support import resume_jobs
from tests.support.helpers import freeze_import_time_objects
from torchtune_ext import parallel as distributed
from torchtune_ext.config import ConfigError, validate
from torchtune_ext.run.control.run_lock import OutputDirLock, check_not_in_use

# A native crash prints every thread's Python stack (rank 0 of this launch once died of
# SIGSEGV under a loaded machine, with nothing to show where).
faulthandler.enable()
freeze_import_time_objects()  # each rank loads ~30 checkpoints, each load runs a full gc.collect()


def refused(out: Path) -> list:
    errors = []
    for attempt in (lambda: check_not_in_use(str(out)), lambda: OutputDirLock(str(out), dist.get_rank())):
        try:
            attempt()
            errors.append(None)
        except ConfigError as err:
            errors.append(str(err))
    return errors


def main(setup_yaml: str, jobs_json: str) -> None:
    distributed.destroy_process_group = lambda: None  # keep the group for the next run
    for job in json.loads(jobs_json):
        if "copy" in job:
            if dist.get_rank() == 0:
                shutil.copytree(job["copy"], job["to"])
            dist.barrier()
            continue
        if "config" in job:
            cfg = validate(OmegaConf.load(job["config"]), extra_keys=resume_jobs.RECIPES[job["recipe"]][2])
            resume_jobs.run(job["recipe"], cfg)
            dist.barrier()
            continue
        out, overrides = Path(job["out"]), job.get("overrides", [])
        if job.get("held"):
            (out / f"refused.{dist.get_rank()}.json").write_text(json.dumps(refused(out)))
        elif job.get("resume"):
            cfg = resume_jobs.config(Path(setup_yaml), job["recipe"], out, *overrides, "resume_from_checkpoint=true")
            resume_jobs.run(job["recipe"], cfg)
        else:
            resume_jobs.chain(job["recipe"], Path(setup_yaml), out, job.get("stops", []), *overrides,
                              stop_ranks=job.get("stop_ranks", [0]), finish=job.get("finish", True))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
