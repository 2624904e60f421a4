"""End to end: the two FSDP2 recipes, full fine-tuning and LoRA, on 2 ranks (gloo on CPU).

The real checkpoint, and the failures that must end a job with one line, run under `tune run
--nproc_per_node 2`. The tiny runs that train to the end (a random ``tiny_llama``, the shipped configs,
the first 16 Alpaca samples) share one torchrun launch of 2 ranks (``two_ranks`` below,
tests/support/resume_worker.py): the full run that a 1-rank resume continues, the LoRA run whose
checkpoint holds the gathered adapter, and the LoRA and DoRA runs that must equal one device. They
used to be four `tune run` launches; what they check needs the runs, not the launcher (which the
tests above and tests/integration/recipes/test_families.py run).
"""

import json
import math
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from tests.integration.recipes.test_distillation import KD_LORA_ALIKE, kd_config
from tests.integration.recipes.test_distillation import RECIPE as KD_RECIPE
from tests.integration.recipes.test_distillation import TINY_LORA as KD_TINY_LORA
from tests.support import resume_jobs
from tests.support.dpo_tiny import RUNS as DPO_RUNS
from tests.support.dpo_tiny import tiny_dpo_config, write_tiny_pairs
from tests.support.helpers import (
    read_jsonl,
    recipe_class,
    rel_diff,
    run_recipe,
    run_tune,
    tiny_alpaca16_config,
)
from tests.support.wandb_reader import read_offline_run
from torchtune_ext import parallel as distributed
from torchtune_ext.checkpoint import list_checkpoints
from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, ConfigError, validate
from torchtune_ext.run.distillation import distillation_keys

RECIPE = "recipes/full_finetune_distributed.py"
CONFIG = "configs/smollm2/135M_full.yaml"
LORA_RECIPE = "recipes/lora_finetune_distributed.py"
LORA_CONFIG = "configs/smollm2/135M_lora.yaml"
KEYS = {"step", "epoch", "loss", "lr", "grad_norm", "num_tokens", "tokens_per_second", "peak_memory_gib",
        "dp_world_size", "tokens_per_second_per_device"}
WEIGHTS = "model-00001-of-00001.safetensors"
TINY_LORA = {"_component_": "torchtune_ext.model.builders.lora_tiny_llama", "lora_attn_modules": ["q_proj", "v_proj"],
             "apply_lora_to_mlp": True, "apply_lora_to_output": False, "lora_rank": 4, "lora_alpha": 8,
             "lora_dropout": 0.1}
SCHEMA = {**LORA_KEYS, **DISTRIBUTED_KEYS}


def tiny_config(assets, tmp_path, output_dir, *overrides):
    """The shipped full config on a random tiny model and the first 16 Alpaca samples (unvalidated); the tiny
    checkpoint and the samples are written once per ``tmp_path``."""
    return tiny_alpaca16_config(CONFIG, {"_component_": "torchtune_ext.model.builders.tiny_llama"}, assets, tmp_path,
                                output_dir, *overrides)


def tiny_lora_config(assets, tmp_path, output_dir, *overrides):
    """The shipped LoRA config on the same tiny model and samples (unvalidated)."""
    return tiny_alpaca16_config(LORA_CONFIG, TINY_LORA, assets, tmp_path, output_dir, *overrides)


def kd_two_ranks_config(assets, tmp_path, output_dir, *overrides):
    """The distillation job of the shared launch (tests/integration/recipes/test_distillation.py checks it)."""
    return kd_config(assets, tmp_path, output_dir.name, KD_TINY_LORA, *KD_LORA_ALIKE, *overrides,
                     "custom_sharded_layers=null")


# ------------------------------------------------------------------ the tiny runs: one launch
# full: 2 ranks x batch 1 x 2 accumulation steps, saved at step 2, resumed on 1 rank by its test
FULL_SETTINGS = ["max_steps_per_epoch=4", "save_every_n_steps=2", "gradient_accumulation_steps=2",
                 "lr_scheduler.num_warmup_steps=1", "optimizer.lr=1e-3"]
# LoRA, dropout on: its checkpoints hold the gathered adapter
LORA_SETTINGS = ["max_steps_per_epoch=4", "save_every_n_steps=2", "batch_size=1", "gradient_accumulation_steps=2",
                 "lr_scheduler.num_warmup_steps=1", "optimizer.lr=0.01"]
