"""The language model of an image-text folder through the recipe (``text_only``): it trains with one key, and the
folder without the key is refused by ``tune run`` in one line.

The model, checkpointer and LoRA in this process: tests/unit/model/hf/test_hf_text_only.py.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.helpers import copy_smollm2_tokenizer, rel_diff


# ----------------------------------------------------------------------------- through the recipe
@pytest.fixture(scope="module")
def recipe_folder(tmp_path_factory, smollm2_assets):
    """A tiny image-text Gemma 3 folder with SmolLM2's tokenizer files (and vocabulary), and 8 Alpaca records."""

    from tests.support.hf_tiny import write_tiny_image_text

    root = tmp_path_factory.mktemp("hf_text_only_recipe")
    model_dir = write_tiny_image_text("gemma3", root / "gemma3-tiny", text={"vocab_size": 49_152})
    copy_smollm2_tokenizer(smollm2_assets, model_dir)
    records = json.loads((smollm2_assets / "data" / "alpaca_en_demo.json").read_text())[:8]
    (root / "alpaca8.json").write_text(json.dumps(records))
    return root


def recipe_overrides(root, out, *more):
    return [f"model_dir={root / 'gemma3-tiny'}", f"output_dir={out}", f"dataset.data_files={root / 'alpaca8.json'}",
            "dataset.split=train", "run_val_every_n_steps=null", "dataset_val=null", "dtype=fp32",
            "tokenizer.max_seq_len=128", "max_steps_per_epoch=2", "batch_size=2", "gradient_accumulation_steps=2",
            "lr_scheduler.num_warmup_steps=1", "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
            "shuffle=false", *more]


def test_the_recipe_trains_the_language_model_with_one_key(recipe_folder):
    """configs/hf/full_single_device.yaml with model.text_only=true (the checkpointer follows it): two steps
    train, and the last step is a text model's folder that transformers loads with the trained weights."""
    from omegaconf import OmegaConf

    from tests.support.helpers import REPO_ROOT, read_jsonl, recipe_class, run_recipe
    from torchtune_ext.config import validate

    out = recipe_folder / "run"
    cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / "configs/hf/full_single_device.yaml"),
                          OmegaConf.from_dotlist(recipe_overrides(recipe_folder, out, "model.text_only=true")))
    recipe = run_recipe(recipe_class("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice"),
                        validate(cfg))
    assert [r["step"] for r in read_jsonl(out / "logs" / "metrics.jsonl")] == [1, 2]
    step = out / "step_2"
    assert json.loads((step / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    saved = AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32)
    for name, value in recipe.model.state_dict().items():
        assert rel_diff(saved.state_dict()[name], value) <= 1e-6, name


def test_the_recipe_refuses_an_image_text_folder_without_the_key(recipe_folder, tmp_path):
    """Without model.text_only: exit status 2, one line naming model.path, the class and the key to set,
    before anything loads or is written."""
    from tests.support.helpers import run_tune

    proc = run_tune("recipes/full_finetune_single_device.py", "--config", "configs/hf/full_single_device.yaml",
                    *recipe_overrides(recipe_folder, tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: config key 'model.path': Gemma3ForConditionalGeneration is an image-text "
                                "model"), lines[-3:]
    assert "set model.text_only=true" in lines[-1] and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
