"""Sharded checkpoints in one process: the keys' checks, a save read back exactly, another model refused.

The multi-rank cases (4 -> 2 and 2 -> 4 ranks, the export) are in
tests/integration/recipes/test_sharded_resume.py, a kill during a save and a write failing on one rank in
tests/integration/distributed/test_sharded_checkpoint.py; here DCP runs without a process group,
on a tiny torchtune Llama, in well under a second.
"""

import errno
import threading

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter
from torchtune.models.llama3_2 import llama3_2

from tests.support import tiny_setup
from tests.support.sharded_state import llama, progress, trained
from torchtune_ext.checkpoint import (
    CheckpointManager,
    Progress,
    ShardedStateDict,
    expected_checkpoint_bytes,
    export_hf,
    is_sharded,
    list_checkpoints,
    load_model_shards,
    load_optimizer_shards,
    saved_tensors,
    verify_checkpoint,
)
from torchtune_ext.config import DISTRIBUTED_KEYS, ConfigError, validate
from torchtune_ext.errors import CheckpointSaveError

CPU = torch.device("cpu")
# DCP without a process group says it assumes one process: it is one here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("key", ["sharded_checkpoints", "enable_async_checkpointing"])
def test_single_device_recipes_refuse_sharded_checkpoints_and_say_what_to_use(cfg, key):
    cfg[key] = True
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert message.startswith(f"config key '{key}'") and "\n" not in message
    assert "recipes/full_finetune_distributed.py" in message and f"{key}=false" in message


def test_async_checkpointing_implies_sharded_checkpoints_in_the_distributed_recipes(cfg):
    cfg.checkpointer.model_type = "LLAMA3_2"
    assert validate(cfg.copy(), extra_keys=DISTRIBUTED_KEYS).sharded_checkpoints is False
    cfg.enable_async_checkpointing = True
    assert validate(cfg, extra_keys=DISTRIBUTED_KEYS).sharded_checkpoints is True


def test_sharded_checkpoints_need_a_family_exported_tensor_by_tensor(cfg):
    cfg.checkpointer.model_type = "PHI3_MINI"  # its HF layout fuses q, k and v: not exportable file by file
    cfg.sharded_checkpoints = True
    with pytest.raises(ConfigError, match="^config key 'sharded_checkpoints'.*PHI3_MINI"):
        validate(cfg, extra_keys=DISTRIBUTED_KEYS)




@pytest.fixture
def saved(tmp_path):
    """A sharded checkpoint of a trained 2-layer model written in one process: (manager, folder, model, optimizer)."""
    model = llama()
    optimizer = trained(model)
    checkpointer = OmegaConf.create({"_component_": "torchtune.training.FullModelHFCheckpointer",
                                     "checkpoint_dir": str(tmp_path), "checkpoint_files": ["none.safetensors"],
                                     "model_type": "LLAMA3_2"})
    (tmp_path / "out").mkdir()  # the run makes it before any save
    manager = CheckpointManager(checkpointer, str(tmp_path / "out"), sharded_load=True, sharded_saves=True)
    progress = Progress()
    progress.step = 2
    folder = manager.save_sharded(model, optimizer, progress)
    return manager, folder, model, optimizer


