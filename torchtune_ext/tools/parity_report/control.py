"""Launcher for the report's control case: a recipe run under the COMMON, INEXACT normalization.

    python -m torchtune_ext.parity_report.control <recipe.py> --config <cfg> [key=value ...]

This is not a training option. It exists so the parity report can show what
the exactness buys: it patches :func:`torchtune_ext.train.step.forward_backward`
in this process only, then runs the recipe the way ``tune run`` runs a local
recipe file. Nothing in the recipes or the config schema can select it.

The control normalizes each micro-batch by its *own* trainable-token count and
divides by the number of micro-batches (what most recipes do with a
mean-reduced loss and ``loss / gradient_accumulation_steps``). A token of a
short sample then weighs more than a token of a long one, and the result
depends on how the step is split. Its logged ``loss`` is the quantity it
optimizes -- the mean of the per-micro-batch means -- so the report's plot
shows how far that is from the exact step loss.
"""

import os
import runpy
import sys
from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from torchtune_ext import ranks
from torchtune_ext.train import step
from torchtune_ext.train.accounting import TokenTotals
from torchtune_ext.train.objective import as_objective


def mean_of_means_forward_backward(
    model: nn.Module,
    objective: Any,
    micro_batches: Sequence[step.MicroBatch],
    *,
    device: torch.device,
    dp_group=None,
    **_ignored,
) -> TokenTotals:
    """Drop-in for :func:`torchtune_ext.train.step.forward_backward` with the inexact normalization.

    Backward runs on ``(summed_loss_i / tokens_i) / M`` for each of the ``M``
    micro-batches of the step (in every backward mode: the bug does not depend
    on the mode). ``objective`` is the run's (a token objective: the recipes'
    cross-entropy). Other keyword arguments of ``forward_backward`` (``backward``,
    ``memory_guard``, ``step``) are accepted and ignored: there is nothing for the guard to decide. A
    micro-batch with no trainable token is left out of the sum; the common recipe would produce NaN there
    (0 / 0), which would hide the weighting error this control is meant to show.

    Returns:
        TokenTotals whose ``loss`` sum is ``mean_of_means * num_tokens``: scaled
        so that :func:`torchtune_ext.train.step.train_step`, which logs ``loss sum /
        num_tokens``, logs the mean of the per-micro-batch means -- the loss
        this control actually optimizes. No token metrics.

    Raises:
        RuntimeError: under data parallelism (the control is single-device).
    """
    if dp_group is not None or ranks.several_processes():
        raise RuntimeError("the parity report's control case runs on a single device only")
    num_micro_batches = len(micro_batches)
    mean_of_means = torch.zeros((), dtype=torch.float32, device=device)
    num_tokens = 0
    objective = as_objective(objective)
    for micro_batch in micro_batches:
        prepared = objective.prepare(micro_batch, device)
        tokens = prepared.count
        num_tokens += tokens
        if tokens == 0:
            continue
        micro_mean = objective(model, prepared).loss / tokens
        (micro_mean / num_micro_batches).backward()
        mean_of_means = mean_of_means + micro_mean.detach() / num_micro_batches
    return TokenTotals(num_tokens, num_tokens, {"loss": (mean_of_means * num_tokens).item()})


def recipe_module(recipe: str) -> str:
    """Module name of a recipe file path, as ``tune run`` derives it: ``recipes/x.py`` -> ``recipes.x``."""
    return os.path.splitext(recipe)[0].replace("/", ".")


def main(argv: Optional[List[str]] = None) -> None:
    """Patch the step, then run ``<recipe.py> --config ... overrides`` as ``tune run`` would.

    The recipe's own ``sys.exit`` ends the process with its exit status.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: python -m torchtune_ext.parity_report.control <recipe.py> --config <cfg> [key=value ...]")
    recipe, recipe_args = argv[0], argv[1:]
    # train_step looks forward_backward up in the step module at call time, so
    # replacing the module attribute reaches every recipe that uses train_step.
    step.forward_backward = mean_of_means_forward_backward
    module = recipe_module(recipe)
    sys.path.append(os.getcwd())  # as tune run does, so a recipe next to the config is importable
    sys.argv = [module, *recipe_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
