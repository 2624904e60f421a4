"""What a distillation recipe checks before anything loads (torchtune_ext.run.distillation); the recipe runs
themselves are tests/integration/recipes/test_distillation.py."""

import pytest
from omegaconf import OmegaConf

from torchtune_ext.errors import ConfigError
from torchtune_ext.run.distillation import distillation_keys

STUDENT = {"model": {"_component_": "torchtune_ext.model.builders.tiny_llama"}}


def sharded_step(tmp_path):
    """A step folder as a run with sharded_checkpoints writes it (dcp/.metadata beside the shards)."""
    step = tmp_path / "run" / "step_4"
    (step / "dcp").mkdir(parents=True)
    (step / "dcp" / ".metadata").write_bytes(b"\0")
    (step / "dcp" / "__0_0.distcp").write_bytes(b"\0")
    return step


@pytest.mark.parametrize("distributed", [False, True])
def test_a_sharded_teacher_checkpoint_is_refused_naming_the_export(tmp_path, distributed):
    """The step folder or its dcp/ as teacher_checkpointer.checkpoint_dir or teacher_model_dir: one line naming
    the key and `python -m torchtune_ext.checkpoint.export <step folder> OUT` (neither recipe loads DCP shards
    as a teacher)."""
    step = sharded_step(tmp_path)
    for folder in (step, step / "dcp"):
        for teacher, key in (({"teacher_model": {"_component_": "torchtune_ext.model.builders.tiny_llama"},
                               "teacher_checkpointer": {"checkpoint_dir": str(folder)}},
                              "teacher_checkpointer.checkpoint_dir"),
                             ({"teacher_model_dir": str(folder)}, "teacher_model_dir")):
            with pytest.raises(ConfigError) as err:
                distillation_keys(OmegaConf.create({**STUDENT, **teacher}), distributed)
            assert err.value.key == key and "\n" not in str(err.value)
            assert f"python -m torchtune_ext.checkpoint.export {step} OUT" in str(err.value)
    # a plain folder beside it is accepted
    plain = tmp_path / "plain"
    plain.mkdir()
    distillation_keys(OmegaConf.create({**STUDENT, "teacher_model_dir": str(plain)}), distributed)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group: one process
def test_the_export_the_refusal_names_is_a_teacher(tmp_path, capsys):
    """What the refusal says works: a sharded step of a tiny Llama, refused as the teacher; its export by
    `python -m torchtune_ext.checkpoint.export STEP OUT` is accepted and loads as the teacher, weight for weight."""
    import torch
    from torchtune.models.llama3_2 import llama3_2

    from tests.support import tiny_setup
    from torchtune_ext.checkpoint import CheckpointManager, Progress
    from torchtune_ext.model.teacher import build_teacher
    from torchtune_ext.tools.export import main as export_main

    root = tmp_path / "run"
    tiny_setup.write_tiny_setup(root, metric_logger=False)
    cfg = OmegaConf.load(root / "tiny.yaml")
    (root / "out").mkdir()
    torch.manual_seed(1)  # other weights than the base checkpoint's (seed 0): the teacher must be the export's
    model = llama3_2(vocab_size=cfg.model.vocab_size, num_layers=tiny_setup.LAYERS, num_heads=tiny_setup.HEADS,
                     num_kv_heads=tiny_setup.KV_HEADS, embed_dim=tiny_setup.DIM, max_seq_len=tiny_setup.MAX_SEQ_LEN,
                     intermediate_dim=tiny_setup.HIDDEN)
    progress = Progress()
    progress.step = 1
    CheckpointManager(cfg.checkpointer, cfg.output_dir, run_config=cfg, sharded_saves=True).save_sharded(
        model, torch.optim.AdamW(model.parameters()), progress)
    step = root / "out" / "step_1"
    kd = OmegaConf.create({"model": cfg.model, "dtype": "fp32", "teacher_dtype": None,
                           "output_dir": str(tmp_path / "kd"), "teacher_model": cfg.model,
                           "teacher_checkpointer": {**OmegaConf.to_container(cfg.checkpointer),
                                                    "checkpoint_dir": str(step)}})
    with pytest.raises(ConfigError, match="checkpoint.export"):
        distillation_keys(kd)
    out = tmp_path / "exported"
    assert export_main([str(step), str(out)]) == 0, capsys.readouterr().err
    kd.teacher_checkpointer.checkpoint_dir = str(out)
    kd.teacher_checkpointer.checkpoint_files = sorted(p.name for p in out.glob("model-*.safetensors"))
    distillation_keys(kd)  # accepted
    teacher, _ = build_teacher(kd, torch.device("cpu"))
    loaded = teacher.state_dict()
    for name, weight in model.state_dict().items():
        assert torch.equal(loaded[name], weight), name
