"""A packaged torchtune config whose weights are not downloaded, run by name through ``tune run``, stops with the
``tune download`` command from its header.

Every config's checks and parameter count, in this process: tests/unit/config/test_upstream_configs.py.
"""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchtune_ext.config.upstream import packaged_configs


def test_packaged_name_runs_to_the_download_line():
    """`tune run recipes/lora_finetune_single_device.py --config qwen2_5/0.5B_lora_single_device`, as
    written (no override, on any machine): the name resolves to torchtune's YAML, every key is
    accepted, and the run stops before any work on one line naming the folder and its download."""
    from tests.support.helpers import run_tune

    cfg = OmegaConf.load(dict(packaged_configs("lora_finetune_single_device"))["qwen2_5/0.5B_lora_single_device"])
    if Path(cfg.checkpointer.checkpoint_dir).exists():
        pytest.skip(f"{cfg.checkpointer.checkpoint_dir} exists here (downloaded)")
    output_dir = Path(cfg.output_dir)
    existed = output_dir.exists()
    proc = run_tune("recipes/lora_finetune_single_device.py", "--config", "qwen2_5/0.5B_lora_single_device",
                    timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == ""
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: config key 'checkpointer.checkpoint_dir': '/tmp/Qwen2.5-0.5B-Instruct'")
    assert line.endswith("`tune download Qwen/Qwen2.5-0.5B-Instruct --output-dir /tmp/Qwen2.5-0.5B-Instruct`")
    assert output_dir.exists() == existed  # nothing written
