"""Atomic checkpoints: a failed save never damages an earlier one; pruning waits for completion."""

import pytest
from omegaconf import OmegaConf

from fake_checkpointer import FakeCheckpointer
from torchtune_ext.checkpoint import (
    CheckpointManager,
    Progress,
    latest_checkpoint,
    list_checkpoints,
    load_recipe_state,
    verify_checkpoint,
)
from torchtune_ext.config import ConfigError


@pytest.fixture
def manager(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "weights.bin").write_bytes(b"base-weights")
    cfg = OmegaConf.create({"_component_": "fake_checkpointer.FakeCheckpointer", "checkpoint_dir": str(base),
                            "output_dir": str(tmp_path / "out")})
    m = CheckpointManager(cfg, str(tmp_path / "out"), keep_last_n=2)
    assert m.load() == {"model": {"w": b"base-weights"}}
    return m


def save(manager, step, payload=b"weights"):
    return manager.save({"model": {"w": payload}}, Progress(step=step, epoch=0, steps_in_epoch=step, seed=3),
                        {"optimizer": {"lr": 0.1 * step}})


def test_save_writes_manifest_and_state(manager):
    path = save(manager, 1)
    assert path.name == "step_1" and (path / "weights.bin").read_bytes() == b"weights"
    manifest = verify_checkpoint(path)
    assert manifest["files"]["weights.bin"] == len(b"weights") and "recipe_state.pt" in manifest["files"]
    state = load_recipe_state(path)
    assert state["progress"] == Progress(step=1, epoch=0, steps_in_epoch=1, seed=3)
    assert state["optimizer"] == {"lr": 0.1} and "rng" in state
    assert not manager.staging.exists()


def test_failed_save_leaves_previous_checkpoint_intact(manager):
    first = save(manager, 1, b"first")
    FakeCheckpointer.fail_next_save = True
    with pytest.raises(OSError, match="simulated"):
        save(manager, 2, b"second")
    assert list_checkpoints(str(manager.output_dir)) == [first]
    assert latest_checkpoint(str(manager.output_dir)) == first
    assert (first / "weights.bin").read_bytes() == b"first"
    second = save(manager, 2, b"second")  # the next save clears the half-written staging folder
    assert latest_checkpoint(str(manager.output_dir)) == second and not manager.staging.exists()


def test_prune_keeps_last_n_after_completion(manager):
    for step in (1, 2, 3):
        save(manager, step)
    assert [p.name for p in list_checkpoints(str(manager.output_dir))] == ["step_2", "step_3"]
    FakeCheckpointer.fail_next_save = True
    with pytest.raises(OSError):
        save(manager, 4)
    assert [p.name for p in list_checkpoints(str(manager.output_dir))] == ["step_2", "step_3"]


def test_same_step_is_not_written_twice(manager):
    path = save(manager, 5, b"periodic")
    assert save(manager, 5, b"epoch-end") == path
    assert (path / "weights.bin").read_bytes() == b"periodic"


def test_verify_detects_missing_and_resized_files(manager):
    path = save(manager, 1)
    (path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="weights.bin.*1 bytes"):
        verify_checkpoint(path)
    (path / "weights.bin").unlink()
    with pytest.raises(ConfigError, match="missing 'weights.bin'"):
        verify_checkpoint(path)


def test_folders_without_manifest_are_not_checkpoints(manager):
    (manager.output_dir / "step_9").mkdir()
    assert latest_checkpoint(str(manager.output_dir)) is None


def test_tokens_seen_counts_the_steps_that_updated_the_model():
    progress = Progress()
    progress.complete_step(skipped=False, end_sample=4, num_tokens=100)
    progress.complete_step(skipped=True, end_sample=8, num_tokens=50)  # non-finite: no update
    progress.complete_step(skipped=False, end_sample=12, num_tokens=30)
    assert progress.tokens_seen == 130 and progress.step == 3 and progress.skipped_steps == 1
    # checkpoints written before tokens_seen existed still load
    assert Progress(**{"step": 2, "epoch": 0, "steps_in_epoch": 2, "samples_in_epoch": 8}).tokens_seen == 0


def test_broken_checkpoint_names_the_file_and_the_previous_intact_one(manager):
    first, second = save(manager, 1), save(manager, 2)
    (second / "weights.bin").write_bytes(b"x")  # truncated
    with pytest.raises(ConfigError, match=f"'weights.bin' has 1 bytes.*previous checkpoint '{first}' is intact"):
        verify_checkpoint(second)
    (first / "weights.bin").write_bytes(b"y")
    with pytest.raises(ConfigError, match="No earlier checkpoint of this run is intact"):
        verify_checkpoint(second)


def test_unreadable_recipe_state_with_a_matching_size_is_named(manager):
    first, second = save(manager, 1), save(manager, 2)
    state = second / "recipe_state.pt"
    state.write_bytes(b"\0" * state.stat().st_size)  # same size, garbage: the manifest cannot tell
    with pytest.raises(ConfigError, match=f"'{state}' cannot be read.*'{first}' is intact"):
        load_recipe_state(second)


def test_save_never_collides_with_a_folder_without_manifest(manager):
    stray = manager.output_dir / "step_2"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("mine")
    path = save(manager, 2)
    assert verify_checkpoint(path)["step"] == 2
    assert (manager.output_dir / "step_2.incomplete" / "notes.txt").read_text() == "mine"
