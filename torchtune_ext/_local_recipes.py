"""Make ``tune run recipes/<name>.py`` run *this* repository's recipes.

torchtune's wheel installs a top-level package called ``recipes`` into
site-packages whose ``__init__`` raises on import. ``tune run recipes/x.py``
turns the path into the module name ``recipes.x`` and appends the working
directory to the *end* of ``sys.path``, so without help Python finds
torchtune's package first and fails (or, worse, could run an upstream recipe).

This module installs a meta-path finder, from a ``.pth`` file shipped with our
package, that resolves the top-level name ``recipes`` to ``./recipes`` when the
current working directory holds a ``recipes/__init__.py``. It touches no other
module name and changes nothing when there is no local ``recipes`` package.
"""

import importlib.abc
import importlib.util
import os
import sys


class LocalRecipesFinder(importlib.abc.MetaPathFinder):
    """Resolve the package ``recipes`` to ``<cwd>/recipes`` if it exists."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "recipes":
            return None
        init = os.path.join(os.getcwd(), "recipes", "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            "recipes", init, submodule_search_locations=[os.path.dirname(init)]
        )


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, LocalRecipesFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, LocalRecipesFinder())
