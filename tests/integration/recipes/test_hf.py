"""End to end: the four recipes on a Hugging Face folder, through configs/hf/*.yaml and `tune run`.

A tiny random Qwen3 (tied embeddings, SmolLM2's vocabulary so the real
tokenizer files serve) written by transformers as a folder, `model_dir` the
one key that points at it. What the library tests of torchtune_ext.hf check
piece by piece, these check through the recipes: a saved step is a Hugging
Face folder transformers loads, a resume continues exactly, two ranks equal
one device (full and LoRA), and bad folders are one line before anything loads.
"""

import json
import shutil

import pytest
import torch

from tests.support.helpers import (
    REPO_ROOT,
    copy_smollm2_tokenizer,
    read_jsonl,
    recipe_class,
    rel_diff,
    run_recipe,
    run_tune,
)
from tests.support.hf_tiny import write_tiny

STEPS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_assets):
    """The model folder (as `hf download` leaves one) and a 16-record Alpaca file."""
    root = tmp_path_factory.mktemp("hf")
    model_dir = write_tiny("qwen3", root / "Qwen3-tiny", vocab_size=49_152)
    copy_smollm2_tokenizer(smollm2_assets, model_dir)
    records = json.loads((smollm2_assets / "data" / "alpaca_en_demo.json").read_text())[:16]
    (root / "alpaca16.json").write_text(json.dumps(records))
    return root


def overrides(root, out, *more):
    data = root / "alpaca16.json"
    return [f"model_dir={root / 'Qwen3-tiny'}", f"output_dir={out}", f"dataset.data_files={data}",
            "dataset.split=train", "run_val_every_n_steps=null", "dataset_val=null", "dtype=fp32",
            "tokenizer.max_seq_len=128", f"max_steps_per_epoch={STEPS}", "lr_scheduler.num_warmup_steps=1",
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger", "shuffle=false", *more]


def tune(recipe, config, *args, nproc=1):
    launcher = ("--nproc_per_node", str(nproc)) if nproc > 1 else ()
    proc = run_tune(*launcher, f"recipes/{recipe}.py", "--config", f"configs/hf/{config}.yaml", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def one_device(folder):
    """Full fine-tuning on one device, batch 2 x 2 accumulation steps, a checkpoint every 2 steps."""
    out = folder / "full_one_device"
    tune("full_finetune_single_device", "full_single_device",
         *overrides(folder, out, "batch_size=2", "gradient_accumulation_steps=2", "save_every_n_steps=2",
                    "keep_last_n_checkpoints=null"))
    return out


def test_a_saved_step_is_a_hugging_face_folder_with_the_trained_weights(folder, one_device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step = one_device / f"step_{STEPS}"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "recipe_state.pt", "checkpoint.json"):
        assert (step / name).is_file(), name
    trained = AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(folder / "Qwen3-tiny"), dtype=torch.float32)
    assert trained.get_input_embeddings().weight is trained.get_output_embeddings().weight  # still tied
    moved = [n for n, p in base.named_parameters() if not torch.equal(p, trained.get_parameter(n))]
    assert len(moved) == len(list(base.parameters()))  # every weight trained
    # the tokenizer in the folder writes what training wrote (the folder's own template: here SmolLM2's,
    # default system prompt included)
    from torchtune.data import Message

    from torchtune_ext.hf.tokenizer import hf_tokenizer

    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    saved = AutoTokenizer.from_pretrained(str(step)).apply_chat_template(chat, tokenize=True)
    saved = saved["input_ids"] if isinstance(saved, dict) or hasattr(saved, "keys") else saved
    training, _ = hf_tokenizer(str(folder / "Qwen3-tiny")).tokenize_messages(
        [Message(role=m["role"], content=m["content"]) for m in chat], add_end_tokens=True)
    assert list(saved) == training


def test_a_resumed_run_continues_exactly(folder, one_device):
    from omegaconf import OmegaConf

    from torchtune_ext.config import validate

    resumed = folder / "full_resumed"
    shutil.copytree(one_device / "step_2", resumed / "step_2")  # as if the run had stopped after step 2
    cfg = OmegaConf.load(REPO_ROOT / "configs/hf/full_single_device.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides(
        folder, resumed, "batch_size=2", "gradient_accumulation_steps=2", "save_every_n_steps=2",
        "resume_from_checkpoint=true")))
    recipe = run_recipe(recipe_class("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice"),
                        validate(cfg))
    expected, got = read_jsonl(one_device / "logs" / "metrics.jsonl"), read_jsonl(resumed / "logs" / "metrics.jsonl")
    assert [r["step"] for r in got] == [3, 4]
    for a, b in zip(got, expected[2:]):
        assert a["num_tokens"] == b["num_tokens"] and a["lr"] == b["lr"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    from safetensors.torch import load_file

    straight = load_file(str(one_device / f"step_{STEPS}" / "model.safetensors"))
    state = recipe.model.state_dict()  # names without activation checkpointing's wrapper
    for name, value in straight.items():
        assert rel_diff(state[name], value) <= 1e-5, name


def test_two_ranks_equal_one_device(folder, one_device):
    """batch 1 x 2 accumulation steps on each of 2 ranks == batch 2 x 2 on one device (the same 4 samples a step).

    LoRA on 2 ranks: tests/integration/distributed/test_hf_distributed.py (== 1 rank, in one launch) and
    tests/integration/recipes/test_sharded_hf.py (the recipe, its adapter loaded in PEFT)."""
    reference = read_jsonl(one_device / "logs" / "metrics.jsonl")
    out = folder / "full_two_ranks"
    tune("full_finetune_distributed", "full", *overrides(folder, out, "batch_size=1", "gradient_accumulation_steps=2"),
         nproc=2)
    got = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for a, b in zip(got, reference):
        assert a["num_tokens"] == b["num_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("case", ["model_dir unset", "no config.json"])
def test_a_bad_model_dir_is_one_line_before_anything_loads(folder, tmp_path, case):
    args = overrides(folder, tmp_path / "out")
    if case == "model_dir unset":
        args = [a for a in args if not a.startswith("model_dir=")]
        key = "model_dir"
    else:
        empty = tmp_path / "empty"
        empty.mkdir()
        args = [a if not a.startswith("model_dir=") else f"model_dir={empty}" for a in args]
        key = "model.path"
    proc = run_tune("recipes/full_finetune_single_device.py", "--config", "configs/hf/full_single_device.yaml", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: config key '{key}'"), lines[-3:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
