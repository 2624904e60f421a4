"""Stand-ins for torchtune's checkpointer that fail half-way through a save."""

import errno
from pathlib import Path

from torchtune.training import FullModelHFCheckpointer


class FakeCheckpointer:
    # True: fail with a plain OSError; an exception instance: raise that one
    fail_next_save = False

    def __init__(self, checkpoint_dir, output_dir, **_):
        self.checkpoint_dir, self.output_dir = Path(checkpoint_dir), Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)

    def load_checkpoint(self):
        return {"model": {"w": (self.checkpoint_dir / "weights.bin").read_bytes()}}

    def save_checkpoint(self, state_dict, epoch, adapter_only=False, **_):
        folder = self.output_dir / f"epoch_{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "weights.bin").write_bytes(state_dict["model"]["w"][:1])
        failure, FakeCheckpointer.fail_next_save = FakeCheckpointer.fail_next_save, False
        if failure is True:
            raise OSError("disk full (simulated)")
        if failure:
            raise failure
        (folder / "weights.bin").write_bytes(state_dict["model"]["w"])


class DiskFullAtStep(FullModelHFCheckpointer):
    """torchtune's HF checkpointer, except that the save of step ``full_at_step`` fills the disk:
    it writes part of the weights file, then fails with ENOSPC."""

    def __init__(self, *args, full_at_step: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._full_at_step = full_at_step

    def save_checkpoint(self, state_dict, epoch, **kwargs):
        if epoch == self._full_at_step:
            folder = Path(self._output_dir) / f"epoch_{epoch}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().save_checkpoint(state_dict, epoch, **kwargs)
