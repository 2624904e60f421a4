"""The LoRA recipe: in process on a tiny checkpoint, and `tune run` on the real one.

The tiny runs (a random ``tiny_llama`` saved as an HF checkpoint, the real
tokenizer and Alpaca data cut to 128 tokens) take seconds and check what the
recipe itself adds: only the adapter trains, the base weights stay
bit-identical through training and saving, the saved adapter and merged model
are what they claim to be. Exact resume is tested in ``test_resume.py``.
"""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune.modules.peft import get_adapter_params
from torchtune.training import FullModelHFCheckpointer

from tests.support.helpers import (
    REPO_ROOT,
    read_jsonl,
    recipe_class,
    run_recipe,
    run_tune,
    tiny_recipe_config,
    write_tiny_hf_checkpoint,
)
from tests.support.wandb_reader import read_offline_run
from torchtune_ext.config import LORA_KEYS, ConfigError, validate
from torchtune_ext.model.builders import lora_tiny_llama, tiny_llama

RECIPE = "recipes/lora_finetune_single_device.py"
CONFIG = "configs/smollm2/135M_lora_single_device.yaml"
KEYS = {"step", "epoch", "loss", "lr", "grad_norm", "num_tokens", "tokens_per_second", "peak_memory_gib"}
TINY_LORA = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                 apply_lora_to_output=False, lora_rank=4, lora_alpha=8)
PEFT_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
LORA = recipe_class(RECIPE, "LoRAFinetuneRecipeSingleDevice")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hf")
    return path, write_tiny_hf_checkpoint(path)


def tiny_config(assets, checkpoint_dir, output_dir, *overrides):
    """The shipped LoRA config on the tiny checkpoint, validated."""
    model = {"_component_": "torchtune_ext.model.builders.lora_tiny_llama", **TINY_LORA, "lora_dropout": 0.0,
             "use_dora": False}
    cfg = tiny_recipe_config(CONFIG, model, assets, checkpoint_dir, output_dir, *overrides)
    return validate(cfg, extra_keys=LORA_KEYS)


def load_hf_model(folder, scratch):
    """A saved HF model folder, read back into torchtune key names."""
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(folder), checkpoint_files=["model-00001-of-00001.safetensors"],
        model_type="LLAMA3_2", output_dir=str(scratch),
    )
    return checkpointer.load_checkpoint()["model"]


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_adapter_trains_base_stays_and_checkpoint_holds_both(smollm2_assets, tiny_checkpoint, tmp_path, use_dora):
    checkpoint_dir, base = tiny_checkpoint
    out = tmp_path / "run"
    # a save after every step: merging the adapter must never touch the live base weights
    recipe = run_recipe(LORA, tiny_config(
        smollm2_assets, checkpoint_dir, out, "max_steps_per_epoch=3", "gradient_accumulation_steps=2",
        "save_every_n_steps=1", "lr_scheduler=null", "optimizer.lr=0.01", f"model.use_dora={use_dora}",
    ))
    model = recipe.model
    adapter_names = set(get_adapter_params(model))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapter_names
    live = model.state_dict()
    assert set(live) - set(base) == adapter_names
    for name, weight in base.items():
        assert torch.equal(live[name], weight), f"base weight {name} changed"
    assert all(live[n].abs().max() > 0 for n in adapter_names if "lora_b" in n)  # B starts at zero

    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(KEYS <= r.keys() and math.isfinite(r["grad_norm"]) for r in rows)

    step = out / "step_3"
    for name in ("adapter/adapter_model.pt", "adapter/adapter_model.safetensors", "adapter/adapter_config.json",
                 "model-00001-of-00001.safetensors", "config.json", "recipe_state.pt"):
        assert (step / name).is_file(), name
    assert not (step / "adapter_config.json").exists()  # the step folder itself is the merged model
    peft_config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert (peft_config["r"], peft_config["lora_alpha"], peft_config["peft_type"]) == (4, 8, "LORA")
    assert set(peft_config["target_modules"]) == PEFT_TARGETS and peft_config["use_dora"] is use_dora
    peft_adapter = load_file(step / "adapter" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in peft_adapter)

    # adapter round trip: base weights plus the saved adapter give the trained model
    adapter = torch.load(step / "adapter" / "adapter_model.pt", weights_only=True)
    assert set(adapter) == adapter_names
    fresh = lora_tiny_llama(**TINY_LORA, use_dora=use_dora)
    fresh.load_state_dict(base, strict=False)
    fresh.load_state_dict(adapter, strict=False)
    fresh.set_num_output_chunks(0)  # one logits tensor
    tokens = torch.randint(0, 49_152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the recipe's model returns hidden states; its loss applies the output projection
        trained = model.output(model(tokens))
        torch.testing.assert_close(fresh(tokens), trained, rtol=0, atol=0)

    # the merged model: base plus the scaled low-rank product, and the same function
    merged = load_hf_model(step, tmp_path / "scratch")
    assert set(merged) == set(base)
    scale = TINY_LORA["lora_alpha"] / TINY_LORA["lora_rank"]
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_a.weight" not in adapter:
            assert torch.equal(merged[name], weight), name
        elif not use_dora:
            delta = scale * adapter[f"{module}.lora_b.weight"] @ adapter[f"{module}.lora_a.weight"]
            torch.testing.assert_close(merged[name], weight + delta, rtol=1e-6, atol=1e-7)
    plain = tiny_llama()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), trained, rtol=1e-5, atol=1e-4)


