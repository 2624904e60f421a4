"""Config schema: defaults, type checks, and errors that name the key."""

import logging

import pytest
from omegaconf import OmegaConf

from torchtune_ext.config import COMMON_KEYS, ConfigError, validate


def test_defaults_are_filled(cfg):
    out = validate(cfg)
    for key, spec in COMMON_KEYS.items():
        assert key in out
    assert out.gradient_accumulation_steps == 1 and out.backward == "auto"
    assert out.loss._component_ == "torchtune_ext.train.loss.SummedCrossEntropyLoss"
    assert "batch_size" not in cfg  # input untouched


@pytest.mark.parametrize("key", ["gradient_accumulation_steps", "batch_size", "epochs"])
@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_positive_integers(cfg, key, value):
    cfg[key] = value
    with pytest.raises(ConfigError, match=f"'{key}'.*positive integer"):
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


def test_output_folders_under_a_file_are_refused_naming_their_key(cfg, tmp_path):
    """torchtune creates profiler.output_dir at setup, after the model has loaded: a NotADirectoryError traceback."""
    (tmp_path / "file").write_text("")
    cfg.output_dir = str(tmp_path / "file" / "out")
    with pytest.raises(ConfigError, match=r"^config key 'output_dir': '.*/file/out' cannot be created: "
                                          r"'.*/file' is a file"):
        validate(cfg)
    cfg.output_dir = str(tmp_path / "out")
    cfg.profiler = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": True,
                    "output_dir": str(tmp_path / "file" / "x" / "profiles")}
    with pytest.raises(ConfigError, match=r"^config key 'profiler.output_dir': .* '.*/file' is a file"):
        validate(cfg)
    cfg.profiler.enabled = False  # not created when off
    validate(cfg)


@pytest.mark.parametrize("key,value,words", [
    ("active_steps", 0, "expected an integer >= 1 or null, got 0"),
    ("wait_steps", -1, "expected an integer >= 0 or null, got -1"),
    ("num_cycles", "abc", "expected an integer >= 0 or null, got 'abc'"),
    ("with_stack", "yes", "expected true or false, got 'yes'"),
])
def test_profiler_values_torch_would_assert_on_later(cfg, key, value, words):
    cfg.profiler = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": True, key: value}
    with pytest.raises(ConfigError, match=f"^config key 'profiler.{key}': {words}$"):
        validate(cfg)
    cfg.profiler = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": True, "wait_steps": 0,
                    "warmup_steps": 0, "active_steps": 1, "num_cycles": 0, "with_stack": False}
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


# Validation keys (torchtune_ext.run.evaluate)

def test_validation_is_off_by_default_and_batch_size_val_follows_batch_size(cfg):
    cfg.batch_size = 6
    out = validate(cfg)
    assert out.dataset_val is None and out.run_val_every_n_steps is None and out.run_val_at_start is False
    assert out.batch_size_val == 6 and out.max_val_samples is None


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_run_val_every_n_steps_must_be_a_positive_integer(cfg, value):
    cfg.dataset_val = dict(cfg.dataset)
    cfg.run_val_every_n_steps = value
    with pytest.raises(ConfigError, match="'run_val_every_n_steps'.*positive integer.*or null for no validation"):
        validate(cfg)


@pytest.mark.parametrize("key,value", [("run_val_every_n_steps", 5), ("run_val_at_start", True)])
def test_validation_needs_dataset_val(cfg, key, value):
    cfg[key] = value
    with pytest.raises(ConfigError, match=f"'dataset_val'.*required by {key}"):
        validate(cfg)


def test_missing_dataset_val_file_is_checked_when_validation_is_on(cfg, caplog):
    cfg.dataset_val = [dict(cfg.dataset), {**cfg.dataset, "data_files": "/nonexistent/val.json"}]
    with caplog.at_level(logging.INFO):
        validate(cfg)  # torchtune's convention: dataset_val alone does not turn validation on
    assert "no validation during training" in caplog.text
    cfg.run_val_every_n_steps = 10
    with pytest.raises(ConfigError, match=r"'dataset_val\[1\].data_files'.*/nonexistent/val.json"):
        validate(cfg)
    cfg.dataset_val = {"source": "json"}
    with pytest.raises(ConfigError, match="'dataset_val'.*_component_"):
        validate(cfg)


def test_the_no_validation_line_is_printed_once_per_job(cfg, caplog, monkeypatch):
    """validate runs on every rank under torchrun: the line comes from rank 0 only, not once per rank."""
    cfg.dataset_val = dict(cfg.dataset)
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            validate(cfg.copy())
        assert ("no validation during training" in caplog.text) == said, rank


@pytest.mark.parametrize("other,ours", [("val_batch_size", "batch_size_val"),
                                        ("max_validation_steps", "max_val_samples"),
                                        ("val_dataset", "dataset_val")])
def test_other_tools_names_point_to_ours(cfg, caplog, other, ours):
    cfg[other] = 4
    with caplog.at_level(logging.WARNING):
        validate(cfg)
    assert f"Did you mean '{ours}'" in caplog.text


def test_config_for_evaluation_needs_no_training_keys(cfg, tmp_path):
    del cfg["optimizer"]
    cfg.output_dir = str(tmp_path / "file")
    (tmp_path / "file").write_text("")  # not a usable output_dir, and not needed to evaluate
    out = validate(cfg, evaluate_on="dataset")
    assert out.batch_size_val == out.batch_size
    with pytest.raises(ConfigError, match="'dataset_val'.*required to evaluate"):
        validate(cfg, evaluate_on="dataset_val")


@pytest.mark.parametrize("change,message", [
    ({}, "needs max_tokens_per_micro_batch"),
    ({"max_tokens_per_micro_batch": 4096, "dataset": {"packed": True}}, "packed already"),
    ({"max_tokens_per_micro_batch": 4096, "collate_fn": "torchtune.data.padded_collate"}, "collate_fn"),
])
def test_pack_micro_batches_needs_a_budget_and_unpacked_data(cfg, change, message):
    bad = OmegaConf.merge(cfg, {"pack_micro_batches": True}, change)
    with pytest.raises(ConfigError, match=f"pack_micro_batches.*{message}"):
        validate(bad)
    assert validate(OmegaConf.merge(cfg, {"pack_micro_batches": True, "max_tokens_per_micro_batch": 4096})
                    ).pack_micro_batches is True
