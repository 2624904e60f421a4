"""Data-parallel exactness: FSDP2 over 2 ranks (gloo, CPU) equals one rank.

One launch per world size runs every case (tests/dist_worker.py); the tests
compare what rank 0 saved. Global batch 4 samples per optimizer step
everywhere, SGD with clipping active, 3 steps; full fine-tuning and LoRA.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, rel_diff

TOL = 1e-5
CLIP = 1.0


def case(world_size, batch_size, grad_accum, once, num_samples=12, model="full", **extra):
    mode = "once" if once else "per_mb"
    name = f"{model}_n{num_samples}_w{world_size}_b{batch_size}_ga{grad_accum}_{mode}"
    for key, value in extra.items():
        name += f"_{key}" if value is True else f"_{key}{value}"
    return dict(name=name, world_size=world_size, batch_size=batch_size, grad_accum=grad_accum, once=once,
                num_samples=num_samples, model=model, clip=CLIP, **extra)


# Four splits of the same global batch of 4, in both backward modes.
SPLITS = [(1, 4, 1), (2, 2, 1), (2, 1, 2), (1, 1, 4)]
CASES = [case(w, b, ga, once) for w, b, ga in SPLITS for once in (True, False)]
# Dataset sizes that do not divide by world size x batch x accumulation:
# 11 samples -> steps of 4, 4, 3; 7 samples with a global batch of 8 -> one step.
CASES += [case(1, 4, 1, True, num_samples=11), case(2, 1, 2, True, num_samples=11),
          case(2, 1, 2, False, num_samples=11), case(2, 2, 1, False, num_samples=11),
          case(1, 4, 2, True, num_samples=7), case(2, 2, 2, True, num_samples=7),
          case(2, 2, 2, False, num_samples=7)]
CASES += [case(2, 1, 2, False, cpu_offload=True)]
# Grouped by length and token-budget micro-batches: the same samples per step, arranged otherwise.
CASES += [case(2, 1, 2, True, grouped=True), case(2, 2, 1, False, grouped=True),
          case(1, 1, 4, False, grouped=True), case(2, 1, 2, True, budget=48), case(2, 1, 2, False, budget=48),
          case(1, 4, 1, False, num_samples=11, budget=40), case(2, 1, 2, False, num_samples=11, grouped=True)]
# LoRA (nonzero lora_b, frozen base): the same four splits, both modes.
CASES += [case(w, b, ga, once, model="lora") for w, b, ga in SPLITS for once in (True, False)]
# Packed: all 12 documents in one optimizer step, packed into 64-token rows on 2 ranks
# (and 1), against the same documents unpacked in one step of batch 12.
PACKED_CASES = [case(1, 12, 1, True), case(2, 4, 1, True, packed=True), case(2, 2, 2, False, packed=True),
                case(1, 8, 1, False, packed=True), case(2, 4, 1, False, model="lora", packed=True),
                case(1, 12, 1, True, model="lora")]
REFERENCE = {("full", 12): "full_n12_w1_b4_ga1_once", ("full", 11): "full_n11_w1_b4_ga1_once",
             ("full", 7): "full_n7_w1_b4_ga2_once", ("lora", 12): "lora_n12_w1_b4_ga1_once"}


def launch(world_size, cases, out):
    """One rank runs as a plain process (a group of one, as without torchrun); more under torchrun."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + [str(REPO_ROOT / "tests" / "dist_worker.py"), str(out), json.dumps(cases)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import torch

    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    out = {}
    for world_size in (1, 2):
        cases = [c for c in CASES + PACKED_CASES if c["world_size"] == world_size]
        out.update(launch(world_size, cases, tmp / f"w{world_size}.pt"))
    return out