# LoRA and DoRA without dropout: 2 ranks x batch 2 against one device x batch 4
ALIKE_SETTINGS = ["max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=1", "optimizer.lr=0.01",
                  "model.lora_dropout=0.0", "save_final_checkpoint=false", "gradient_accumulation_steps=1"]


def alike_settings(use_dora):
    return [*ALIKE_SETTINGS, f"model.use_dora={use_dora}"]


@pytest.fixture(scope="module")
def two_ranks(smollm2_assets, tmp_path_factory):
    """Every tiny run of this module that trains to the end on 2 ranks, in one launch; returns the folder that
    holds their output folders, the tiny checkpoint (``base/``) and the samples."""
    root = tmp_path_factory.mktemp("two_ranks")
    runs = {"full_straight": ("full_dist", tiny_config, [*FULL_SETTINGS, "batch_size=1"]),
            "lora_straight": ("lora_dist", tiny_lora_config, LORA_SETTINGS),
            "lora_two_ranks": ("lora_dist", tiny_lora_config, [*alike_settings(False), "batch_size=2"]),
            "dora_two_ranks": ("lora_dist", tiny_lora_config, [*alike_settings(True), "batch_size=2"]),
            # distillation, 2 ranks x batch 2: compared with one device x batch 4 in test_distillation.py
            "kd_two_ranks": ("kd_lora_dist", kd_two_ranks_config, ["batch_size=2"])}
    jobs = []
    for name, (recipe, config, overrides) in runs.items():
        OmegaConf.save(config(smollm2_assets, root, root / name, *overrides), root / f"{name}.yaml")
        jobs.append({"recipe": recipe, "config": str(root / f"{name}.yaml")})
    write_tiny_pairs(root, smollm2_assets)  # preference pairs, on the same tiny checkpoint (root/base)
    for kind in ("lora_dist", "full_dist"):
        OmegaConf.save(tiny_dpo_config(kind, smollm2_assets, root, root / f"dpo_{kind}", *DPO_SGD),
                       root / f"dpo_{kind}.yaml")
        jobs.append({"recipe": f"dpo_{kind}", "config": str(root / f"dpo_{kind}.yaml")})
        # the same run with its reference log-probabilities precomputed over both ranks
        OmegaConf.save(tiny_dpo_config(kind, smollm2_assets, root, root / f"dpo_{kind}_pre", *DPO_SGD,
                                       "precompute_reference_log_probs=true"), root / f"dpo_{kind}_pre.yaml")
        jobs.append({"recipe": f"dpo_{kind}", "config": str(root / f"dpo_{kind}_pre.yaml")})
    resume_jobs.launch(2, jobs)
    return root


# SGD without clipping and a small step: the update is linear in the gradient (AdamW's first update is about
# lr * sign(g), so a gradient entry near 0 whose fp32 rounding differs between the summation orders moves its
# weight by +-lr). Not fused: fused SGD has no DTensor sharding rule.
DPO_SGD = ("optimizer._component_=torch.optim.SGD", "optimizer.lr=1e-3", "optimizer.fused=false", "clip_grad_norm=null")


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_dpo_with_precomputed_reference_on_two_ranks_equals_the_reference_run(two_ranks, kind):
    """precompute_reference_log_probs on 2 ranks: each rank's pairs find their own reference sums (every rank
    runs the reference on its micro-batches of epoch 0 and validation, one all-reduce shares the table), so
    every record equals the 2-rank run that runs its reference in each step; rank 0 wrote the 7 + 3 pairs."""
    want = read_jsonl(two_ranks / f"dpo_{kind}_dist" / "logs" / "metrics.jsonl")
    got = read_jsonl(two_ranks / f"dpo_{kind}_dist_pre" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] and len(want) == 4
    for g, w in zip(got, want):
        assert g.get("num_pairs") == w.get("num_pairs") and g.get("num_tokens") == w.get("num_tokens")
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/chosen", "logps/rejected", "val_loss",
                    "val_rewards/margins"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (w["step"], key)
    table = torch.load(two_ranks / f"dpo_{kind}_dist_pre" / "reference_log_probs.pt", weights_only=True)["table"]
    assert table.shape == (10, 2) and (table < 0).all()


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_dpo_on_two_ranks_equals_one_device(two_ranks, smollm2_assets, tmp_path, kind):
    """Preference tuning: 2 ranks x 1 pair x 2 accumulation steps == one device x 2 pairs x 2 (7 pairs: steps of 4
    and 3, the short one's 3 pairs spread over the ranks unevenly), loss, grad norm and pair metrics to fp32
    precision, validation included; step 1 is ln 2 (the reference is the base)."""
    cfg = tiny_dpo_config(kind, smollm2_assets, two_ranks, tmp_path / "one", *DPO_SGD)
    run_recipe(recipe_class(*DPO_RUNS[kind][:2]), cfg)
    one = read_jsonl(tmp_path / "one" / "logs" / "metrics.jsonl")
    two = read_jsonl(two_ranks / f"dpo_{kind}_dist" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in one] and len(one) == 4  # 2 validations, 2 steps
    assert [r.get("num_pairs") for r in one if "loss" in r] == [4, 3]
    assert abs(one[1]["loss"] - math.log(2)) < 1e-6
    for got, want in zip(two, one):
        assert got.get("num_pairs") == want.get("num_pairs") and got.get("num_tokens") == want.get("num_tokens")
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen", "val_loss",
                    "val_rewards/margins", "val_logps/rejected"):
            if key in want:
                # abs: DPO's h is a small difference of log-probability sums of a few hundred nats each, whose fp32
                # rounding (~3e-5) depends on the summation order; once the policy has left its reference that
                # shows in loss and margins at ~1e-5 absolute (measured: 8e-6), whatever the split
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-4), (got["step"], key)


