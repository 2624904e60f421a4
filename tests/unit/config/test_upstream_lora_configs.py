"""torchtune 0.6.1's configs of the two LoRA fine-tuning recipes, accepted as written and built on the meta device
with the parameter count of their architecture: the checks of tests/unit/config/test_upstream_configs.py (which
says what they are), in a file of their own so that pytest's two workers share these 77 builds with the other 53.
"""

import pytest

from tests.unit.config.test_upstream_configs import LORA, _check, pretend_cuda  # noqa: F401 (a fixture)


@pytest.mark.parametrize("recipe,name,path", LORA, ids=[f"{r}:{n}" for r, n, _ in LORA])
def test_torchtune_config_runs_unchanged(recipe, name, path, tmp_path, pretend_cuda):  # noqa: F811
    _check(recipe, name, path, tmp_path)
