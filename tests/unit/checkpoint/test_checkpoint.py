"""Atomic checkpoints: a failed save never damages an earlier one; pruning waits for completion."""

import errno
import json
import shutil
from collections import namedtuple

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.fake_checkpointer import FakeCheckpointer
from tests.support.helpers import damage_same_size, deny, tiny_lora_model, tiny_model
from torchtune_ext.checkpoint import (
    MANIFEST,
    CheckpointManager,
    CheckpointSaveError,
    Progress,
    discovery,
    expected_checkpoint_bytes,
    latest_checkpoint,
    list_checkpoints,
    load_recipe_state,
    run_saves,
    tensor_bytes,
    verify_checkpoint,
    writer,
)
from torchtune_ext.checkpoint.run_saves import announce
from torchtune_ext.config import ConfigError

DiskUsage = namedtuple("DiskUsage", "total used free")


@pytest.fixture
def manager(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "weights.bin").write_bytes(b"base-weights")
    cfg = OmegaConf.create({"_component_": "tests.support.fake_checkpointer.FakeCheckpointer",
                            "checkpoint_dir": str(base), "output_dir": str(tmp_path / "out")})
    m = CheckpointManager(cfg, str(tmp_path / "out"), keep_last_n=2)
    assert m.load() == {"model": {"w": b"base-weights"}}
    return m


def save(manager, step, payload=b"weights"):
    return manager.save({"model": {"w": payload}}, Progress(step=step, epoch=0, steps_in_epoch=step, seed=3),
                        {"lr": 0.1 * step})


def test_save_writes_manifest_and_state(manager):
    path = save(manager, 1)
    assert path.name == "step_1" and (path / "weights.bin").read_bytes() == b"weights"
    manifest = verify_checkpoint(path)
    assert manifest["files"]["weights.bin"] == len(b"weights") and "recipe_state.pt" in manifest["files"]
    state = load_recipe_state(path)
    assert state.progress == Progress(step=1, epoch=0, steps_in_epoch=1, seed=3)
    assert state.optimizer == {"lr": 0.1} and len(state.rng_by_rank) == 1
    assert not manager.staging.exists()


def test_the_loss_spike_history_is_saved_and_comes_back_with_the_run(manager):
    """A resumed run's health check continues from the checkpoint's healthy losses (train/health.py)."""
    progress = Progress(step=3, seed=3, healthy_losses=[10.5, 10.7, 10.6])
    path = manager.save({"model": {"w": b"weights"}}, progress, {})
    assert load_recipe_state(path).progress.healthy_losses == [10.5, 10.7, 10.6]
    state = torch.load(path / "recipe_state.pt", weights_only=False)
    del state["progress"]["healthy_losses"]  # a checkpoint of an earlier version: no history, as before
    torch.save(state, path / "recipe_state.pt")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["recipe_state.pt"] = (path / "recipe_state.pt").stat().st_size
    manifest.pop("sha256", None)
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert load_recipe_state(path).progress.healthy_losses == []


def test_a_checkpoint_of_an_earlier_version_keeps_its_sample_order(manager):
    """Before data_seed was saved the epochs' order followed the run's seed: a resume must keep that order
    (another one would train some samples of the epoch in progress twice and others never)."""
    path = save(manager, 1)
    state = torch.load(path / "recipe_state.pt", weights_only=False)
    assert state["progress"]["data_seed"] == 0  # new runs: torchtune's sampler seed
    del state["progress"]["data_seed"]
    torch.save(state, path / "recipe_state.pt")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["recipe_state.pt"] = (path / "recipe_state.pt").stat().st_size
    (path / MANIFEST).write_text(json.dumps(manifest))
    progress = load_recipe_state(path).progress
    assert (progress.seed, progress.data_seed) == (3, 3)


