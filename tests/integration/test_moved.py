"""The documented commands run under the module paths of earlier versions (torchtune_ext.moved; the rest of
its tests: tests/unit/test_moved.py)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("command", ["torchtune_ext.download", "torchtune_ext.evaluate",
                                     "torchtune_ext.parity_report", "torchtune_ext.checkpoint.export"])
def test_the_documented_commands_run_under_their_old_module_paths(command):
    out = subprocess.run([sys.executable, "-m", command, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
