"""``python -m torchtune_ext.checkpoint.export STEP OUT`` in one process, on a tiny sharded checkpoint.

A tiny Llama with tiny_setup's base folder (tokenizer, config.json, weights), trained in a folder of its own
with a config whose paths are relative to it (as a user's ``assets/...``), saved sharded there; the export
then runs from another directory. The multi-rank export of a real run is tests/integration/recipes/test_hf.py's.
"""

import json
import os
import stat

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.models.llama3_2 import llama3_2

from tests.support import tiny_setup
from torchtune_ext.checkpoint import CheckpointManager, Progress
from torchtune_ext.checkpoint.hf_export import EXPORT_MARKER
from torchtune_ext.data.tokenizer import training_chat_template
from torchtune_ext.tools.export import main as export_main

# DCP without a process group says it assumes one process: it is one here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run folder whose config is relative to it, with sharded step_1 and step_2 in ``out/``; the current
    directory is another one when the test starts. Returns (run folder, config)."""
    root = tmp_path / "run"
    tiny_setup.write_tiny_setup(root, metric_logger=False)
    cfg = OmegaConf.load(root / "tiny.yaml")
    cfg.output_dir = "out"
    cfg.checkpointer.checkpoint_dir = cfg.tokenizer.path = "tiny_model"
    cfg.dataset.data_files = "data.json"
    monkeypatch.chdir(root)
    (root / "out").mkdir()
    manager = CheckpointManager(cfg.checkpointer, cfg.output_dir, run_config=cfg, sharded_saves=True)
    torch.manual_seed(0)
    model = llama3_2(vocab_size=cfg.model.vocab_size, num_layers=tiny_setup.LAYERS, num_heads=tiny_setup.HEADS,
                     num_kv_heads=tiny_setup.KV_HEADS, embed_dim=tiny_setup.DIM, max_seq_len=64,
                     intermediate_dim=tiny_setup.HIDDEN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):
        progress = Progress()
        progress.step = step
        manager.save_sharded(model, optimizer, progress)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return root, cfg


def _export(step, out, capsys):
    code = export_main([str(step), str(out)])
    return code, capsys.readouterr().err


def test_the_export_is_readable_as_a_checkpoint_under_the_umask(run, tmp_path, capsys):
    root, _ = run
    old = os.umask(0o022)
    try:
        assert _export(root / "out" / "step_2", tmp_path / "hf", capsys)[0] == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755
    files = [p for p in (tmp_path / "hf").rglob("*") if p.is_file()]
    assert any(p.name.endswith(".safetensors") for p in files)  # safetensors writes them 0600
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o644 for p in files}


def test_the_export_carries_trainings_chat_template_not_the_base_folders(run, tmp_path, capsys):
    root, cfg = run
    assert _export(root / "out" / "step_2", tmp_path / "hf", capsys)[0] == 0
    os.chdir(root)
    want = training_chat_template(OmegaConf.to_container(cfg, resolve=True))
    assert want  # the base folder's tokenizer_config.json has none
    assert "chat_template" not in json.loads((root / "tiny_model" / "tokenizer_config.json").read_text())
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == want
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json"}  # no staging marker, no recipe state


def test_a_staging_folder_this_tool_did_not_make_is_kept_and_named(run, tmp_path, capsys):
    root, _ = run
    partial = tmp_path / "hf.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    code, err = _export(root / "out" / "step_2", tmp_path / "hf", capsys)
    assert code == 2 and err.count("\n") == 1 and f"'{partial}' exists and was not made by this export" in err
    assert (partial / "notes.txt").read_text() == "mine" and not (tmp_path / "hf").exists()


def test_an_interrupted_exports_staging_folder_is_replaced(run, tmp_path, capsys):
    root, _ = run
    partial = tmp_path / "hf.partial"
    partial.mkdir()
    (partial / EXPORT_MARKER).touch()
    (partial / "model-00001-of-00002.safetensors").write_text("half")
    assert _export(root / "out" / "step_2", tmp_path / "hf", capsys)[0] == 0
    assert not partial.exists() and not (tmp_path / "hf" / "model-00001-of-00002.safetensors").exists()


def test_relative_paths_of_the_run_are_found_from_another_directory_without_a_recorded_one(run, tmp_path, capsys,
                                                                                          monkeypatch):
    """Checkpoints of earlier versions record no run directory: output_dir ('out') locates it."""
    root, _ = run
    state_file = root / "out" / "step_2" / "recipe_state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state.pop("run_dir") == str(root)
    torch.save(state, state_file)
    manifest = json.loads((root / "out" / "step_2" / "checkpoint.json").read_text())
    manifest["files"]["recipe_state.pt"] = state_file.stat().st_size
    manifest.pop("sha256", None)
    (root / "out" / "step_2" / "checkpoint.json").write_text(json.dumps(manifest))
    assert _export(root / "out" / "step_2", tmp_path / "hf", capsys)[0] == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_a_run_directory_that_cannot_be_found_is_one_line_saying_where_to_run_from(run, tmp_path, capsys):
    root, _ = run
    moved = tmp_path / "moved"
    (root / "out").rename(moved)  # neither the recorded directory nor output_dir leads to tiny_model now
    (root / "tiny_model").rename(tmp_path / "tiny_model_gone")
    code, err = _export(moved / "step_2", tmp_path / "hf", capsys)
    assert code == 2 and err.count("\n") == 1
    assert "'tiny_model' is relative to the directory training ran in" in err and "run the export from" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_a_step_that_does_not_exist_names_the_checkpoints_there(run, tmp_path, capsys):
    root, _ = run
    code, err = _export(root / "out" / "step_99", tmp_path / "hf", capsys)
    assert code == 2 and err.count("\n") == 1
    out = root / "out"
    assert f"'{out / 'step_99'}' does not exist; sharded checkpoints in '{out}': step_1, step_2" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_a_run_folder_names_its_checkpoints_and_the_one_to_pass(run, tmp_path, capsys):
    root, _ = run
    code, err = _export(root / "out", tmp_path / "hf", capsys)
    assert code == 2 and err.count("\n") == 1
    assert "is a run's output_dir, not one checkpoint" in err and "step_1, step_2" in err
    assert f"'{root / 'out' / 'step_2'}', the newest" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_a_shard_damaged_at_the_same_size_is_refused_by_its_sha256_and_nothing_is_written(run, tmp_path, capsys):
    """The manifest's sizes all match: only the content hash tells (as a resume and evaluate refuse it)."""
    root, _ = run
    shard = sorted((root / "out" / "step_2" / "dcp").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(b ^ 0xFF for b in data[100:164])
    shard.write_bytes(bytes(data))
    code, err = _export(root / "out" / "step_2", tmp_path / "hf", capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"'dcp/{shard.name}' is damaged" in err and "SHA-256 mismatch" in err and "resume_from_checkpoint" not in err
    assert f"export one of them, e.g. '{root / 'out' / 'step_1'}'" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    assert _export(root / "out" / "step_1", tmp_path / "hf", capsys)[0] == 0  # the fix it names works


def test_an_unfinished_saves_staging_folder_names_the_intact_checkpoints(run, tmp_path, capsys):
    root, _ = run
    staging = root / "out" / ".staging"
    (root / "out" / "step_2").rename(staging)  # a sharded save's folder before its manifest went in: as here
    (staging / "checkpoint.json").unlink()
    code, err = _export(staging, tmp_path / "hf", capsys)
    assert code == 2 and err.count("\n") == 1
    assert "staging folder of a save that did not finish" in err
    assert "Intact sharded checkpoints of this run: step_1" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("failure", ["full", "read-only"])
def test_a_write_that_fails_is_one_line_exit_74_and_the_partial_output_is_removed(run, tmp_path, capsys,
                                                                                monkeypatch, failure):
    """safetensors reports a full disk in its own words (no OSError); a read-only folder fails the first mkdir."""
    import errno
    from pathlib import Path

    from torchtune_ext.checkpoint import hf_export

    root, _ = run
    if failure == "full":
        def save_file(*args, **kwargs):
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(hf_export, "save_file", save_file)
    else:
        mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if self.name == "hf.partial":
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only)
    code, err = _export(root / "out" / "step_2", tmp_path / "hf", capsys)
    assert code == 74 and err.count("\n") == 1 and "Traceback" not in err
    assert f"error: writing the export to '{tmp_path / 'hf'}' failed (" in err
    assert "the partial 'hf.partial' was removed" in err
    if failure == "full":
        assert "the disk is full (" in err and "free some space, or give an OUT on another disk" in err
    else:
        assert "Read-only file system" in err and f"give an OUT in a folder you can write (not '{tmp_path}')" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
