"""End to end: the four recipes on a Hugging Face folder, through configs/hf/*.yaml.

A tiny random Qwen3 (tied embeddings, SmolLM2's vocabulary so the real
tokenizer files serve) written by transformers as a folder, `model_dir` the
one key that points at it. What the library tests of torchtune_ext.model.hf check
piece by piece, these check through the recipes: a saved step is a Hugging
Face folder transformers loads, a resume continues exactly, two ranks equal
one device, and bad folders are one line before anything loads (`tune run`).

Sharded checkpoints on this path: full fine-tuning on 2 ranks saves
asynchronously every 2 steps (LoRA synchronously); its step_2 resumes on one
rank (`tune run --nproc_per_node 1`, batch 1 x 4 accumulation steps: the same
global batch) and must continue the uninterrupted run (loss and grad norm to
1e-5). The final folders of the sharded runs (full and LoRA) must give the
logits of the gathered runs' folders in transformers (LoRA: the merged model,
and PEFT's adapter on the base folder too); so must a periodic checkpoint
exported on request (``python -m torchtune_ext.checkpoint.export``). The
gathered runs, full and LoRA, are tensor parallel (1 data-parallel x 2
tensor-parallel ranks, the model's own tp_plan, batch 2 x 2 accumulation
steps: the same global batch) and must train as the data-parallel ones: the
recipe's end of tests/integration/distributed/test_hf_tensor_parallel.py.

The four 2-rank runs share one torchrun launch (``two_ranks``,
tests/support/resume_worker.py); the full data-parallel one is also the run
that must equal one device.
"""

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from tests.support import resume_jobs
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
from torchtune_ext.tools.export import main as export_main

STEPS = 4
TOL = 1e-5
VOCAB = 49_152


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_assets):
    """The model folder (as `hf download` leaves one) and a 16-record Alpaca file."""
    root = tmp_path_factory.mktemp("hf")
    model_dir = write_tiny("qwen3", root / "Qwen3-tiny", vocab_size=VOCAB)
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


def tune(recipe, config, *args):
    proc = run_tune(f"recipes/{recipe}.py", "--config", f"configs/hf/{config}.yaml", *args)
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



# ------------------------------------------------------------------ the 2-rank runs: one launch
TWO_RANKS = {
    # name: (recipe, overrides); every run: the same global batch of 4 samples
    "full_sharded": ("full", ["batch_size=1", "gradient_accumulation_steps=2", "enable_async_checkpointing=true",
                              "save_every_n_steps=2"]),
    "full_gathered": ("full", ["tensor_parallel_dim=2", "batch_size=2", "gradient_accumulation_steps=2",
                               "save_every_n_steps=2"]),
    "lora_sharded": ("lora", ["batch_size=1", "gradient_accumulation_steps=2", "model.lora_rank=4",
                              "model.lora_alpha=8", "sharded_checkpoints=true", "save_every_n_steps=2"]),
    # tensor parallel (PEFT's adapters split with their base)
    "lora_gathered": ("lora", ["tensor_parallel_dim=2", "batch_size=2", "gradient_accumulation_steps=2",
                               "model.lora_rank=4", "model.lora_alpha=8"]),
}


def distributed_overrides(root, out, *more):
    return [*overrides(root, out, "keep_last_n_checkpoints=null"), *more]


@pytest.fixture(scope="module")
def two_ranks(folder):
    """The 2-rank runs of TWO_RANKS in one launch; returns the folder holding their output folders."""
    jobs = []
    for name, (kind, more) in TWO_RANKS.items():
        cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / f"configs/hf/{kind}.yaml"),
                              OmegaConf.from_dotlist(distributed_overrides(folder, folder / name, *more)))
        OmegaConf.save(cfg, folder / f"{name}.yaml")
        jobs.append({"recipe": f"{kind}_dist", "config": str(folder / f"{name}.yaml")})
    resume_jobs.launch(2, jobs)
    return folder


