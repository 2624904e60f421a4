"""What the tests share: tiny models, data and configs, readers of a run's outputs, and the worker scripts.

Imported as ``tests.support`` (``from tests.support.helpers import ...``): pytest
imports the tests from the repository root, and a process a test starts runs
from the root with the root on PYTHONPATH (the workers as modules:
``torchrun ... -m tests.support.dist_worker``). ``full_disk/`` is not imported:
a recipe process gets it on PYTHONPATH, so that its ``sitecustomize.py`` runs
at interpreter start.
"""
