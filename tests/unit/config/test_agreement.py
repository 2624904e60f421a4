"""torchtune_ext.config.agreement: ranks started with different configs are refused, naming the keys.

The collective itself runs over a real gloo group in tests/integration/distributed/test_distributed.py
(``config_agreement``); here the gathered values are handed in, as ``ranks.from_every_rank`` returns them.
"""

import pytest
from omegaconf import OmegaConf

from torchtune_ext import ranks
from torchtune_ext.config import agreement
from torchtune_ext.errors import ConfigError


def _cfg(lr=1e-3, steps=None, **extra):
    return OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": lr},
                             "max_steps_per_epoch": steps, "output_dir": "out", "base": "a", "path": "${base}/x",
                             **extra})


def test_the_digest_is_of_the_resolved_values_not_their_order_or_spelling():
    a = agreement.flat_config(_cfg())
    b = agreement.flat_config(OmegaConf.create({"path": "a/x", "base": "a", "output_dir": "out",
                                                "max_steps_per_epoch": None,
                                                "optimizer": {"lr": 1e-3, "_component_": "torch.optim.AdamW"}}))
    assert a["path"] == '"a/x"' and agreement.config_digest(a) == agreement.config_digest(b)
    assert agreement.config_digest(a) != agreement.config_digest(agreement.flat_config(_cfg(lr=5e-2)))


def test_the_refusal_names_each_differing_key_with_its_values_and_ranks():
    flats = [agreement.flat_config(c) for c in (_cfg(), _cfg(), _cfg(lr=5e-2, steps=3), _cfg(lr=5e-2, steps=3))]
    err = agreement.config_differences(flats)
    assert err.key == "max_steps_per_epoch, optimizer.lr"
    assert "max_steps_per_epoch is null on ranks 0-1 / 3 on ranks 2-3" in str(err)
    assert "optimizer.lr is 0.001 on ranks 0-1 / 0.05 on ranks 2-3" in str(err)
    assert "give every node the same config file and the same key=value overrides" in str(err)
    assert "\n" not in str(err) and "output_dir" not in str(err)


def test_a_key_only_one_rank_has_is_named_too():
    flats = [agreement.flat_config(_cfg()), agreement.flat_config(_cfg(compile=True))]
    err = agreement.config_differences(flats)
    assert err.key == "compile" and "compile is (not set) on rank 0 / true on rank 1" in str(err)


@pytest.fixture
def two_ranks(monkeypatch):
    """ranks as in a 2-rank job whose other rank resolved ``other``: returns a setter for it."""
    other = {}
    monkeypatch.setattr(ranks, "several_processes", lambda group=None: True)

    def gather(value, group=None):
        theirs = other["cfg"]
        flat = agreement.flat_config(theirs)
        return [value, agreement.config_digest(flat) if isinstance(value, str) else flat]

    monkeypatch.setattr(ranks, "from_every_rank", gather)
    return lambda cfg: other.update(cfg=cfg)


def test_start_up_passes_when_every_rank_agrees_and_refuses_otherwise(two_ranks):
    two_ranks(_cfg())
    agreement.check_same_config_on_every_rank(_cfg())
    two_ranks(_cfg(lr=5e-2))
    with pytest.raises(ConfigError, match=r"config key 'optimizer.lr': .*0.001 on rank 0 / 0.05 on rank 1"):
        agreement.check_same_config_on_every_rank(_cfg())


def test_one_process_compares_nothing(monkeypatch):
    monkeypatch.setattr(ranks, "from_every_rank", lambda *a, **k: pytest.fail("a collective in one process"))
    agreement.check_same_config_on_every_rank(_cfg())
