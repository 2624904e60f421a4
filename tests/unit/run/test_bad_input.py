"""Bad input found before anything heavy runs, as one ConfigError/UserError naming the key or file.

Through ``tune run`` in a process of its own: tests/integration/test_bad_input.py.
"""

import json
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ext.checkpoint import CheckpointManager
from torchtune_ext.config import ConfigError, UserError, validate
from torchtune_ext.data import build_dataset
from torchtune_ext.run.control.command_line import check_command_line
from torchtune_ext.run.preflight import check_components
from torchtune_ext.run.resume import check_resume_point

IGNORE = -100

CPU = torch.device("cpu")


# ----------------------------------------------------------------- command line
@pytest.fixture
def yaml_file(tmp_path):
    def write(text):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return str(path)

    return write


def test_yaml_syntax_error_names_file_line_and_column(yaml_file):
    path = yaml_file("batch_size: 2\noptimizer:\n  lr: [1, 2\nepochs: 1\n")
    with pytest.raises(UserError, match=f"^--config '{path}', line 4, column 7: did not find expected ',' or "
                       r"'\]' \(while parsing a flow sequence at line 3, column 7\)$"):
        check_command_line(["--config", path])
    path = yaml_file("optimizer:\n  lr: 1\n   eps: 2\n")  # no context: the problem's place only
    with pytest.raises(UserError, match=f"^--config '{path}', line 3, column 7: mapping values are not allowed "
                       "in this context$"):
        check_command_line(["--config", path])


@pytest.mark.parametrize("argv,words", [
    (["--config", "/nonexistent.yaml"], ["'/nonexistent.yaml' does not exist"]),
    (["--config", "FILE", "~model"], ["'~model'", "component", "cannot remove"]),
    (["--config", "FILE", "~nothing"], ["'~nothing'", "not a key"]),
    (["--config", "FILE", "batch_size"], ["'batch_size'", "expected key=value"]),
    (["--config", "FILE", "--batch_size=3"], ["'--batch_size=3'", "only --config"]),
    # torchtune's parser would read the last --config only: two files are refused, not half-used
    (["--config", "FILE", "--config", "/nonexistent.yaml"],
     ["--config is given 2 times ('FILE', '/nonexistent.yaml'): only one file is read, not a merge"]),
    (["--config", "/nonexistent.yaml", "--config=FILE"], ["given 2 times", "give one --config"]),
    (["--config", "FILE", "--config=FILE", "~nothing"], ["'~nothing'", "not a key of 'FILE'"]),
], ids=["missing", "remove-component", "remove-unknown", "no-value", "flag", "two-configs",
        "two-configs-equals", "same-config-twice"])
def test_command_line_mistakes(yaml_file, argv, words):
    path = yaml_file("model:\n  _component_: torchtune_ext.model.builders.tiny_llama\nbatch_size: 2\n")
    with pytest.raises(UserError) as err:
        check_command_line([path if a == "FILE" else a.replace("=FILE", f"={path}") for a in argv])
    for word in words:
        assert word.replace("FILE", path) in str(err.value)
    check_command_line(["--config", path, "batch_size=3", "~batch_size", "model.embed_dim=32"])  # all fine


# ------------------------------------------------------------------- components
@pytest.fixture
def tiny_cfg(tiny_run):
    return lambda *overrides: validate(OmegaConf.merge(OmegaConf.load(tiny_run()), OmegaConf.from_dotlist(overrides)))


@pytest.mark.parametrize("override,key,words", [
    ("optimizer.lr=-1", "optimizer", ["torch.optim.AdamW", "Invalid learning rate: -1"]),
    ("optimizer.lr=abc", "optimizer.lr", ["expects a number", "'abc'"]),
    ("optimizer.betaz=[0.9,0.9]", "optimizer.betaz", ["not an argument of torch.optim.AdamW", "'betas'"]),
    ("lr_scheduler.num_warmup_steps=abc", "lr_scheduler.num_warmup_steps", ["expects a number"]),
    ("model._component_=torchtune_ext.model.no_such_model", "model._component_",
     ["'torchtune_ext.model' has no attribute 'no_such_model'"]),
    ("tokenizer._component_=no_such_package.tok", "tokenizer._component_", ["no module 'no_such_package'"]),
    ("model.num_heads=3", "model", ["cannot build this model", "num_heads"]),
    # refused as a loss, not for an argument (num_output_chunks) that only ours takes
    ("loss._component_=torch.nn.MSELoss", "loss", ["torch.nn.MSELoss cannot be normalized exactly"]),
], ids=["lr-negative", "lr-text", "unknown-arg", "warmup-text", "no-component", "no-package", "builder",
        "not-cross-entropy"])
