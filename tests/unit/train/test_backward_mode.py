"""The `backward` key (issue 33, U3): auto, once_per_step, per_micro_batch; the older backward_once_per_step is gone.

auto decides per step (the memory guard) and says nothing above DEBUG: the decision is what was asked for.
once_per_step always keeps every micro-batch's graph for one backward, and says once when the guard
predicts that the device lacks the memory. per_micro_batch always runs a backward per micro-batch.
"""

import importlib
import logging

import pytest
import torch

from tests.support.helpers import RecordingLoss, collate, instruct_samples, rel_diff, tiny_model
from torchtune_ext.config import ConfigError, validate
from torchtune_ext.train.memory import MemoryGuard, MicroBatchShape
from torchtune_ext.train.step import forward_backward, train_step

CPU = torch.device("cpu")
TORCHTUNE_LOGGER = "torchtune.utils._logging"  # the memory guard's (torchtune's logger, level INFO of its own)


# ------------------------------------------------------------------------------- config
def test_default_is_auto_and_says_nothing(cfg, caplog):  # noqa: F811
    with caplog.at_level(logging.DEBUG):
        out = validate(cfg)
    assert out.backward == "auto"
    assert "backward" not in caplog.text


def test_backward_takes_three_values(cfg):  # noqa: F811
    for value in ("auto", "once_per_step", "per_micro_batch"):
        cfg.backward = value
        assert validate(cfg).backward == value
    cfg.backward = "once"
    with pytest.raises(ConfigError, match="'backward'.*expected one of auto, once_per_step, per_micro_batch"):
        validate(cfg)


@pytest.mark.parametrize("old,meant", [(True, "auto"), (False, "per_micro_batch")])
def test_the_removed_older_key_alone_is_one_line_naming_what_replaces_it(cfg, old, meant):  # noqa: F811
    cfg.backward_once_per_step = old
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == "backward_once_per_step" and "\n" not in str(err.value)
    assert "was removed" in str(err.value) and f"use backward={meant} for backward_once_per_step={str(old).lower()}" \
        in str(err.value)


@pytest.mark.parametrize("old,backward", [(False, "once_per_step"), (True, "per_micro_batch"), (False, "auto")])
def test_the_removed_key_contradicting_backward_is_an_error(cfg, old, backward):  # noqa: F811
    cfg.backward_once_per_step, cfg.backward = old, backward
    with pytest.raises(ConfigError, match="'backward_once_per_step': was removed"):
        validate(cfg)


@pytest.mark.parametrize("old,backward", [(True, "auto"), (True, "once_per_step"), (False, "per_micro_batch")])
def test_a_saved_config_with_both_keys_runs_with_one_warning_and_drops_the_old_one(cfg, caplog, monkeypatch, old,
                                                                                   backward):  # noqa: F811
    cfg.backward_once_per_step, cfg.backward = old, backward  # what earlier versions wrote to logs/config_N.yaml
    for rank, said in (("1", 0), ("0", 1)):  # validate runs on every rank: one line per job
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            out = validate(cfg.copy())
        assert out.backward == backward and "backward_once_per_step" not in out
        lines = [r.getMessage() for r in caplog.records if "backward_once_per_step" in r.getMessage()]
        assert len(lines) == said, (rank, lines)
    assert "was removed" in lines[0] and f"backward={backward} applies" in lines[0]


def test_the_removed_key_on_the_command_line_gets_the_same_line(cfg, monkeypatch):  # noqa: F811
    validate_module = importlib.import_module("torchtune_ext.config.validate")

    monkeypatch.setattr(validate_module, "_command_line_keys", ("backward_once_per_step",))
    cfg.backward_once_per_step = False
    with pytest.raises(ConfigError, match="use backward=per_micro_batch"):
        validate(cfg)


# ------------------------------------------------------------------------------- the step
def micro_batches():
    samples = instruct_samples([3, 9, 1, 6, 2, 4], [12, 2, 30, 7, 5, 9])
    return [collate(samples[i:i + 2]) for i in range(0, 6, 2)]


def model_and_loss(seed=0):
    model = tiny_model(seed)
    loss_fn = RecordingLoss()
    loss_fn.take_output_projection(model)
    return model, loss_fn


# a step torchtune's recipe runs with less memory than three kept graphs: auto runs it per micro-batch
SMALL_BASELINE = [MicroBatchShape(1, 1, 1)]


def step_modes(backward, available, steps=3, **kwargs):
    """Run ``steps`` optimizer steps; returns how each micro-batch ran and the loss of each step."""
    model, loss_fn = model_and_loss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the same micro-batches every step
    guard = MemoryGuard(model, CPU, optimizer, available=lambda _device: available)
    losses = []
    for step in range(1, steps + 1):
        result = train_step(model, optimizer, loss_fn, micro_batches(), device=CPU, memory_guard=guard,
                            baseline=SMALL_BASELINE, step=step, backward=backward, **kwargs)
        losses.append(result.loss)
    return loss_fn.recomputed, losses, result


PLENTY = 1 << 50