def test_failed_save_leaves_previous_checkpoint_intact(manager):
    first = save(manager, 1, b"first")
    FakeCheckpointer.fail_next_save = True
    with pytest.raises(CheckpointSaveError, match=r"saving step_2 in .* failed \(OSError: disk full \(simulated\)\): "
                       "the partial checkpoint was removed and .*step_1 is intact: fix the cause, then continue "
                       "with resume_from_checkpoint=true$"):
        save(manager, 2, b"second")
    assert list_checkpoints(str(manager.output_dir)) == [first]
    assert latest_checkpoint(str(manager.output_dir)) == first
    assert (first / "weights.bin").read_bytes() == b"first"
    assert not manager.staging.exists()  # the half-written folder went with the failure
    second = save(manager, 2, b"second")
    assert latest_checkpoint(str(manager.output_dir)) == second and not manager.staging.exists()


def test_prune_keeps_last_n_after_completion(manager):
    for step in (1, 2, 3):
        save(manager, step)
    assert [p.name for p in list_checkpoints(str(manager.output_dir))] == ["step_2", "step_3"]
    FakeCheckpointer.fail_next_save = True
    with pytest.raises(CheckpointSaveError):
        save(manager, 4)
    assert [p.name for p in list_checkpoints(str(manager.output_dir))] == ["step_2", "step_3"]


def test_prune_keeps_the_last_checkpoint_from_before_the_damage(manager):
    """While the health checks distrust steps >= 3, step_2 (the one to resume from) is never pruned."""
    for step in (1, 2):
        save(manager, step)
    for step in (3, 4, 5):
        manager.save({"model": {"w": b"w"}}, Progress(step=step, seed=3), {}, suspect_from=3)
    assert [p.name for p in list_checkpoints(str(manager.output_dir))] == ["step_2", "step_4", "step_5"]
    save(manager, 6)  # healthy again: ordinary pruning
    assert [p.name for p in list_checkpoints(str(manager.output_dir))] == ["step_5", "step_6"]


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


def test_prune_never_removes_the_checkpoint_just_written(tmp_path, manager):
    manager.keep_last_n = 1
    save(manager, 5)
    path = save(manager, 3)  # numbered lower than a checkpoint already there
    assert path.is_dir() and (manager.output_dir / "step_5").is_dir()


def test_manifest_never_lists_itself(manager):
    """torchtune copies the files of the folder it loaded from, a previous checkpoint's manifest included:
    a resumed run's checkpoint used to list that stale manifest, and could not be resumed from."""
    first = save(manager, 1)
    real_save = FakeCheckpointer.save_checkpoint

    def save_and_copy(self, state_dict, epoch, **kwargs):
        real_save(self, state_dict, epoch, **kwargs)
        shutil.copy(first / "checkpoint.json", self.output_dir / f"epoch_{epoch}" / "checkpoint.json")

    FakeCheckpointer.save_checkpoint = save_and_copy
    try:
        second = save(manager, 2)
    finally:
        FakeCheckpointer.save_checkpoint = real_save
    assert "checkpoint.json" not in verify_checkpoint(second)["files"]


def test_a_manifest_listing_itself_still_verifies(manager):
    """Checkpoints that resumed runs of earlier versions wrote stay resumable."""
    path = save(manager, 1)
    manifest = json.loads((path / "checkpoint.json").read_text())
    manifest["files"]["checkpoint.json"] = 308
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    verify_checkpoint(path)


def test_not_enough_space_is_refused_before_writing(manager, monkeypatch):
    first = save(manager, 1)
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: DiskUsage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointSaveError, match="not enough free disk space to save step_2 in output_dir "
                       ".*: it needs about 1 MiB, 1000 B are free; nothing was written and .*step_1 is intact: "
                       "free some space, then continue with resume_from_checkpoint=true$"):
        save(manager, 2)
    assert list_checkpoints(str(manager.output_dir)) == [first] and not manager.staging.exists()


def test_a_failed_first_save_does_not_suggest_resuming(manager, monkeypatch):
    """No checkpoint to resume from yet: the message says to start again, not resume_from_checkpoint=true."""
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: DiskUsage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointSaveError) as err:
        save(manager, 1)
    assert str(err.value).endswith("nothing was written and no checkpoint of this run exists yet: free some "
                                   "space, then start the run again")
    assert "resume_from_checkpoint" not in str(err.value)


