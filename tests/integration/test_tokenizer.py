"""The tokenizer through the recipe: a saved checkpoint carries the chat template training used; a tokenizer path
that is not a tokenizer stops ``tune run`` with one line.

SmolLM2Tokenizer itself: tests/unit/data/test_tokenizer.py.
"""

import json
from pathlib import Path

import pytest
from torchtune.data import Message

TWO_TURNS = [
    Message("user", "Hello! How are you?", masked=True),
    Message("assistant", "I am fine, thank you."),
    Message("user", "Describe crepes.", masked=True),
    Message("assistant", "Whisk the flour\nand the eggs."),
]
# A template of our own for the Hugging Face tokenizer: the saved folder must carry it, not the base folder's
BRACKETS = "{% for m in messages %}[{{ m.role }}] {{ m.content }}<|im_end|>\n{% endfor %}"


def hf_ids(folder, messages):
    from transformers import AutoTokenizer

    conversation = [{"role": m.role, "content": m.text_content} for m in messages]
    return AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(conversation, tokenize=True)["input_ids"]


@pytest.mark.parametrize("tokenizer", [{}, {"tokenizer._component_": "torchtune_ext.data.hf_tokenizer.hf_tokenizer",
                                            "tokenizer.chat_template": BRACKETS}], ids=["smollm2", "hf"])
def test_saved_checkpoint_carries_the_chat_template_training_used(tiny_run, tokenizer):
    """issue 33 U4: the step folder's tokenizer_config.json was SmolLM2's, whose template adds a system prompt."""
    from omegaconf import OmegaConf

    from tests.support.helpers import recipe_class, run_recipe
    from torchtune_ext.config import validate

    cfg = validate(OmegaConf.load(tiny_run(n_samples=4, max_steps_per_epoch=1, batch_size=1,
                                           gradient_accumulation_steps=1, metric_logger=None, **tokenizer)))
    recipe = run_recipe(recipe_class("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice"), cfg)
    saved = Path(cfg.output_dir) / "step_1"
    assert hf_ids(saved, TWO_TURNS) == recipe.run.tokenizer.tokenize_messages(TWO_TURNS)[0]
    base = json.loads((Path(cfg.checkpointer.checkpoint_dir) / "tokenizer_config.json").read_text())
    assert "named SmolLM" in base["chat_template"]  # the base folder is untouched
    manifest = json.loads((saved / "checkpoint.json").read_text())["files"]
    assert manifest["tokenizer_config.json"] == (saved / "tokenizer_config.json").stat().st_size


def test_tokenizer_path_that_is_not_a_tokenizer_stops_the_recipe_in_one_line(tiny_run):
    import os

    from tests.support.helpers import run_tune

    config = tiny_run()
    root = config.parent
    path = root / "notes.txt"
    path.write_text("not a tokenizer\n")
    out = root / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_tune("recipes/full_finetune_single_device.py", "--config", str(config), f"tokenizer.path={path}",
                    timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: config key 'tokenizer.path': '{path}' is not a Hugging Face tokenizer.json (expected "
                      "ident at line 1 column 2); expected a tokenizer.json or the folder holding it"]
    assert os.listdir(out) == ["notes.txt"]
