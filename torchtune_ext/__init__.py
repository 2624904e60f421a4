"""Exact token-normalized gradient accumulation for torchtune recipes.

Kept import-light on purpose: a ``.pth`` file imports
``torchtune_ext._local_recipes`` at every interpreter start-up.
"""

__version__ = "0.1.0"
