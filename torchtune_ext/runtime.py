"""Run-time options torchtune's configs ask for, set up the way torchtune does.

* :func:`offload_activations` (``enable_activation_offloading``): torchtune's
  ``OffloadActivations`` saved-tensor hooks around every forward of the model;
* :func:`build_profiler` (``profiler``): torchtune's ``setup_torch_profiler``,
  or a profiler that does nothing when it is off;
* :func:`use_low_cpu_ram` (``low_cpu_ram``): torchtune's switch for the QLoRA
  state-dict hook that dequantizes through a memory-mapped file;
* :func:`set_log_level` (``log_level``): the level of torchtune's logger.

None of them changes what is computed: the step's token count, loss and
gradients are the same with or without them.
"""

from typing import Any, Optional

from torch import nn


def offload_activations(model: nn.Module, enabled: bool) -> None:
    """Offload the activations saved for backward to CPU memory during ``model``'s forward.

    Uses ``torchtune.training.get_act_offloading_ctx_manager`` (which keeps the
    output projection's activations on the device). Its context is entered by a
    forward pre-hook and left by a forward hook, so every forward of the model,
    however the training step calls it, runs inside it, as in torchtune's
    recipes. Saved tensors are brought back in backward, whether backward
    runs once per step or once per micro-batch.

    Args:
        model: the model to train (before FSDP sharding or compiling is fine).
        enabled: the ``enable_activation_offloading`` key; False does nothing.
            Needs CUDA and activation checkpointing (checked by the config).
    """
    if not enabled:
        return
    from torchtune import training

    context = training.get_act_offloading_ctx_manager(model, True)
    model.register_forward_pre_hook(lambda *_: context.__enter__())
    model.register_forward_hook(lambda *_: context.__exit__(None, None, None), always_call=True)


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


def use_low_cpu_ram(enabled: bool) -> None:
    """Choose torchtune's QLoRA state-dict hook: dequantize NF4 weights through a
    memory-mapped file (``low_cpu_ram=true``, Linux) or in memory. Call before
    building the model: the LoRA builders register the hook they find set."""
    from torchtune.modules import common_utils

    common_utils._use_low_cpu_ram = bool(enabled)


def set_log_level(level: str) -> None:
    """Apply the ``log_level`` key (DEBUG, INFO, WARNING, ERROR) to torchtune's logger.

    Every line of the recipes and of ``torchtune_ext`` goes through that one
    logger (``torchtune.utils.get_logger``), whose level modules set when they
    are imported; call this after the imports, when the recipe starts.
    """
    from torchtune import utils

    utils.get_logger(level)
