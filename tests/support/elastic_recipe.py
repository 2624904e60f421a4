"""The full distributed recipe, but rank 1 of a job's first attempt dies by SIGKILL once step 3 is logged.

    tune run --nproc_per_node 2 --max-restarts 1 tests/support/elastic_recipe.py --config RUN.yaml

For tests/integration/test_lost_processes.py: torchrun's agent sees the dead worker, stops the
other and starts both again (``TORCHELASTIC_RESTART_COUNT`` 1), and those run the
same command line from the top. The kill happens inside the worker, after a
logged step, so the test does not race a run whose steps take milliseconds.
"""

import os
import signal

from recipes import full_finetune_distributed as recipe
from torchtune_ext.run import loop
from torchtune_ext.run.control import exits

KILL_AFTER_STEP = 3
build_metric_logger = loop.build_metric_logger


def build_dying_metric_logger(*args, **kwargs):
    logger = build_metric_logger(*args, **kwargs)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if first_attempt and os.environ.get("RANK") == "1":
        log = logger.log

        def log_then_die(record):
            log(record)
            if record["step"] == KILL_AFTER_STEP:
                os.kill(os.getpid(), signal.SIGKILL)

        logger.log = log_then_die
    return logger


loop.build_metric_logger = build_dying_metric_logger

if __name__ == "__main__":
    exits.run_main(recipe.recipe_main)
