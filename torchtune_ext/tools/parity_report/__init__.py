"""The gradient-accumulation parity report: ``python -m torchtune_ext.parity_report``.

Checks the claim "batch N without accumulation, batch 1 with N accumulation
steps, and N ranks give the same training" on the user's own recipe, model and
data. It runs the real recipe once per case (each a subprocess with its own
output folder and W&B run, all in one W&B group), compares every case's
per-step loss and gradient norm with the reference case (batch N, no
accumulation) and writes ``report.md``, plots and the raw metrics.

Modules, one job each:

* :mod:`.cases` -- which cases exist and the command line that runs each;
* :mod:`.analysis` -- metrics in, comparison and ``report.md`` out;
* :mod:`.plots` -- the matplotlib figures;
* :mod:`.control` -- launcher of the control case, the common inexact
  normalization (per-micro-batch mean, divided by the number of micro-batches).
  It exists only here, so no training config can select it;
* :mod:`.cli` -- the command line that ties them together.

Kept import-light: ``control`` runs as ``python -m`` and must not pull in
matplotlib.
"""
