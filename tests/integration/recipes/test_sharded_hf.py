"""Sharded checkpoints on the transformers model path (configs/hf/*.yaml): resume at another world size, and
the final Hugging Face folder, written file by file from the shards, is the one a gathered save writes.

A tiny random Qwen3 folder (tied embeddings) as in tests/integration/recipes/test_hf.py. Full fine-tuning on 2
ranks saves asynchronously every 2 steps (LoRA synchronously); its step_2 resumes in one process (batch
1 x 4 accumulation steps: the same global batch) and must continue the uninterrupted run (loss and grad
norm to 1e-5). The final folders of the sharded runs (full and LoRA) must give the logits of the gathered
runs' folders in transformers (LoRA: the merged model, and PEFT's adapter on the base folder too); so
must a periodic checkpoint exported on request (``python -m torchtune_ext.checkpoint.export``). The
gathered runs, full and LoRA, are tensor parallel (1 data-parallel x 2 tensor-parallel ranks, the model's
own tp_plan, batch 2 x 2 accumulation steps: the same global batch) and must train as the data-parallel
ones: the recipe's end of tests/integration/distributed/test_hf_tensor_parallel.py.
"""

import json
import shutil

import pytest
import torch

from tests.support.helpers import copy_smollm2_tokenizer, read_jsonl, rel_diff, run_tune
from tests.support.hf_tiny import write_tiny
from torchtune_ext.checkpoint.export import main as export_main

STEPS = 4
TOL = 1e-5
VOCAB = 49_152


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_assets):
    root = tmp_path_factory.mktemp("hf_sharded")
    model_dir = write_tiny("qwen3", root / "Qwen3-tiny", vocab_size=VOCAB)
    copy_smollm2_tokenizer(smollm2_assets, model_dir)
    records = json.loads((smollm2_assets / "data" / "alpaca_en_demo.json").read_text())[:16]
    (root / "alpaca16.json").write_text(json.dumps(records))
    return root


def tune(root, kind, out, *more, nproc=2):
    proc = run_tune("--nproc_per_node", str(nproc), f"recipes/{kind}_finetune_distributed.py", "--config",
                    f"configs/hf/{kind}.yaml", f"model_dir={root / 'Qwen3-tiny'}", f"output_dir={out}",
                    f"dataset.data_files={root / 'alpaca16.json'}", "dataset.split=train",
                    "run_val_every_n_steps=null", "dataset_val=null", "dtype=fp32", "tokenizer.max_seq_len=128",
                    f"max_steps_per_epoch={STEPS}", "lr_scheduler.num_warmup_steps=1", "shuffle=false",
                    "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
                    "keep_last_n_checkpoints=null", *more, extra_env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


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


def test_full_sharded_resumes_on_one_rank_and_exports_the_gathered_folder(folder):
    sharded = tune(folder, "full", folder / "full_sharded", "batch_size=1", "gradient_accumulation_steps=2",
                   "enable_async_checkpointing=true", "save_every_n_steps=2")
    gathered = tune(folder, "full", folder / "full_gathered", "tensor_parallel_dim=2", "batch_size=2",
                    "gradient_accumulation_steps=2", "save_every_n_steps=2")
    tensor_parallel = read_jsonl(gathered / "logs" / "metrics.jsonl")
    assert (tensor_parallel[0]["dp_world_size"], tensor_parallel[0]["tp_world_size"]) == (1, 2)
    _assert_same_steps(tensor_parallel, read_jsonl(sharded / "logs" / "metrics.jsonl"))
    assert (sharded / "step_2" / "dcp" / ".metadata").is_file() and not (sharded / "step_2" / "config.json").exists()
    resumed = folder / "full_resumed"
    shutil.copytree(sharded / "step_2", resumed / "step_2")
    tune(folder, "full", resumed, "batch_size=1", "gradient_accumulation_steps=4", "sharded_checkpoints=true",
         "resume_from_checkpoint=true", nproc=1)
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


def test_lora_sharded_exports_the_gathered_folder_and_adapter(folder):
    settings = ("batch_size=1", "gradient_accumulation_steps=2", "model.lora_rank=4", "model.lora_alpha=8")
    sharded = tune(folder, "lora", folder / "lora_sharded", *settings, "sharded_checkpoints=true",
                   "save_every_n_steps=2")
    # tensor parallel (PEFT's adapters split with their base), the same global batch
    gathered = tune(folder, "lora", folder / "lora_gathered", "tensor_parallel_dim=2", "batch_size=2",
                    "gradient_accumulation_steps=2", "model.lora_rank=4", "model.lora_alpha=8")
    tensor_parallel = read_jsonl(gathered / "logs" / "metrics.jsonl")
    assert (tensor_parallel[0]["dp_world_size"], tensor_parallel[0]["tp_world_size"]) == (1, 2)
    _assert_same_steps(tensor_parallel, read_jsonl(sharded / "logs" / "metrics.jsonl"))
    resumed = folder / "lora_resumed"  # 2 ranks -> 1, the same global batch (configs/hf/lora.yaml: no dropout)
    shutil.copytree(sharded / "step_2", resumed / "step_2")
    tune(folder, "lora", resumed, "batch_size=1", "gradient_accumulation_steps=4", "model.lora_rank=4",
         "model.lora_alpha=8", "sharded_checkpoints=true", "resume_from_checkpoint=true", nproc=1)
    _assert_continues(read_jsonl(resumed / "logs" / "metrics.jsonl"), read_jsonl(sharded / "logs" / "metrics.jsonl"))
    got, want = sharded / f"step_{STEPS}", gathered / f"step_{STEPS}"
    assert (got / "dcp" / ".metadata").is_file()
    reference = logits(want, IDS)
    assert rel_diff(logits(got, IDS), reference) <= TOL  # the merged model
    assert rel_diff(logits(folder / "Qwen3-tiny", IDS, adapter=got / "adapter"), reference) <= TOL
    assert {p.name for p in (got / "adapter").iterdir()} == {p.name for p in (want / "adapter").iterdir()}