def test_resume_needs_an_adapter(smollm2_assets, tiny_checkpoint, tmp_path):
    checkpoint_dir, _ = tiny_checkpoint
    out = tmp_path / "run"
    run_recipe(LORA, tiny_config(smollm2_assets, checkpoint_dir, out, "max_steps_per_epoch=1"))
    (out / "step_1" / "adapter" / "adapter_model.pt").unlink()
    manifest = json.loads((out / "step_1" / "checkpoint.json").read_text())
    del manifest["files"]["adapter/adapter_model.pt"]  # a complete checkpoint, but of a full fine-tune
    (out / "step_1" / "checkpoint.json").write_text(json.dumps(manifest))
    recipe = LORA(tiny_config(smollm2_assets, checkpoint_dir, out, "resume_from_checkpoint=true"))
    with pytest.raises(ConfigError, match="resume_from_checkpoint.*adapter_model.pt"):
        recipe.setup()


@pytest.mark.parametrize("overrides,key", [
    (["model.lora_attn_modules=[q_proj,gate_proj]"], "model.lora_attn_modules"),
    (["model.lora_attn_modules=[]", "model.apply_lora_to_mlp=false"], "model.lora_attn_modules"),  # nothing to adapt
    (["model.lora_rank=0"], "model.lora_rank"),
    (["model.lora_alpha=null"], "model.lora_alpha"),
    (["model.lora_dropout=1.0"], "model.lora_dropout"),
    (["model.use_dora=maybe"], "model.use_dora"),
    (["save_adapter_weights_only=1"], "save_adapter_weights_only"),
])
def test_lora_config_errors_name_the_key(smollm2_assets, tiny_checkpoint, tmp_path, overrides, key):
    checkpoint_dir, _ = tiny_checkpoint
    with pytest.raises(ConfigError, match=f"'{key}'"):
        tiny_config(smollm2_assets, checkpoint_dir, tmp_path / "run", *overrides)


def test_lora_settings_left_out_take_the_builders_defaults(smollm2_assets, tiny_checkpoint, tmp_path):
    """As in torchtune: a LoRA config may leave settings to the builder (read from its signature)."""
    from torchtune_ext.config import lora_settings

    checkpoint_dir, _ = tiny_checkpoint
    cfg = OmegaConf.load(REPO_ROOT / CONFIG)
    for key in ("apply_lora_to_mlp", "apply_lora_to_output", "lora_rank", "lora_alpha"):
        del cfg.model[key]
    cfg.checkpointer.checkpoint_dir = str(checkpoint_dir)
    cfg.output_dir = str(tmp_path / "run")
    settings = lora_settings(validate(cfg, extra_keys=LORA_KEYS).model)
    # lora_smollm2_135m's defaults
    assert (settings.apply_lora_to_mlp, settings.apply_lora_to_output, settings.lora_rank, settings.lora_alpha) == (
        False, False, 8, 16)
    gemma = {"_component_": "torchtune.models.gemma.lora_gemma_2b", "lora_attn_modules": ["q_proj"]}
    assert lora_settings(gemma).apply_lora_to_output is False  # no such argument: the output is the tied embedding


def test_alpaca_two_steps_end_to_end(smollm2_assets, tmp_path):
    out = tmp_path / "run"
    proc = run_tune(RECIPE, "--config", CONFIG, f"output_dir={out}", "max_steps_per_epoch=2", "batch_size=2",
                    "gradient_accumulation_steps=1", "backward=per_micro_batch", "tokenizer.max_seq_len=128",
                    # the shipped config validates before and after training: this test trains only
                    "run_val_every_n_steps=null", "run_val_at_start=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2,442,240 trainable" in proc.stdout + proc.stderr  # rank 8 on 7 projections x 30 layers
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert KEYS <= r.keys()
        assert 0.3 < r["loss"] < 4.0 and math.isfinite(r["grad_norm"]) and r["num_tokens"] > 0
    ckpt = out / "step_2"
    for name in ("adapter/adapter_model.pt", "adapter/adapter_model.safetensors", "adapter/adapter_config.json",
                 "model-00001-of-00001.safetensors", "config.json", "tokenizer.json", "recipe_state.pt"):
        assert (ckpt / name).is_file(), name
    peft_config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert (peft_config["r"], peft_config["lora_alpha"], set(peft_config["target_modules"])) == (8, 16, PEFT_TARGETS)
    run = read_offline_run(str(out / "logs"))
    logged = [h for h in run["history"] if "loss" in h]
    assert [(h["global_step"], h["loss"]) for h in logged] == [(r["step"], r["loss"]) for r in rows]
