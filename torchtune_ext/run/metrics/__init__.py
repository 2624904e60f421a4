"""Per-step metrics: timing, throughput, peak memory, and a rank-aware logger.

Every optimizer step produces one record with the same keys in every recipe
(see :func:`step_record`). It goes to ``<output_dir>/logs/metrics.jsonl`` (one
JSON object per line, appended, so a resumed run continues the same file) and
to the configured torchtune metric logger (W&B by default). Only rank 0
writes; other ranks hold a logger that does nothing, so the training loop has
no rank branches.

The modules, each with one job:

* :mod:`~torchtune_ext.run.metrics.peak_memory`: a step's peak memory (CUDA's counter; RSS sampled on CPU);
* :mod:`~torchtune_ext.run.metrics.timer`: a step's wall time;
* :mod:`~torchtune_ext.run.metrics.record`: the step record, the progress bar's text, the last step's line;
* :mod:`~torchtune_ext.run.metrics.wandb_charts`: W&B's axes and the whole run's loss charts;
* :mod:`~torchtune_ext.run.metrics.model_artifacts`: a checkpoint as a W&B model artifact (``log_model``);
* :mod:`~torchtune_ext.run.metrics.logger`: the rank-aware logger (JSONL and a torchtune backend);
* :mod:`~torchtune_ext.run.metrics.reporter`: all of it once per step, for the training loop.
"""

from torchtune_ext.run.metrics.logger import MetricLogger, build_metric_logger
from torchtune_ext.run.metrics.peak_memory import lifetime_peak_rss_bytes, peak_memory_gib, reset_peak_memory
from torchtune_ext.run.metrics.record import last_step_line, progress_description, step_record
from torchtune_ext.run.metrics.reporter import StepReporter
from torchtune_ext.run.metrics.timer import StepTimer
from torchtune_ext.run.metrics.wandb_charts import define_wandb_axes, log_wandb_loss_charts, loss_curves

__all__ = [
    "MetricLogger",
    "StepReporter",
    "StepTimer",
    "build_metric_logger",
    "define_wandb_axes",
    "last_step_line",
    "lifetime_peak_rss_bytes",
    "log_wandb_loss_charts",
    "loss_curves",
    "peak_memory_gib",
    "progress_description",
    "reset_peak_memory",
    "step_record",
]
