"""Names that moved when the library became layered packages: the old module paths keep working.

Configs name components by module path (``_component_:
torchtune_ext.models.smollm2_135m``), the docs' commands run modules
(``python -m torchtune_ext.download``) and people's own scripts import them.
Those paths were the library's top-level modules until the modules moved into
one package per layer (docs/architecture.md). :data:`MOVED` maps each old
module path to the module that holds its names now; an import of an old path
(``import``, ``importlib.import_module``, torchtune's ``_component_``
resolution, ``python -m``, unpickling) gets that very module object, not a
copy, so ``isinstance`` checks and monkeypatching see one module.

:func:`canonical` gives the current spelling of a dotted name, for the code
that compares component paths as text (which model family a config names,
whether it is a transformers model).

Nothing here imports a moved module until an old path is imported.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Optional

PACKAGE = "torchtune_ext"

# old module path (under torchtune_ext) -> where its names are now. A module that was split points at the
# package that re-exports its public names (distributed -> parallel, models -> model).
MOVED = {
    "upstream": "config.upstream",
    "lora_parallel": "parallel.lora",
    "distributed": "parallel",
    "loss": "train.loss",
    "accounting": "train.accounting",
    "grad_norm": "train.grad_norm",
    "optim_in_bwd": "train.optim_in_bwd",
    "health": "train.health",
    "memory": "train.memory",
    "step": "train.step",
    "data_check": "data.check",
    "tokenizer": "data.tokenizer",
    "assets": "data.assets",
    "models": "model",
    "lora": "model.lora",
    "runtime": "model.runtime",
    "hf": "model.hf",
    "hf.model": "model.hf.build",
    "hf.lora": "model.hf.lora",
    "hf.checkpointer": "model.hf.checkpointer",
    "hf.tokenizer": "data.hf_tokenizer",
    "hf.tensor_parallel": "parallel.hf_plan",
    "loop": "run.loop",
    "resume": "run.resume",
    "preflight": "run.preflight",
    "evaluate": "run.evaluate",
    "control": "run.control",
    "metrics": "run.metrics",
    "flops": "run.metrics.flops",
    "download": "tools.download",
    "gguf_to_hf": "tools.gguf_to_hf",
    "parity_report": "tools.parity_report",
    "checkpoint.export": "tools.export",
}
_FULL = {f"{PACKAGE}.{old}": f"{PACKAGE}.{new}" for old, new in MOVED.items()}
# packages that moved whole: their submodules moved with them (control.exits -> run.control.exits)
_PACKAGES = ("control", "metrics", "parity_report", "hf")


def current_module(name: str) -> Optional[str]:
    """The module that an old module path ``name`` (``torchtune_ext.loss``) now is; None if it did not move."""
    if name in _FULL:
        return _FULL[name]
    if any(name.startswith(old + ".") for old in _FULL if old.count(".") > 1):
        return None  # inside a module that moved on its own (hf.tokenizer.x): that module's entry decides
    for package in _PACKAGES:
        old = f"{PACKAGE}.{package}."
        if name.startswith(old):
            return f"{_FULL[old[:-1]]}.{name[len(old):]}"
    return None


def canonical(path: str) -> str:
    """``path`` (a module, or a module and a name: ``torchtune_ext.hf.causal_lm``) spelled as it is now.

    The longest old module path that ``path`` starts with is replaced by its
    current module; a path that did not move is returned as given.
    """
    parts = path.split(".")
    for end in range(len(parts), 1, -1):
        new = current_module(".".join(parts[:end]))
        if new is not None:
            return ".".join([new, *parts[end:]])
    return path


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old module path as the module it moved to: the same object, registered under both names."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder, replaced in exec_module

    def exec_module(self, module) -> None:
        # the import system reads sys.modules[name] back after this: the real module is what the import returns
        sys.modules[module.__name__] = importlib.import_module(self.target)

    def get_code(self, fullname: str):
        """For ``python -m <old path>``: the code of the module it moved to."""
        spec = importlib.util.find_spec(self.target)
        if spec.submodule_search_locations is not None:  # a package: runpy runs its __main__
            spec = importlib.util.find_spec(f"{self.target}.__main__")
        return spec.loader.get_code(spec.name)

    def is_package(self, fullname: str) -> bool:
        return importlib.util.find_spec(self.target).submodule_search_locations is not None


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``, so that an old path is never loaded a second time from a folder that
    happens to hold a file of the same name (``hf.lora`` -> ``model/hf/lora.py``)."""

    def find_spec(self, fullname, path=None, target=None):
        new = current_module(fullname)
        if new is None:
            return None
        loader = _MovedModuleLoader(new)
        return importlib.machinery.ModuleSpec(fullname, loader, is_package=loader.is_package(fullname))


def install() -> None:
    """Make the old module paths importable (idempotent; :mod:`torchtune_ext` calls it on import)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
