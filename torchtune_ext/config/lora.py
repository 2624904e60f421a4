"""A LoRA ``model`` config's adapter settings, the builder's own defaults filled in.

In the LoRA recipes the adapter settings live under ``model`` (torchtune's
vocabulary, passed to the LoRA builder as they are). Settings the config
leaves out take the builder's own defaults (read from its signature), so a
torchtune LoRA config means here what it means upstream.
"""

import inspect
from dataclasses import dataclass
from typing import Any, Tuple

from omegaconf import OmegaConf

from torchtune_ext.config.checkers import boolean, import_component, positive_int, text_model
from torchtune_ext.errors import ConfigError
from torchtune_ext.moved import canonical

LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")


@dataclass(frozen=True)
class LoRASettings:
    """The adapter settings of a LoRA ``model`` config, the builder's defaults filled in.

    ``apply_lora_to_output`` is False for builders without that argument
    (their output projection is the tied token embedding).
    """

    lora_attn_modules: Tuple[str, ...]
    apply_lora_to_mlp: bool
    apply_lora_to_output: bool
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    use_dora: bool
    quantize_base: bool


def lora_settings(cfg_model: Any, key: str = "model") -> LoRASettings:
    """Resolve and check the LoRA settings of a ``model`` config.

    Args:
        cfg_model: the ``model`` node (``_component_`` naming a torchtune LoRA
            builder, plus its arguments).
        key: the config key of ``cfg_model``, for messages.

    Returns:
        LoRASettings: explicit values, else the builder's defaults.

    Raises:
        ConfigError: naming ``model.<argument>`` for a missing, mistyped or
            out-of-range setting, or one the builder does not take.
    """
    value = OmegaConf.to_container(cfg_model) if OmegaConf.is_config(cfg_model) else dict(cfg_model)
    text_model(key, value)
    builder = import_component(f"{key}._component_", value["_component_"])
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):  # no introspectable signature: only what the config says
        params = {}
    merged = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    merged.update({k: v for k, v in value.items() if k != "_component_"})
    for name in ("apply_lora_to_mlp", "apply_lora_to_output", "use_dora", "quantize_base"):
        merged.setdefault(name, False)
        boolean(f"{key}.{name}", merged[name])
    modules = merged.get("lora_attn_modules")
    # a transformers model also takes its own module names (MLA's q_a_proj), checked against the model when built
    own_names = canonical(str(value["_component_"])).startswith("torchtune_ext.model.hf.")
    if (not isinstance(modules, list) or len(set(modules)) != len(modules)
            or any(not isinstance(m, str) or (m not in LORA_ATTN_MODULES and not own_names) for m in modules)):
        raise ConfigError(f"{key}.lora_attn_modules",
                          f"expected a list of distinct names from {', '.join(LORA_ATTN_MODULES)}, got {modules!r}")
    if not (modules or merged["apply_lora_to_mlp"] or merged["apply_lora_to_output"]):
        raise ConfigError(f"{key}.lora_attn_modules", "no module would get an adapter: name at least one "
                          "attention projection or set apply_lora_to_mlp=true")
    positive_int(f"{key}.lora_rank", merged.get("lora_rank"))
    alpha = merged.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConfigError(f"{key}.lora_alpha", f"expected a positive number (adapters are scaled by "
                          f"lora_alpha / lora_rank), got {alpha!r}")
    dropout = merged.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"{key}.lora_dropout", f"expected a probability in [0, 1), got {dropout!r}")
    return LoRASettings(tuple(modules), merged["apply_lora_to_mlp"], merged["apply_lora_to_output"],
                        merged["lora_rank"], alpha, dropout, merged["use_dora"], merged["quantize_base"])