def test_resume_on_another_world_size(two_ranks, smollm2_assets, tmp_path):
    """A 2-rank run saved mid-epoch resumes on 1 rank (same global batch) and continues as it would have."""
    straight, resumed = two_ranks / "full_straight", tmp_path / "resumed"
    shutil.copytree(straight / "step_2", resumed / "step_2")  # as if the run had stopped after step 2
    cfg = tiny_config(smollm2_assets, two_ranks, resumed, *FULL_SETTINGS, "batch_size=2",
                      "resume_from_checkpoint=true")
    run_recipe(recipe_class(RECIPE, "FullFinetuneRecipeDistributed"), validate(cfg, extra_keys=DISTRIBUTED_KEYS))

    expected = read_jsonl(straight / "logs" / "metrics.jsonl")
    got = read_jsonl(resumed / "logs" / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4] and [r["step"] for r in got] == [3, 4]
    assert expected[2]["lr"] > 0  # warmup ended: a scheduler reset to step 0 would show here
    for a, b in zip(got, expected[2:]):
        assert a["num_tokens"] == b["num_tokens"] and a["lr"] == b["lr"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    final = load_file(straight / "step_4" / WEIGHTS)
    for key, weight in load_file(resumed / "step_4" / WEIGHTS).items():
        # AdamW's first steps move each weight by about +-lr: compare on that scale
        assert rel_diff(weight, final[key]) <= 1e-4, key


def test_checkpoint_holds_the_gathered_adapter_and_merged_model(two_ranks):
    """Adapter, PEFT config and merged model are gathered from 2 ranks. (A 2-rank LoRA run resumed bit for bit,
    dropout on, through four stops: tests/integration/recipes/test_resume_chain.py.)"""
    expected = read_jsonl(two_ranks / "lora_straight" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    step = two_ranks / "lora_straight" / "step_4"
    adapter = torch.load(step / "adapter" / "adapter_model.pt", weights_only=True)
    # 2 layers x (q, v, 3 MLP projections) x (A, B), full (unsharded) shapes
    assert len(adapter) == 20 and adapter["layers.0.attn.q_proj.lora_a.weight"].shape == (4, 64)
    assert json.loads((step / "adapter" / "adapter_config.json").read_text())["r"] == 4
    # the merged model: base weights where no adapter is, base + alpha/r * B @ A where one is
    base = load_file(two_ranks / "base" / "model.safetensors")
    merged = load_file(step / "model-00001-of-00001.safetensors")
    assert merged.keys() == base.keys()
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    delta = 2.0 * adapter["layers.1.mlp.w1.lora_b.weight"] @ adapter["layers.1.mlp.w1.lora_a.weight"]
    gate = "model.layers.1.mlp.gate_proj.weight"
    torch.testing.assert_close(merged[gate], base[gate] + delta, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_one_device_one_rank_and_two_ranks_train_alike(two_ranks, smollm2_assets, tmp_path, use_dora):
    """The same seed and data give the same adapter, so the same losses and gradient norms:
    the single-device recipe at batch 4, the distributed one on 1 rank at batch 4 and on 2 ranks at batch 2."""
    runs = {}
    for name, recipe_file, cls, schema in (
            ("single", "recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice", LORA_KEYS),
            ("one_rank", LORA_RECIPE, "LoRAFinetuneRecipeDistributed", SCHEMA)):
        cfg = tiny_lora_config(smollm2_assets, two_ranks, tmp_path / name, *alike_settings(use_dora), "batch_size=4")
        run_recipe(recipe_class(recipe_file, cls), validate(cfg, extra_keys=schema))
        runs[name] = read_jsonl(tmp_path / name / "logs" / "metrics.jsonl")
    two = "dora_two_ranks" if use_dora else "lora_two_ranks"
    runs["two_ranks"] = read_jsonl(two_ranks / two / "logs" / "metrics.jsonl")

    reference = runs.pop("single")
    assert [r["step"] for r in reference] == [1, 2, 3]
    assert reference[0]["grad_norm"] > 0 and reference[2]["loss"] != reference[0]["loss"]
    for name, rows in runs.items():
        assert [r["num_tokens"] for r in rows] == [r["num_tokens"] for r in reference], name
        for got, want in zip(rows, reference):
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (name, got["step"], key)


def test_dora_on_one_rank_starts_like_single_device(smollm2_assets, tmp_path):
    """A fresh adapter leaves the model unchanged (B = 0), so step 1 equals the single-device recipe's."""
    losses = {}
    for name, cls, schema in (("dist", "LoRAFinetuneRecipeDistributed", SCHEMA),
                              ("single", "LoRAFinetuneRecipeSingleDevice", LORA_KEYS)):
        cfg = tiny_lora_config(smollm2_assets, tmp_path, tmp_path / name, "max_steps_per_epoch=1",
                               "model.use_dora=true", "model.lora_dropout=0.0", "save_adapter_weights_only=true")
        recipe_file = LORA_RECIPE if name == "dist" else "recipes/lora_finetune_single_device.py"
        run_recipe(recipe_class(recipe_file, cls), validate(cfg, extra_keys=schema))
        (row,) = read_jsonl(tmp_path / name / "logs" / "metrics.jsonl")
        losses[name] = (row["loss"], row["num_tokens"])
        adapter = torch.load(tmp_path / name / "step_1" / "adapter" / "adapter_model.pt", weights_only=True)
        assert "layers.0.attn.q_proj.magnitude" in adapter
        assert not (tmp_path / name / "step_1" / "model-00001-of-00001.safetensors").exists()
    assert losses["dist"][1] == losses["single"][1]
    assert abs(losses["dist"][0] - losses["single"][0]) <= 1e-6 * losses["single"][0]


def test_two_ranks_distil_like_one_device(two_ranks, smollm2_assets, tmp_path):
    """The same steps at batch 4 on one device and at 2 ranks x batch 2 (FSDP2, the teacher sharded too):
    the same num_tokens, loss, ce_loss, kd_loss and grad_norm."""
    cfg = kd_config(smollm2_assets, two_ranks, "kd_one_device", KD_TINY_LORA, *KD_LORA_ALIKE, "batch_size=4")
    run_recipe(KD_RECIPE, validate(cfg, extra_keys=distillation_keys(cfg)))
    reference = read_jsonl(two_ranks / "kd_one_device" / "logs" / "metrics.jsonl")
    rows = read_jsonl(two_ranks / "kd_two_ranks" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2]
    for got, want in zip(rows, reference):
        assert got["num_tokens"] == want["num_tokens"] and got["dp_world_size"] == 2
        for key in ("loss", "ce_loss", "kd_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)


# ------------------------------------------------------------------ through tune run, and in process
def test_real_checkpoint_two_steps(smollm2_assets, tmp_path):
    out = tmp_path / "run"
    proc = run_tune("--nproc_per_node", "2", RECIPE, "--config", CONFIG, f"output_dir={out}",
                    "max_steps_per_epoch=2", "batch_size=1", "gradient_accumulation_steps=1",
                    "tokenizer.max_seq_len=128",  # the real weights, shorter steps (512 tokens: ~4x the compute)
                    # the shipped config validates before and after training: this test trains only
                    "run_val_every_n_steps=null", "run_val_at_start=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # one writer: rank 0
    for r in rows:
        assert KEYS <= r.keys() and r["dp_world_size"] == 2
        assert 0.3 < r["loss"] < 4.0 and math.isfinite(r["grad_norm"])
        assert r["num_tokens"] > 0 and r["tokens_per_second"] == pytest.approx(r["num_tokens"] / r["step_seconds"])
        assert r["tokens_per_second_per_device"] == pytest.approx(r["tokens_per_second"] / 2)
    # the checkpoint is gathered into the single-device HF format
    ckpt = out / "step_2"
    for name in (WEIGHTS, "config.json", "tokenizer.json", "recipe_state.pt", "checkpoint.json"):
        assert (ckpt / name).is_file(), name
    with safe_open(str(ckpt / WEIGHTS), "pt") as saved, \
            safe_open(str(smollm2_assets / "SmolLM2-135M-Instruct" / "model.safetensors"), "pt") as base:
        assert set(saved.keys()) == set(base.keys())
        assert saved.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    # a single W&B run (rank 0's), holding what metrics.jsonl holds
    assert len(list((out / "logs" / "wandb").glob("offline-run-*"))) == 1
    run = read_offline_run(str(out / "logs"))
    logged = [h for h in run["history"] if "loss" in h]
    assert [(h["global_step"], h["tokens_per_second_per_device"]) for h in logged] == \
        [(r["step"], r["tokens_per_second_per_device"]) for r in rows]


def test_config_checks_the_distributed_keys(smollm2_assets, tmp_path):
    cfg = tiny_config(smollm2_assets, tmp_path, tmp_path / "run", "fsdp_cpu_offload=sometimes")
    with pytest.raises(ConfigError, match="'fsdp_cpu_offload'"):
        validate(cfg, extra_keys=DISTRIBUTED_KEYS)
    assert validate(OmegaConf.load(CONFIG), extra_keys=DISTRIBUTED_KEYS).fsdp_cpu_offload is False


def test_weights_that_do_not_fit_are_a_config_error(smollm2_assets, tmp_path):
    cfg = tiny_config(smollm2_assets, tmp_path, tmp_path / "run", "model.embed_dim=32", "model.num_heads=2",
                      "model.num_kv_heads=1")
    recipe = recipe_class(RECIPE, "FullFinetuneRecipeDistributed")(validate(cfg, extra_keys=DISTRIBUTED_KEYS))
    try:
        with pytest.raises(ConfigError, match="'checkpointer.checkpoint_dir'.*'tok_embeddings.weight' has shape"):
            recipe.setup()
    finally:
        distributed.destroy_process_group()


def test_two_ranks_stop_together_with_one_line(smollm2_assets, tmp_path):
    """Under torchrun a destroyed model and a save that fills the disk end the job with one line and the recipe's
    exit status (3, 74), not torchrun's ChildFailedError report; the ranks agree on the step at which they stop
    (rank 1 learns of rank 0's failed save). Bad input (2): test_tensor_parallel_recipe.py's refusal."""
    cases = {"save_failed": (["save_every_n_steps=1",
                              "checkpointer._component_=tests.support.fake_checkpointer.DiskFullAtStep",
                              "checkpointer.full_at_step=2"], 74, "the disk filled up while saving step_2"),
             "destroyed": (["optimizer.lr=1e6", "lr_scheduler.num_warmup_steps=1", "save_every_n_steps=1"], 3,
                           "optimizer step 3")}
    for name, (overrides, status, words) in cases.items():
        out = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        OmegaConf.save(tiny_config(smollm2_assets, tmp_path, out, "batch_size=2", "gradient_accumulation_steps=1",
                                   *overrides), config)
        proc = run_tune("--nproc_per_node", "2", RECIPE, "--config", str(config), timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == status, proc.stderr[-3000:]
        assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert [p.name for p in list_checkpoints(str(tmp_path / "save_failed"))] == ["step_1"]
    assert not (tmp_path / "save_failed" / ".staging").exists()
    assert "Last checkpoint from before the damage" in errors[0] and "step_2" in errors[0]
    assert [r["step"] for r in read_jsonl(tmp_path / "destroyed" / "logs" / "metrics.jsonl")] == [1, 2]
