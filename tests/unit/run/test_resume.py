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
