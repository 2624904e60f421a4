"""Recipe config: every default in one place, every error names its key.

A recipe calls :func:`validate` on the parsed OmegaConf config before it
builds anything. ``validate`` fills in defaults, checks types and ranges,
checks the keys together and that input files exist, and raises
:class:`~torchtune_ext.errors.ConfigError` naming the offending key and what
is expected. :func:`torchtune_ext.run.control.exits.exit_on_user_error` turns
such expected mistakes into one clear line on stderr and exit status 2,
without a traceback and before anything is written.

The modules, each with one job:

* :mod:`~torchtune_ext.config.checkers`: what one value may be; components and what a null one means;
* :mod:`~torchtune_ext.config.lora`: a LoRA ``model``'s adapter settings, the builder's defaults filled in;
* :mod:`~torchtune_ext.config.schema`: every key with its default, check and meaning;
* :mod:`~torchtune_ext.config.combinations`: keys valid alone that do not work together;
* :mod:`~torchtune_ext.config.files`: input files exist, output folders can be written;
* :mod:`~torchtune_ext.config.validate`: all of it, in order, once per run;
* :mod:`~torchtune_ext.config.docs`: ``docs/configuration.md``, generated from the schema.

The names below are what the rest of the library and the recipes import.
"""

from torchtune_ext.config.checkers import (
    LOG_MODEL_CHOICES,
    MULTIMODAL_FAMILIES,
    check_output_chunks,
    enabled,
    import_component,
    log_model_mode,
    resolve_component,
    validation_enabled,
)
from torchtune_ext.config.combinations import check_tensor_parallel_dim
from torchtune_ext.config.files import check_input_files, check_output_dir
from torchtune_ext.config.lora import LORA_ATTN_MODULES, LoRASettings, lora_settings
from torchtune_ext.config.schema import (
    BACKWARD_MODES,
    COMMON_KEYS,
    DISTILLATION_KEYS,
    DISTRIBUTED_KEYS,
    LORA_KEYS,
    NO_DEFAULT,
    PROFILER_COMPONENT,
    Key,
)
from torchtune_ext.config.validate import command_line_keys, ignored_keys, remind_ignored_keys, validate
from torchtune_ext.errors import ConfigError, UserError

__all__ = [
    "BACKWARD_MODES",
    "COMMON_KEYS",
    "DISTILLATION_KEYS",
    "DISTRIBUTED_KEYS",
    "LORA_ATTN_MODULES",
    "LOG_MODEL_CHOICES",
    "LORA_KEYS",
    "MULTIMODAL_FAMILIES",
    "NO_DEFAULT",
    "PROFILER_COMPONENT",
    "ConfigError",
    "Key",
    "LoRASettings",
    "UserError",
    "check_input_files",
    "check_output_chunks",
    "check_tensor_parallel_dim",
    "check_output_dir",
    "command_line_keys",
    "enabled",
    "ignored_keys",
    "import_component",
    "log_model_mode",
    "lora_settings",
    "remind_ignored_keys",
    "resolve_component",
    "validate",
    "validation_enabled",
]
