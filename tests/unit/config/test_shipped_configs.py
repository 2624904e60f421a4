"""What the configs in configs/ promise a new user (issue 33, U2 and U3).

* A config with a validation set validates during training (run_val_every_n_steps set), so no
  default run prints "dataset_val is set but run_val_every_n_steps is null".
* Its validation records are held out of training: the records of dataset_val and of dataset,
  loaded as the recipe loads them (the datasets library's split slicing), share none. A record
  that occurs more than once in the source file may sit on both sides, but no record is used
  more often than the file holds it.
* Every config names the backward mode with the `backward` key, and its run starts without a
  line about the older key.
"""

import collections
import functools
import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT
from torchtune_ext.config import DISTILLATION_KEYS, DISTRIBUTED_KEYS, LORA_KEYS, ConfigError, validate
from torchtune_ext.config.preference import PREFERENCE_KEYS

CONFIGS = sorted((REPO_ROOT / "configs").rglob("*.yaml"))
IDS = [str(p.relative_to(REPO_ROOT / "configs")) for p in CONFIGS]
WITH_VALIDATION = [p for p in CONFIGS if OmegaConf.load(p).get("dataset_val") is not None]


def _schema(path: Path):
    text = path.read_text()
    keys = {}
    if "lora_finetune" in text.split("\n\n")[0] or "lora_dpo" in text.split("\n\n")[0]:
        keys.update(LORA_KEYS)
    if "knowledge_distillation" in text.split("\n\n")[0]:  # a LoRA student: the LoRA keys too
        keys.update(DISTILLATION_KEYS)
        if "lora" in path.name:
            keys.update(LORA_KEYS)
    if "_distributed.py" in text.split("\n\n")[0]:
        keys.update(DISTRIBUTED_KEYS)
    if "_dpo_" in text.split("\n\n")[0]:
        keys.update(PREFERENCE_KEYS)
    return keys


def test_some_shipped_configs_validate():
    # the SmolLM2 configs (Alpaca and Shakespeare, full and LoRA, 1 and 2 ranks; DPO) and the Hugging Face ones
    smollm2 = [p for p in CONFIGS if p.parent.name == "smollm2"]
    # 6 fine-tuning, 3 distillation
    assert len([p for p in smollm2 if "_dpo" not in p.name]) == 9 and set(smollm2) <= set(WITH_VALIDATION)
    assert all(p in WITH_VALIDATION for p in CONFIGS if p.parent.name in ("hf", "qwen3", "gemma3", "qwen3_moe"))


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_a_validation_set_is_used(path, tmp_path, caplog):
    cfg = OmegaConf.load(path)
    if cfg.get("dataset_val") is not None:
        assert isinstance(cfg.get("run_val_every_n_steps"), int) and cfg.run_val_every_n_steps > 0
    assert "backward" in cfg and "backward_once_per_step" not in cfg
    cfg.output_dir = str(tmp_path / "out")
    cfg.checkpointer.output_dir = cfg.output_dir
    if OmegaConf.is_missing(cfg, "model_dir"):  # configs/hf: the one key left to the command line
        cfg.model_dir = str(tmp_path / "model")
    if OmegaConf.is_missing(cfg, "teacher_model_dir"):  # configs/hf KD: the teacher's folder too
        cfg.teacher_model_dir = str(tmp_path / "teacher")
    with caplog.at_level(logging.INFO):
        try:
            validate(cfg, extra_keys=_schema(path))
        except ConfigError as err:  # weights not downloaded: checked after the lines below would be said
            assert err.key.startswith("checkpointer") or err.key == "model_dir", err
    assert "run_val_every_n_steps is null" not in caplog.text
    assert "backward" not in caplog.text


def _records(cfg_dataset):
    """The dataset's records as the recipe loads them (torchtune hands these keys to datasets.load_dataset)."""
    given = OmegaConf.to_container(cfg_dataset, resolve=True)
    kwargs = {k: given[k] for k in ("data_files", "split", "name", "data_dir") if given.get(k) is not None}
    return list(_load_records(given["source"], json.dumps(kwargs, sort_keys=True)))


@functools.lru_cache(maxsize=None)
def _load_records(source, kwargs_json):
    """Loaded once per (source, keys): the full and LoRA configs of a dataset share its file and its slices."""
    import datasets

    rows = datasets.load_dataset(source, **json.loads(kwargs_json))
    return tuple(json.dumps(row, sort_keys=True) for row in rows)


@pytest.mark.parametrize("path", WITH_VALIDATION, ids=[str(p.relative_to(REPO_ROOT / "configs"))
                                                       for p in WITH_VALIDATION])
def test_validation_records_are_held_out_of_training(path, smollm2_assets):
    cfg = OmegaConf.load(path)
    train, val = _records(cfg.dataset), _records(cfg.dataset_val)
    whole = collections.Counter(_records(OmegaConf.merge(cfg.dataset, {"split": "train"})))
    assert val and len(train) > 10 * len(val)
    used = collections.Counter(train) + collections.Counter(val)
    # no record trains and validates beyond the copies the file holds of it
    assert not [r for r, n in used.items() if n > whole[r]]
    # what both sides share is only text the file repeats (the Shakespeare stage directions)
    shared = set(train) & set(val)
    assert all(whole[r] > 1 for r in shared)
    assert len(shared) <= 0.05 * len(set(val))


def test_the_overlap_check_catches_the_old_configs(smollm2_assets):
    """Before issue 33 the Alpaca configs trained on the whole file, dataset_val included."""
    cfg = OmegaConf.load(REPO_ROOT / "configs/smollm2/135M_full_single_device.yaml")
    train = collections.Counter(_records(OmegaConf.merge(cfg.dataset, {"split": "train"})))
    val = collections.Counter(_records(cfg.dataset_val))
    assert len(val) == 50 and sum(1 for r, n in (train + val).items() if n > train[r]) == 50