def test_a_full_disk_with_older_checkpoints_says_they_can_go(manager, monkeypatch):
    """Old checkpoints are deleted only after a new one is complete, so with one on disk lowering
    keep_last_n_checkpoints frees nothing (test above); with two, the older one can be deleted."""
    save(manager, 1)
    save(manager, 2)
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: DiskUsage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointSaveError) as err:
        save(manager, 3)
    assert ("free some space (resuming needs only the newest checkpoint: the older one, step_1, can be deleted; "
            "a lower keep_last_n_checkpoints keeps fewer from then on), then continue with resume_from_checkpoint"
            "=true") in str(err.value)
    assert f"{manager.output_dir / 'step_2'} is intact" in str(err.value)


def test_a_file_where_the_staging_folder_goes(manager, tmp_path):
    """Refused at start-up (load) with the key; one made during training fails that save, not a traceback."""
    first = save(manager, 1)
    manager.staging.write_text("a user's file")
    with pytest.raises(CheckpointSaveError, match=r"saving step_2 failed before writing: '.*\.staging' is a file, "
                       "but saves stage each checkpoint in a folder of that name: nothing was written and "
                       ".*step_1 is intact: move or delete the file, then continue with resume_from_checkpoint=true"):
        save(manager, 2)
    assert manager.staging.read_text() == "a user's file" and list_checkpoints(str(manager.output_dir)) == [first]
    cfg = OmegaConf.create({"_component_": "tests.support.fake_checkpointer.FakeCheckpointer",
                            "checkpoint_dir": str(tmp_path / "base"), "output_dir": str(manager.output_dir)})
    with pytest.raises(ConfigError,
                       match=r"^config key 'output_dir': '.*\.staging' is a file, but saves stage each checkpoint"):
        CheckpointManager(cfg, str(manager.output_dir)).load()


@pytest.mark.parametrize("where", ["clearing staging", "moving into place", "syncing"])
def test_a_failure_around_the_write_is_a_failed_save(manager, monkeypatch, where):
    """The steps before and after the checkpointer writes fail like the write itself: one error, exit 74."""
    save(manager, 1)  # the checkpoint a failed save must leave intact
    broken = OSError(errno.EIO, "Input/output error")

    def fail(*args, **kwargs):
        raise broken

    if where == "clearing staging":
        manager.staging.mkdir()
        monkeypatch.setattr(writer.shutil, "rmtree", fail)
        expected = r"saving step_2 in output_dir .* failed before writing \(OSError: .*Input/output error\): nothing"
    elif where == "moving into place":
        real_replace = writer.os.replace
        monkeypatch.setattr(writer.os, "replace",
                            lambda src, dst: fail() if str(dst).endswith("step_2") else real_replace(src, dst))
        expected = r"saving step_2 in .* failed when moving it into place \(OSError: .*\): the partial checkpoint was"
    else:
        monkeypatch.setattr(writer, "fsync_dir", fail)
        expected = (r"saving step_2 in .* failed: the folder could not be synced to disk \(OSError: .*\); .*step_2 "
                    "is complete but may not survive a crash of the machine")
    with pytest.raises(CheckpointSaveError, match=expected) as err:
        save(manager, 2)
    assert err.value.__cause__ is broken
    monkeypatch.undo()
    newest = manager.output_dir / ("step_2" if where == "syncing" else "step_1")
    assert str(err.value).endswith("fix the cause, then continue with resume_from_checkpoint=true")
    assert where == "syncing" or str(err.value).endswith(f"{newest} is intact: fix the cause, then continue with "
                                                         "resume_from_checkpoint=true")
    assert latest_checkpoint(str(manager.output_dir)) == newest
    assert (where == "clearing staging") == manager.staging.exists()


