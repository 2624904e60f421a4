"""The preference recipes' keys (``*_dpo_*.py``): the loss of a pair, and what pairs cannot do.

:data:`PREFERENCE_KEYS` replace the common keys of the same name
(:func:`torchtune_ext.config.validate` takes them as ``extra_keys``):

* ``loss``: torchtune's ``DPOLoss`` (``beta``, ``label_smoothing``) and
  ``RSOLoss`` (``gamma``: the hinge loss) as torchtune's DPO configs name
  them, or ours, ``torchtune_ext.train.preference.PreferenceLoss`` with
  ``loss_type`` one of :data:`LOSS_TYPES` (DPO's ``sigmoid``, ``ipo``,
  ``hinge``, ``simpo``, ``reference_free``);
* ``pack_micro_batches`` must stay false: the two responses of a pair are
  two rows, each attending only to its own prompt (docs/preference.md);
* ``dataset`` and ``dataset_val``: preference datasets, not packed.
"""

from typing import Any, Dict, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_ext.config.checkers import boolean, component_node, switched_off
from torchtune_ext.config.schema import COMMON_KEYS, Key
from torchtune_ext.errors import ConfigError

PREFERENCE_LOSS = "torchtune_ext.train.preference.PreferenceLoss"
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "reference_free")

# component -> (its arguments, the loss_type it is)
_LOSSES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "torchtune.rlhf.loss.DPOLoss": (("beta", "label_smoothing"), "sigmoid"),
    "torchtune.rlhf.loss.dpo.DPOLoss": (("beta", "label_smoothing"), "sigmoid"),
    "torchtune.rlhf.loss.RSOLoss": (("gamma",), "hinge"),
    "torchtune.rlhf.loss.dpo.RSOLoss": (("gamma",), "hinge"),
    PREFERENCE_LOSS: (("loss_type", "beta", "label_smoothing", "gamma"), ""),
}

PREFERENCE_LOSSES = tuple(_LOSSES)  # the loss components a preference recipe accepts


def preference_loss_arguments(value: Any) -> Dict[str, Any]:
    """The :class:`~torchtune_ext.train.preference.PreferenceLoss` arguments a checked ``loss`` node means
    (torchtune's ``DPOLoss(beta, label_smoothing)``: sigmoid; ``RSOLoss(gamma)``: hinge with beta = gamma)."""
    node = OmegaConf.to_container(value) if isinstance(value, DictConfig) else dict(value)
    component = node.pop("_component_")
    loss_type = _LOSSES[component][1]
    if loss_type == "hinge":
        return {"loss_type": "hinge", "beta": node.get("gamma", 0.1)}
    if loss_type:
        node["loss_type"] = loss_type
    return node


def check_preference_loss(key: str, value: Any) -> None:
    """``loss`` of a preference recipe: a known component, known arguments, ``beta > 0``,
    ``0 <= label_smoothing < 0.5``."""
    component_node(key, value)
    component = str(value.get("_component_"))
    if component not in _LOSSES:
        raise ConfigError(f"{key}._component_", f"{component} is not a preference loss these recipes compute "
                          f"exactly; use torchtune.rlhf.loss.DPOLoss or {PREFERENCE_LOSS} (loss_type: "
                          f"{', '.join(LOSS_TYPES)})")
    allowed = _LOSSES[component][0]
    for name in value:
        if name != "_component_" and name not in allowed:
            raise ConfigError(f"{key}.{name}", f"is not an argument of {component}; it takes {', '.join(allowed)}")
    args = preference_loss_arguments(value)
    if args.get("loss_type", "sigmoid") not in LOSS_TYPES:
        raise ConfigError(f"{key}.loss_type", f"expected one of {', '.join(LOSS_TYPES)}, got {args['loss_type']!r}")
    for name in ("beta", "label_smoothing", "gamma"):
        if name in args and (isinstance(args[name], bool) or not isinstance(args[name], (int, float))):
            raise ConfigError(f"{key}.{name}", f"expected a number, got {args[name]!r}")
    beta_key = f"{key}.gamma" if "gamma" in value and component != PREFERENCE_LOSS else f"{key}.beta"
    if not args.get("beta", 0.1) > 0:
        raise ConfigError(beta_key, f"must be > 0 (the inverse temperature of the preference), got {args['beta']}")
    if not 0 <= args.get("label_smoothing", 0.0) < 0.5:
        raise ConfigError(f"{key}.label_smoothing", f"must be in [0, 0.5) (the assumed share of flipped "
                          f"preferences), got {args['label_smoothing']}")


def _pairs(key: str, value: Any) -> None:
    items = list(value) if isinstance(value, (list, ListConfig)) else [value]
    for i, item in enumerate(items):
        item_key = key if len(items) == 1 else f"{key}[{i}]"
        component_node(item_key, item)
        if bool(item.get("packed", False)):
            raise ConfigError(f"{item_key}.packed", "preference pairs are not packed: each response attends "
                              "only to its own prompt in a row of its own; set packed=false")


def _optional_pairs(key: str, value: Any) -> None:
    if not switched_off(value):
        _pairs(key, value)


def _not_packed(key: str, value: Any) -> None:
    boolean(key, value)
    if value:
        raise ConfigError(key, "is not supported by the preference recipes (a pair's two responses are two "
                          "rows); set pack_micro_batches=false")


PREFERENCE_KEYS: Dict[str, Key] = {
    "loss": Key({"_component_": "torchtune.rlhf.loss.DPOLoss", "beta": 0.1, "label_smoothing": 0.0},
                check_preference_loss, doc=(
        "The loss of a preference pair, summed over the step's pairs and divided once by their number: "
        "torchtune.rlhf.loss.DPOLoss (beta, label_smoothing), RSOLoss (gamma: hinge), or "
        "torchtune_ext.train.preference.PreferenceLoss (loss_type sigmoid, ipo, hinge, simpo, reference_free; "
        "docs/preference.md).")),
    "dataset": Key(COMMON_KEYS["dataset"].default, _pairs, required=True, doc=(
        "The preference dataset (torchtune.datasets.preference_dataset, stack_exchange_paired_dataset: chosen "
        "and rejected responses), or a list of them; batch_size counts pairs.")),
    "dataset_val": Key(None, _optional_pairs, doc=(
        "A held-out preference dataset: validation reports the loss and pair metrics as means over its pairs.")),
    "pack_micro_batches": Key(False, _not_packed, doc="Must be false: a pair's responses are two rows."),
    "precompute_reference_log_probs": Key(False, boolean, doc=(
        "Run the reference model over every training and validation pair once before training and store the "
        "summed log-probabilities in output_dir/reference_log_probs.pt (with a fingerprint of the pairs and "
        "the model); training never runs the reference, a resume reads the file (docs/preference.md).")),
}
