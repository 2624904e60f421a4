"""torchtune_ext._local_recipes: the checks ``tune run`` gets before torchrun starts (no process here)."""

import argparse
from pathlib import Path

import pytest

from torchtune_ext import _local_recipes


class _Run:
    """torchtune's ``Run`` as far as the check reaches: its parser (errors exit 2 with one ``tune run:`` line)."""

    def __init__(self):
        self._parser = argparse.ArgumentParser(prog="tune run")
        self.ran = []


def _tune_run(capsys, **torchrun_args):
    run = _Run()
    args = argparse.Namespace(recipe="recipes/full_finetune_distributed.py", recipe_args=[], **torchrun_args)
    checked = _local_recipes._check_recipe_path(lambda self, a: self.ran.append(a))
    with pytest.raises(SystemExit) as exit_:
        checked(run, args)
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_several_nodes_without_a_rendezvous_endpoint_is_one_line_naming_the_flags(capsys, nnodes):
    """tune run would start torchrun standalone (a rendezvous on this node only) and wait for ever."""
    code, err = _tune_run(capsys, nnodes=nnodes, rdzv_endpoint="", rdzv_backend="static")
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"tune run: error: --nnodes {nnodes} needs a rendezvous every node can reach")
    assert "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB, the same on every node" in line


def test_one_node_or_an_endpoint_passes_the_check(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the repository root: its recipes/ exist
    for torchrun_args in ({"nnodes": "1", "rdzv_endpoint": ""},
                          {"nnodes": "2", "rdzv_endpoint": "10.0.0.1:29400", "rdzv_backend": "c10d"}):
        run = _Run()
        args = argparse.Namespace(recipe="recipes/full_finetune_distributed.py", recipe_args=[], **torchrun_args)
        run._get_recipe = lambda recipe: None
        run._convert_to_dotpath = lambda recipe: "recipes.full_finetune_distributed"
        _local_recipes._check_recipe_path(lambda self, a: self.ran.append(a))(run, args)
        assert len(run.ran) == 1
