"""Run control: how a run starts, holds its folder, stops and ends.

* :mod:`~torchtune_ext.run.control.command_line`: the recipe's command line, checked before torchtune parses it;
* :mod:`~torchtune_ext.run.control.exits`: one line and an exit status per expected error, once per job;
* :mod:`~torchtune_ext.run.control.launcher`: the ``tune`` launcher exits like its workers, with their line;
* :mod:`~torchtune_ext.run.control.rollback`: a setup that fails leaves ``output_dir`` as it was;
* :mod:`~torchtune_ext.run.control.run_lock`: one run per ``output_dir``;
* :mod:`~torchtune_ext.run.control.preemption`: SIGTERM / SIGINT save a checkpoint and exit 75.

Nothing is imported here: the launcher imports :mod:`~torchtune_ext.run.control.launcher`
at start-up and needs none of the others.
"""