def test_a_sharded_save_reads_back_exactly_model_and_optimizer(saved):
    _, folder, model, optimizer = saved
    assert folder.name == "step_2" and is_sharded(folder)
    verify_checkpoint(folder, content=True)  # the manifest lists every shard with its SHA-256
    state = ShardedStateDict(folder, {k: v.to("meta") for k, v in model.state_dict().items()})
    with torch.device("meta"):
        fresh = llama(seed=1)
    assert load_model_shards(fresh, state, CPU) == ([], [])
    for (name, got), want in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_optimizer_shards(fresh, fresh_optimizer, folder)
    for got, want in zip(fresh_optimizer.state_dict()["state"].values(), optimizer.state_dict()["state"].values()):
        assert all(torch.equal(got[k], want[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_a_sharded_checkpoint_of_another_model_is_one_config_error_before_anything_is_read(saved):
    manager, folder, _, _ = saved
    with torch.device("meta"):
        other = llama(layers=1)  # one layer fewer: the checkpoint has tensors this model lacks
    state = ShardedStateDict(folder, saved_tensors(folder))
    with pytest.raises(ConfigError) as err:
        load_model_shards(other, state, CPU, model_name="llama3_2 (1 layer)")
    message = str(err.value)
    assert message.startswith("config key 'resume_from_checkpoint'") and "\n" not in message
    assert "another model than llama3_2 (1 layer)" in message and "layers.1." in message
    assert all(p.is_meta for p in other.parameters())  # refused before any storage was allocated
    verify_checkpoint(folder, content=True)  # and the checkpoint is untouched


@pytest.fixture
def async_manager(tmp_path, monkeypatch):
    """An asynchronous manager whose saves stop before their manifest until ``release`` is set."""
    (tmp_path / "out").mkdir()
    manager = CheckpointManager(OmegaConf.create({}), str(tmp_path / "out"), sharded_load=True, sharded_saves=True,
                                asynchronous=True)
    release = threading.Event()
    complete = CheckpointManager._complete

    def held_complete(self, *args, **kwargs):
        assert release.wait(timeout=60)
        return complete(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "_complete", held_complete)
    yield manager, release
    release.set()
    manager.close()



def test_an_asynchronous_save_returns_at_once_holds_the_state_of_its_step_and_counts_only_when_complete(
        async_manager):
    manager, release = async_manager
    model = llama()
    optimizer = trained(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    folder = manager.save_sharded(model, optimizer, progress(2), asynchronous=True)
    assert not folder.exists()  # being written: no checkpoint yet (a kill now leaves none, not half of one)
    with torch.no_grad():  # training goes on: the next optimizer step changes the weights in place
        for p in model.parameters():
            p.add_(1.0)
    # at most one save in flight: the next one waits for this one to be complete
    second = threading.Thread(target=manager.save_sharded, args=(model, optimizer, progress(3)))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive() and not folder.exists()
    release.set()
    second.join(timeout=60)
    manager.wait()
    verify_checkpoint(folder, content=True)
    verify_checkpoint(folder.parent / "step_3", content=True)
    with torch.device("meta"):
        fresh = llama(seed=1)
    load_model_shards(fresh, ShardedStateDict(folder, saved_tensors(folder)), CPU)
    for name, tensor in fresh.state_dict().items():  # the weights when save_sharded was called
        assert torch.equal(tensor, before[name]), name


def test_the_line_of_an_asynchronous_save_says_it_was_written_in_the_background(tmp_path, caplog):
    """Its line comes steps after the save's step, and its time was no pause of training: the line says so;
    a synchronous save's does not."""
    (tmp_path / "out").mkdir()
    manager = CheckpointManager(OmegaConf.create({}), str(tmp_path / "out"), sharded_saves=True, asynchronous=True)
    model = llama()
    optimizer = trained(model)
    with caplog.at_level("INFO"):
        manager.save_sharded(model, optimizer, progress(1), asynchronous=True)
        manager.wait()
        manager.save_sharded(model, optimizer, progress(2))
    manager.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Checkpoint saved")]
    assert len(lines) == 2, lines
    assert "step_1 (" in lines[0] and "written in the background while training went on)" in lines[0]
    assert "step_2 (" in lines[1] and "background" not in lines[1]


def test_a_failed_asynchronous_save_is_a_failed_save_at_the_next_save_or_wait(async_manager, monkeypatch):
    manager, release = async_manager
    release.set()
    model = llama()
    optimizer = trained(model)
    manager.save_sharded(model, optimizer, progress(1), asynchronous=True)
    manager.wait()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    folder = manager.save_sharded(model, optimizer, progress(2), asynchronous=True)  # returns: the write fails later
    with pytest.raises(CheckpointSaveError, match="disk filled up while saving step_2") as err:
        manager.wait()
    assert "\n" not in str(err.value)
    assert isinstance(err.value, CheckpointSaveError)  # what the recipes exit with 74 on (torchtune_ext.errors)
    assert not folder.exists() and not manager.staging.exists()
    verify_checkpoint(folder.parent / "step_1", content=True)  # the previous checkpoint is intact
    manager.wait()  # reported once


@pytest.mark.parametrize("room", [False, True])
def test_torchs_unexpected_pos_error_on_a_filled_disk_is_called_a_full_disk(tmp_path, monkeypatch, room):
    """torch's stream writer says only "unexpected pos" when the disk fills under it (3 saves in 4 on a full
    disk): the free space at the failure tells whether the rest of the save could fit, as for a gathered save."""
    import shutil
    from collections import namedtuple

    from torchtune_ext.checkpoint import sharded_save

    (tmp_path / "out").mkdir()
    manager = CheckpointManager(OmegaConf.create({}), str(tmp_path / "out"), sharded_load=True, sharded_saves=True)
    model = llama()
    optimizer = trained(model)
    manager.save_sharded(model, optimizer, progress(1))
    usage, real_usage, filled = namedtuple("usage", "total used free"), shutil.disk_usage, []

    def disk_usage(path):
        free = 4096 if filled and not room else real_usage(path).free
        return usage(2**40, 2**40 - free, free)

    def fills_the_disk(*args, **kwargs):
        filled.append(True)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(sharded_save.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(FileSystemWriter, "write_data", fills_the_disk)
    with pytest.raises(CheckpointSaveError) as err:
        manager.save_sharded(model, optimizer, progress(2))
    message = str(err.value)
    assert "\n" not in message and "unexpected pos" in message
    if room:  # a write that stopped short with room left: not a full disk
        assert message.startswith("saving step_2 in output_dir") and "disk filled up" not in message
    else:
        assert message.startswith("the disk filled up while saving step_2") and "4 KiB are free now" in message
        assert "it needs about" in message and "free some space" in message
    assert not manager.staging.exists() and not (tmp_path / "out" / "step_2").exists()
    verify_checkpoint(tmp_path / "out" / "step_1", content=True)


def test_the_start_up_estimate_bounds_a_final_sharded_checkpoint_with_its_export_closely(tmp_path):
    """The disk estimate of a sharded run (shards + optimizer + the final Hugging Face export) is an upper bound of
    the final checkpoint, the largest one, and a close one; the export equals the base file's layout."""
    base = tmp_path / "base"
    base.mkdir()
    vocab = tiny_setup.write_tokenizer(base)
    tiny_setup.write_checkpoint(base, vocab)
    checkpointer = OmegaConf.create({"_component_": "torchtune.training.FullModelHFCheckpointer",
                                     "checkpoint_dir": str(base), "checkpoint_files": ["model.safetensors"],
                                     "model_type": "LLAMA3_2"})
    torch.manual_seed(0)
    model = llama3_2(vocab_size=vocab, num_layers=tiny_setup.LAYERS, num_heads=tiny_setup.HEADS,
                     num_kv_heads=tiny_setup.KV_HEADS, embed_dim=tiny_setup.DIM, max_seq_len=64,
                     intermediate_dim=tiny_setup.HIDDEN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, vocab, (2, 8))).sum().backward()
    optimizer.step()
    (tmp_path / "out").mkdir()
    manager = CheckpointManager(checkpointer, str(tmp_path / "out"), sharded_saves=True)
    folder = manager.save_sharded(model, optimizer, progress(1), export=lambda staging, rank, world: export_hf(
        staging, staging, checkpointer, rank=rank, world_size=world))
    verify_checkpoint(folder, content=True)
    written = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    estimate = expected_checkpoint_bytes(model, optimizer, sharded=True)
    assert written <= estimate <= written + 160 * 2**10, (written, estimate)
    exported = load_file(str(folder / "model-00001-of-00001.safetensors"))
    assert exported.keys() == load_file(str(base / "model.safetensors")).keys()


def test_sharded_saves_keep_the_newest_n(tmp_path):
    (tmp_path / "out").mkdir()
    manager = CheckpointManager(OmegaConf.create({}), str(tmp_path / "out"), keep_last_n=2, sharded_saves=True)
    model = llama()
    optimizer = trained(model)
    for step in (1, 2, 3):
        manager.save_sharded(model, optimizer, progress(step))
    assert [c.name for c in list_checkpoints(str(tmp_path / "out"))] == ["step_2", "step_3"]
