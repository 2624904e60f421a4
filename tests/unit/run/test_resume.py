"""torchtune_ext.run.resume.check_resume_point: where a run starts, checked before any work."""

import json

import pytest
from omegaconf import OmegaConf

from torchtune_ext.errors import ConfigError
from torchtune_ext.run.resume import check_resume_point


def _cfg(out, resume):
    return OmegaConf.create({"output_dir": str(out), "resume_from_checkpoint": resume,
                             "verify_checkpoint_hashes": True})


def _complete(folder, step):
    folder.mkdir(parents=True)
    (folder / "checkpoint.json").write_text(json.dumps({"step": step, "files": {}}))


def test_a_new_run_starts_in_an_empty_or_absent_folder(tmp_path):
    check_resume_point(_cfg(tmp_path / "absent", resume=False))
    (tmp_path / "empty").mkdir()
    check_resume_point(_cfg(tmp_path / "empty", resume=False))


def test_a_new_run_does_not_write_over_the_checkpoints_of_another(tmp_path):
    _complete(tmp_path / "step_2", 2)
    with pytest.raises(ConfigError, match="'output_dir'.*already holds checkpoints of a run; set "
                                          "resume_from_checkpoint=true"):
        check_resume_point(_cfg(tmp_path, resume=False))


def test_a_resume_needs_a_complete_checkpoint(tmp_path):
    (tmp_path / "step_2").mkdir()  # no manifest: not a checkpoint
    with pytest.raises(ConfigError, match="'resume_from_checkpoint'.*no complete checkpoint"):
        check_resume_point(_cfg(tmp_path, resume=True))
    _complete(tmp_path / "step_1", 1)  # the later step_2 would collide with this run's next save
    with pytest.raises(ConfigError, match="'output_dir'.*step_2' has no checkpoint.json"):
        check_resume_point(_cfg(tmp_path, resume=True))
    (tmp_path / "step_2").rmdir()
    check_resume_point(_cfg(tmp_path, resume=True))


def test_a_resume_checks_the_newest_checkpoint_against_its_manifest(tmp_path):
    folder = tmp_path / "step_3"
    folder.mkdir()
    (folder / "checkpoint.json").write_text(json.dumps({"step": 3, "files": {"model.safetensors": 10}}))
    with pytest.raises(ConfigError, match="'resume_from_checkpoint'.*is missing 'model.safetensors'"):
        check_resume_point(_cfg(tmp_path, resume=True))


@pytest.mark.parametrize("sharded", [True, False])
def test_a_lora_step_in_the_full_recipe_is_told_the_fix_its_folder_allows(tmp_path, sharded):
    """A periodic sharded LoRA step holds dcp/ shards only: "fine-tune its merged weights" pointed at weights it
    does not have; its fix is to export it first (the export writes the merged model). A gathered step holds them."""
    from torchtune_ext.checkpoint import Progress
    from torchtune_ext.checkpoint.resume_state import ResumeState
    from torchtune_ext.run.resume import check_resume

    step = tmp_path / "out" / "step_4"
    (step / "dcp").mkdir(parents=True)
    if not sharded:
        (step / "model.safetensors").write_bytes(b"merged")
    lora = {"_component_": "torchtune.models.llama3_2.lora_llama3_2", "lora_attn_modules": ["q_proj"]}
    resumed = ResumeState(Progress(step=4), None, [{}], config={"model": lora}, path=step, sharded=sharded)
    cfg = OmegaConf.create({"model": {"_component_": "torchtune.models.llama3_2.llama3_2"}, "fsdp_cpu_offload": False})
    with pytest.raises(ConfigError) as err:
        check_resume(resumed, cfg)
    message = str(err.value)
    assert message.count("config key ") == 1 and "resume it with a LoRA recipe (recipes/lora_finetune_distributed.py)" \
        in message
    if sharded:
        assert message.endswith(f"or export its merged model (python -m torchtune_ext.checkpoint.export {step} "
                                 f"{step}_hf) and fine-tune that in a new output_dir with "
                                 f"checkpointer.checkpoint_dir={step}_hf")
    else:
        assert message.endswith(f"or fine-tune its merged weights in a new output_dir with "
                                f"checkpointer.checkpoint_dir={step}")
