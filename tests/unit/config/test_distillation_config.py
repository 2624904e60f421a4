"""The distillation keys' checks (torchtune_ext.config.distillation)."""

import pytest
from omegaconf import OmegaConf

from torchtune_ext.config.distillation import check_same_teacher, check_teacher, optional_dtype, unit_interval
from torchtune_ext.errors import ConfigError

TEACHER = {"teacher_model": {"_component_": "torchtune_ext.model.builders.smollm2_135m"},
           "teacher_checkpointer": {"checkpoint_dir": "assets/SmolLM2-135M-Instruct"}}


def test_kd_ratio_and_teacher_dtype():
    for good in (0, 0.5, 1):
        unit_interval("kd_ratio", good)
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ConfigError, match="kd_ratio"):
            unit_interval("kd_ratio", bad)
    optional_dtype("teacher_dtype", None)
    optional_dtype("teacher_dtype", "bf16")
    with pytest.raises(ConfigError, match="teacher_dtype"):
        optional_dtype("teacher_dtype", "float16")


def test_one_teacher_with_its_checkpointer():
    with pytest.raises(ConfigError) as err:
        check_teacher(OmegaConf.create({}))
    assert err.value.key == "teacher_model"
    with pytest.raises(ConfigError) as err:
        check_teacher(OmegaConf.create({**TEACHER, "teacher_model_dir": "x"}))
    assert err.value.key == "teacher_model_dir"
    with pytest.raises(ConfigError) as err:
        check_teacher(OmegaConf.create({"teacher_model": TEACHER["teacher_model"]}))
    assert err.value.key == "teacher_checkpointer"
    with pytest.raises(ConfigError, match="python -m torchtune_ext.download") as err:
        check_teacher(OmegaConf.create({**TEACHER, "teacher_checkpointer": {"checkpoint_dir": "assets/missing"}}))
    assert err.value.key == "teacher_checkpointer.checkpoint_dir"
    # a folder no download command is known for: the line still ends with what to do
    with pytest.raises(ConfigError) as err:
        check_teacher(OmegaConf.create({**TEACHER, "teacher_checkpointer": {"checkpoint_dir": "/nonexistent"}}))
    assert "put the model's files in '/nonexistent' or set the key" in str(err.value)
    assert not str(err.value).rstrip().endswith(":")


def test_resume_with_another_teacher_is_refused():
    cfg = OmegaConf.create(TEACHER)
    check_same_teacher(None, cfg)  # nothing saved: nothing to compare
    check_same_teacher(OmegaConf.to_container(cfg), cfg)
    other = OmegaConf.create({**TEACHER, "teacher_checkpointer": {"checkpoint_dir": "models/another"}})
    with pytest.raises(ConfigError, match="assets/SmolLM2-135M-Instruct") as err:
        check_same_teacher(OmegaConf.to_container(cfg), other)
    assert err.value.key == "teacher_model" and "\n" not in str(err.value)
    with pytest.raises(ConfigError):
        check_same_teacher({"teacher_model_dir": "models/a"}, OmegaConf.create({"teacher_model_dir": "models/b"}))


def test_on_policy_keys_and_their_combinations():
    """on_policy_ratio in [0, 1]; > 0 refused with packed data and in the distributed recipe, naming the key."""
    from torchtune_ext.config.distillation import check_on_policy, on_policy_share, sampling_temperature

    for good in (0, 0.5, 1):
        on_policy_share("on_policy_ratio", good)
    for bad in (-0.1, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="on_policy_ratio"):
            on_policy_share("on_policy_ratio", bad)
    for bad in (0, -1.0, None):
        with pytest.raises(ConfigError, match="on_policy_temperature"):
            sampling_temperature("on_policy_temperature", bad)
    check_on_policy(OmegaConf.create({"dataset": {"packed": True}}), distributed=True)  # ratio 0: offline
    check_on_policy(OmegaConf.create({"on_policy_ratio": 0.5, "dataset": {}}))
    for cfg, distributed in (({"on_policy_ratio": 0.5, "dataset": {"packed": True}}, False),
                             ({"on_policy_ratio": 0.5, "dataset": [{}], "pack_micro_batches": True}, False),
                             ({"on_policy_ratio": 1, "dataset": {}}, True)):
        with pytest.raises(ConfigError) as err:
            check_on_policy(OmegaConf.create(cfg), distributed)
        assert err.value.key == "on_policy_ratio" and "\n" not in str(err.value)
