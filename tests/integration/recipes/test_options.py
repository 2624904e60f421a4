"""Every accepted recipe option does something: activation checkpointing, dtype,
compile, logging cadence, shuffle and seed -- on a tiny model, in process."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from tests.support.helpers import read_jsonl, recipe_class, run_recipe, tiny_recipe_config, write_tiny_hf_checkpoint
from torchtune_ext.config import validate

RECIPE = recipe_class("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice")
SETTINGS = ["max_steps_per_epoch=3", "batch_size=2", "gradient_accumulation_steps=2", "save_final_checkpoint=false",
            "lr_scheduler.num_warmup_steps=0", "optimizer.lr=0.01"]


def _run(assets, base, out, *overrides):
    cfg = tiny_recipe_config("configs/smollm2/135M_full_single_device.yaml",
                             {"_component_": "torchtune_ext.model.builders.tiny_llama"}, assets, base, out, *SETTINGS,
                             *overrides)
    recipe = run_recipe(RECIPE, validate(cfg))
    return recipe, read_jsonl(out / "logs" / "metrics.jsonl")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "base"
    write_tiny_hf_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def plain(smollm2_assets, base):
    """The run with SETTINGS alone, trained once for the tests that compare an option with it."""
    return _run(smollm2_assets, base, base.parent / "plain")


@pytest.fixture
def run(smollm2_assets, base, tmp_path):
    return lambda name, *overrides: _run(smollm2_assets, base, tmp_path / name, *overrides)


def losses(rows):
    return [r["loss"] for r in rows]


def test_activation_checkpointing_wraps_layers_and_changes_no_number(run, plain):
    plain, rows = plain
    wrapped, rows_ac = run("ac", "enable_activation_checkpointing=true")
    assert not any(isinstance(m, CheckpointWrapper) for m in plain.model.modules())
    assert sum(isinstance(m, CheckpointWrapper) for m in wrapped.model.modules()) == len(wrapped.model.layers)
    assert losses(rows_ac) == pytest.approx(losses(rows), rel=1e-6)


def test_bf16_trains_in_bf16_close_to_fp32(run, plain):
    _, rows = plain  # fp32
    recipe, rows_bf16 = run("bf16", "dtype=bf16")
    assert {p.dtype for p in recipe.model.parameters()} == {torch.bfloat16}
    # the loss is accumulated in fp32 from bf16 logits: close, not equal
    assert losses(rows_bf16)[0] == pytest.approx(losses(rows)[0], rel=2e-2)
    assert all(r["loss"] == r["loss"] for r in rows_bf16)  # no NaN


def test_compile_matches_eager(run, plain):
    eager, rows = plain
    recipe, rows_compiled = run("compiled", "compile=true")
    compiled = [m for m in recipe.model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(compiled) == len(recipe.model.layers)
    # the tied embedding adds its rows to .grad itself on CPU, but not under compile
    assert type(eager.model.tok_embeddings).__name__ == "_RowsIntoGradEmbedding"
    assert type(recipe.model.tok_embeddings) is torch.nn.Embedding
    assert losses(rows_compiled) == pytest.approx(losses(rows), rel=1e-4)


def test_log_every_n_steps(run):
    _, rows = run("every2", "log_every_n_steps=2", "max_steps_per_epoch=4")
    assert [r["step"] for r in rows] == [2, 4]


def test_shuffle_decides_the_order_and_seed_does_not(run):
    """As in torchtune, whose recipes seed their sampler with 0: the same samples in the same steps whatever
    `seed` (seed: null included, which draws a new seed per run), another order with shuffle=false."""
    _, a = run("a", "seed=1")
    _, b = run("b", "seed=1")
    _, c = run("c", "seed=2")
    _, e = run("e", "seed=null")
    _, d = run("d", "seed=1", "shuffle=false")
    tokens = lambda rows: [r["num_tokens"] for r in rows]  # noqa: E731
    assert tokens(a) == tokens(b) and losses(a) == losses(b)
    assert tokens(a) == tokens(c) == tokens(e)
    assert tokens(a) != tokens(d)


def test_step_that_does_not_fit_runs_per_micro_batch_said_at_debug(run, monkeypatch, caplog):
    """The default (backward: auto) on a machine without the memory for once per step: the recipe trains
    per micro-batch, with the same losses as the once-per-step run, and says so at DEBUG only (the choice
    is the one auto was asked to make; issue 33 U3)."""
    import logging

    from torchtune import utils

    from torchtune_ext.train import memory

    _, rows = run("fits", "once_per_step_memory_limit=device")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 1 << 20)  # 1 MiB free
    try:
        with caplog.at_level(logging.DEBUG):
            _, rows_tight = run("tight", "once_per_step_memory_limit=device", "log_level=DEBUG")
    finally:
        utils.get_logger("INFO")
    lines = [r for r in caplog.records if "backward" in r.getMessage() and "micro-batch" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG
    assert lines[0].getMessage().startswith("Step 1: backward=auto runs backward per micro-batch")
    assert "available" in lines[0].getMessage()
    assert [r["once_per_step"] for r in rows] == [1] * len(rows)
    assert [r["once_per_step"] for r in rows_tight] == [0] * len(rows)
    assert losses(rows_tight) == pytest.approx(losses(rows), rel=1e-5)


def test_mfu_and_padding_are_logged_every_step(run):
    _, rows = run("mfu", "peak_tflops_per_device=0.001")
    for r in rows:
        assert 0 <= r["padding_fraction"] < 1 and r["tflops_per_device"] >= r["useful_tflops_per_device"] > 0
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.001)


def test_arrangements_of_a_step_train_alike(run, monkeypatch):
    """Ungrouped, grouped (the default), a token budget and packed rows: the same samples per step, the
    same losses and token counts; packing leaves no padding. Every arrangement hands the memory guard the
    same baseline: the ungrouped run's micro-batches (torchtune's), every position a logits row. On this
    tiny model a vocabulary-wide logits row outweighs a token's activations, so the default limit still
    runs once per step, as does once_per_step_memory_limit=device."""
    from torchtune_ext.train import memory

    calls = []
    step_needs, decide_step = memory.MemoryGuard.step_needs, memory.MemoryGuard.decide_step

    def recording_needs(self, micro_batches, baseline=None):
        calls.append([self.limit, list(micro_batches), list(baseline or []), None])
        return step_needs(self, micro_batches, baseline)

    def recording_decision(self, needs):
        decision = decide_step(self, needs)
        calls[-1][3] = decision[0]  # once per step
        return decision

    monkeypatch.setattr(memory.MemoryGuard, "step_needs", recording_needs)
    monkeypatch.setattr(memory.MemoryGuard, "decide_step", recording_decision)
    guarded = {}

    def run_recording(name, *overrides):
        first = len(calls)
        rows = run(name, *overrides)[1]
        guarded[name] = calls[first:]
        return rows

    grouped = run_recording("grouped")
    ungrouped = run_recording("ungrouped", "group_by_length=false")
    budget = run_recording("budget", "max_tokens_per_micro_batch=1024")
    packed = run_recording("packed", "max_tokens_per_micro_batch=1024", "pack_micro_batches=true")
    device = run_recording("device", "once_per_step_memory_limit=device")
    for rows in (ungrouped, budget, packed, device):
        assert losses(rows) == pytest.approx(losses(grouped), rel=1e-5)
        assert [r["num_tokens"] for r in rows] == [r["num_tokens"] for r in grouped]
    # the same budget pads its micro-batches; packing them removes every padding position
    assert all(r["padding_fraction"] == 0 for r in packed)
    assert any(r["padding_fraction"] > 0 for r in ungrouped) and any(r["padding_fraction"] > 0 for r in budget)

    # one call per step with more than one micro-batch (the budget may put a step in one)
    plain = [[(m.batch, m.seq_len) for m in c[1]] for c in guarded["ungrouped"]]
    assert len(plain) == 3
    for name in ("grouped", "ungrouped", "device"):
        assert [[(b.batch, b.seq_len) for b in c[2]] for c in guarded[name]] == plain
        assert all(b.trainable_rows == b.batch * b.seq_len for c in guarded[name] for b in c[2])
    assert {c[0] for name, cs in guarded.items() if name != "device" for c in cs} == {"torchtune"}
    assert {c[0] for c in guarded["device"]} == {"device"} and all(c[3] for c in calls)


def test_log_level_applies_and_each_step_logs_its_backward_mode(run, caplog):
    """log_level sets torchtune's logger (every recipe line goes through it) for the whole run; the
    once_per_step metric says how each step's gradient was computed."""
    import logging

    from torchtune import utils

    logger = utils.get_logger()
    try:
        with caplog.at_level(logging.DEBUG):
            _, quiet = run("quiet", "log_level=WARNING")
        assert not [r for r in caplog.records if r.name == logger.name and r.levelno < logging.WARNING]
        _, each = run("debug", "log_level=DEBUG", "backward=per_micro_batch")
        assert logger.getEffectiveLevel() == logging.DEBUG  # nothing imported during the run reset it
    finally:
        utils.get_logger("INFO")
    assert [r["once_per_step"] for r in quiet] == [1, 1, 1]  # GA 2; the tiny model fits the default limit
    assert [r["once_per_step"] for r in each] == [0, 0, 0]
    assert losses(each) == pytest.approx(losses(quiet), rel=1e-5)


def test_token_metrics_can_be_turned_off_and_change_nothing_else(run, plain):
    """loss.token_metrics=false: no token_accuracy / entropy in the records, the same training."""
    _, with_metrics = plain
    _, without = run("no_metrics", "loss.token_metrics=false")
    assert all({"token_accuracy", "entropy"} <= r.keys() for r in with_metrics)
    assert not any({"token_accuracy", "entropy"} & r.keys() for r in without)
    assert losses(without) == losses(with_metrics)
    assert [r["grad_norm"] for r in without] == [r["grad_norm"] for r in with_metrics]


def test_training_on_cpu_keeps_freed_memory(run, monkeypatch):
    """The shared loop (every recipe's train()) turns on runtime.keep_freed_cpu_memory for its device."""
    from torchtune_ext.run import loop

    calls = []
    monkeypatch.setattr(loop, "keep_freed_cpu_memory", lambda device: calls.append(device.type))
    run("plain")
    assert calls == ["cpu"]
