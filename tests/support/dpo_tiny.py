"""Tiny preference runs of the shipped DPO configs: the random tiny checkpoint and 7 + 3 short bundled pairs.

Shared by tests/integration/recipes/test_dpo_recipes.py (one device, in process) and
tests/integration/recipes/test_distributed_recipes.py (the same runs on 2 ranks, in its one torchrun launch).
"""

from pathlib import Path

from tests.support.helpers import tiny_recipe_config, write_tiny_hf_checkpoint
from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, validate
from torchtune_ext.config.preference import PREFERENCE_KEYS

TINY_LORA = dict(_component_="torchtune_ext.model.builders.lora_tiny_llama", lora_attn_modules=["q_proj", "v_proj"],
                 apply_lora_to_mlp=False, apply_lora_to_output=False, lora_rank=4, lora_alpha=8, lora_dropout=0.0)
TINY = dict(_component_="torchtune_ext.model.builders.tiny_llama")
# kind: (recipe file, class, shipped config, tiny model, schema)
RUNS = {
    "lora": ("recipes/lora_dpo_single_device.py", "LoRADPORecipeSingleDevice",
             "configs/smollm2/135M_lora_dpo_single_device.yaml", TINY_LORA, {**LORA_KEYS, **PREFERENCE_KEYS}),
    "full": ("recipes/full_dpo_single_device.py", "FullDPORecipeSingleDevice",
             "configs/smollm2/135M_full_dpo_single_device.yaml", TINY, PREFERENCE_KEYS),
    "lora_dist": ("recipes/lora_dpo_distributed.py", "LoRADPORecipeDistributed", "configs/smollm2/135M_lora_dpo.yaml",
                  TINY_LORA, {**LORA_KEYS, **DISTRIBUTED_KEYS, **PREFERENCE_KEYS}),
    "full_dist": ("recipes/full_dpo_distributed.py", "FullDPORecipeDistributed", "configs/smollm2/135M_full_dpo.yaml",
                  TINY, {**DISTRIBUTED_KEYS, **PREFERENCE_KEYS}),
}


def write_tiny_pairs(root: Path, assets: Path) -> Path:
    """The tiny checkpoint (``root/base``) and 10 short pairs of the bundled file: 7 to train on, 3 held out."""
    if not (root / "base").exists():
        write_tiny_hf_checkpoint(root / "base")
    lines = (assets / "data" / "dpo_en_demo_pairs.jsonl").read_text().splitlines()
    short = [line for line in lines if len(line) < 2500][:10]
    (root / "train.jsonl").write_text("\n".join(short[:7]) + "\n")
    (root / "val.jsonl").write_text("\n".join(short[7:]) + "\n")
    return root


def tiny_dpo_config(kind: str, assets: Path, root: Path, output_dir: Path, *overrides: str):
    """The shipped config of ``kind`` on the tiny checkpoint and pairs of ``root``, validated: 7 pairs, global
    batch 4 (a step of 4 pairs, then the short last one of 3), validation at the start and after the last step."""
    _, _, shipped, model, keys = RUNS[kind]
    per_rank = ["batch_size=1"] if kind.endswith("_dist") else ["batch_size=2"]
    cfg = tiny_recipe_config(shipped, model, assets, root / "base", output_dir,
                             f"dataset.data_files={root}/train.jsonl", *per_rank,
                             "gradient_accumulation_steps=2", "max_steps_per_epoch=null",
                             f"dataset_val.data_files={root}/val.jsonl", "dataset_val.split=train",
                             "run_val_every_n_steps=2", "run_val_at_start=true", "lr_scheduler=null",
                             "optimizer.lr=1e-2", "tokenizer.max_seq_len=256", *overrides)
    return validate(cfg, extra_keys=keys)
