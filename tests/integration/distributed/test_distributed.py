"""Data-parallel exactness: FSDP2 over 2 ranks (gloo, CPU) equals one rank.

One launch per world size runs every case (tests/support/dist_worker.py); the tests
compare what rank 0 saved. Global batch 4 samples per optimizer step
everywhere, SGD with clipping active, 3 steps; full fine-tuning and LoRA.
The ``eval_*`` cases run one validation pass (torchtune_ext.run.evaluate) over 13
samples at several batch sizes, packings and world sizes.
"""

import json

import pytest
import torch

from tests.support.helpers import rel_diff, run_worker, tiny_model

TOL = 1e-5
CLIP = 1.0


def case(world_size, batch_size, grad_accum, once, num_samples=12, model="full", arch="llama", **extra):
    mode = "once" if once else "per_mb"
    name = f"{model}_n{num_samples}_w{world_size}_b{batch_size}_ga{grad_accum}_{mode}"
    if arch != "llama":
        name = f"{arch}_{name}"
    extra.setdefault("clip", CLIP)
    for key, value in extra.items():
        if key == "clip" and value == CLIP:
            continue
        name += f"_{key}" if value is True else f"_{key}{value}"
    return dict(name=name, world_size=world_size, batch_size=batch_size, grad_accum=grad_accum, once=once,
                num_samples=num_samples, model=model, arch=arch, **extra)


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
# pack_micro_batches: each rank's share of the step concatenated into rows of at most 48 tokens.
CASES += [case(2, 1, 2, True, budget=48, pack=True), case(2, 1, 2, False, num_samples=11, budget=40, pack=True)]
# The model returning logits (the loss not applying the output projection), and a memory
# guard that says "does not fit" on one rank only: all ranks fall back together.
CASES += [case(2, 1, 2, True, logits=True), case(2, 1, 2, False, logits=True),
          case(2, 1, 2, True, guard_veto_rank=1), case(2, 1, 2, True, model="lora", guard_veto_rank=0)]
# The default memory limit with each step's torchtune baseline, grouped by length: the ranks' shares
# differ, and the guard bounds the job by its largest rank; against one rank with the step in one batch.
GUARD_CASES = [case(2, 2, 2, True, num_samples=16, model="lora", grouped=True, guard_baseline=True),
               case(1, 8, 1, True, num_samples=16, model="lora")]
# LoRA (nonzero lora_b, frozen base): the same four splits, both modes.
CASES += [case(w, b, ga, once, model="lora") for w, b, ga in SPLITS for once in (True, False)]
# Packed: all 12 documents in one optimizer step, packed into 64-token rows on 2 ranks
# (and 1), against the same documents unpacked in one step of batch 12.
PACKED_CASES = [case(1, 12, 1, True), case(2, 4, 1, True, packed=True), case(2, 2, 2, False, packed=True),
                case(1, 8, 1, False, packed=True), case(2, 4, 1, False, model="lora", packed=True),
                case(1, 12, 1, True, model="lora")]


def eval_case(world_size, batch_size, model="full", **extra):
    name = f"eval_{model}_w{world_size}_b{batch_size}"
    for key, value in extra.items():
        name += f"_{key}" if value is True else f"_{key}{value}"
    return dict(name=name, kind="eval", world_size=world_size, batch_size=batch_size, model=model, **extra)


# One validation pass over 13 samples (padding, masked prompts, an all-masked sample, a
# one-token sample): batch 1, 3 and 8 per rank on 1 and 2 ranks (partial last batches,
# stand-ins on 2 ranks), chunked logits, grouping, a token budget, packed; full and LoRA.
EVAL_CASES = [eval_case(w, b) for w in (1, 2) for b in (1, 3, 8)]
EVAL_CASES += [eval_case(2, 3, chunks=4), eval_case(2, 3, grouped=True), eval_case(2, 8, budget=64),
               eval_case(1, 2, packed=True), eval_case(2, 1, packed=True),
               eval_case(1, 1, model="lora"), eval_case(2, 3, model="lora"), eval_case(1, 8, model="lora")]
