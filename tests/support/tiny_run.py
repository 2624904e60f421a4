"""A tiny but complete recipe setup for subprocess (`tune run`) tests.

Writes into a folder: a random ``tiny_llama`` checkpoint in HF format
(:func:`helpers.write_tiny_hf_checkpoint`) with the real SmolLM2 tokenizer
files beside it, an Alpaca-format dataset with varied lengths
(:func:`tiny_setup.write_dataset`), and a YAML config derived from the shipped
single-device config. A recipe run on it takes seconds, so resume and failure
tests can afford several runs.
"""

from pathlib import Path

from omegaconf import OmegaConf

from tests.support.helpers import copy_smollm2_tokenizer, tiny_recipe_config, write_tiny_hf_checkpoint
from tests.support.tiny_setup import write_dataset


def make_tiny_run(root: Path, assets: Path, n_samples: int = 24, **overrides) -> Path:
    """Write checkpoint, data and config under ``root``; return the config path.

    ``overrides`` are set on the config (dotted keys allowed).
    """
    ckpt = root / "ckpt"
    write_tiny_hf_checkpoint(ckpt)
    copy_smollm2_tokenizer(assets, ckpt)
    write_dataset(root / "data.json", n_samples)
    cfg = tiny_recipe_config("configs/smollm2/135M_full_single_device.yaml",
                             {"_component_": "torchtune_ext.model.builders.tiny_llama"}, assets, ckpt, root / "out")
    cfg.tokenizer.path = str(ckpt)
    cfg.dataset.data_files = str(root / "data.json")  # all of it (tiny_recipe_config: split train)
    cfg.max_steps_per_epoch = None
    cfg.lr_scheduler.num_warmup_steps = 1
    cfg.optimizer.lr = 1e-3
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    path = root / "config.yaml"
    OmegaConf.save(cfg, path)
    return path


