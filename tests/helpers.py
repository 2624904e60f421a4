"""Shared test utilities: tiny models, synthetic samples, collation."""

import copy
from typing import Dict, List, Sequence

import torch
from torchtune.data import padded_collate_sft
from torchtune.models.llama3_2 import llama3_2

IGNORE = -100
VOCAB = 128


def tiny_model(seed: int = 0, vocab_size: int = VOCAB) -> torch.nn.Module:
    """A 2-layer random llama3_2 decoder (fp32, CPU) for exactness tests."""
    torch.manual_seed(seed)
    return llama3_2(
        vocab_size=vocab_size, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        max_seq_len=128, intermediate_dim=64, rope_base=10_000, scale_factor=1,
    )


def text_samples(lengths: Sequence[int], seed: int = 0) -> List[Dict[str, List[int]]]:
    """Text-completion samples: every label trainable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append({"tokens": tokens, "labels": list(tokens)})
    return out


def instruct_samples(prompt_lengths: Sequence[int], answer_lengths: Sequence[int], seed: int = 1):
    """Instruct samples: prompt labels masked with IGNORE, answer trainable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, a in zip(prompt_lengths, answer_lengths):
        tokens = torch.randint(3, VOCAB, (p + a,), generator=g).tolist()
        out.append({"tokens": tokens, "labels": [IGNORE] * p + tokens[p:]})
    return out


def collate(samples, pad_to: int = 0):
    """torchtune's SFT collator, optionally right-padded to ``pad_to`` columns."""
    batch = padded_collate_sft(samples, padding_idx=0, ignore_idx=IGNORE)
    extra = pad_to - batch["tokens"].size(1)
    if extra > 0:
        batch["tokens"] = torch.nn.functional.pad(batch["tokens"], (0, extra), value=0)
        batch["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=IGNORE)
    return batch


def windows(samples, batch_size: int, grad_accum: int, pad_to: int = 0):
    """Split samples in order into optimizer-step windows of micro-batches."""
    micro = [collate(samples[i:i + batch_size], pad_to) for i in range(0, len(samples), batch_size)]
    return [micro[i:i + grad_accum] for i in range(0, len(micro), grad_accum)]


def clone(model):
    return copy.deepcopy(model)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def run_tune(*args: str, timeout: int = 600, extra_env=None):
    """Run ``tune run ...`` from the repository root, as a user types it.

    PYTHONPATH points at this checkout so a worktree tests its own code.
    Returns the CompletedProcess (text output, not raising on failure).
    """
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), WANDB_SILENT="true")
    env.update(extra_env or {})
    return subprocess.run(
        ["tune", "run", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def read_jsonl(path):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def synthetic_sft_dataset(tokenizer=None, num_samples: int = 12, seed: int = 3):
    """A list dataset of instruct samples with varied prompt and answer lengths.

    Usable as a config ``_component_`` (``helpers.synthetic_sft_dataset``):
    torchtune passes the tokenizer first, which is not needed here.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 12, (num_samples,), generator=g).tolist()
    answers = torch.randint(1, 20, (num_samples,), generator=g).tolist()
    return instruct_samples(prompts, answers, seed=seed)


TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 2048, "vocab_size": 49152, "tie_word_embeddings": True,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}


def write_tiny_hf_checkpoint(folder, seed: int = 0):
    """A random ``torchtune_ext.models.tiny_llama()`` saved as an HF checkpoint folder.

    Loads with ``FullModelHFCheckpointer(model_type="LLAMA3_2")`` exactly like
    the SmolLM2 checkpoint and takes the real SmolLM2 tokenizer (same
    vocabulary), so recipe tests run the real code path in seconds.
    """
    import json
    import pathlib

    from safetensors.torch import save_file
    from torchtune.models.convert_weights import tune_to_hf

    from torchtune_ext.models import tiny_llama

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hf = tune_to_hf(tiny_llama().state_dict(), num_heads=4, num_kv_heads=2, dim=64)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY_HF_CONFIG, indent=1))