def test_components_are_checked_before_loading(tiny_cfg, override, key, words):
    with pytest.raises(ConfigError) as err:
        check_components(tiny_cfg(override), CPU)
    assert str(err.value).startswith(f"config key '{key}'")
    for word in words:
        assert word in str(err.value)


def test_a_good_config_passes(tiny_cfg):
    check_components(tiny_cfg(), CPU)
    # torchtune's loss runs as ours, which takes num_output_chunks=auto (the shipped configs' value)
    check_components(tiny_cfg("loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss",
                              "loss.num_output_chunks=auto"), CPU)


WANDB = "metric_logger._component_=torchtune.training.metric_logging.WandBLogger"


@pytest.mark.parametrize("override,words", [
    ("metric_logger.mode=ofline", ["'metric_logger.mode': W&B rejects 'ofline': Input should be 'online', 'offline'"]),
    ("metric_logger.project=123", ["'metric_logger.project': W&B rejects 123: Input should be a valid string"]),
    ("metric_logger.tags=[1,[2]]", ["'metric_logger.tags': W&B rejects [1, [2]]"]),
    # refused by W&B's own validator (UsageError), not by pydantic
    ("metric_logger.project=a/b", ["'metric_logger.project': W&B rejects 'a/b': Invalid project name 'a/b': "
                                   "cannot contain characters"]),
    ("metric_logger.project=a#b", ["'metric_logger.project': W&B rejects 'a#b'", "found '#'"]),
], ids=["mode", "project", "tags", "project-slash", "project-hash"])
def test_wandb_settings_are_checked_before_loading(tiny_cfg, override, words):
    """wandb.init validates its settings only when the logger starts, after the data check and the model load."""
    with pytest.raises(ConfigError) as err:
        check_components(tiny_cfg(WANDB, override), CPU)
    for word in words:
        assert word in str(err.value)
    check_components(tiny_cfg(WANDB, "metric_logger.mode=offline", "metric_logger.project=p",
                              "metric_logger.tags=[a,b]", "metric_logger.group=g"), CPU)


def test_log_model_takes_false_end_or_checkpoint_with_wandb_only(tiny_cfg):
    """metric_logger.log_model: a bad value names the key and the values it takes; another logger would take the
    key as an argument and ignore it; `end` needs the final checkpoint. All before anything loads."""
    with pytest.raises(ConfigError) as err:
        tiny_cfg(WANDB, "metric_logger.log_model=always")
    assert str(err.value).startswith("config key 'metric_logger.log_model': expected one of false, end, "
                                     "checkpoint (") and str(err.value).endswith("got 'always'")
    with pytest.raises(ConfigError, match="'metric_logger.log_model': end logs the final checkpoint, which "
                       "save_final_checkpoint=false leaves out"):
        tiny_cfg(WANDB, "metric_logger.log_model=end", "save_final_checkpoint=false")
    with pytest.raises(ConfigError, match=r"'metric_logger.log_model': only W&B's logger logs checkpoints as "
                       r"artifacts, not torchtune.training.metric_logging.DiskLogger"):
        check_components(tiny_cfg("metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
                                  "metric_logger.log_model=end"), CPU)
    for value in ("false", "end", "checkpoint"):
        check_components(tiny_cfg(WANDB, "metric_logger.mode=offline", f"metric_logger.log_model={value}"), CPU)
    # metric_logger=null on the command line: the key goes with the logger it belongs to
    check_components(tiny_cfg(WANDB, "metric_logger._component_=null", "metric_logger.log_model=end"), CPU)


