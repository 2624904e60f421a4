# This repository's recipes, importable as ``recipes.<name>`` so that
# ``tune run recipes/<name>.py`` finds them (see torchtune_ext/_local_recipes.py).
