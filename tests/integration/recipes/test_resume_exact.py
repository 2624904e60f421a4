"""Resuming continues a run exactly, in every single-device recipe.

Each recipe runs in process on a tiny checkpoint: once for 4 steps, saving
at step 2, and once resumed from a copy of that step_2 folder. Steps 3 and 4
must match bit for bit: the optimizer moments, the warmup position of the LR
scheduler, the mid-epoch data position and (LoRA, with dropout on) the RNG
all have to be restored.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.support.helpers import read_jsonl, recipe_class, run_recipe, tiny_recipe_config, write_tiny_hf_checkpoint
from torchtune_ext.config import LORA_KEYS, validate

TINY_LORA = {"_component_": "torchtune_ext.model.builders.lora_tiny_llama", "lora_attn_modules": ["q_proj", "v_proj"],
             "apply_lora_to_mlp": True, "apply_lora_to_output": False, "lora_rank": 4, "lora_alpha": 8,
             "lora_dropout": 0.1}

RECIPES = {
    # name: (recipe file, class, config, tiny model, extra schema keys, overrides, trained weights file)
    "full": ("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice",
             "configs/smollm2/135M_full_single_device.yaml", {"_component_": "torchtune_ext.model.builders.tiny_llama"},
             None, [], "model-00001-of-00001.safetensors"),
    "lora": ("recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice",
             "configs/smollm2/135M_lora_single_device.yaml", TINY_LORA,
             LORA_KEYS, ["save_adapter_weights_only=true"], "adapter/adapter_model.pt"),
}
SETTINGS = ["max_steps_per_epoch=4", "save_every_n_steps=2", "gradient_accumulation_steps=2",
            "lr_scheduler.num_warmup_steps=1", "optimizer.lr=0.01"]


def _weights(path):
    return load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_resume_continues_exactly(name, smollm2_assets, tmp_path):
    recipe_file, cls_name, config, model, extra_keys, overrides, weights = RECIPES[name]
    recipe = recipe_class(recipe_file, cls_name)
    checkpoint_dir = tmp_path / "base"
    write_tiny_hf_checkpoint(checkpoint_dir)

    def run(output_dir, *more):
        cfg = tiny_recipe_config(config, model, smollm2_assets, checkpoint_dir, output_dir,
                                 *SETTINGS, *overrides, *more)
        run_recipe(recipe, validate(cfg, extra_keys=extra_keys))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight)
    resumed.mkdir()
    shutil.copytree(straight / "step_2", resumed / "step_2")  # as if the run had stopped after step 2
    run(resumed, "resume_from_checkpoint=true")

    expected = read_jsonl(straight / "logs" / "metrics.jsonl")
    got = read_jsonl(resumed / "logs" / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4] and [r["step"] for r in got] == [3, 4]
    assert expected[2]["lr"] > 0  # warmup ended: a scheduler reset to step 0 would show here
    # tokens_seen continues from the checkpoint (group_by_length is on: the configs' default)
    fields = ("loss", "grad_norm", "lr", "num_tokens", "tokens_seen", "padding_fraction")
    for a, b in zip(got, expected[2:]):
        assert [a[f] for f in fields] == [b[f] for f in fields], a["step"]
    assert [r["tokens_seen"] for r in expected] == [sum(r["num_tokens"] for r in expected[:i + 1]) for i in range(4)]
    final = _weights(straight / "step_4" / weights)
    for key, weight in _weights(resumed / "step_4" / weights).items():
        assert torch.equal(weight, final[key]), key
