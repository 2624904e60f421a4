"""A recipe with ``metric_logger.log_model`` (W&B offline): its checkpoints become model artifacts.

The logger's side (values, damaged folders, rank 0, the default that logs
nothing): tests/unit/run/test_metrics.py; the key's checks:
tests/unit/run/test_bad_input.py.
"""

from omegaconf import OmegaConf

from tests.support.helpers import read_jsonl, recipe_class, run_recipe, tiny_alpaca16_config
from tests.support.wandb_reader import read_offline_run
from torchtune_ext.config import validate

RECIPE = ("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice")
CONFIG = "configs/smollm2/135M_full_single_device.yaml"


def test_every_checkpoint_is_logged_once_complete_even_one_pruned_later(smollm2_assets, tmp_path, monkeypatch):
    """log_model=checkpoint, a save every 2 of 4 steps, one checkpoint kept: step_2 is logged before step_4's
    save prunes it (W&B keeps its copy), step_4 as the final one; each artifact holds the files of its folder."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    out = tmp_path / "run"
    cfg = tiny_alpaca16_config(CONFIG, {"_component_": "torchtune_ext.model.builders.tiny_llama"}, smollm2_assets,
                               tmp_path, out, "batch_size=2", "gradient_accumulation_steps=2",
                               "save_every_n_steps=2", "keep_last_n_checkpoints=1", "run_val_every_n_steps=null",
                               "run_val_at_start=false")
    cfg.metric_logger = OmegaConf.create({"_component_": "torchtune.training.metric_logging.WandBLogger",
                                          "project": "artifacts", "mode": "offline", "log_dir": str(out / "logs"),
                                          "log_model": "checkpoint"})
    run_recipe(recipe_class(*RECIPE), validate(cfg))
    assert [r["step"] for r in read_jsonl(out / "logs" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not (out / "step_2").exists() and (out / "step_4").is_dir()
    artifacts = [a for a in read_offline_run(str(out / "logs"))["artifacts"] if a["type"] != "run_table"]
    assert [(a["type"], a["metadata"]["step"], "final" in a["aliases"]) for a in artifacts] == [
        ("model", 2, False), ("model", 4, True)]  # the loss charts' tables are artifacts of their own
    final = out / "step_4"
    files = {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()}
    assert {"checkpoint.json", "recipe_state.pt", "model-00001-of-00001.safetensors"} <= files
    assert set(artifacts[0]["files"]) == set(artifacts[1]["files"]) == files
    for path, staged in artifacts[1]["files"].items():
        assert open(staged, "rb").read() == (final / path).read_bytes(), path
