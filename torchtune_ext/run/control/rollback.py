"""Setup that fails leaves ``output_dir`` as it was: what this run created in it is removed again.

:func:`output_dir_unchanged_on_error` wraps a recipe's setup
(:func:`torchtune_ext.run.loop.run_recipe`); :class:`torchtune_ext.run.control.run_lock.OutputDirLock`
tells it, through :func:`output_dir_taken` and :func:`output_dir_refused`,
what the folder held when this run took it, so that nothing of another run
or of the user is ever removed.
"""

import contextlib
import os
import shutil
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

from torchtune_ext.errors import EXIT_USER_ERROR, UserError
from torchtune_ext.run.control.exits import finish_wandb


@dataclass
class _Rollback:
    """What a rollback block may remove: set when this process's run takes the folder's lock inside it."""

    before: Optional[set] = None  # what the folder held when the run took it; None: not taken (yet)
    created_folder: bool = False
    created_files: Tuple[str, ...] = ()
    refused: bool = False


# The rollback blocks open in this process, by absolute output_dir (torchtune_ext.run.control.run_lock reports to them).
_ROLLBACKS: Dict[str, _Rollback] = {}


def output_dir_taken(path: str, created_folder: bool = False, created_files: Tuple[str, ...] = ()) -> None:
    """This run (its rank 0) has just taken the lock of ``path``: what the folder holds now is not its to remove.

    Called by :class:`torchtune_ext.run.control.run_lock.OutputDirLock` on every rank of
    the job that holds the folder. ``created_folder`` / ``created_files``
    (relative to ``path``): what taking the lock created, which this run
    removes if its setup fails. No effect outside
    :func:`output_dir_unchanged_on_error`.
    """
    state = _ROLLBACKS.get(os.path.abspath(path))
    if state is not None:
        state.before = _tree(path) if os.path.isdir(path) else set()
        state.created_folder, state.created_files = created_folder, tuple(created_files)


def output_dir_refused(path: str) -> None:
    """Another run holds ``path``: the rollback of this run's setup touches nothing in it."""
    state = _ROLLBACKS.get(os.path.abspath(path))
    if state is not None:
        state.refused = True


@contextlib.contextmanager
def output_dir_unchanged_on_error(path: str) -> Iterator[None]:
    """Undo what this run's setup created in ``output_dir`` if setup fails.

    On any exception inside the block (bad input, or a crash while loading),
    what appeared in ``path`` after this run took the folder's lock
    (:class:`torchtune_ext.run.control.run_lock.OutputDirLock`, the first thing setup
    writes) is removed, at any depth, and so are the lock file and ``path``
    itself if taking the lock created them: the staging folder the
    checkpointer creates, a new ``logs/``, and on a resume the new
    ``logs/config_<N>.yaml`` and W&B run segment. What was there when the lock
    was taken is another run's or the user's, and stays: two runs started
    together in one folder both enter this block before either has created
    anything, and the one refused the lock removes nothing at all. A setup
    that failed before taking the lock has written nothing, and nothing is
    removed. A W&B run started in the block is finished first (as failed,
    without its summary), so that W&B neither writes into nor names a removed
    folder. Use it around a recipe's ``setup()`` only: training writes are
    never rolled back.
    """
    key = os.path.abspath(path)
    state, outer = _Rollback(), _ROLLBACKS.get(key)
    _ROLLBACKS[key] = state
    try:
        yield
    except BaseException as err:
        finish_wandb(EXIT_USER_ERROR if isinstance(err, UserError) else 1, quiet=True)  # the run's own status
        if state.before is not None and not state.refused:
            _remove_new_entries(path, state)
        raise
    finally:
        if outer is None:
            del _ROLLBACKS[key]
        else:
            _ROLLBACKS[key] = outer


def _remove_new_entries(path: str, state: _Rollback) -> None:
    # Other ranks of the job on the same host remove the same entries at the same time: a missing one is fine
    if state.created_folder:
        shutil.rmtree(path, ignore_errors=True)
        return
    if not os.path.isdir(path):
        return
    for name in sorted((_tree(path) - state.before) | set(state.created_files)):  # a folder before its content
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):  # inside a folder removed just before
                os.remove(target)


def _tree(path: str) -> set:
    """Paths of everything under ``path``, relative to it (links are not followed)."""
    found = set()
    for root, dirs, files in os.walk(path):
        rel = os.path.relpath(root, path)
        found.update(os.path.normpath(os.path.join(rel, name)) for name in dirs + files)
    return found
