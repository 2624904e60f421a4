"""Config schema: defaults, type checks, and errors that name the key."""

import logging

import pytest
from omegaconf import OmegaConf

from torchtune_ext.config import COMMON_KEYS, ConfigError, validate


@pytest.fixture
def cfg(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"x")
    data = tmp_path / "data.json"
    data.write_text("[]")
    return OmegaConf.create({
        "output_dir": str(tmp_path / "out"),
        "model": {"_component_": "m"},
        "tokenizer": {"_component_": "t", "path": str(ckpt)},
        "dataset": {"_component_": "d", "source": "json", "data_files": str(data)},
        "checkpointer": {"_component_": "c", "checkpoint_dir": str(ckpt), "checkpoint_files": ["model.safetensors"]},
        "optimizer": {"_component_": "o"},
    })


def test_defaults_are_filled(cfg):
    out = validate(cfg)
    for key, spec in COMMON_KEYS.items():
        assert key in out
    assert out.gradient_accumulation_steps == 1 and out.backward_once_per_step is True
    assert out.loss._component_ == "torchtune_ext.loss.SummedCrossEntropyLoss"
    assert "batch_size" not in cfg  # input untouched


@pytest.mark.parametrize("key", ["gradient_accumulation_steps", "batch_size", "epochs"])
@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_positive_integers(cfg, key, value):
    cfg[key] = value
    with pytest.raises(ConfigError, match=f"'{key}'.*positive integer"):
        validate(cfg)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_backward_once_per_step_must_be_boolean(cfg, value):
    cfg.backward_once_per_step = value
    with pytest.raises(ConfigError, match="'backward_once_per_step'.*true or false"):
        validate(cfg)


def test_unknown_key_warns_with_closest_match(cfg, caplog):
    cfg.gradient_acumulation_steps = 4
    with caplog.at_level(logging.WARNING):
        validate(cfg)
    assert "gradient_acumulation_steps" in caplog.text and "Did you mean 'gradient_accumulation_steps'" in caplog.text


def test_missing_required_key(cfg):
    del cfg["optimizer"]
    with pytest.raises(ConfigError, match="'optimizer'.*required"):
        validate(cfg)


def test_missing_bundled_asset_names_download_command(cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg.checkpointer.checkpoint_dir = "assets/SmolLM2-135M-Instruct"
    with pytest.raises(ConfigError, match="checkpointer.checkpoint_dir.*python -m torchtune_ext.download"):
        validate(cfg)


def test_missing_dataset_file(cfg):
    cfg.dataset.data_files = "/nonexistent/data.json"
    with pytest.raises(ConfigError, match="'dataset.data_files'.*/nonexistent/data.json"):
        validate(cfg)


def test_missing_checkpoint_file(cfg):
    cfg.checkpointer.checkpoint_files = ["model.safetensors", "other.safetensors"]
    with pytest.raises(ConfigError, match="checkpointer.checkpoint_files.*other.safetensors"):
        validate(cfg)


def test_output_dir_is_a_file(cfg, tmp_path):
    (tmp_path / "file").write_text("")
    cfg.output_dir = str(tmp_path / "file")
    with pytest.raises(ConfigError, match="'output_dir'.*not a directory"):
        validate(cfg)


def test_dtype_and_device_choices(cfg):
    cfg.dtype = "fp16"
    with pytest.raises(ConfigError, match="'dtype'.*fp32, bf16"):
        validate(cfg)


def test_null_component_means_off(cfg):
    cfg.metric_logger = {"_component_": None, "project": "p"}  # what `metric_logger=null` produces
    cfg.lr_scheduler = None
    out = validate(cfg)
    from torchtune_ext.config import enabled

    assert enabled(out.metric_logger) is None and enabled(out.lr_scheduler) is None
    cfg.model = {"_component_": None}
    with pytest.raises(ConfigError, match="'model'"):
        validate(cfg)