def test_wandb_that_cannot_start_is_one_config_error(tiny_cfg, tmp_path, monkeypatch):
    """mode=online without an API key: wandb.init raises UsageError when the logger starts (setup rolls back)."""
    import wandb

    from torchtune_ext.run.metrics import build_metric_logger

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    cfg = tiny_cfg(WANDB, "metric_logger.mode=online", f"output_dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError, match=r"^config key 'metric_logger': W&B could not start a run \(UsageError: No "
                       r"API key configured. .*\); metric_logger.mode=offline logs without an account or network"):
        build_metric_logger(cfg, rank=0)


def test_metric_logger_log_dir_under_a_file_is_checked_before_loading(tiny_cfg, tmp_path):
    """The logger creates log_dir only when it starts, after the model has loaded."""
    (tmp_path / "afile").write_text("")
    for logger in (WANDB, "metric_logger._component_=torchtune.training.metric_logging.DiskLogger"):
        with pytest.raises(ConfigError, match=r"^config key 'metric_logger.log_dir': '.*/afile/logs' cannot be "
                           r"created: '.*/afile' is a file"):
            check_components(tiny_cfg(logger, f"metric_logger.log_dir={tmp_path / 'afile' / 'logs'}"), CPU)
    assert (tmp_path / "afile").is_file()
    check_components(tiny_cfg(WANDB, f"metric_logger.log_dir={tmp_path / 'logs'}"), CPU)
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("component", [[], ["profiler._component_=torchtune.training.setup_torch_profiler"]],
                         ids=["no-component", "component"])
def test_profiler_arguments_are_checked_before_loading(tiny_cfg, component):
    """torchtune_ext.run.diagnostics.build_profiler calls setup_torch_profiler with the section only after the model has
    loaded; the section may leave out its _component_."""
    with pytest.raises(ConfigError, match=r"^config key 'profiler.foo': is not an argument of "
                       r"torchtune.training.setup_torch_profiler$"):
        check_components(tiny_cfg(*component, "profiler.enabled=true", "profiler.foo=1"), CPU)
    with pytest.raises(ConfigError, match=r"^config key 'profiler.activ_steps': .*; did you mean 'active_steps'\?$"):
        check_components(tiny_cfg(*component, "profiler.enabled=true", "profiler.activ_steps=1"), CPU)
    check_components(tiny_cfg(*component, "profiler.enabled=true", "profiler.active_steps=1", "profiler.cpu=true"),
                     CPU)


def test_packed_rows_longer_than_the_model_takes(tiny_cfg):
    """pack_micro_batches builds rows up to the budget: one longer than the model's max_seq_len is refused."""
    cfg = tiny_cfg("pack_micro_batches=true", "max_tokens_per_micro_batch=4096", "model.max_seq_len=2048")
    with pytest.raises(ConfigError, match="'max_tokens_per_micro_batch'.*4096 tokens per packed row.*"
                                          "max_seq_len=2048; use at most 2048"):
        check_components(cfg, CPU)
    check_components(tiny_cfg("pack_micro_batches=true", "max_tokens_per_micro_batch=2048",
                              "model.max_seq_len=2048"), CPU)


def test_adapter_on_a_tied_output_projection(tiny_cfg):
    cfg = tiny_cfg()
    cfg.model = {"_component_": "torchtune_ext.model.builders.lora_tiny_llama", "lora_attn_modules": ["q_proj"],
                 "apply_lora_to_mlp": False, "apply_lora_to_output": True, "lora_rank": 4, "lora_alpha": 8}
    with pytest.raises(ConfigError, match="'model.apply_lora_to_output'.*token embedding \\(tied weights\\)") as err:
        check_components(cfg, CPU)
    assert "llama3.2" not in str(err.value)


# ------------------------------------------------------------------ checkpoints
def test_config_json_that_does_not_fit_the_weights(tiny_run):
    cfg = OmegaConf.load(tiny_run())
    ckpt = cfg.checkpointer.checkpoint_dir
    hf = json.loads(open(f"{ckpt}/config.json").read())
    hf["num_attention_heads"] = 8
    open(f"{ckpt}/config.json", "w").write(json.dumps(hf))
    manager = CheckpointManager(cfg.checkpointer, cfg.output_dir)
    with pytest.raises(ConfigError, match=f"'checkpointer.checkpoint_dir'.*do not fit '{ckpt}/config.json' "
                                          "\\(num_attention_heads=8, num_key_value_heads=2"):
        manager.load()


def test_truncated_base_weights_are_named(tiny_run):
    cfg = OmegaConf.load(tiny_run())
    weights = f"{cfg.checkpointer.checkpoint_dir}/model.safetensors"
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[:len(data) // 2])
    with pytest.raises(ConfigError, match=f"'checkpointer.checkpoint_dir'.*{weights}"):
        CheckpointManager(cfg.checkpointer, cfg.output_dir).load()


def test_truncated_base_weights_are_found_by_the_start_up_checks(tiny_run):
    """A download cut short is found by the file checks that run before the data check and any weight (the
    safetensors header lists more bytes than the file has); a file that is not safetensors at all too."""
    from torchtune_ext.config.files import check_input_files

    cfg = OmegaConf.load(tiny_run())
    weights = f"{cfg.checkpointer.checkpoint_dir}/model.safetensors"
    data = open(weights, "rb").read()
    check_input_files(cfg)
    open(weights, "wb").write(data[:-1])
    with pytest.raises(ConfigError, match=f"'checkpointer.checkpoint_dir'.*'{weights}' is cut short: "
                                          f"{len(data) - 1} bytes, its header lists {len(data)}"):
        check_input_files(cfg)
    open(weights, "wb").write(b"<html>rate limited</html>")
    with pytest.raises(ConfigError, match=f"'{weights}' is not a safetensors file"):
        check_input_files(cfg)


def test_resume_refuses_a_later_folder_without_manifest(tiny_run, caplog):
    cfg = OmegaConf.load(tiny_run())
    out = Path(cfg.output_dir)
    for name in ("step_1", "step_2", "step_5"):
        (out / name).mkdir(parents=True)
    (out / "step_2" / "checkpoint.json").write_text(json.dumps({"step": 2, "files": {}}))  # the only complete one
    cfg = validate(cfg)
    cfg.resume_from_checkpoint = True
    with pytest.raises(ConfigError, match="'output_dir'.*step_5' has no checkpoint.json.*save over it"):
        check_resume_point(cfg)
    (out / "step_5").rmdir()
    with caplog.at_level(logging.WARNING):
        check_resume_point(cfg)
    assert "step_1' has no checkpoint.json" in caplog.text


def test_resume_auto_continues_when_a_checkpoint_exists_and_starts_the_run_when_none_does(tiny_run, monkeypatch):
    """``resume_from_checkpoint: auto`` (for scheduler requeues and torchrun restarts, which run one command
    line from the first start on): a new run in an empty folder; the newest complete checkpoint once there
    is one; step folders that are no complete checkpoint are refused with what to do, for a new run too."""
    cfg = OmegaConf.load(tiny_run())
    out = Path(cfg.output_dir)
    cfg.resume_from_checkpoint = "auto"
    auto = validate(cfg)
    check_resume_point(auto)
    assert auto.resume_from_checkpoint is False
    (out / "step_1").mkdir(parents=True)
    for resume in ("auto", False):
        cfg.resume_from_checkpoint = resume
        with pytest.raises(ConfigError, match="'output_dir'.*holds step_<N> folders without checkpoint.json.*move "
                                              "them out of it or choose another output_dir"):
            check_resume_point(validate(cfg))
    (out / "step_2").mkdir()
    (out / "step_2" / "checkpoint.json").write_text(json.dumps({"step": 2, "files": {}}))
    cfg.resume_from_checkpoint = "auto"
    auto = validate(cfg)
    check_resume_point(auto)
    assert auto.resume_from_checkpoint is True
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    cfg.resume_from_checkpoint = False  # a restart of a job started without auto
    with pytest.raises(ConfigError, match="already holds checkpoints of a run; .*; this is torchrun's restart 1 of 3: "
                                          "launch with resume_from_checkpoint=auto"):
        check_resume_point(validate(cfg))
    cfg.resume_from_checkpoint = "yes"
    with pytest.raises(ConfigError, match="'resume_from_checkpoint'.*expected true, false or auto, got 'yes'"):
        validate(cfg)


# ------------------------------------------------------------------------- data
def records(tmp_path, rows, name="data.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture
def data_cfg(tiny_run, tmp_path):
    def make(rows):
        cfg = OmegaConf.load(tiny_run())
        cfg.dataset.data_files = str(records(tmp_path, rows))
        from torchtune import config as tt_config

        return cfg.dataset, tt_config.instantiate(cfg.tokenizer)  # max_seq_len 128

    return make


GOOD = {"instruction": "say yes", "input": "", "output": "yes"}


def test_records_without_the_dataset_columns(data_cfg):
    dataset_cfg, tokenizer = data_cfg([{"prompt": "a", "answer": "b"}] * 3)
    with pytest.raises(ConfigError, match="record 0 of .* has no column 'instruction' \\(its columns: prompt, "
                                          "answer\\).*dataset.column_map"):
        build_dataset(dataset_cfg, tokenizer)


def test_answers_cut_away_and_replacement_characters_are_counted(data_cfg, caplog):
    long_prompt = dict(GOOD, instruction="word " * 200)  # the answer is cut away at max_seq_len
    dataset_cfg, tokenizer = data_cfg([GOOD, long_prompt, GOOD, dict(GOOD, output="caf\ufffd"), long_prompt])
    with caplog.at_level(logging.WARNING):
        dataset, _ = build_dataset(dataset_cfg, tokenizer, data_errors="warn")
    assert len(dataset) == 5
    assert "2 samples whose answer is cut away entirely at tokenizer.max_seq_len=128" in caplog.text
    assert "(first: sample 1)" in caplog.text
    assert "1 sample with replacement characters (U+FFFD)" in caplog.text and "(first: sample 3)" in caplog.text
    with pytest.raises(ConfigError, match="'dataset'.*2 samples whose answer is cut away.*set data_errors=warn"):
        build_dataset(dataset_cfg, tokenizer, data_errors="error")


def test_clean_data_passes_with_data_errors_error(data_cfg, caplog):
    dataset_cfg, tokenizer = data_cfg([GOOD] * 3)
    with caplog.at_level(logging.WARNING):
        dataset, _ = build_dataset(dataset_cfg, tokenizer, data_errors="error")
    assert len(dataset) == 3 and "Data check" not in caplog.text


def test_invalid_utf8_names_the_line(tiny_run, tmp_path):
    from torchtune import config as tt_config

    cfg = OmegaConf.load(tiny_run())
    lines = [json.dumps(GOOD).encode()] * 3
    lines[2] = json.dumps(dict(GOOD, output="cafXX")).encode().replace(b"XX", b"\xe9")  # latin-1
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg.dataset.data_files = str(path)
    with pytest.raises(ConfigError, match=f"'{path}' is not valid UTF-8 \\(line 3, byte 0xE9\\)"):
        build_dataset(cfg.dataset, tt_config.instantiate(cfg.tokenizer))


# ---------------------------------------------------------------------- torchrun
def child_failure(tmp_path, rank, exitcode, message=None):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error_{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": message, "timestamp": 100 + rank}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


@pytest.fixture
def launcher_signal_handlers():
    """The launcher's wrapper ignores SIGTERM / SIGINT once its status is decided: put pytest's back afterwards."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("failures,status,printed", [
    ({0: (2, "error: bad"), 1: (2, "error: bad")}, 2, ""),  # rank 0 printed it
    ({0: (-15, "error: bad"), 1: (2, "error: bad")}, 2, ""),  # rank 0 printed it, then torchrun stopped it
    ({0: (-15, None), 1: (3, "error: training stopped: x")}, 3, "error: training stopped: x (rank 1)\n"),
    ({0: (-15, None), 1: (74, "error: saving step_2 in 'x' failed")}, 74,
     "error: saving step_2 in 'x' failed (rank 1)\n"),  # a failed save (EX_IOERR)
    ({0: (1, None), 1: (-15, None)}, None, ""),  # a crash: torchrun's own report
], ids=["all-ranks", "rank0-then-stopped", "other-rank-only", "save-failed", "crash"])
def test_launcher_exits_quietly_when_the_workers_reported(tmp_path, capsys, monkeypatch, failures, status, printed,
                                                         launcher_signal_handlers):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchtune_ext.errors import OUTCOME_FILE_ENV
    from torchtune_ext.run.control.launcher import quiet_reported_failures

    monkeypatch.setenv(OUTCOME_FILE_ENV, "")  # restored afterwards: the launcher sets it for its workers

    error = ChildFailedError("recipe", {r: child_failure(tmp_path, r, code, msg)
                                        for r, (code, msg) in failures.items()})

    def run(args):
        raise error

    if status is None:
        with pytest.raises(ChildFailedError):
            quiet_reported_failures(run)(None)
    else:
        with pytest.raises(SystemExit) as exit_info:
            quiet_reported_failures(run)(None)
        assert exit_info.value.code == status
    assert capsys.readouterr().err == printed


@pytest.mark.parametrize("recorded", [None, 0, 74, 75, 143],
                         ids=["nothing-recorded", "finished", "save-failed", "stopped", "second-signal"])
def test_launcher_signalled_too_exits_with_rank0s_recorded_status(monkeypatch, capsys, recorded,
                                                                 launcher_signal_handlers):
    """A scheduler's SIGTERM reaches the launcher as well as the workers, and torchrun's agent raises
    SignalException, without the workers' statuses: the status rank 0 recorded is the launcher's exit status
    (0 once training finished: the signal came during the cleanup). With none recorded, the shell's status for
    the signal, in one line instead of torchrun's traceback."""
    import os

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from torchtune_ext.errors import OUTCOME_FILE_ENV
    from torchtune_ext.run.control import exits, launcher

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(OUTCOME_FILE_ENV, "")  # restored afterwards: the launcher sets it for its workers

    def run(args):
        if recorded is not None:
            exits.record_outcome(recorded)  # rank 0 of a worker, after its line (same environment here)
        raise SignalException("got signal: 15", sigval=15)

    with pytest.raises(SystemExit) as exit_info:
        launcher.quiet_reported_failures(run)(None)
    assert exit_info.value.code == (143 if recorded is None else recorded)
    assert capsys.readouterr().err == ("tune run: stopped by SIGTERM (exit status 143)\n" if recorded is None else "")
    import signal  # a scheduler's further signals while the launcher exits: no SignalException traceback each

    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert not os.path.exists(os.environ[OUTCOME_FILE_ENV])  # the launcher leaves nothing behind


def test_data_errors_key_reaches_the_data_pass(tiny_run, tmp_path):
    from torchtune import config as tt_config

    from torchtune_ext.data import build_step_loader

    long_prompt = dict(GOOD, instruction="word " * 200)
    cfg = OmegaConf.load(tiny_run())
    cfg.dataset.data_files = str(records(tmp_path, [GOOD, long_prompt, GOOD]))
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    assert len(build_step_loader(validate(cfg), tokenizer, seed=0, ignore_index=-100)) == 3  # default: warn
    cfg.data_errors = "error"
    with pytest.raises(ConfigError, match="'dataset'.*1 sample whose answer is cut away"):
        build_step_loader(validate(cfg), tokenizer, seed=0, ignore_index=-100)
    cfg.data_errors = "ignore"
    with pytest.raises(ConfigError, match="'data_errors'.*warn, error"):
        validate(cfg)


def test_token_ids_past_the_models_embedding_are_one_line_before_anything_is_written(tiny_run, tmp_path):
    """A model with fewer embedding rows than the tokenizer has ids (here 300 against SmolLM2's 49,152) failed at
    its first forward with a long traceback, after logs/, metrics.jsonl and the lock were made. The data check's
    pass over every sample compares the largest id with the rows: training data and validation data alike."""
    from tests.support.helpers import recipe_class
    from torchtune_ext.run.loop import run_recipe

    out = tmp_path / "out"
    cfg = OmegaConf.load(tiny_run(**{"model.vocab_size": 300, "output_dir": str(out)}))
    recipe = recipe_class("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice")
    with pytest.raises(ConfigError) as err:
        run_recipe(recipe, cfg)
    message = str(err.value)
    assert message.startswith("config key 'tokenizer': the tokenizer torchtune_ext.data.tokenizer")
    assert "\n" not in message
    assert f"('{cfg.tokenizer.path}') gives token id" in message
    assert "but the model 'torchtune_ext.model.builders.tiny_llama' has 300 token embeddings (ids 0-299)" in message
    assert not out.exists() or not any(out.iterdir())  # no logs/, no metrics.jsonl, no lock

    cfg.model.vocab_size = 49_152  # the training data fits; the validation data, tokenized the same, not: refused too
    cfg.dataset_val, cfg.run_val_every_n_steps = dict(cfg.dataset), 1
    from torchtune import config as tt_config

    from torchtune_ext.run.evaluate import build_val_loader

    tokenizer = tt_config.instantiate(cfg.tokenizer)
    checked = validate(cfg)
    assert build_val_loader(checked, tokenizer, ignore_index=IGNORE, model_vocab_size=49_152) is not None
    with pytest.raises(ConfigError, match=r"token id \d+ \(dataset_val '.*', sample \d+\), but the model .* has "
                                          "300 token embeddings"):
        build_val_loader(checked, tokenizer, ignore_index=IGNORE, model_vocab_size=300)


def test_packed_documents_with_nothing_to_learn_are_counted_but_not_split_fragments():
    from torchtune.datasets import PackedDataset

    from tests.support.helpers import instruct_samples
    from torchtune_ext.data.check import check_dataset

    samples = instruct_samples([3, 4, 5, 2], [5, 0, 6, 9])  # sample 1: prompt only, nothing to learn
    report = check_dataset(PackedDataset(samples, max_seq_len=16, padding_idx=0), {"data_files": "x.json"},
                           "dataset", ignore_index=IGNORE, max_seq_len=None)
    assert (report.num_samples, report.num_tokens) == (4, 5 + 0 + 6 + 9)
    assert report.problems() == ["1 document with no trainable token (all labels masked, e.g. an empty answer) "
                                 "(first: document 1)"]
    # Split across packs of 8, the second sample's first token ends the first pack: a fragment that
    # trains nothing (its label is the prompt's), the packing's doing, not reported.
    split = PackedDataset(instruct_samples([2, 2], [5, 4]), max_seq_len=8, padding_idx=0, split_across_pack=True)
    assert [p["seq_lens"].tolist() for p in split.packs] == [[7, 1], [5, 3]]
    report = check_dataset(split, {"data_files": "x.json"}, "dataset", ignore_index=IGNORE, max_seq_len=None)
    assert (report.num_samples, report.problems()) == (2, [])


def test_a_recipe_path_starting_with_dot_slash_reaches_torchrun_as_a_module_name(monkeypatch):
    """Under --nproc_per_node tune run hands torchrun the module name made from the path (python -m): the
    normalised path's, not the relative '.recipes.full_finetune_distributed'."""
    import sys

    from torchtune._cli import run as tune_run
    from torchtune._cli.tune import TuneCLIParser

    from tests.support.helpers import REPO_ROOT

    launched = []
    monkeypatch.setattr(tune_run, "run", launched.append)
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "argv", ["tune", "run", "--nproc_per_node", "2", "./recipes/full_finetune_distributed.py",
                                      "--config", "c.yaml"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # tune run appends the working directory
    parser = TuneCLIParser()
    parser.run(parser.parse_args())
    assert [(args.module, args.training_script) for args in launched] == [(True, "recipes.full_finetune_distributed")]


def test_the_last_line_comes_after_the_progress_bars_final_redraw(capsys):
    """On a file or pipe, a bar still open when the run ends redraws itself when it is closed at exit:
    the line saying how the run ended must come after that, as the last line."""
    import sys

    from tqdm import tqdm

    from torchtune_ext.run.control.exits import write_line

    bar = tqdm(total=4, file=sys.stderr)
    bar.update(1)
    write_line("error: the end")
    bar.close()  # what the interpreter does at exit
    assert capsys.readouterr().err.endswith("\nerror: the end\n")


def test_torchrun_closing_the_other_workers_is_not_logged_after_rank0s_last_line(tmp_path, monkeypatch):
    """Once rank 0 has printed and recorded how the run ended, torchrun's 'Sending process N closing signal'
    warning for the workers still running would follow that line: it is dropped then, and only then."""
    import logging

    from torchtune_ext.errors import OUTCOME_FILE_ENV
    from torchtune_ext.run.control import exits, launcher

    records = [logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.WARNING, "api.py", 1,
                                 "Sending process %s closing signal %s", (1234, "SIGTERM"), None),
               # the agent, signalled during the cleanup of a finished run
               logging.LogRecord("torch.distributed.elastic.agent.server.api", logging.WARNING, "api.py", 1,
                                 "Received %s death signal, shutting down workers", (15,), None)]
    outcome = tmp_path / "outcome"
    monkeypatch.setenv(OUTCOME_FILE_ENV, str(outcome))
    monkeypatch.setenv("RANK", "0")
    for record in records:
        assert launcher._drop_reported_failure_log(record)  # kept: no outcome recorded (e.g. a crash)
    exits.record_outcome(0)
    for record in records:
        assert not launcher._drop_reported_failure_log(record)


# ------------------------------------------------------- unknown keys (issue 33 U1)
@pytest.mark.parametrize("override,key,closest", [
    ("optimzer.lr=1e-4", "optimzer.lr", "optimizer"),  # a section misspelt: nothing sets the learning rate
    ("gradient_accumulation=4", "gradient_accumulation", "gradient_accumulation_steps"),
    ("val_batch_size=4", "val_batch_size", "batch_size_val"),  # another tool's name for ours
    ("fsdp_cpu_offload=true", "fsdp_cpu_offload", None),  # a key of the distributed recipes only
])
def test_a_command_line_key_that_matches_nothing_stops_the_run(tiny_cfg, override, key, closest, caplog):
    """A key typed on the command line that no recipe key matches would train at the defaults, exit 0, with a
    warning scrolled away: one line naming it (and the closest key), before anything is built."""
    from torchtune_ext.config import command_line_keys

    message = f"^config key '{key}': typed on the command line, but this recipe has no key '{key.split('.')[0]}'"
    with command_line_keys([override.split("=")[0]]), pytest.raises(ConfigError, match=message) as err:
        tiny_cfg(override)
    assert "\n" not in str(err.value)
    assert str(err.value).endswith(f"Did you mean '{closest}'?" if closest else
                                   "the value would be ignored (only the distributed recipes read it)")
    assert not caplog.records  # no warning before the line


def test_an_unknown_key_in_the_yaml_file_is_a_warning_and_named_again_at_the_end(tiny_cfg, caplog, monkeypatch):
    """torchtune's configs carry keys no recipe reads: a warning at the start, listed once more at the end
    (remind_ignored_keys, which the training loop calls when the run ends), on rank 0 only; a known key given
    on the command line is fine."""
    from torchtune_ext.config import command_line_keys, remind_ignored_keys

    with command_line_keys(["batch_size", "optimizer.lr"]):
        cfg = tiny_cfg("enable_kv_cache=true", "optimzer.lr=1", "batch_size=3", "optimizer.lr=0.1")
    assert cfg.batch_size == 3

    def warned():
        return [r.getMessage() for r in caplog.records if r.name.startswith("torchtune_ext.config")]

    assert warned() == ["Unknown config key 'enable_kv_cache' is ignored.",
                      "Unknown config key 'optimzer' is ignored. Did you mean 'optimizer'?"]
    caplog.clear()
    remind_ignored_keys(cfg)
    assert warned() == ["Config keys this recipe ignored (not read, as said at the start): enable_kv_cache, optimzer"]
    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    remind_ignored_keys(cfg)
    assert not warned()
    monkeypatch.setenv("RANK", "0")
    cfg = tiny_cfg()
    caplog.clear()
    remind_ignored_keys(cfg)  # nothing ignored: nothing said
    assert not warned()


def test_command_line_keys_are_those_of_the_overrides(yaml_file):
    path = yaml_file("model:\n  _component_: torchtune_ext.model.builders.tiny_llama\nbatch_size: 2\n")
    assert check_command_line(["--config", path, "batch_size=3", "~batch_size", "model.embed_dim=32",
                               "optimzer.lr=1"]) == ["batch_size", "model.embed_dim", "optimzer.lr"]


def test_an_output_dir_that_is_a_file_says_to_choose_a_folder(tmp_path):
    """One line naming the key, the file and the fix; the file is left as it was."""
    from torchtune_ext.config.files import check_output_dir

    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ConfigError) as err:
        check_output_dir(str(afile))
    message = str(err.value)
    assert message.startswith("config key 'output_dir'") and "\n" not in message
    assert f"'{afile}' exists and is not a directory: choose a folder path for output_dir" in message
    assert afile.read_text() == "mine"
