"""torchtune_ext.ranks: which process this is, from torchrun's variables or the process group."""

import pytest

from torchtune_ext import ranks

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def plain_process(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_a_plain_process_is_rank_zero_of_one(plain_process):
    assert not ranks.launched_by_torchrun()
    assert ranks.rank() == 0 and ranks.is_rank_zero()
    assert ranks.world_size() == 1
    assert ranks.local_rank() is None and ranks.local_world_size() is None
    assert not ranks.in_process_group()
    assert ranks.process_group_size() == 1 and not ranks.several_processes()


def test_a_torchrun_worker_reads_its_variables_before_any_process_group(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks.launched_by_torchrun()
    assert ranks.rank() == 3 and not ranks.is_rank_zero()
    assert ranks.world_size() == 4
    assert ranks.local_rank() == 1 and ranks.local_world_size() == 2
    # a collective needs a process group: the variables alone do not make one
    assert not ranks.in_process_group() and not ranks.several_processes()


def test_an_empty_variable_reads_as_unset(monkeypatch):
    monkeypatch.setenv("RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "")
    assert ranks.rank() == 0 and ranks.world_size() == 1


def test_a_process_group_answers_without_torchrun_variables(plain_process):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group of another test is still open in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert ranks.in_process_group()
        assert ranks.rank() == 0 and ranks.world_size() == 1 and ranks.process_group_size() == 1
        assert not ranks.several_processes()
    finally:
        dist.destroy_process_group()
    assert not ranks.in_process_group()
