"""A run: the loop every recipe shares, and what surrounds it.

* :mod:`~torchtune_ext.run.loop`: the setup order, the training loop, saving and cleanup;
* :mod:`~torchtune_ext.run.preflight`: the config's components checked before anything loads;
* :mod:`~torchtune_ext.run.resume`: where a run starts, and continuing it under new settings;
* :mod:`~torchtune_ext.run.evaluate`: exact evaluation, validation during training, and
  ``python -m torchtune_ext.evaluate``;
* :mod:`~torchtune_ext.run.diagnostics`: the profiler and the log level;
* :mod:`~torchtune_ext.run.control`: how a run starts, holds its folder, stops and ends;
* :mod:`~torchtune_ext.run.metrics`: the step record, peak memory, the rank-aware logger.

Nothing is imported here: the start-up hook imports :mod:`~torchtune_ext.run.control.launcher`
in every Python process and must not pull in torch.
"""
