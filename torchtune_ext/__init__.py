"""Exact token-normalized gradient accumulation for torchtune recipes.

The library is one package per layer, each importing only the ones below it
(docs/architecture.md): ``config`` -> ``checkpoint`` -> ``parallel`` ->
``train`` -> ``data`` -> ``model`` -> ``run`` -> ``tools``, on the leaf
modules ``errors``, ``text``, ``ranks`` and ``moved``.

Kept import-light on purpose: a ``.pth`` file imports
``torchtune_ext._local_recipes`` at every interpreter start-up. The module
paths of the library before its packages (``torchtune_ext.loss``,
``torchtune_ext.models``, ...) still import (:mod:`torchtune_ext.moved`).
"""

from torchtune_ext import moved

moved.install()

__version__ = "0.1.0"