def test_an_old_checkpoint_that_cannot_be_deleted_is_a_warning(manager, monkeypatch, caplog):
    """The new checkpoint is complete: training goes on, and the user is told what to delete."""
    first = save(manager, 1)
    save(manager, 2)
    real_rmtree = writer.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if str(path) == str(first):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(writer.shutil, "rmtree", rmtree)
    with caplog.at_level("INFO"):
        third = save(manager, 3)
    assert list_checkpoints(str(manager.output_dir)) == [first, manager.output_dir / "step_2", third]
    assert f"the old checkpoint '{first}' could not be deleted (PermissionError" in caplog.text
    assert "delete it by hand" in caplog.text
    # the warning follows the line of the save it belongs to
    assert caplog.text.index("Checkpoint saved: " + str(third)) < caplog.text.index("could not be deleted")


def test_an_old_checkpoint_deleted_in_part_is_not_called_a_checkpoint(manager, monkeypatch, caplog):
    first = save(manager, 1)
    save(manager, 2)

    real_rmtree = writer.shutil.rmtree

    def rmtree(path, *args, **kwargs):  # as with an immutable file: the manifest goes, then a file refuses
        if str(path) != str(first):
            return real_rmtree(path, *args, **kwargs)
        (first / "checkpoint.json").unlink()
        raise PermissionError(errno.EPERM, "Operation not permitted", "config.json")

    monkeypatch.setattr(writer.shutil, "rmtree", rmtree)
    with caplog.at_level("WARNING"):
        save(manager, 3)
    assert (f"the old checkpoint '{first}' was deleted only in part (its checkpoint.json is gone: what is left is "
            "not a checkpoint) (PermissionError") in caplog.text


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("basic_ios::clear: iostream error")], ids=["ENOSPC", "torch.save"])
def test_disk_filling_up_during_a_save(manager, monkeypatch, failure):
    """A write that fails on a full disk: the partial checkpoint is removed, the previous one kept, one error.

    torch.save reports a full disk as a bare RuntimeError: the free space at the failure tells."""
    first = save(manager, 1)
    calls = []

    def disk_usage(path):  # room before the save; full when the failure is examined
        calls.append(path)
        return DiskUsage(10**9, 0, 10**9) if len(calls) == 1 else DiskUsage(10**9, 10**9, 0)

    monkeypatch.setattr(writer.shutil, "disk_usage", disk_usage)
    FakeCheckpointer.fail_next_save = failure
    with pytest.raises(CheckpointSaveError, match="the disk filled up while saving step_2 in .*: it needs about 1 MiB, "
                       ".* are free now; the partial checkpoint was removed and .*step_1 is intact") as err:
        save(manager, 2)
    assert err.value.__cause__ is failure
    assert list_checkpoints(str(manager.output_dir)) == [first] and not manager.staging.exists()


@pytest.mark.parametrize("failure", [OSError(errno.EFBIG, "File too large"),
                                     RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                  "unexpected pos 576 vs 534"),
                                     RuntimeError("Error while serializing: I/O error: File too large (os error 27)")],
                         ids=["EFBIG", "torch.save", "safetensors"])
def test_a_failed_write_is_one_error_naming_the_checkpoint(manager, failure):
    """Writes that fail with room on the disk (a file size limit, an I/O error) are reported, not a traceback."""
    first = save(manager, 1)
    FakeCheckpointer.fail_next_save = failure
    with pytest.raises(CheckpointSaveError, match=r"saving step_2 in .* failed \((RuntimeError|OSError): ") as err:
        save(manager, 2)
    assert str(failure) in str(err.value) and f"{first} is intact" in str(err.value)
    # an OSError names its cause; torch.save's and safetensors' reports do not: say what to look for
    assert ("find why a write stopped short (a file size limit such as ulimit -f, a failing device), then "
            "continue" in str(err.value)) == (not isinstance(failure, OSError))
    assert err.value.__cause__ is failure
    assert list_checkpoints(str(manager.output_dir)) == [first] and not manager.staging.exists()


