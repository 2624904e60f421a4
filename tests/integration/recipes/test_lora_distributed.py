"""End to end: the FSDP2 LoRA recipe under `tune run --nproc_per_node 2` (gloo on CPU), on a tiny checkpoint."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.support.helpers import read_jsonl, recipe_class, run_recipe, run_tune, tiny_alpaca16_config
from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, validate

RECIPE = "recipes/lora_finetune_distributed.py"
CONFIG = "configs/smollm2/135M_lora.yaml"
TINY_LORA = {"_component_": "torchtune_ext.models.lora_tiny_llama", "lora_attn_modules": ["q_proj", "v_proj"],
             "apply_lora_to_mlp": True, "apply_lora_to_output": False, "lora_rank": 4, "lora_alpha": 8,
             "lora_dropout": 0.1}
SCHEMA = {**LORA_KEYS, **DISTRIBUTED_KEYS}


def tiny_config(assets, tmp_path, output_dir, *overrides):
    """The shipped config on a random tiny model and the first 16 Alpaca samples (unvalidated)."""
    return tiny_alpaca16_config(CONFIG, TINY_LORA, assets, tmp_path, output_dir, *overrides)


def two_ranks(assets, tmp_path, output_dir, *overrides):
    config = tmp_path / f"{output_dir.name}.yaml"
    OmegaConf.save(tiny_config(assets, tmp_path, output_dir, *overrides), config)
    proc = run_tune("--nproc_per_node", "2", RECIPE, "--config", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(output_dir / "logs" / "metrics.jsonl")


def test_checkpoint_holds_the_gathered_adapter_and_merged_model(smollm2_assets, tmp_path):
    """Adapter, PEFT config and merged model are gathered from 2 ranks. (A 2-rank LoRA run resumed bit for bit,
    dropout on, through four stops: tests/integration/recipes/test_resume_chain.py.)"""
    settings = ["max_steps_per_epoch=4", "save_every_n_steps=2", "batch_size=1", "gradient_accumulation_steps=2",
                "lr_scheduler.num_warmup_steps=1", "optimizer.lr=0.01"]
    straight = tmp_path / "straight"
    expected = two_ranks(smollm2_assets, tmp_path, straight, *settings)
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    step = straight / "step_4"
    adapter = torch.load(step / "adapter" / "adapter_model.pt", weights_only=True)
    # 2 layers x (q, v, 3 MLP projections) x (A, B), full (unsharded) shapes
    assert len(adapter) == 20 and adapter["layers.0.attn.q_proj.lora_a.weight"].shape == (4, 64)
    assert json.loads((step / "adapter" / "adapter_config.json").read_text())["r"] == 4
    # the merged model: base weights where no adapter is, base + alpha/r * B @ A where one is
    base = load_file(tmp_path / "base" / "model.safetensors")
    merged = load_file(step / "model-00001-of-00001.safetensors")
    assert merged.keys() == base.keys()
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    delta = 2.0 * adapter["layers.1.mlp.w1.lora_b.weight"] @ adapter["layers.1.mlp.w1.lora_a.weight"]
    gate = "model.layers.1.mlp.gate_proj.weight"
    torch.testing.assert_close(merged[gate], base[gate] + delta, rtol=1e-6, atol=1e-7)


def test_dora_on_one_rank_starts_like_single_device(smollm2_assets, tmp_path):
    """A fresh adapter leaves the model unchanged (B = 0), so step 1 equals the single-device recipe's."""
    losses = {}
    for name, cls, schema in (("dist", "LoRAFinetuneRecipeDistributed", SCHEMA),
                              ("single", "LoRAFinetuneRecipeSingleDevice", LORA_KEYS)):
        cfg = tiny_config(smollm2_assets, tmp_path, tmp_path / name, "max_steps_per_epoch=1", "model.use_dora=true",
                          "model.lora_dropout=0.0", "save_adapter_weights_only=true")
        recipe_file = RECIPE if name == "dist" else "recipes/lora_finetune_single_device.py"
        run_recipe(recipe_class(recipe_file, cls), validate(cfg, extra_keys=schema))
        (row,) = read_jsonl(tmp_path / name / "logs" / "metrics.jsonl")
        losses[name] = (row["loss"], row["num_tokens"])
        adapter = torch.load(tmp_path / name / "step_1" / "adapter" / "adapter_model.pt", weights_only=True)
        assert "layers.0.attn.q_proj.magnitude" in adapter
        assert not (tmp_path / name / "step_1" / "model-00001-of-00001.safetensors").exists()
    assert losses["dist"][1] == losses["single"][1]
    assert abs(losses["dist"][0] - losses["single"][0]) <= 1e-6 * losses["single"][0]


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_one_device_one_rank_and_two_ranks_train_alike(smollm2_assets, tmp_path, use_dora):
    """The same seed and data give the same adapter, so the same losses and gradient norms:
    the single-device recipe at batch 4, the distributed one on 1 rank at batch 4 and on 2 ranks at batch 2."""
    settings = ["max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=1", "optimizer.lr=0.01",
                "model.lora_dropout=0.0", "save_final_checkpoint=false", f"model.use_dora={use_dora}",
                "gradient_accumulation_steps=1"]
    runs = {}
    for name, recipe_file, cls, schema in (
            ("single", "recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice", LORA_KEYS),
            ("one_rank", RECIPE, "LoRAFinetuneRecipeDistributed", SCHEMA)):
        cfg = tiny_config(smollm2_assets, tmp_path, tmp_path / name, *settings, "batch_size=4")
        run_recipe(recipe_class(recipe_file, cls), validate(cfg, extra_keys=schema))
        runs[name] = read_jsonl(tmp_path / name / "logs" / "metrics.jsonl")
    runs["two_ranks"] = two_ranks(smollm2_assets, tmp_path, tmp_path / "two_ranks", *settings, "batch_size=2")

    reference = runs.pop("single")
    assert [r["step"] for r in reference] == [1, 2, 3]
    assert reference[0]["grad_norm"] > 0 and reference[2]["loss"] != reference[0]["loss"]
    for name, rows in runs.items():
        assert [r["num_tokens"] for r in rows] == [r["num_tokens"] for r in reference], name
        for got, want in zip(rows, reference):
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (name, got["step"], key)
