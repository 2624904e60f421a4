"""Data mistakes found before training (issue 33: F7, F12), where a process of its own is needed: a file the
process may not read, and the recipe stopping with one line (exit 2) through the command line.

The checks themselves, in one process: tests/unit/data/test_data_input.py.
"""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT, run_tune

GOOD = {"instruction": "say yes", "input": "", "output": "yes"}

UNREADABLE = """
import sys
from omegaconf import OmegaConf
from torchtune_ext.config import ConfigError, validate
try:
    validate(OmegaConf.load(sys.argv[1]))
except ConfigError as err:
    print(err)
"""


def _with_data(tiny_run, path):
    cfg = OmegaConf.load(tiny_run())
    cfg.dataset.data_files = str(path)
    return cfg


def _without_root_powers():
    """The command prefix that runs a process without the power to read any file (root ignores chmod)."""
    if os.geteuid() != 0:
        return []
    probe = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("running as root without setpriv's capability drop: chmod 000 cannot be tested")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


@pytest.mark.parametrize("locked", ["file", "folder"])
def test_an_unreadable_data_file_says_so(tiny_run, tmp_path, locked):
    """chmod 000 of the file, or of its folder (the file then looks missing): the message said
    'No such file or directory'."""
    (tmp_path / "private").mkdir()
    data = tmp_path / "private" / "secret.json"
    data.write_text(json.dumps([GOOD] * 3))
    config = tmp_path / "unreadable.yaml"
    OmegaConf.save(_with_data(tiny_run, data), config)
    target = data if locked == "file" else data.parent
    target.chmod(0)
    try:
        proc = subprocess.run([*_without_root_powers(), sys.executable, "-c", UNREADABLE, str(config)],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    finally:
        target.chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == (f"config key 'dataset.data_files': '{data}' cannot be read (permission denied); "
                                   f"make it readable (chmod a+r) or point dataset.data_files at a copy")


def test_the_recipe_stops_with_one_line_and_writes_nothing(tiny_run):
    """The issue's case end to end: packs of 8 tokens skipped every step and exited 0 after training."""
    config = tiny_run(**{"dataset.packed": True, "tokenizer.max_seq_len": 8})
    out = config.parent / "out"
    proc = run_tune("recipes/full_finetune_single_device.py", "--config", str(config), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: config key 'dataset': no trainable token in any of its 24 documents")
    assert not out.exists()
