"""Every test under tests/integration/ starts a process (tune run, torchrun, a fresh interpreter) or runs a recipe.

Being here is what marks a test: each one gets the ``slow`` marker, so that
``python -m pytest -m "not slow"`` still selects the unit tree alone (as
``python -m pytest tests/unit`` does).
"""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    # the hook sees every collected item, of both trees: mark this tree's
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
