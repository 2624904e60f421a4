"""docs/data.md, "Your data" (issue 33, U5): its commands run, as written on the page.

The page's ```bash blocks run in bash, in a folder laid out as the repository root, with a
`tune` on the PATH that records its command line. Each recorded `tune run` is then
checked as the recipe checks it before the model loads (torchtune's own merge of the YAML
and the overrides, the config schema, the components, the data pass, the validation
set), and one, the command with a validation file, runs for real: on a tiny model with
the same vocabulary, one optimizer step.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT, read_jsonl, write_tiny_hf_checkpoint

PAGE = REPO_ROOT / "docs" / "data.md"
CPU = torch.device("cpu")

RECORDER = """#!{python}
import json, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def page_commands(tmp_path_factory, smollm2_assets):
    """Run the page's blocks; returns (folder they ran in, the `tune` command lines they gave)."""
    root = tmp_path_factory.mktemp("your_data")
    for name in ("recipes", "configs", "assets"):
        (root / name).symlink_to(REPO_ROOT / name)
    shim = root / "bin"
    shim.mkdir()
    log = root / "tune_commands.jsonl"
    (shim / "tune").write_text(RECORDER.format(python=sys.executable, log=str(log)))
    (shim / "tune").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO_ROOT))
    for block in bash_blocks(PAGE.read_text()):
        proc = subprocess.run(["bash", "-e", "-c", block], cwd=root, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (block, proc.stderr[-2000:])
    return root, read_jsonl(log)


def test_every_command_on_the_page_ran(page_commands):
    _, commands = page_commands
    written = sum(block.count("tune run ") for block in bash_blocks(PAGE.read_text()))
    assert written == 7 and len(commands) == written
    assert all(c[:4] == ["run", "recipes/full_finetune_single_device.py", "--config",
                         "configs/smollm2/135M_full_single_device.yaml"] for c in commands)
    sources = {o.split("=", 1)[1] for c in commands for o in c if o.startswith("dataset.source=")}
    assert sources == {"json", "csv", "parquet"}
    components = {o.split("=", 1)[1].rsplit(".", 1)[1] for c in commands for o in c
                  if o.startswith("dataset._component_=")}
    assert components == {"instruct_dataset", "chat_dataset", "text_completion_dataset"}


def _checked(root, argv, monkeypatch):
    """What the recipe builds from ``tune run <argv>`` before loading the model: the training
    loader's dataset and, with validation on, the validation loader."""
    from torchtune import config as tt_config
    from torchtune.config._utils import _merge_yaml_and_cli_args

    from torchtune_ext.config import validate, validation_enabled
    from torchtune_ext.data import build_step_loader
    from torchtune_ext.run.evaluate import build_val_loader
    from torchtune_ext.run.preflight import check_components

    monkeypatch.chdir(root)
    yaml = OmegaConf.to_container(OmegaConf.load(argv[3]))
    cfg = validate(_merge_yaml_and_cli_args(argparse.Namespace(**yaml), argv[4:]))
    check_components(cfg, CPU)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    loader = build_step_loader(cfg, tokenizer, seed=0, ignore_index=-100)
    val = build_val_loader(cfg, tokenizer, ignore_index=-100) if validation_enabled(cfg) else None
    return cfg, loader.dataset, val


def _trainable(dataset):
    return sum(sum(1 for label in sample["labels"][1:] if label != -100) for sample in dataset)


def test_each_command_is_accepted_and_reads_its_data(page_commands, monkeypatch):
    root, commands = page_commands
    built = {}
    for argv in commands:
        name = next(o for o in argv if o.startswith("output_dir=")).split("/")[-1]
        cfg, dataset, val = _checked(root, argv, monkeypatch)
        built[name] = (cfg, dataset, val)
        assert (val is not None) == (name == "my_validated"), name
    # the same 50 records in JSON Lines, CSV and Parquet: the same samples
    tokens = {name: [s["tokens"] for s in built[name][1]] for name in ("my_jsonl", "my_csv", "my_parquet")}
    assert len(tokens["my_jsonl"]) == 50 and tokens["my_csv"] == tokens["my_jsonl"] == tokens["my_parquet"]
    # column_map: the answers train, the prompts are masked ...
    masked, unmasked = _trainable(built["my_jsonl"][1]), _trainable(built["my_prompts_too"][1])
    assert 0 < masked < unmasked  # ... unless train_on_input=true
    chat = built["my_chat"][1]
    assert len(chat) == 50 and _trainable(chat) > 0
    text_cfg, text, _ = built["my_text"]
    assert text_cfg.dataset.packed and all(len(s["tokens"]) == text_cfg.tokenizer.max_seq_len for s in text)
    assert built["my_validated"][0].run_val_every_n_steps == 2


def test_the_command_with_a_validation_file_trains_and_validates(page_commands, smollm2_assets):
    root, commands = page_commands
    (argv,) = [c for c in commands if "output_dir=outputs/my_validated" in c]
    checkpoint = root / "tiny_model"
    write_tiny_hf_checkpoint(checkpoint)  # SmolLM2's vocabulary: the real tokenizer works with it
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_assets / "SmolLM2-135M-Instruct" / name, checkpoint / name)
    tiny = ["model._component_=torchtune_ext.model.builders.tiny_llama", f"checkpointer.checkpoint_dir={checkpoint}",
            "max_steps_per_epoch=1", "metric_logger=null", "tokenizer.max_seq_len=128"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), WANDB_SILENT="true")
    proc = subprocess.run(["tune", *argv, *tiny], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(root / "outputs" / "my_validated" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1]
    assert [(r["step"], r["val_num_samples"]) for r in rows if "val_loss" in r] == [(0, 10), (1, 10)]
    assert (root / "outputs" / "my_validated" / "step_1" / "checkpoint.json").is_file()