def assert_same_run(got, ref, label):
    assert len(got["steps"]) == len(ref["steps"]), label
    for i, (s, r) in enumerate(zip(got["steps"], ref["steps"])):
        assert s["num_tokens"] == r["num_tokens"], (label, i)
        assert abs(s["loss"] - r["loss"]) <= TOL * abs(r["loss"]), (label, i, s["loss"], r["loss"])
        assert abs(s["grad_norm"] - r["grad_norm"]) <= TOL * abs(r["grad_norm"]), (label, i)
        for metric in ("token_accuracy", "entropy"):
            # absolute floor: fp32 log-softmax resolves an almost-certain prediction's entropy to ~1e-7 nats
            assert abs(s[metric] - r[metric]) <= TOL * abs(r[metric]) + 1e-7, (label, i, metric)
    assert got["params"].keys() == ref["params"].keys()
    for key in ref["params"]:
        assert rel_diff(got["params"][key], ref["params"][key]) <= TOL, (label, key)


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_same_loss_grad_norm_and_params_as_one_rank(results, name):
    """Any split over ranks, batch and accumulation, either backward mode, matches 1 rank x batch 4."""
    (spec,) = [c for c in CASES if c["name"] == name]
    ref = results[REFERENCE[spec["model"], spec["num_samples"]]]
    assert_same_run(results[name], ref, name)
    # clipping was active, so equal parameters also show it used the global norm
    assert all(s["grad_norm"] > CLIP for s in ref["steps"])


def test_uneven_dataset_steps(results):
    """A short last step is its own step, normalized by its own (global) token count."""
    # 11 samples in steps of 4: on 2 ranks x batch 1 x 2 micro-batches, the last
    # step has 3 real samples and one label-masked top-up on rank 1
    steps = results["full_n11_w2_b1_ga2_per_mb"]["steps"]
    assert [s["micro_batches"] for s in steps] == [2, 2, 2]
    one_rank = results["full_n11_w1_b4_ga1_once"]["steps"]
    assert [s["num_tokens"] for s in steps] == [s["num_tokens"] for s in one_rank]
    (only,) = results["full_n7_w2_b2_ga2_once"]["steps"]
    assert only["num_tokens"] == results["full_n7_w1_b4_ga2_once"]["steps"][0]["num_tokens"]


def test_logged_loss_is_identical_on_every_rank(results):
    for name, r in results.items():
        if r["world_size"] == 2:
            assert r["losses_by_rank"][0] == r["losses_by_rank"][1], name


def test_ranks_split_the_token_count(results):
    """Each rank counts its own tokens; the step's count is their sum."""
    r = results["full_n12_w2_b2_ga1_once"]
    assert all(0 < s["local_num_tokens"] < s["num_tokens"] for s in r["steps"])


def test_per_micro_batch_mode_reduce_scatters_once_per_step(results):
    """With backward per micro-batch, gradients are reduce-scattered only after the last one."""
    checked = 0
    for spec in CASES:
        r = results[spec["name"]]
        if spec["world_size"] == 2 and not spec["once"] and spec["grad_accum"] > 1:
            # one reduce-scatter per FSDP unit with trainable parameters per step, however
            # many micro-batches: 2 blocks + root (embedding, norm) for full fine-tuning,
            # the 2 blocks for LoRA (the root holds no adapter)
            units = r["fsdp_units"] if spec["model"] == "full" else r["fsdp_units"] - 1
            assert r["reduce_scatters"] == [units] * len(r["steps"]), spec["name"]
            checked += 1
    assert checked >= 4


def test_cpu_offload_policy_applied(results):
    assert results["full_n12_w2_b1_ga2_per_mb_cpu_offload"]["offload_policy"] == "CPUOffloadPolicy"
    assert results["full_n12_w2_b1_ga2_per_mb"]["offload_policy"] == "OffloadPolicy"


@pytest.mark.parametrize("name", [c["name"] for c in PACKED_CASES if c.get("packed")])
def test_packed_equals_unpacked(results, name):
    """The same documents in one step, packed (1 or 2 ranks, either mode) or as one padded batch."""
    (spec,) = [c for c in PACKED_CASES if c["name"] == name]
    assert len(results[name]["steps"]) == 1
    assert_same_run(results[name], results[f"{spec['model']}_n12_w1_b12_ga1_once"], name)
