"""A checkpoint written before the library's layered packages resumes exactly (the on-disk format is unchanged).

``tests/data/checkpoint_598b2e0/`` holds step 2 of a 4-step LoRA run written by
the code of commit 598b2e0 (its README says how), and the losses of all 4
steps of that run. The base model and data are made again here the same way;
the run's config names the model with the module path of that time
(``torchtune_ext.models.lora_tiny_llama``, now ``torchtune_ext.model``).
Resuming it with today's code must give steps 3 and 4 as the old code trained
them uninterrupted.
"""

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT, run_tune, write_tiny_hf_checkpoint
from tests.support.tiny_setup import write_dataset

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "checkpoint_598b2e0"


def test_a_checkpoint_of_the_code_before_the_packages_resumes_exactly(smollm2_assets, tmp_path):
    base = tmp_path / "base"
    write_tiny_hf_checkpoint(base, seed=0, embedding_std=0.02)
    write_dataset(tmp_path / "data.json", 16)
    old = json.loads((FIXTURE / "metrics.json").read_text())
    cfg = OmegaConf.load(REPO_ROOT / "configs/smollm2/135M_lora_single_device.yaml")
    cfg.model = {"_component_": "torchtune_ext.models.lora_tiny_llama",  # the spelling of 598b2e0
                 "lora_attn_modules": ["q_proj", "v_proj"],
                 "apply_lora_to_mlp": False, "apply_lora_to_output": False, "lora_rank": 2, "lora_alpha": 4,
                 "lora_dropout": 0.0}
    cfg.checkpointer.checkpoint_dir = str(base)
    cfg.tokenizer.path = str(smollm2_assets / "SmolLM2-135M-Instruct")
    cfg.tokenizer.max_seq_len = 64
    cfg.dataset.data_files = str(tmp_path / "data.json")
    cfg.dataset.split = "train"
    cfg.run_val_every_n_steps, cfg.run_val_at_start = None, False
    cfg.output_dir = str(tmp_path / "out")
    cfg.metric_logger = None
    cfg.batch_size, cfg.gradient_accumulation_steps = 2, 2
    cfg.max_steps_per_epoch, cfg.epochs = 4, 1
    cfg.save_every_n_steps = 2
    cfg.save_adapter_weights_only = True
    cfg.lr_scheduler.num_warmup_steps = 1
    cfg.optimizer.lr = 1e-2
    cfg.seed = 5
    cfg.resume_from_checkpoint = True
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    shutil.copytree(FIXTURE / "step_2", tmp_path / "out" / "step_2")

    proc = run_tune("recipes/lora_finetune_single_device.py", "--config", str(tmp_path / "config.yaml"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resuming from" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r for r in records if "loss" in r and "step" in r}
    assert sorted(resumed) == [3, 4]  # the old checkpoint was read, not a fresh start
    for expected in old[2:]:
        got = resumed[expected["step"]]
        assert got["num_tokens"] == expected["num_tokens"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