def test_a_write_that_fails_before_any_file_says_nothing_was_written(manager, monkeypatch):
    """E.g. output_dir made read-only during training: the staging folder cannot even be made."""
    first = save(manager, 1)

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(manager.staging))

    monkeypatch.setattr(manager._checkpointer, "save_checkpoint", refuse)
    with pytest.raises(CheckpointSaveError) as err:
        save(manager, 2)
    assert str(err.value).endswith(f"(PermissionError: [Errno 13] Permission denied: '{manager.staging}'): nothing "
                                   f"was written and {first} is intact: fix the cause, then continue with "
                                   "resume_from_checkpoint=true")


def test_a_bug_raised_while_handling_a_write_error_keeps_its_traceback(manager):
    """Only the error and what it was raised *from* classify it: a KeyError raised inside an
    `except OSError` block is a bug, not a failed write."""
    bug = KeyError("a bug")
    bug.__context__ = OSError(errno.EIO, "Input/output error")
    FakeCheckpointer.fail_next_save = bug
    with pytest.raises(KeyError, match="a bug"):
        save(manager, 1)
    assert not manager.staging.exists()


def test_other_failures_are_raised_as_they_are(manager):
    FakeCheckpointer.fail_next_save = ValueError("not a disk problem")
    with pytest.raises(ValueError, match="not a disk problem"):
        save(manager, 1)
    assert not manager.staging.exists()


@pytest.mark.parametrize("kind", ["full", "lora", "lora_adapter_only"])
def test_expected_checkpoint_bytes_covers_what_is_written(kind):
    """The start-up estimate is at least the tensors a checkpoint holds, and at most ~100 KiB more (1 rank)."""
    model = tiny_model() if kind == "full" else tiny_lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    model(torch.randint(0, 100, (1, 8))).sum().backward()
    optimizer.step()  # creates the state the estimate had to predict
    state = model.state_dict()
    if kind == "full":
        written = tensor_bytes(state)
    else:
        adapter = {k: v for k, v in state.items() if "lora" in k}
        merged = 0 if kind.endswith("only") else tensor_bytes(state) - tensor_bytes(adapter)
        written = 2 * tensor_bytes(adapter) + merged
    written += tensor_bytes(optimizer.state_dict())
    estimate = expected_checkpoint_bytes(model, optimizer, lora=kind != "full", adapter_only=kind.endswith("only"))
    assert written <= estimate <= written + 100 * 2**10 + 256 * len(state)


def test_a_tied_embedding_is_counted_once_as_the_folder_writes_it(tmp_path):
    """transformers' lm_head.weight is embed_tokens.weight: save_pretrained writes it once, and the estimate
    counted it twice (52.3 MiB estimated, 40.3 MiB written for a tied model)."""
    from transformers import AutoModelForCausalLM

    from tests.support.hf_tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=True, vocab_size=4096))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # 4096 x 32 fp32: 512 KiB
    model.save_pretrained(str(tmp_path / "hf"))
    written = sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.safetensors"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the estimate is the weights
    estimate = expected_checkpoint_bytes(model, optimizer)
    assert written <= estimate <= written + 100 * 2**10 + 256 * len(model.state_dict())


@pytest.mark.parametrize("keep", [1, 2, None])
def test_start_up_warning_suggests_lowering_keep_only_where_it_helps(manager, monkeypatch, caplog, keep):
    """With keep_last_n_checkpoints=1 two checkpoints are on disk at times anyway (the new one is complete
    before the old one goes): lowering it is not possible, so only freeing space is suggested."""
    manager.keep_last_n = keep
    monkeypatch.setattr(run_saves, "planned_save_steps", lambda progress, loader, cfg: [2, 4, 6])
    monkeypatch.setattr(run_saves.shutil, "disk_usage", lambda path: DiskUsage(10**9, 10**9 - 3 * 10**6, 3 * 10**6))
    with caplog.at_level("WARNING"):
        announce(manager, 2 * 10**6, Progress(step=0, epoch=0, steps_in_epoch=0, seed=3), loader=None, cfg=None)
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warning) == 1 and "not enough for all of them" in warning[0]
    assert ("lower keep_last_n_checkpoints or free some space" in warning[0]) == (keep != 1)
    assert warning[0].endswith("free some space")


