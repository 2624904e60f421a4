"""Tensor parallelism x FSDP2: the same training as data parallelism.

One 4-process launch (tests/support/tp_worker.py, gloo on CPU): 2 data-parallel x
2 tensor-parallel ranks against 4 data-parallel ranks on the same global batch,
4 AdamW steps with clipping. The plan and the config checks, in this process:
tests/unit/parallel/test_tensor_parallel.py.
"""

import json

import pytest
import torch

from tests.support.helpers import rel_diff, run_worker

TOL = 1e-5


# ------------------------------------------------------------- exactness
CASES = [
    {"name": "dp4", "tp": 1},
    {"name": "dp2_tp2", "tp": 2},
    {"name": "dp2_tp2_once", "tp": 2, "once": True},
    {"name": "qwen2_dp4", "tp": 1, "arch": "qwen2"},
    {"name": "qwen2_dp2_tp2", "tp": 2, "arch": "qwen2"},
    # LoRA (torchtune_ext.parallel.lora): adapters split with their base; Qwen2's on its untied output too
    {"name": "lora_dp4", "tp": 1, "model": "lora"},
    {"name": "lora_dp2_tp2", "tp": 2, "model": "lora"},
    {"name": "qwen2_lora_dp4", "tp": 1, "arch": "qwen2", "model": "lora"},
    {"name": "qwen2_lora_dp2_tp2", "tp": 2, "arch": "qwen2", "model": "lora"},
    # the mistake: the token count and sums reduced over every rank, i.e. each token counted once per tp rank
    {"name": "dp2_tp2_counted_on_every_rank", "tp": 2, "count_all_ranks": True},
    # checkpointed after 2 steps as the recipes save, continued on another layout
    # (TP -> DP: tests/integration/recipes/test_tensor_parallel_recipe.py, through the recipe, from a sharded
    # checkpoint)
    {"name": "dp4_then_dp2_tp2", "tp": 1, "then_tp": 2},
]
REFERENCE = {"dp2_tp2": "dp4", "dp2_tp2_once": "dp4", "qwen2_dp2_tp2": "qwen2_dp4", "lora_dp2_tp2": "lora_dp4",
             "qwen2_lora_dp2_tp2": "qwen2_lora_dp4"}
# Qwen2's key bias gets a gradient of 0 in exact arithmetic (softmax does not change when every key moves by the
# same vector); AdamW turns its rounding noise (~1e-9) into steps of +-lr, different for every summation order.
NOISE_ONLY = ("attn.k_proj.bias",)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "results.pt"
    proc = run_worker(4, "tp_worker", str(out), json.dumps(CASES), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def assert_same_run(got, ref):
    assert len(got["steps"]) == len(ref["steps"]) == 4
    for i, (s, r) in enumerate(zip(got["steps"], ref["steps"])):
        assert s["num_tokens"] == r["num_tokens"], i
        for key in ("loss", "grad_norm", "token_accuracy", "entropy"):
            assert abs(s[key] - r[key]) <= TOL * abs(r[key]) + 1e-7, (i, key, s[key], r[key])
    assert got["params"].keys() == ref["params"].keys()
    for key in ref["params"]:
        if not key.endswith(NOISE_ONLY):
            assert rel_diff(got["params"][key], ref["params"][key]) <= TOL, key


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_two_by_two_tensor_parallel_equals_four_data_parallel(results, name):
    got = results[name]
    assert (got["dp_size"], got["tp_size"]) == (2, 2)
    assert_same_run(got, results[REFERENCE[name]])


def test_counting_tokens_on_every_rank_is_caught(results):
    """Summed over all 4 ranks, each token counts once per tensor-parallel rank: the step's gradient halves."""
    got, ref = results["dp2_tp2_counted_on_every_rank"], results["dp4"]
    assert [s["num_tokens"] for s in got["steps"]] == [2 * s["num_tokens"] for s in ref["steps"]]
    with pytest.raises(AssertionError):
        assert_same_run(got, ref)
    assert got["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"] / 2, rel=1e-5)


@pytest.mark.parametrize("name", ["dp4_then_dp2_tp2"])
def test_a_checkpoint_moves_between_tensor_and_data_parallel(results, name):
    """Model and AdamW state gathered from one layout after 2 steps and loaded into the other: the run goes on
    as if uninterrupted."""
    assert (results[name]["dp_size"], results[name]["tp_size"]) == ((4, 1) if name.endswith("dp4") else (2, 2))
    assert_same_run(results[name], results["dp4"])
