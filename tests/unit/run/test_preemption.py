"""SIGTERM and Ctrl-C ask for a stop after the step in progress (exit status 75): the parts that run in this process.

The runs stopped by real signals, and signals while a process exits: tests/integration/test_preemption.py.
"""

import os
import signal

import pytest
import torch

from tests.support.helpers import REPO_ROOT
from torchtune_ext.errors import EXIT_STOPPED, OUTCOME_FILE_ENV
from torchtune_ext.run.control.exits import record_outcome
from torchtune_ext.run.control.preemption import resume_command


def test_resume_command_names_the_recipe_file(monkeypatch):
    argv = ["recipes.full_finetune_single_device", "--config", "my config.yaml", "resume_from_checkpoint=false",
            "batch_size=4"]
    assert resume_command(argv) == ("tune run recipes/full_finetune_single_device.py --config 'my config.yaml' "
                                    "batch_size=4 resume_from_checkpoint=true")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_command([str(REPO_ROOT / "recipes/x.py"), "--config", "c.yaml"]).startswith(
        "tune run --nproc_per_node 2 ")


def test_a_job_of_several_nodes_is_continued_with_its_launchers_real_flags(monkeypatch):
    """On 2 nodes the line held a literal '<your torchrun flags for the other nodes>': pasting it failed. The
    launcher hands its own command line to its workers; the line repeats it, to be run on every node."""
    from torchtune_ext.errors import LAUNCH_COMMAND_ENV
    from torchtune_ext.run.control.preemption import continue_with

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    launched = ("tune run --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
                "--rdzv-id job7 recipes/full_finetune_distributed.py --config my.yaml resume_from_checkpoint=false "
                "optimizer.lr=1e-4")
    monkeypatch.setenv(LAUNCH_COMMAND_ENV, launched)
    argv = ["recipes.full_finetune_distributed", "--config", "my.yaml", "optimizer.lr=1e-4"]
    command = resume_command(argv)
    assert command == launched.replace("resume_from_checkpoint=false ", "") + " resume_from_checkpoint=true"
    assert continue_with(command) == f"Continue on every node with: {command}"
    monkeypatch.delenv(LAUNCH_COMMAND_ENV)  # plain torchrun: the flags this process knows, no placeholder
    assert resume_command(argv).startswith("tune run --nproc_per_node 2 --nnodes 2 recipes/full_finetune_distributed")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert continue_with("x") == "Continue with: x"


@pytest.mark.parametrize("rank,local_rank,every_node,written", [
    ("0", "0", False, True), ("2", "0", False, False), ("2", "0", True, True), ("3", "1", True, False)])
def test_every_nodes_launcher_learns_a_shared_status(tmp_path, monkeypatch, rank, local_rank, every_node, written):
    """A stop all ranks agreed on reaches the launcher of each node (through its first worker), not only rank 0's:
    a scheduler signals every node's launcher, which would otherwise exit 143 while its workers saved."""
    outcome = tmp_path / "outcome"
    monkeypatch.setenv(OUTCOME_FILE_ENV, str(outcome))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    record_outcome(EXIT_STOPPED, every_node=every_node)
    assert (outcome.read_text() == f"{EXIT_STOPPED}\n") if written else not outcome.exists()


def test_ctrl_c_asks_for_the_same_stop_as_sigterm(tmp_path, capfd, monkeypatch):
    """SIGINT (Ctrl-C) takes GracefulStop's handler as SIGTERM does: a stop after the step, said with its name
    (the end-to-end path: test_signal_saves_says_how_to_resume_and_resumes_exactly with SIGTERM)."""
    from torchtune_ext.run.control import preemption

    monkeypatch.setattr(preemption, "finish_wandb", lambda status: None)
    monkeypatch.setattr(preemption, "record_outcome", lambda *args, **kwargs: None)
    monkeypatch.setattr(preemption, "resume_command", lambda: "tune run x.py resume_from_checkpoint=true")
    stop = preemption.GracefulStop(torch.device("cpu"))
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested()
        assert stop.stop(tmp_path / "step_3", 3) == EXIT_STOPPED
    finally:
        stop.close()
    err = capfd.readouterr().err
    assert "SIGINT received: stopping after the current optimizer step" in err
    assert f"Stopped on SIGINT after optimizer step 3; checkpoint: {tmp_path / 'step_3'}" in err