EVAL_TOL = 1e-6
# A second and third architecture (issue: exactness is not a property of one model): a Qwen2
# with q/k/v biases and an untied output projection (LoRA on it too), and a Gemma (scaled
# embeddings, GeGLU, one KV head, tied output). Batch 4 vs 1 x 4 accumulation vs 2 ranks x 2.
# Clipped at 0.05, below every step's norm, so equal parameters also show the global norm was used.
ARCH_SPLITS, ARCH_CLIP = [(1, 4, 1), (1, 1, 4), (2, 2, 1)], 0.05
CASES += [case(w, b, ga, once, model=m, arch=a, clip=ARCH_CLIP) for a in ("qwen2", "gemma") for m in ("full", "lora")
          for w, b, ga in ARCH_SPLITS for once in (True, False)]
# custom_sharded_layers: embedding and output projection as FSDP units of their own (the loss
# applies that output unit, and once per step recomputes it in backward).
CASES += [case(2, 2, 1, False, arch="qwen2", clip=ARCH_CLIP, sharded=["tok_embeddings", "output"]),
          case(2, 1, 2, True, arch="qwen2", clip=ARCH_CLIP, sharded=["tok_embeddings", "output"])]
REFERENCE = {("llama", "full", 12): "full_n12_w1_b4_ga1_once", ("llama", "full", 11): "full_n11_w1_b4_ga1_once",
             ("llama", "full", 7): "full_n7_w1_b4_ga2_once", ("llama", "lora", 12): "lora_n12_w1_b4_ga1_once"}
REFERENCE.update({(a, m, 12): f"{a}_{m}_n12_w1_b4_ga1_once_clip{ARCH_CLIP}" for a in ("qwen2", "gemma")
                  for m in ("full", "lora")})
# optimizer_in_bwd (no clipping, one micro-batch per rank and step): against the normal step, unclipped.
OPTIM_IN_BWD_CASES = [
    case(1, 4, 1, True, clip=None), case(1, 4, 1, True, clip=None, optim_in_bwd=True),
    case(2, 2, 1, True, clip=None, optim_in_bwd=True), case(2, 2, 1, False, clip=None, optim_in_bwd=True),
    case(1, 4, 1, True, model="lora", clip=None), case(2, 2, 1, True, model="lora", clip=None, optim_in_bwd=True),
]


def launch(world_size, cases, out):
    proc = run_worker(world_size, "dist_worker", str(out), json.dumps(cases))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


# rank 1 starts every step 0.5 s late (tests/support/dist_worker.py): rank 0 waits for it in the step's collectives
LATE_CASE = case(2, 2, 1, False, late_rank=1)


