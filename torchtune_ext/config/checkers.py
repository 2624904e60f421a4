"""What a config value may be: the checks of single values, and what a component node means.

Each check takes the dotted key and the value and raises
:class:`~torchtune_ext.errors.ConfigError` naming the key and what is
expected; the schema (:mod:`torchtune_ext.config.schema`) pairs them with
keys. Components (``_component_`` paths) are imported here, with the package
to install when one is missing.
"""

import importlib
from typing import Any, Callable

from omegaconf import DictConfig

from torchtune_ext.errors import ConfigError


def positive_int(key: str, value: Any) -> None:
    """An integer >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"expected a positive integer, got {value!r}")


def optional_positive_int(key: str, value: Any) -> None:
    """null, or an integer >= 1."""
    if value is not None:
        positive_int(key, value)


def non_negative_int(key: str, value: Any) -> None:
    """An integer >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, f"expected an integer >= 0, got {value!r}")


def optional_int(key: str, value: Any) -> None:
    """null, or any integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(key, f"expected an integer or null, got {value!r}")


def boolean(key: str, value: Any) -> None:
    """true or false (not a string or a number that reads as one)."""
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {value!r}")


def boolean_or_auto(key: str, value: Any) -> None:
    """true, false or the string auto."""
    if value != "auto" and not isinstance(value, bool):
        raise ConfigError(key, f"expected true, false or auto, got {value!r}")


def optional_boolean(key: str, value: Any) -> None:
    """null, true or false."""
    if value is not None:
        boolean(key, value)


def optional_positive_float(key: str, value: Any) -> None:
    """null, or a number > 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(key, f"expected a positive number or null, got {value!r}")


def string(key: str, value: Any) -> None:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"expected a non-empty string, got {value!r}")


def optional_string(key: str, value: Any) -> None:
    """null, or a non-empty string."""
    if value is not None:
        string(key, value)


def one_of(*choices: str) -> Callable[[str, Any], None]:
    """A check that the value is one of ``choices``."""
    def check(key: str, value: Any) -> None:
        if value not in choices:
            raise ConfigError(key, f"expected one of {', '.join(choices)}, got {value!r}")

    return check


def check_output_chunks(key: str, value: Any) -> None:
    """``loss.num_output_chunks``: ``auto`` or a positive integer (:mod:`torchtune_ext.train.loss`)."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, f"expected auto or a positive integer, got {value!r}")


def component_node(key: str, value: Any) -> None:
    """A mapping whose ``_component_`` names a class or function (torchtune's component config)."""
    if not isinstance(value, (dict, DictConfig)) or not isinstance(value.get("_component_"), str):
        raise ConfigError(key, "expected a mapping with a '_component_' entry naming a class or function")


def optional_component_node(key: str, value: Any) -> None:
    """A component mapping, or null (or a ``_component_`` of null: off, see :func:`enabled`)."""
    if enabled(value) is not None:
        component_node(key, value)


def enabled(node: Any) -> Any:
    """``node`` itself, or None if it is null or its ``_component_`` is null.

    ``tune run ... metric_logger=null`` sets ``metric_logger._component_`` to
    null (torchtune's shorthand for the component), which means "off".
    """
    if node is None or (isinstance(node, (dict, DictConfig)) and node.get("_component_") is None):
        return None
    return node


def switched_off(node: Any) -> bool:
    """None, or torchtune's ``key=null`` on the command line (it sets ``key._component_`` to null)."""
    return node is None or (isinstance(node, (dict, DictConfig)) and "_component_" in node
                            and node["_component_"] is None)


# Values of ``metric_logger.log_model``, as Hugging Face's WANDB_LOG_MODEL: which checkpoints become W&B artifacts.
LOG_MODEL_CHOICES = ("false", "end", "checkpoint")


def log_model_mode(metric_logger: Any) -> str:
    """``metric_logger.log_model``: ``false`` (the default, also with the logger off), ``end`` (the final
    checkpoint) or ``checkpoint`` (every checkpoint saved); YAML's ``false`` counts as ``"false"``.

    Raises:
        ConfigError: (key ``metric_logger.log_model``) any other value.
    """
    node = enabled(metric_logger)
    value = node.get("log_model", "false") if node is not None else "false"
    value = "false" if value is False else value
    if value not in LOG_MODEL_CHOICES:
        raise ConfigError("metric_logger.log_model", f"expected one of {', '.join(LOG_MODEL_CHOICES)} (which "
                          f"checkpoints W&B keeps as model artifacts: none, the final one, every one), got {value!r}")
    return value


def validation_enabled(cfg: DictConfig) -> bool:
    """Whether a recipe validates during training: ``run_val_every_n_steps`` or
    ``run_val_at_start`` asks for it (torchtune's convention: a ``dataset_val``
    alone, as in torchtune's shipped configs, does not turn validation on)."""
    return bool(cfg.get("run_val_every_n_steps") or cfg.get("run_val_at_start"))


# Multimodal model families: their forward takes images (encoder_input) and
# their data a tiled-image collator; these recipes train text decoders only.
MULTIMODAL_FAMILIES = ("torchtune.models.llama3_2_vision", "torchtune.models.llama4")


def text_model(key: str, value: Any) -> None:
    """A ``model`` component that is not a multimodal (image and text) family."""
    component_node(key, value)
    component = value["_component_"]
    if component.startswith(MULTIMODAL_FAMILIES):
        raise ConfigError(f"{key}._component_", f"{component} is a multimodal (image and text) model, which these "
                          "recipes do not train; use a text-only model (e.g. torchtune.models.llama3_1.llama3_1_8b) "
                          "or torchtune's own recipe for it")


def resolve_component(path: str) -> Any:
    """The object a ``_component_`` dotted path names, importing as needed.

    Raises:
        ValueError: no such module or attribute (the message names the part
            that is missing). Errors raised while importing an existing
            module propagate.
    """
    parts = path.split(".")
    if not path or not all(parts):
        raise ValueError(f"'{path}' is not a dotted path such as torch.optim.AdamW")
    module, found = None, 0
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            module, found = importlib.import_module(name), i
            break
        except ModuleNotFoundError as err:
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise  # an existing module failed to import one of its own dependencies
    if module is None:
        raise ValueError(f"there is no module '{parts[0]}' (is its package installed?)")
    obj = module
    for j in range(found, len(parts)):
        if not hasattr(obj, parts[j]):
            raise ValueError(f"'{'.'.join(parts[:j])}' has no attribute '{parts[j]}'")
        obj = getattr(obj, parts[j])
    return obj


def import_component(key: str, component: str) -> Any:
    """The object a ``_component_`` path names, or a :class:`ConfigError` naming the missing package.

    Raises:
        ConfigError: (key ``key``) if the module or the attribute does not
            exist; a missing package is named with what installs it.
    """
    try:
        return resolve_component(component)
    except ModuleNotFoundError as err:  # an existing module needs a package that is not installed
        package = (err.name or "").split(".")[0]
    except ValueError as err:
        package = component.split(".")[0]
        if f"there is no module '{package}'" not in str(err):
            raise ConfigError(key, f"'{component}' cannot be imported: {err}") from None
    hint = _INSTALL_HINTS.get(package, f"`pip install {package}`")
    raise ConfigError(key, f"{component} cannot be imported: there is no module '{package}' (its Python "
                      f"package is not installed): {hint}")


_INSTALL_HINTS = {
    "bitsandbytes": "`pip install bitsandbytes` (its paged optimizers need a CUDA GPU), "
                    "or use optimizer._component_=torch.optim.AdamW",
    "torchvision": "`pip install torchvision` with the version that matches torch",
}
