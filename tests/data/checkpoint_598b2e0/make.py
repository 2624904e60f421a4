"""How ``step_2/`` and ``metrics.json`` were made: run with the code of commit 598b2e0, not today's.

    git worktree add --detach ../old 598b2e0
    cd ../old && PYTHONPATH=$PWD python <this file> OUT_DIR ASSETS_DIR

A LoRA run of ``lora_finetune_single_device`` (4 steps, adapter-only checkpoints at steps 2 and 4) on a tiny
Llama and 16 samples; ``OUT_DIR/out/step_2`` and ``OUT_DIR/out/logs/metrics.jsonl`` are what this folder holds.
"""

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path.cwd() / "tests"))  # the old checkout's test helpers (a script, not a test)
from helpers import write_tiny_hf_checkpoint  # noqa: E402
from tiny_setup import write_dataset  # noqa: E402


def main(root: Path, assets: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    base = root / "base"
    write_tiny_hf_checkpoint(base, seed=0, embedding_std=0.02)
    write_dataset(root / "data.json", 16)
    cfg = OmegaConf.load("configs/smollm2/135M_lora_single_device.yaml")
    cfg.model = {"_component_": "torchtune_ext.models.lora_tiny_llama", "lora_attn_modules": ["q_proj", "v_proj"],
                 "apply_lora_to_mlp": False, "apply_lora_to_output": False, "lora_rank": 2, "lora_alpha": 4,
                 "lora_dropout": 0.0}
    cfg.checkpointer.checkpoint_dir = str(base)
    cfg.tokenizer.path = str(assets / "SmolLM2-135M-Instruct")
    cfg.tokenizer.max_seq_len = 64
    cfg.dataset.data_files = str(root / "data.json")
    cfg.dataset.split = "train"
    cfg.run_val_every_n_steps, cfg.run_val_at_start = None, False
    cfg.output_dir = str(root / "out")
    cfg.metric_logger = None
    cfg.batch_size, cfg.gradient_accumulation_steps = 2, 2
    cfg.max_steps_per_epoch, cfg.epochs = 4, 1
    cfg.save_every_n_steps = 2
    cfg.save_adapter_weights_only = True
    cfg.lr_scheduler.num_warmup_steps = 1
    cfg.optimizer.lr = 1e-2
    cfg.seed = 5
    OmegaConf.save(cfg, root / "config.yaml")
    subprocess.run(["tune", "run", "recipes/lora_finetune_single_device.py", "--config", str(root / "config.yaml")],
                   env=dict(os.environ, WANDB_MODE="offline"), check=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]).absolute(), Path(sys.argv[2]).absolute())
