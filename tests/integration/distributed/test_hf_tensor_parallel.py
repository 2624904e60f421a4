"""Tensor parallelism for transformers models: their own tp_plan, applied with torch's styles, equals data parallelism.

One 2-process launch (tests/support/hf_dist_worker.py, gloo on CPU):
1 data-parallel x 2 tensor-parallel ranks against 2 data-parallel ranks on the
same global batch, per family: Llama (untied output projection, split and
gathered), Qwen 3 (tied, q/k norms over each rank's own heads), Gemma 3 (tied,
a scaled embedding, a sliding window, a soft cap), OLMo 2 (q/k norms over every
head: q/k/v gathered, o_proj's input split again); and the Llama with activation
checkpointing, FSDP2's CPU offload, and torchtune's optimizer_in_bwd. The plan
and its checks, in this process on meta-device models: tests/unit/parallel/test_hf_tensor_parallel.py.
"""

import json

import pytest
import torch

from tests.support.helpers import rel_diff, run_worker
from tests.support.hf_tiny import write_olmo2, write_tiny

TOL = 1e-5
# adapters on every projection the plan splits: q/v and the MLP by columns, o_proj and down_proj by rows
LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=4,
            lora_alpha=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp")
    out = {name: write_tiny(name, root / name) for name in ("llama", "qwen3", "gemma3")}
    out["olmo2"] = write_olmo2(root / "olmo2")
    return out


# ------------------------------------------------------------- exactness
FAMILIES = ("llama", "qwen3", "gemma3", "olmo2")


def cases(folders):
    out = []
    for family in FAMILIES:
        # a global batch of 4 samples per step: 2 ranks x 1 x 2 micro-batches; 1 data-parallel rank x 2 x 2
        common = dict(folder=str(folders[family]), grad_accum=2, once=False)
        out += [dict(name=f"{family}_dp2", tp=1, batch_size=1, **common),
                dict(name=f"{family}_tp2", tp=2, batch_size=2, **common)]
    out.append(dict(out[1], name="llama_tp2_ac_once", ac=True, once=True))  # activation checkpointing
    out.append(dict(out[1], name="llama_tp2_offload", cpu_offload=True))  # FSDP2's CPU offload
    out += [dict(out[0], name="llama_lora_dp2", lora=LORA), dict(out[1], name="llama_lora_tp2", lora=LORA),
            dict(out[2], name="qwen3_lora_dp2", lora=LORA), dict(out[3], name="qwen3_lora_tp2", lora=LORA)]
    # torchtune's optimizer_in_bwd: one micro-batch per step, no clipping, against data parallelism so
    out += [dict(out[0], name="llama_dp2_noclip", batch_size=2, grad_accum=1, once=True, clip=None),
            dict(out[1], name="llama_tp2_in_backward", batch_size=4, grad_accum=1, once=True, clip=None,
                 in_backward=True)]
    # the mistake: the step's tokens summed over both ranks of the tensor-parallel group, i.e. counted twice
    out.append(dict(out[1], name="llama_tp2_counted_on_every_rank", count_all_ranks=True))
    return out


@pytest.fixture(scope="module")
def results(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tp_run") / "results.pt"
    proc = run_worker(2, "hf_dist_worker", str(out), str(folders["llama"]), json.dumps(cases(folders)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def assert_same_run(got, ref):
    assert len(got["steps"]) == len(ref["steps"]) == 2
    for a, b in zip(got["steps"], ref["steps"]):
        assert a["num_tokens"] == b["num_tokens"]
        assert abs(a["loss"] - b["loss"]) <= TOL * b["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * b["grad_norm"], (a, b)
    assert got["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        assert rel_diff(got["params"][key], value) <= TOL, key


REFERENCE = {"llama_tp2_in_backward": "llama_dp2_noclip", "llama_lora_tp2": "llama_lora_dp2",
             "qwen3_lora_tp2": "qwen3_lora_dp2"}


@pytest.mark.parametrize("name", [f"{f}_tp2" for f in FAMILIES] + ["llama_tp2_ac_once", "llama_tp2_offload",
                                                                      "llama_tp2_in_backward", "llama_lora_tp2",
                                                                      "qwen3_lora_tp2"])
def test_two_tensor_parallel_ranks_equal_two_data_parallel(results, name):
    """Loss, grad norm (before clipping) and trained weights (gathered: the state dict has no trace of the
    split) of 1 x 2 tensor parallel equal 2 x 1 data parallel on the same global batch."""
    reference = results[REFERENCE.get(name, f"{name.split('_')[0]}_dp2")]
    assert results[name]["mesh"] == (1, 2) and reference["mesh"] == (2, 1)
    assert_same_run(results[name], reference)


def test_counting_tokens_on_every_rank_is_caught(results):
    got, ref = results["llama_tp2_counted_on_every_rank"], results["llama_dp2"]
    assert [s["num_tokens"] for s in got["steps"]] == [2 * s["num_tokens"] for s in ref["steps"]]
    assert got["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"] / 2, rel=1e-5)
    with pytest.raises(AssertionError):
        assert_same_run(got, ref)
