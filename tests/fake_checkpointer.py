"""A stand-in for torchtune's checkpointer that can fail half-way through a save."""

from pathlib import Path


class FakeCheckpointer:
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
        if FakeCheckpointer.fail_next_save:
            FakeCheckpointer.fail_next_save = False
            raise OSError("disk full (simulated)")
        (folder / "weights.bin").write_bytes(state_dict["model"]["w"])