# Rank 1 resolves another optimizer.lr and max_steps_per_epoch (a node's stale config): every rank refuses
CONFIG_CASE = dict(name="config_agreement", kind="config", world_size=2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    out = {}
    for world_size in (1, 2):
        every = CASES + PACKED_CASES + EVAL_CASES + OPTIM_IN_BWD_CASES + GUARD_CASES + [LATE_CASE, CONFIG_CASE]
        cases = [c for c in every if c["world_size"] == world_size]
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
    ref = results[REFERENCE[spec["arch"], spec["model"], spec["num_samples"]]]
    assert_same_run(results[name], ref, name)
    # clipping was active, so equal parameters also show it used the global norm
    assert all(s["grad_norm"] > spec["clip"] for s in ref["steps"])


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
        if r.get("world_size") == 2:  # the training cases (the config-agreement case trains nothing)
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


def test_memory_guard_veto_on_one_rank_switches_every_rank(results):
    """Rank 1 short of memory: rank 0, which has plenty, runs backward per micro-batch too (the
    ranks agree, or FSDP's collectives would not match); the results equal one rank's (above).
    Short of memory, the fallback does not defer FSDP2's gradient sync (which would keep unsharded
    gradients between micro-batches): every micro-batch reduce-scatters, as torchtune's recipe does."""
    for name, units_of in (("full_n12_w2_b1_ga2_once_guard_veto_rank1", lambda r: r["fsdp_units"]),
                           ("lora_n12_w2_b1_ga2_once_guard_veto_rank0", lambda r: r["fsdp_units"] - 1)):
        r = results[name]
        assert r["once_per_step_modes"] == [False] * len(r["steps"])
        assert r["reduce_scatters"] == [units_of(r) * s["micro_batches"] for s in r["steps"]], name
        assert all(s["micro_batches"] == 2 for s in r["steps"])


def test_memory_guard_bounds_the_job_by_its_largest_rank(results):
    """Two ranks, the default limit, each rank's torchtune baseline: every step's decision is the one the
    element-wise maximum of both ranks' figures gives (all-reduced in the step), and at least one step
    defers the gradient sync although one rank's own share alone would not have allowed it. The run equals
    one rank with the step's 8 samples in one micro-batch."""
    from torchtune_ext.train.memory import MemoryGuard

    r = results["lora_n16_w2_b2_ga2_once_grouped_guard_baseline"]
    guard = MemoryGuard(tiny_model(), torch.device("cpu"), available=lambda _device: None)
    units = r["fsdp_units"] - 1  # the root holds no adapter
    per_rank = list(zip(*r["step_needs_by_rank"]))
    assert len(per_rank) == len(r["steps"]) == 2
    job_only = 0
    for needs, step, scatters, once in zip(per_rank, r["steps"], r["reduce_scatters"], r["once_per_step_modes"]):
        job_once, job_defer = guard.decide_step([max(v) for v in zip(*needs)])
        assert once == job_once
        assert scatters == (units if once or job_defer else units * step["micro_batches"])
        job_only += job_defer and not all(guard.decide_step(own)[1] for own in needs)
    assert job_only >= 1
    assert_same_run(r, results["lora_n16_w1_b8_ga1_once"], "lora_n16_w2_b2_ga2_once_grouped_guard_baseline")


def test_cpu_offload_policy_applied(results):
    assert results["full_n12_w2_b1_ga2_per_mb_cpu_offload"]["offload_policy"] == "CPUOffloadPolicy"
    assert results["full_n12_w2_b1_ga2_per_mb"]["offload_policy"] == "OffloadPolicy"


@pytest.mark.parametrize("name", [c["name"] for c in PACKED_CASES if c.get("packed")])
def test_packed_equals_unpacked(results, name):
    """The same documents in one step, packed (1 or 2 ranks, either mode) or as one padded batch."""
    (spec,) = [c for c in PACKED_CASES if c["name"] == name]
    assert len(results[name]["steps"]) == 1
    assert_same_run(results[name], results[f"{spec['model']}_n12_w1_b12_ga1_once"], name)


def reference_validation(model_kind):
    """Independent reference: each sample alone (no padding, no batch), fp64 sums of the
    per-token cross-entropy, argmax hits and entropy over its trainable next-token positions."""
    import torch
    import torch.nn.functional as F

    from tests.support.dist_worker import EVAL_EMBEDDING_STD, build, initial_state
    from tests.support.helpers import IGNORE, synthetic_val_dataset

    model = build(model_kind)
    model.load_state_dict(initial_state(model_kind, EVAL_EMBEDDING_STD))
    model.eval()
    loss = correct = entropy = 0.0
    count = 0
    with torch.no_grad():
        for s in synthetic_val_dataset():
            labels = torch.tensor(s["labels"][1:])
            keep = labels != IGNORE
            if not keep.any():
                continue
            logits = model(torch.tensor([s["tokens"]]))[0, :-1][keep].double()
            log_probs = torch.log_softmax(logits, -1)
            loss += F.nll_loss(log_probs, labels[keep], reduction="sum").item()
            correct += (logits.argmax(-1) == labels[keep]).sum().item()
            entropy += -(log_probs.exp() * log_probs).sum().item()
            count += int(keep.sum())
    return {"loss": loss / count, "token_accuracy": correct / count, "entropy": entropy / count, "num_tokens": count}


@pytest.mark.parametrize("name", [c["name"] for c in EVAL_CASES])
def test_validation_does_not_depend_on_batching_or_ranks(results, name):
    """Validation loss, token accuracy and entropy: the same for batch 1, 3, 8, 1 or 2 ranks, packed or not."""
    (spec,) = [c for c in EVAL_CASES if c["name"] == name]
    got, ref = results[name]["eval"], results[f"eval_{spec['model']}_w1_b1"]["eval"]
    assert got["num_tokens"] == ref["num_tokens"] > 0
    assert got["num_samples"] == (3 if spec.get("packed") else 13)  # packed: 13 samples in 3 rows of 64 tokens
    for key in ("loss", "token_accuracy", "entropy", "perplexity"):
        assert abs(got[key] - ref[key]) <= EVAL_TOL * abs(ref[key]), (name, key, got[key], ref[key])
    # every rank took part and holds the same result; nothing of training's state changed
    r = results[name]
    no_time = [{k: v for k, v in e.items() if k != "seconds"} for e in r["evals_by_rank"]]
    assert all(e == no_time[0] for e in no_time)
    assert r["modes_restored"] and r["grads_after"] == 0
    if spec["world_size"] == 2:
        assert 0 < r["local_num_tokens"] < got["num_tokens"]


@pytest.mark.parametrize("model_kind", ["full", "lora"])
def test_validation_equals_independent_reference(results, model_kind):
    ref = reference_validation(model_kind)
    got = results[f"eval_{model_kind}_w2_b3" if model_kind == "lora" else "eval_full_w2_b8"]["eval"]
    assert got["num_tokens"] == ref["num_tokens"]
    for key in ("loss", "token_accuracy", "entropy"):
        assert abs(got[key] - ref[key]) <= EVAL_TOL * abs(ref[key]), (key, got[key], ref[key])
    assert 0 < ref["token_accuracy"] < 1 and ref["entropy"] > 0.5  # informative values, not 0 or saturated


def test_custom_sharded_layers_get_units_of_their_own(results):
    """2 blocks + embedding + output + root; the same result as without them (checked above)."""
    sharded = [c["name"] for c in CASES if c.get("sharded")]
    assert [results[n]["fsdp_units"] for n in sharded] == [5, 5]
    assert results[f"qwen2_full_n12_w2_b2_ga1_per_mb_clip{ARCH_CLIP}"]["fsdp_units"] == 3


@pytest.mark.parametrize("name", [c["name"] for c in OPTIM_IN_BWD_CASES if c.get("optim_in_bwd")])
def test_optimizer_in_backward_equals_the_normal_step(results, name):
    """Updating each parameter in its gradient hook (1 or 2 ranks) equals the step after backward."""
    (spec,) = [c for c in OPTIM_IN_BWD_CASES if c["name"] == name]
    reference = f"{spec['model']}_n12_w1_b4_ga1_once_clipNone"
    assert_same_run(results[name], results[reference], name)
    # gathered for a checkpoint as the recipes do: one group per trainable parameter, by name
    trainable = [k for k in results[name]["params"] if spec["model"] == "full" or "lora_" in k]
    groups = results[name]["optimizer_state"]["param_groups"]
    assert sorted(p for g in groups for p in g["params"]) == sorted(trainable)
    assert all(len(g["params"]) == 1 for g in groups)


def test_a_late_rank_shows_as_the_others_waiting(results):
    """StepResult.wait_seconds (the progress bar's 'waiting: ranks'): rank 0 spends the 0.5 s by which rank 1
    is late in the step's first collective, the token count; with one process nothing is measured."""
    late = [s["wait_seconds"] for s in results[LATE_CASE["name"]]["steps"]]
    assert len(late) == 3 and all(0.4 <= w < 2.0 for w in late), late
    one_rank = results[case(1, 4, 1, False)["name"]]["steps"]
    assert all(s["wait_seconds"] == 0.0 for s in one_rank)


def test_ranks_started_with_different_configs_all_refuse_naming_the_keys(results):
    """torchtune_ext.config.agreement over a real gloo group: one line, the same on every rank, before any step."""
    refused = results[CONFIG_CASE["name"]]["refused_by_rank"]
    assert len(refused) == 2 and refused[0] == refused[1] and refused[0].count("\n") == 0
    assert refused[0].startswith("config key 'max_steps_per_epoch, optimizer.lr': ")
    assert "optimizer.lr is 0.001 on rank 0 / 0.05 on rank 1" in refused[0]