def test_each_mode_does_what_it_says_with_the_same_loss(caplog):
    with caplog.at_level(logging.DEBUG, logger=TORCHTUNE_LOGGER):
        auto, auto_losses, auto_result = step_modes("auto", PLENTY)
    # auto: the guard's default limit (torchtune's recipe needs less for this step) -> per micro-batch,
    # and the decision is auto's own: nothing above DEBUG
    assert auto == [False] * 9 and auto_result.once_per_step is False
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG and "backward" in r.getMessage()]
    assert any(r.levelno == logging.DEBUG and "per micro-batch" in r.getMessage() for r in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.INFO):
        once, once_losses, once_result = step_modes("once_per_step", PLENTY)
        each, each_losses, each_result = step_modes("per_micro_batch", PLENTY)
    assert once == [True] * 9 and once_result.once_per_step is True  # no torchtune bound, memory plenty
    assert each == [False] * 9 and each_result.once_per_step is False
    assert not [r for r in caplog.records if "backward" in r.getMessage()]  # as asked: nothing to say
    assert once_losses == pytest.approx(auto_losses, rel=1e-6) == each_losses


def test_once_per_step_says_once_when_the_device_lacks_the_memory(caplog):
    with caplog.at_level(logging.INFO):
        once, _, result = step_modes("once_per_step", 1000, steps=4)
    assert once == [True] * 12 and result.once_per_step is True  # always, as asked
    (line,) = [r for r in caplog.records if "backward" in r.getMessage()]
    assert line.levelno == logging.WARNING
    text = line.getMessage()
    assert text.startswith("Step 1: backward=once_per_step needs about ")
    assert "1000 B available" in text and "may run out of memory" in text and "backward=auto" in text


def test_auto_falls_back_for_the_device_quietly(caplog):
    with caplog.at_level(logging.INFO):
        auto, _, result = step_modes("auto", 1000)
    assert auto == [False] * 9 and result.once_per_step is False
    assert not [r for r in caplog.records if "backward" in r.getMessage()]


def test_without_a_guard_once_per_step_and_auto_keep_every_graph_and_unknown_modes_are_refused():
    model, loss_fn = model_and_loss()
    forward_backward(model, loss_fn, micro_batches(), device=CPU, backward="auto")  # no guard: once
    assert loss_fn.recomputed == [True] * 3
    model, loss_fn = model_and_loss()
    forward_backward(model, loss_fn, micro_batches(), device=CPU, backward="once_per_step")  # no guard: once
    assert loss_fn.recomputed == [True] * 3
    with pytest.raises(ValueError, match="backward must be one of auto, once_per_step, per_micro_batch"):
        forward_backward(model, loss_fn, micro_batches(), device=CPU, backward="once")


def test_once_per_step_does_not_redo_a_step_that_ran_out_of_memory():
    """auto redoes such a step per micro-batch (tests/unit/train/test_memory.py); once_per_step was asked for: the error
    stands, after the warning above said it might come."""
    model, loss_fn = model_and_loss()
    calls = {"n": 0}

    def oom_on_second_forward(_module, _args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    model.layers[0].register_forward_pre_hook(oom_on_second_forward)
    with pytest.raises(torch.OutOfMemoryError):
        forward_backward(model, loss_fn, micro_batches(), device=CPU, backward="once_per_step",
                         memory_guard=MemoryGuard(model, CPU, available=lambda _device: None))
    assert calls["n"] == 2


def test_per_micro_batch_and_once_per_step_give_the_same_gradients():
    grads = {}
    for mode in ("once_per_step", "per_micro_batch"):
        model, loss_fn = model_and_loss()
        forward_backward(model, loss_fn, micro_batches(), device=CPU, backward=mode)
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in grads["once_per_step"].items():
        assert rel_diff(grad, grads["per_micro_batch"][name]) <= 1e-5, name


def test_optimizer_in_backward_says_once_that_it_runs_one_backward(cfg, caplog):  # noqa: F811
    """Its hooks update each parameter during the step's one backward: per micro-batch cannot apply where a
    step has several micro-batches (only a token budget makes them: it needs gradient_accumulation_steps=1)."""
    cfg.optimizer_in_bwd, cfg.clip_grad_norm, cfg.backward = True, None, "per_micro_batch"
    with caplog.at_level(logging.INFO):
        validate(cfg)
    assert "optimizer_in_bwd" not in caplog.text  # one micro-batch per step: nothing differs
    cfg.max_tokens_per_micro_batch = 4096
    with caplog.at_level(logging.INFO):
        validate(cfg)
    assert caplog.text.count("backward=per_micro_batch does not apply with optimizer_in_bwd=true") == 1


@pytest.mark.parametrize("backward", ["auto", "once_per_step", "per_micro_batch"])
def test_one_micro_batch_is_backpropagated_at_once_without_recomputing_its_output(backward):
    """A step of one micro-batch has one backward in every mode: its graph waits for no other, so the loss
    keeps its log-probabilities instead of recomputing the output projection in backward (an extra forward
    of the output layer for nothing), and the step says it ran once per step."""
    model, loss_fn = model_and_loss()
    totals = forward_backward(model, loss_fn, micro_batches()[:1], device=CPU, backward=backward)
    assert loss_fn.recomputed == [False]
    assert totals.once_per_step is True
