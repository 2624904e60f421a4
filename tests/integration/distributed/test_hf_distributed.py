"""A transformers model (tiny Qwen3, tied embeddings) on 2 ranks (FSDP2, gloo) equals one rank, full and LoRA.

One launch per world size (tests/support/hf_dist_worker.py); global batch of 4
samples per optimizer step everywhere, SGD with clipping, 2 steps.
"""

import json

import pytest
import torch

from tests.support.helpers import rel_diff, run_worker
from tests.support.hf_tiny import write_tiny

TOL = 1e-5
LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=4,
            lora_alpha=8)
CASES = {
    1: [dict(name="w1_b4_ga1_once", batch_size=4, grad_accum=1, once=True),
        dict(name="lora_w1_b4_ga1_once", batch_size=4, grad_accum=1, once=True, lora=LORA)],
    2: [dict(name="w2_b2_ga1_once", batch_size=2, grad_accum=1, once=True),
        dict(name="w2_b1_ga2_per_mb_ac_offload", batch_size=1, grad_accum=2, once=False, ac=True, cpu_offload=True),
        dict(name="lora_w2_b1_ga2_per_mb", batch_size=1, grad_accum=2, once=False, lora=LORA)],
}


def launch(world_size, folder, out):
    proc = run_worker(world_size, "hf_dist_worker", str(out), str(folder), json.dumps(CASES[world_size]))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_dist")
    folder = write_tiny("qwen3", tmp / "qwen3")
    out = {}
    for world_size in CASES:
        out.update(launch(world_size, folder, tmp / f"w{world_size}.pt"))
    return out


@pytest.mark.parametrize("name", [c["name"] for c in CASES[2]])
def test_two_ranks_equal_one(results, name):
    """Loss, grad norm (before clipping) and the trained weights of 2 ranks equal 1 rank's; FSDP units are
    the decoder layers (from _no_split_modules) and the root."""
    reference, got = results["lora_w1_b4_ga1_once" if name.startswith("lora") else "w1_b4_ga1_once"], results[name]
    assert len(got["steps"]) == len(reference["steps"]) == 2
    for a, b in zip(got["steps"], reference["steps"]):
        assert a["num_tokens"] == b["num_tokens"]
        assert abs(a["loss"] - b["loss"]) <= TOL * b["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * b["grad_norm"]
    assert got["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        assert rel_diff(got["params"][key], value) <= TOL, key
    assert got["units"] == ["", "model.layers.0", "model.layers.1"]
    if name.startswith("lora"):  # the adapters trained, the base did not
        assert got["base_moved"] == [] and any("lora_B" in k and v.abs().max() > 0 for k, v in got["params"].items())
    else:
        assert got["base_moved"]
    assert got["checkpointed"] == (2 if "_ac" in name else 0)