def resume_on_one_rank(root, kind, out, *more):
    """`tune run --nproc_per_node 1` of the distributed recipe, resuming ``out``."""
    proc = run_tune("--nproc_per_node", "1", f"recipes/{kind}_finetune_distributed.py", "--config",
                    f"configs/hf/{kind}.yaml", *distributed_overrides(root, out, *more, "resume_from_checkpoint=true"),
                    extra_env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
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

    from torchtune_ext.data.hf_tokenizer import hf_tokenizer

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
        folder, resumed, "batch_size=2", "gradient_accumulation_steps=2", "save_every_n_steps=1",
        # step_3's save deletes the step resumed from: later saves must not read from it
        "keep_last_n_checkpoints=1", "resume_from_checkpoint=true")))
    recipe = run_recipe(recipe_class("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice"),
                        validate(cfg))
    expected, got = read_jsonl(one_device / "logs" / "metrics.jsonl"), read_jsonl(resumed / "logs" / "metrics.jsonl")
    assert [r["step"] for r in got] == [3, 4]
    assert sorted(p.name for p in resumed.glob("step_*")) == [f"step_{STEPS}"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # copied from the base folder
        assert (resumed / f"step_{STEPS}" / name).is_file(), name
    for a, b in zip(got, expected[2:]):
        assert a["num_tokens"] == b["num_tokens"] and a["lr"] == b["lr"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    from safetensors.torch import load_file

    straight = load_file(str(one_device / f"step_{STEPS}" / "model.safetensors"))
    state = recipe.model.state_dict()  # names without activation checkpointing's wrapper
    for name, value in straight.items():
        assert rel_diff(state[name], value) <= 1e-5, name


def test_two_ranks_equal_one_device(two_ranks, one_device):
    """batch 1 x 2 accumulation steps on each of 2 ranks == batch 2 x 2 on one device (the same 4 samples a step).

    The 2 ranks' run is the sharded one below (its checkpoints change no number). LoRA on 2 ranks:
    tests/integration/distributed/test_hf_distributed.py (== 1 rank, in one launch) and the sharded LoRA
    run below (the recipe, its adapter loaded in PEFT)."""
    reference = read_jsonl(one_device / "logs" / "metrics.jsonl")
    got = read_jsonl(two_ranks / "full_sharded" / "logs" / "metrics.jsonl")
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


# ------------------------------------------------------------------ sharded checkpoints
def logits(path, ids, adapter=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(ids).logits


def _assert_same_steps(got, ref):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert a["num_tokens"] == b["num_tokens"] and a["lr"] == b["lr"]
        for field in ("loss", "grad_norm"):
            assert abs(a[field] - b[field]) <= TOL * abs(b[field]), (a["step"], field, a[field], b[field])


def _assert_continues(got, ref):
    """Steps 3-4 of a run resumed from step 2 equal the uninterrupted run's."""
    assert [r["step"] for r in ref] == [1, 2, 3, 4] and [r["step"] for r in got] == [3, 4]
    _assert_same_steps(got, ref[2:])


IDS = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def test_full_sharded_resumes_on_one_rank_and_exports_the_gathered_folder(two_ranks):
    folder = two_ranks
    sharded, gathered = folder / "full_sharded", folder / "full_gathered"
    tensor_parallel = read_jsonl(gathered / "logs" / "metrics.jsonl")
    assert (tensor_parallel[0]["dp_world_size"], tensor_parallel[0]["tp_world_size"]) == (1, 2)
    _assert_same_steps(tensor_parallel, read_jsonl(sharded / "logs" / "metrics.jsonl"))
    assert (sharded / "step_2" / "dcp" / ".metadata").is_file() and not (sharded / "step_2" / "config.json").exists()
    resumed = folder / "full_sharded_resumed"
    shutil.copytree(sharded / "step_2", resumed / "step_2")
    resume_on_one_rank(folder, "full", resumed, "batch_size=1", "gradient_accumulation_steps=4",
                       "sharded_checkpoints=true")
    _assert_continues(read_jsonl(resumed / "logs" / "metrics.jsonl"), read_jsonl(sharded / "logs" / "metrics.jsonl"))
    want = logits(gathered / f"step_{STEPS}", IDS)
    for final in (sharded / f"step_{STEPS}", resumed / f"step_{STEPS}"):
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "model.safetensors"):
            assert (final / name).is_file(), (final, name)
        assert rel_diff(logits(final, IDS), want) <= TOL, final
    # on request, in one process: a periodic checkpoint (shards only) of 2 ranks
    assert export_main([str(sharded / "step_2"), str(folder / "step_2_hf")]) == 0
    assert rel_diff(logits(folder / "step_2_hf", IDS), logits(gathered / "step_2", IDS)) <= TOL


def test_lora_sharded_exports_the_gathered_folder_and_adapter(two_ranks):
    folder = two_ranks
    sharded, gathered = folder / "lora_sharded", folder / "lora_gathered"
    tensor_parallel = read_jsonl(gathered / "logs" / "metrics.jsonl")
    assert (tensor_parallel[0]["dp_world_size"], tensor_parallel[0]["tp_world_size"]) == (1, 2)
    _assert_same_steps(tensor_parallel, read_jsonl(sharded / "logs" / "metrics.jsonl"))
    resumed = folder / "lora_sharded_resumed"  # 2 ranks -> 1, the same global batch (configs/hf/lora.yaml: no dropout)
    shutil.copytree(sharded / "step_2", resumed / "step_2")
    resume_on_one_rank(folder, "lora", resumed, "batch_size=1", "gradient_accumulation_steps=4", "model.lora_rank=4",
                       "model.lora_alpha=8", "sharded_checkpoints=true")
    _assert_continues(read_jsonl(resumed / "logs" / "metrics.jsonl"), read_jsonl(sharded / "logs" / "metrics.jsonl"))
    got, want = sharded / f"step_{STEPS}", gathered / f"step_{STEPS}"
    assert (got / "dcp" / ".metadata").is_file()
    reference = logits(want, IDS)
    assert rel_diff(logits(got, IDS), reference) <= TOL  # the merged model
    assert rel_diff(logits(folder / "Qwen3-tiny", IDS, adapter=got / "adapter"), reference) <= TOL
    assert {p.name for p in (got / "adapter").iterdir()} == {p.name for p in (want / "adapter").iterdir()}
