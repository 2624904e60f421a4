"""Data and sequence-length mistakes found before training (issue 33: F7, F12).

Each one is a ConfigError (one line, exit 2) raised before the model loads, naming the key or the file.
An unreadable file and the recipe's line through ``tune run``: tests/integration/test_data_input.py.
"""

import json

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ext.config import ConfigError, validate
from torchtune_ext.data import build_dataset, build_step_loader
from torchtune_ext.run.preflight import check_components, model_max_seq_len

CPU = torch.device("cpu")
GOOD = {"instruction": "say yes", "input": "", "output": "yes"}


@pytest.fixture
def tiny_cfg(tiny_run):
    return lambda *overrides: validate(OmegaConf.merge(OmegaConf.load(tiny_run()), OmegaConf.from_dotlist(overrides)))


# ------------------------------------------------------------------ F7: sequence length
def test_tokenizer_max_seq_len_above_the_models_limit(tiny_cfg):
    """torchtune's decoder refuses a longer input only at the first forward, after W&B and the logs started."""
    with pytest.raises(ConfigError, match=r"'tokenizer.max_seq_len'.*256 is more than the model's max_seq_len=128 "
                                          r"\(torchtune_ext.model.builders.tiny_llama\).*tokenizer.max_seq_len=128"):
        check_components(tiny_cfg("tokenizer.max_seq_len=256", "model.max_seq_len=128"), CPU)
    check_components(tiny_cfg("tokenizer.max_seq_len=128", "model.max_seq_len=128"), CPU)  # equal: fits


def test_the_models_limit_comes_from_the_builder_when_the_config_leaves_it_out(tiny_cfg):
    # tiny_llama's own default is 2048; the config does not name max_seq_len
    with pytest.raises(ConfigError, match=r"'tokenizer.max_seq_len'.*9000 is more than the model's "
                                          r"max_seq_len=2048"):
        check_components(tiny_cfg("tokenizer.max_seq_len=9000"), CPU)


def test_samples_longer_than_the_model_without_truncation(tiny_run, tmp_path):
    """tokenizer.max_seq_len=null truncates nothing: a sample longer than the model's limit is named."""
    from torchtune import config as tt_config

    cfg = OmegaConf.load(tiny_run())
    data = tmp_path / "long.json"
    data.write_text(json.dumps([GOOD, dict(GOOD, output="word " * 200), GOOD]))
    cfg.dataset.data_files = str(data)
    cfg.tokenizer.max_seq_len = None
    cfg.model.max_seq_len = 64
    cfg = validate(cfg)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    with pytest.raises(ConfigError, match=r"'dataset'.*sample 1 has \d+ tokens, more than the model's "
                                          r"max_seq_len=64.*set tokenizer.max_seq_len=64"):
        build_step_loader(cfg, tokenizer, seed=0, ignore_index=-100, model_max_seq_len=model_max_seq_len(cfg.model))
    cfg.model.max_seq_len = 2048
    assert len(build_step_loader(cfg, tokenizer, seed=0, ignore_index=-100)) == 3


# ------------------------------------------------------------------ F12: data files
def _with_data(tiny_run, path, **overrides):
    cfg = OmegaConf.load(tiny_run())
    cfg.dataset.data_files = str(path)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_an_empty_data_file_is_named_before_anything_loads(tiny_run, tmp_path):
    """A 0-byte file made the datasets library raise a bare StopIteration."""
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match=f"'dataset.data_files': '{empty}' is empty \\(0 bytes\\)"):
        validate(_with_data(tiny_run, empty))


@pytest.mark.parametrize("content,name", [(b"[]", "records.json"), (b"\n", "blank.json")])
def test_a_data_file_without_records_is_named(tiny_run, tmp_path, content, name):
    from torchtune import config as tt_config

    path = tmp_path / name
    path.write_bytes(content)
    cfg = validate(_with_data(tiny_run, path))
    with pytest.raises(ConfigError, match=f"'dataset'.*'{path}' has no records"):
        build_dataset(cfg.dataset, tt_config.instantiate(cfg.tokenizer))


@pytest.mark.parametrize("name", ["records.jsonl", "records.json"])
def test_invalid_json_is_named_by_its_line_and_column_in_the_file(tiny_run, tmp_path, name):
    """Line 500 of a JSON Lines file was "row 97" (an Arrow block's row) and "position 1682" (a pandas offset);
    a JSON list broken on its line 300 likewise. The file's own line and column are named."""
    from torchtune import config as tt_config

    records = [json.dumps(dict(GOOD, output="yes " * (i % 40))) for i in range(600)]
    broken = 'Hmm"}'  # an unquoted word where a key must be
    path = tmp_path / name
    if name.endswith(".jsonl"):
        records[499] = records[499][:-1] + ", " + broken
        path.write_text("\n".join(records) + "\n")
        column = len(records[499]) - len(broken) + 1
        where = f"line 500, column {column}"
    else:
        records[298] = records[298][:-1] + ", " + broken
        path.write_text("[\n" + ",\n".join(records) + "\n]\n")
        where = f"line 300, column {len(records[298]) - len(broken) + 1}"
    cfg = validate(_with_data(tiny_run, path))
    with pytest.raises(ConfigError) as err:
        build_dataset(cfg.dataset, tt_config.instantiate(cfg.tokenizer))
    assert str(err.value).startswith(f"config key 'dataset': '{path}' is not valid JSON at {where}: Expecting "
                                     "property name enclosed in double quotes; fix that line")


def test_a_dataset_with_no_trainable_token_at_all_stops_before_training(tiny_run):
    """Packs of 8 tokens cut every answer away: every step would be skipped, and the run ended with exit 0."""
    from torchtune import config as tt_config

    cfg = validate(_with_data(tiny_run, OmegaConf.load(tiny_run()).dataset.data_files,
                              **{"dataset.packed": True, "tokenizer.max_seq_len": 8}))
    with pytest.raises(ConfigError, match=r"'dataset'.*no trainable token in any of its 24 documents.*"
                                          r"every optimizer step would be skipped"):
        build_step_loader(cfg, tt_config.instantiate(cfg.tokenizer), seed=0, ignore_index=-100)


def test_dataset_val_null_on_the_command_line_turns_the_validation_set_off(tiny_run):
    """torchtune's parser reads `dataset_val=null` as dataset_val._component_=null (its shorthand for a
    component, as metric_logger=null): that is "no validation set", not a malformed one."""
    import argparse

    from torchtune.config._utils import _merge_yaml_and_cli_args

    yaml = OmegaConf.to_container(OmegaConf.load(tiny_run()))
    yaml["dataset_val"] = dict(yaml["dataset"])
    cfg = _merge_yaml_and_cli_args(argparse.Namespace(**yaml), ["dataset_val=null"])
    assert cfg.dataset_val._component_ is None
    assert validate(cfg).dataset_val is None
    cfg.run_val_every_n_steps = 2
    with pytest.raises(ConfigError, match="'dataset_val': is required by run_val_every_n_steps"):
        validate(cfg)