def test_start_up_warning_on_resume_counts_only_the_checkpoints_to_come(manager, monkeypatch, caplog):
    """The free space excludes the checkpoints already on disk: with one kept and one on disk, the next save
    needs room for one more, not two."""
    save(manager, 1)
    manager.keep_last_n = 1
    monkeypatch.setattr(run_saves, "planned_save_steps", lambda progress, loader, cfg: [2])
    monkeypatch.setattr(run_saves.shutil, "disk_usage", lambda path: DiskUsage(10**9, 10**9 - 3 * 10**6, 3 * 10**6))
    with caplog.at_level("INFO"):
        announce(manager, 2 * 10**6, Progress(step=1, epoch=0, steps_in_epoch=1, seed=3), loader=None, cfg=None)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert "1 to write, the newest 1 kept (keep_last_n_checkpoints=1): up to " in caplog.text


# ------------------------------------------------------- CPU memory of a save (issue 31)
def test_save_memory_is_the_gathered_checkpoint_on_rank_zero_and_the_own_shards_when_asynchronous():
    from torchtune_ext.checkpoint import expected_checkpoint_bytes, save_memory_bytes

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert save_memory_bytes(model, optimizer, distributed=False) == 0  # one process writes what it holds
    assert save_memory_bytes(model, optimizer, distributed=True) == expected_checkpoint_bytes(model, optimizer)
    assert save_memory_bytes(model, optimizer, distributed=True, sharded=True) == 0  # written from where it is
    # one rank's shards (here the whole model) copied to CPU: weights and AdamW's two moments
    assert save_memory_bytes(model, optimizer, distributed=True, sharded=True, asynchronous=True) == \
        weights + 2 * trainable


@pytest.mark.parametrize("sharded,key", [(False, "sharded_checkpoints"), (True, "enable_async_checkpointing")])
def test_start_up_refuses_a_save_the_cpu_memory_cannot_hold(manager, monkeypatch, sharded, key):
    monkeypatch.setattr(run_saves, "planned_save_steps", lambda progress, loader, cfg: [2])
    manager.sharded_saves = sharded
    progress = Progress(step=0, epoch=0, steps_in_epoch=0, seed=3)
    with pytest.raises(ConfigError) as err:
        announce(manager, 10**3, progress, loader=None, cfg=None, save_memory=(3 * 2**30, 2**30))
    assert err.value.key == key and "about 3 GiB, 1 GiB available" in str(err.value), str(err.value)
    assert ("Set sharded_checkpoints=true" in str(err.value)) != sharded
    announce(manager, 10**3, progress, loader=None, cfg=None, save_memory=(2**30, 3 * 2**30))  # fits
    announce(manager, 10**3, progress, loader=None, cfg=None, save_memory=(3 * 2**30, None))  # unknown: no refusal
    monkeypatch.setattr(run_saves, "planned_save_steps", lambda progress, loader, cfg: [])
    announce(manager, 10**3, progress, loader=None, cfg=None, save_memory=(3 * 2**30, 2**30))  # nothing to save


# ------------------------------------------------------- content hashes (issue 33 F11)
def test_manifest_records_the_sha256_of_every_file(manager):
    import hashlib

    path = save(manager, 1)
    manifest = json.loads((path / MANIFEST).read_text())
    assert sorted(manifest["sha256"]) == sorted(manifest["files"]) == ["recipe_state.pt", "weights.bin"]
    for name, digest in manifest["sha256"].items():
        assert digest == hashlib.sha256((path / name).read_bytes()).hexdigest(), name


@pytest.mark.parametrize("name", ["recipe_state.pt", "weights.bin"])
def test_same_size_damage_is_refused_naming_the_file_and_the_intact_checkpoint(manager, name):
    first, second = save(manager, 1), save(manager, 2, b"second-weights")
    damage_same_size(second / name)
    verify_checkpoint(second)  # sizes only: the damage passes
    with pytest.raises(ConfigError, match=rf"^config key 'resume_from_checkpoint': checkpoint '{second}': "
                       rf"'{name}' is damaged: its content differs from what was saved \(SHA-256 mismatch, same "
                       rf"size\)\. The previous checkpoint '{first}' is intact: move 'step_2' out of the output_dir"):
        verify_checkpoint(second, content=True)
    damage_same_size(first / "recipe_state.pt")  # "intact" means its content too
    with pytest.raises(ConfigError, match="No earlier checkpoint of this run is intact"):
        verify_checkpoint(second, content=True)


