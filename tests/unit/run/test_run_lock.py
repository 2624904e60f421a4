"""One run per output folder: the lock and the rollback of a failed setup, in this process.

Runs and lock holders in processes of their own: tests/integration/test_run_lock.py.
"""


import pytest

from torchtune_ext.config import ConfigError
from torchtune_ext.run.control.rollback import output_dir_unchanged_on_error
from torchtune_ext.run.control.run_lock import OutputDirLock, check_not_in_use, holder


def test_free_folder_has_no_holder_and_probing_writes_nothing(tmp_path):
    assert holder(str(tmp_path / "absent")) is None and not (tmp_path / "absent").exists()
    lock = OutputDirLock(str(tmp_path / "out"))
    lock.release()
    assert holder(str(tmp_path / "out")) is None  # released: the file stays, unlocked
    check_not_in_use(str(tmp_path / "out"))


def test_a_failed_setup_removes_only_what_appeared_after_it_took_the_lock(tmp_path):
    """What another run wrote while this one waited for the folder (here: the last checkpoint of a run ending
    just then) is not this run's to remove; what this run wrote once it held the lock is."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "logs").mkdir()
    with pytest.raises(ConfigError):
        with output_dir_unchanged_on_error(str(out)):
            (out / "step_3").mkdir()  # written by the run that held the folder before this one took it
            (out / "step_3" / "checkpoint.json").write_text("{}")
            lock = OutputDirLock(str(out))
            (out / "logs" / "config_1.yaml").write_text("a: 1\n")
            (out / ".staging").mkdir()
            raise ConfigError("dataset", "bad")
    lock.release()
    # the lock file too: taking the lock created it
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["logs", "step_3", "step_3/checkpoint.json"]
