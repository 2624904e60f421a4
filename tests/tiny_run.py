"""A tiny but complete recipe setup for fast end-to-end tests.

Writes into a folder: a random ``tiny_llama`` checkpoint in HF format (what
the torchtune HF checkpointer loads), the real SmolLM2 tokenizer files, an
Alpaca-format JSON dataset with varied lengths, and a YAML config derived
from the shipped single-device config with those paths. A recipe run on it
takes seconds, so resume and failure tests can afford several runs.
"""

import json
import random
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torchtune.models import convert_weights

from helpers import REPO_ROOT
from torchtune_ext.models import tiny_llama

TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128)


def write_checkpoint(folder: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = tiny_llama(**TINY)
    head_dim = TINY["embed_dim"] // TINY["num_heads"]
    hf = convert_weights.tune_to_hf(
        model.state_dict(), num_heads=TINY["num_heads"], num_kv_heads=TINY["num_kv_heads"],
        dim=TINY["embed_dim"], head_dim=head_dim,
    )
    save_file({k: v.contiguous() for k, v in hf.items()}, folder / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": TINY["embed_dim"],
        "intermediate_size": TINY["intermediate_dim"], "num_hidden_layers": TINY["num_layers"],
        "num_attention_heads": TINY["num_heads"], "num_key_value_heads": TINY["num_kv_heads"],
        "head_dim": head_dim, "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)


def write_alpaca(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = "the cat sat on a mat while seven dogs ran past quickly into old green fields".split()
    records = []
    for i in range(n):
        say = lambda k: " ".join(rng.choice(words) for _ in range(k))
        records.append({"instruction": say(rng.randint(2, 20)), "input": say(rng.randint(0, 6)),
                        "output": say(rng.randint(1, 40))})
    path.write_text(json.dumps(records))


def make_tiny_run(root: Path, assets: Path, n_samples: int = 24, **overrides) -> Path:
    """Write checkpoint, data and config under ``root``; return the config path.

    ``overrides`` are set on the config (dotted keys allowed).
    """
    write_checkpoint(root / "ckpt", assets / "SmolLM2-135M-Instruct")
    write_alpaca(root / "data.json", n_samples)
    cfg = OmegaConf.load(REPO_ROOT / "configs/smollm2/135M_full_single_device.yaml")
    cfg.output_dir = str(root / "out")
    cfg.model = {"_component_": "torchtune_ext.models.tiny_llama", **TINY}
    cfg.tokenizer.path = str(root / "ckpt")
    cfg.tokenizer.max_seq_len = 128
    cfg.dataset.data_files = str(root / "data.json")
    cfg.checkpointer.checkpoint_dir = str(root / "ckpt")
    cfg.metric_logger = None
    cfg.max_steps_per_epoch = None
    cfg.lr_scheduler.num_warmup_steps = 1
    cfg.optimizer.lr = 1e-3
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    path = root / "config.yaml"
    OmegaConf.save(cfg, path)
    return path