def test_a_checkpoint_without_hashes_still_verifies(manager):
    """Checkpoints of earlier versions have sizes only: they resume, checked by size."""
    path = save(manager, 1)
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["sha256"]
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert verify_checkpoint(path, content=True)["step"] == 1
    (path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="'weights.bin' has 1 bytes"):
        verify_checkpoint(path, content=True)


def test_a_file_that_cannot_be_read_is_named(manager, monkeypatch):
    path = save(manager, 1)
    real = discovery.file_sha256

    def unreadable(file):
        if file.name == "weights.bin":
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file)

    monkeypatch.setattr(discovery, "file_sha256", unreadable)
    with pytest.raises(ConfigError, match=rf"checkpoint '{path}': 'weights.bin' cannot be read \(PermissionError"):
        verify_checkpoint(path, content=True)


# --------------------------------------------- folders that cannot be read (issue 33 F4)
@pytest.mark.parametrize("which", ["newest", "older"])
def test_an_unreadable_step_folder_is_one_error_naming_it(manager, monkeypatch, which):
    first, second = save(manager, 1), save(manager, 2)
    folder = second if which == "newest" else first
    deny(monkeypatch, folder)
    for listing in (list_checkpoints, latest_checkpoint, discovery.incomplete_checkpoints):
        with pytest.raises(ConfigError, match=rf"^config key 'output_dir': '{folder}' cannot be read "
                           r"\(PermissionError: .*Permission denied.*\), so the checkpoints in it cannot be listed "
                           rf"or checked; give this user read access to it \(e.g. chmod u\+rwx '{folder}'\) or move "
                           r"it out of the output_dir$"):
            listing(str(manager.output_dir))


def test_an_unreadable_output_dir_is_one_error_naming_it(manager, monkeypatch):
    save(manager, 1)
    real = discovery.Path.iterdir

    def iterdir(path):
        if path == manager.output_dir:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(discovery.Path, "iterdir", iterdir)
    with pytest.raises(ConfigError, match=rf"^config key 'output_dir': '{manager.output_dir}' cannot be read"):
        latest_checkpoint(str(manager.output_dir))


def test_an_old_folder_that_becomes_unreadable_during_training_only_stops_pruning(manager, monkeypatch, caplog):
    """Listing for pruning happens after the new checkpoint is complete: a warning, training goes on."""
    first, _ = save(manager, 1), save(manager, 2)
    deny(monkeypatch, first)
    with caplog.at_level("WARNING"):
        third = save(manager, 3)
    assert third.is_dir() and first.is_dir()
    assert f"old checkpoints were not pruned: config key 'output_dir': '{first}' cannot be read" in caplog.text


def test_hashes_can_be_left_out_for_very_large_checkpoints(tmp_path):
    """verify_checkpoint_hashes=false: no pass over the bytes at save (nor at resume): sizes only."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "weights.bin").write_bytes(b"base-weights")
    cfg = OmegaConf.create({"checkpointer": {"_component_": "tests.support.fake_checkpointer.FakeCheckpointer",
                                             "checkpoint_dir": str(base), "output_dir": str(tmp_path / "out")},
                            "output_dir": str(tmp_path / "out"), "keep_last_n_checkpoints": 2,
                            "verify_checkpoint_hashes": False})
    manager = CheckpointManager.from_config(cfg)
    manager.load()
    path = save(manager, 1)
    assert "sha256" not in json.loads((path / MANIFEST).read_text())
    cfg.verify_checkpoint_hashes = True
    manager = CheckpointManager.from_config(cfg)
    manager.load()
    assert "sha256" in json.loads((save(manager, 2) / MANIFEST).read_text())
