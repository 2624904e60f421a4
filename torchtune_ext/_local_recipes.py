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

It also installs :class:`TuneLauncherHook`: in the ``tune`` command, when
torchtune's ``tune run`` module is imported, its torchrun entry point is
wrapped by :func:`torchtune_ext.run.control.launcher.quiet_reported_failures`, so that a
distributed recipe that stopped on bad input exits with its one line and
status 2 instead of torchrun's ``ChildFailedError`` traceback.
"""

import importlib.abc
import importlib.machinery
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


class TuneLauncherHook(importlib.abc.MetaPathFinder):
    """After ``torchtune._cli.run`` is imported, wrap its ``run`` (torchrun's launcher)."""

    MODULE = "torchtune._cli.run"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            try:
                # only in the tune command, once it imports torchtune's launcher: a .pth file imports this
                # module at every interpreter start-up, which must not pay for torch
                from torchtune_ext.run.control.launcher import quiet_reported_failures

                module.run = quiet_reported_failures(module.run)
                module.Run._run_cmd = _check_recipe_path(module.Run._run_cmd)
            except Exception:  # never break `tune` itself: torchrun then reports failures as usual
                pass

        spec.loader.exec_module = exec_and_wrap
        return spec


def _runnable(module: str) -> bool:
    """Whether ``module`` can be found on ``sys.path`` (a recipe may be a module on PYTHONPATH) and run:
    a package runs only with a ``__main__`` module (``recipes.x`` becomes the package ``recipes``)."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            return importlib.util.find_spec(f"{module}.__main__") is not None
        return spec is not None
    except (ImportError, ValueError):  # a missing parent package, an empty or relative name
        return False


def _check_recipe_path(run_cmd):
    """Wrap ``tune run``'s ``Run._run_cmd``: a recipe that is neither torchtune's, nor an existing ``.py``
    file, nor a runnable module on ``sys.path`` (``recipes/full_finetune_single_devic.py``, or the dotted
    ``recipes.full_finetune_single_device``, which ``tune run`` turns into the package ``recipes``) is a
    command-line error (exit status 2), not an ``ImportError`` traceback from importing the module name
    made from the path;
    so is an absolute path or one outside the working directory, which ``tune run`` cannot import. A
    recipe of torchtune's named where ``recipes/<name>.py`` exists still runs, after a note naming ours.
    A recipe file inside the working directory is passed on normalised (``./recipes/x.py`` as
    ``recipes/x.py``), ``--config=FILE`` as ``--config FILE``, the form ``tune run`` looks for; ``--config``
    without a file is a command-line error."""

    def checked(self, args):
        _check_rendezvous(self._parser, args)
        recipe = args.recipe
        # argparse's --config=FILE form: tune run looks for a separate "--config" (and would say it is missing)
        args.recipe_args = [part for arg in args.recipe_args for part in
                            (["--config", arg[len("--config="):]] if arg.startswith("--config=") else [arg])]
        if any(arg == "--config" and (i + 1 == len(args.recipe_args) or not args.recipe_args[i + 1])
               for i, arg in enumerate(args.recipe_args)):
            self._parser.error("--config needs a file: --config FILE (a path or the name of a torchtune config)")
        upstream = self._get_recipe(recipe) is not None
        if upstream and os.path.isfile(os.path.join("recipes", f"{recipe}.py")):
            # Habit from torchtune: the name runs upstream's recipe, which knows none of our config keys
            print(f"note: '{recipe}' runs torchtune's own recipe; this repository's (exact gradient accumulation, "
                  f"which configs/ are written for) is 'tune run recipes/{recipe}.py'", file=sys.stderr, flush=True)
        if not upstream:
            if not os.path.isfile(recipe) and not _runnable(self._convert_to_dotpath(recipe)):
                local = sorted(n for n in os.listdir("recipes") if n.endswith(".py") and not n.startswith("_")) \
                    if os.path.isdir("recipes") else []
                hint = (f"; the recipes here: {', '.join('recipes/' + n for n in local)}" if local else
                        "; run tune from the repository root")
                dotted = "" if os.path.splitext(recipe)[1] in ("", ".py") else \
                    " (tune run takes a file path; what follows the last '.' is read as its extension)"
                self._parser.error(f"recipe '{recipe}' is neither one of torchtune's nor a file{dotted}{hint}")
            if os.path.isabs(recipe) or os.path.normpath(recipe).startswith(".."):
                self._parser.error(f"recipe '{recipe}': tune run imports a recipe file by its path relative to "
                                   f"the working directory; run it from the repository root as "
                                   f"recipes/{os.path.basename(recipe)}")
            if os.path.isfile(recipe):
                # tune run makes the module name by replacing '/' with '.': "./recipes/x.py" would become the
                # relative name ".recipes.x", which both runpy and torchrun's `python -m` refuse
                args.recipe = os.path.normpath(recipe)
        return run_cmd(self, args)

    return checked


def _max_nodes(nnodes) -> int:
    """torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) as its largest count; 1 if it is not a number."""
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        return 1


def _check_rendezvous(parser, args) -> None:
    """Several nodes without ``--rdzv-endpoint``: a command-line error (exit status 2) instead of a wait for ever.

    ``tune run`` runs torchrun standalone when no endpoint is given: a rendezvous on this node alone, which
    the other nodes cannot join, so the job waited silently for nodes that never come.
    """
    nodes = _max_nodes(getattr(args, "nnodes", 1))
    if nodes > 1 and not getattr(args, "rdzv_endpoint", ""):
        parser.error(f"--nnodes {args.nnodes} needs a rendezvous every node can reach, and without --rdzv-endpoint "
                     "tune run starts one on this node alone (the job would wait for ever): add "
                     "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB, the same on every node, "
                     "HOST being the first node's address")


def install() -> None:
    """Put the finders first on ``sys.meta_path`` (idempotent)."""
    for finder in (LocalRecipesFinder, TuneLauncherHook):
        if not any(isinstance(f, finder) for f in sys.meta_path):
            sys.meta_path.insert(0, finder())
