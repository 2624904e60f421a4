"""The preference recipes' loss key: torchtune's DPO losses and ours, checked to one line naming the key."""

import pytest
from omegaconf import OmegaConf

from torchtune_ext.config.preference import PREFERENCE_KEYS, check_preference_loss, preference_loss_arguments
from torchtune_ext.errors import ConfigError
from torchtune_ext.train.preference import LOSS_TYPES, PreferenceLoss


def loss(**node):
    return OmegaConf.create(node)


def test_torchtunes_losses_mean_ours():
    assert preference_loss_arguments(PREFERENCE_KEYS["loss"].default) == {
        "loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0}
    rso = loss(_component_="torchtune.rlhf.loss.RSOLoss", gamma=0.3)
    assert preference_loss_arguments(rso) == {"loss_type": "hinge", "beta": 0.3}
    simpo = loss(_component_="torchtune_ext.train.preference.PreferenceLoss", loss_type="simpo", beta=2.0, gamma=0.5)
    check_preference_loss("loss", simpo)
    built = PreferenceLoss(**preference_loss_arguments(simpo))
    assert (built.loss_type, built.beta, built.gamma, built.needs_reference) == ("simpo", 2.0, 0.5, False)


def test_the_config_knows_every_loss_type_of_the_loss():
    from torchtune_ext.config.preference import LOSS_TYPES as CONFIG_TYPES

    assert CONFIG_TYPES == LOSS_TYPES


@pytest.mark.parametrize("node,key", [
    (dict(_component_="torchtune.rlhf.loss.DPOLoss", beta=0.0), "loss.beta"),
    (dict(_component_="torchtune.rlhf.loss.RSOLoss", gamma=-1.0), "loss.gamma"),
    (dict(_component_="torchtune.rlhf.loss.DPOLoss", label_smoothing=0.5), "loss.label_smoothing"),
    (dict(_component_="torchtune.rlhf.loss.DPOLoss", gamma=0.5), "loss.gamma"),
    (dict(_component_="torchtune.rlhf.loss.DPOLoss", beta="high"), "loss.beta"),
    (dict(_component_="torchtune_ext.train.preference.PreferenceLoss", loss_type="kto"), "loss.loss_type"),
    (dict(_component_="torchtune.rlhf.loss.PPOLoss"), "loss._component_"),
])
def test_bad_loss_is_one_line_naming_its_key(node, key):
    with pytest.raises(ConfigError) as err:
        check_preference_loss("loss", loss(**node))
    assert err.value.key == key and "\n" not in str(err.value)
