"""Why a step is slow (issue 33, U6): the time spent waiting for its data and for the other ranks.

The progress bar and every step record show tokens/s and the shares of the step's wall time
(data loading plus the step) spent loading the step's samples and waiting in the step's
collectives for the other ranks.
"""

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.helpers import IGNORE, instruct_samples, tiny_model, windows
from torchtune_ext.data import StepLoader, make_collate
from torchtune_ext.run.metrics import progress_description, step_record
from torchtune_ext.train import accounting
from torchtune_ext.train import step as step_module
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import StepResult, train_step, waiting_shares

CPU = torch.device("cpu")


class SlowDataset(torch.utils.data.Dataset):
    """Samples that take ``delay`` seconds each to read (a slow disk, a tokenizer on a busy CPU)."""

    def __init__(self, n, delay):
        self.samples, self.delay = instruct_samples([3] * n, [5] * n), delay

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.samples[i]


def test_the_loader_times_each_steps_data():
    loader = StepLoader(SlowDataset(8, 0.05), make_collate(False, 0, IGNORE), batch_size=2,
                        gradient_accumulation_steps=2, ignore_index=IGNORE)
    steps = list(loader.epoch(0))
    assert len(steps) == 2
    for step in steps:  # 4 samples of 0.05 s each
        assert 0.2 <= step.load_seconds < 1.0
    fast = StepLoader(SlowDataset(8, 0.0), make_collate(False, 0, IGNORE), batch_size=2,
                      gradient_accumulation_steps=2, ignore_index=IGNORE)
    assert all(s.load_seconds < 0.1 for s in fast.epoch(0))


def _step(**kwargs):
    model = tiny_model()
    loss_fn = SummedCrossEntropyLoss(1, IGNORE)
    loss_fn.take_output_projection(model)
    (window,) = windows(instruct_samples([3, 5, 2, 4], [6, 4, 8, 3]), batch_size=2, grad_accum=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_step(model, optimizer, loss_fn, window, device=CPU, step=1, **kwargs)


def test_one_process_waits_for_no_rank():
    assert _step().wait_seconds == 0.0


def test_time_in_the_steps_collectives_is_the_wait_for_the_other_ranks(monkeypatch):
    """Two ranks, as this rank sees them: each all-reduce returns when the slowest rank gets there
    (here 0.1 s later). The step's collectives: the token count before any forward, the loss sums after."""
    calls = []

    def all_reduce_after_the_other_rank(tensor, op=None, group=None):
        calls.append(tensor.numel())
        time.sleep(0.1)

    monkeypatch.setattr(accounting, "dp_is_active", lambda group=None: True)
    monkeypatch.setattr(step_module, "dp_is_active", lambda group=None: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce_after_the_other_rank)
    result = _step()
    assert len(calls) == 2
    assert 0.2 <= result.wait_seconds < 0.2 + 0.15


def test_the_shares_of_a_step():
    result = StepResult(loss=1.0, num_tokens=300, local_num_tokens=300, grad_norm=1.0, wait_seconds=0.5)
    shares = waiting_shares(result, step_seconds=2.0, data_seconds=2.0)
    assert shares == {"data_seconds": 2.0, "data_wait_fraction": 0.5, "rank_wait_fraction": 0.125}
    assert waiting_shares(StepResult(1.0, 3, 3, 1.0), step_seconds=0.0) == {
        "data_seconds": 0.0, "data_wait_fraction": 0.0, "rank_wait_fraction": 0.0}


def test_the_record_and_the_progress_bar_say_why_a_step_is_slow():
    class Data:  # a StepData's timing and padding figures
        load_seconds, num_padded_positions, num_real_tokens = 3.0, 100, 100

    result = StepResult(loss=1.0, num_tokens=300, local_num_tokens=300, grad_norm=1.0, wait_seconds=0.25)
    record = step_record(result, step=4, epoch=0, lr=1e-4, step_seconds=1.0, device=CPU, data=Data(), dp_world_size=2)
    assert record["data_seconds"] == 3.0
    assert record["data_wait_fraction"] == pytest.approx(0.75)
    assert record["rank_wait_fraction"] == pytest.approx(0.0625)
    assert progress_description(record) == "step 4 | loss 1.0000 | 300 tok/s | waiting: data 75%, ranks 6%"
    alone = step_record(StepResult(1.0, 300, 300, 1.0), step=5, epoch=0, lr=1e-4, step_seconds=1.0, device=CPU)
    assert alone["rank_wait_fraction"] == 0.0
    assert progress_description(alone) == "step 5 | loss 1.0000 | 300 tok/s | waiting: data 0%"  # one process
