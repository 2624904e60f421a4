"""What a run shows besides its metrics: the profiler and the log level, as torchtune's configs set them."""

from typing import Any, Optional


def build_profiler(cfg_profiler: Optional[Any]):
    """The ``profiler`` section as torchtune sets it up.

    Args:
        cfg_profiler: the ``profiler`` config (``_component_:
            torchtune.training.setup_torch_profiler``, ``enabled``, activities,
            schedule, ``output_dir``) or None.

    Returns:
        an object with ``start()``, ``step()`` (call once per optimizer step)
        and ``stop()``: a ``torch.profiler.profile`` writing traces to the
        section's ``output_dir``, or torchtune's ``DummyProfiler`` when
        ``enabled`` is false or the section is absent.
    """
    from omegaconf import OmegaConf
    from torchtune import training

    if cfg_profiler is None or not cfg_profiler.get("enabled", False):
        return training.DummyProfiler()
    args = {k: v for k, v in OmegaConf.to_container(cfg_profiler, resolve=True).items() if k != "_component_"}
    profiler, _ = training.setup_torch_profiler(**args)
    return profiler

def set_log_level(level: str) -> None:
    """Apply the ``log_level`` key (DEBUG, INFO, WARNING, ERROR) to torchtune's logger.

    Every line of the recipes and of ``torchtune_ext`` goes through that one
    logger (``torchtune.utils.get_logger``), whose level modules set when they
    are imported; call this after the imports, when the recipe starts.
    """
    from torchtune import utils

    utils.get_logger(level)
