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
