"""Models: torchtune's builders and transformers' models, built, wrapped, sharded and loaded alike.

* :mod:`~torchtune_ext.model.builders`: SmolLM2-135M (full and LoRA) and a tiny Llama, torchtune decoders;
* :mod:`~torchtune_ext.model.build`: any model a config names, built, sharded and loaded;
* :mod:`~torchtune_ext.model.lora`: a LoRA model's weights: the frozen base, DoRA's magnitudes, a resumed adapter;
* :mod:`~torchtune_ext.model.runtime`: activation checkpointing, offloading, compiling as the config asks;
* :mod:`~torchtune_ext.model.hf`: transformers models (folder, call convention, build; LoRA with PEFT;
  the checkpointer). Imported by name only: transformers takes seconds to import.

The builders and the building functions are re-exported here (``_component_:
torchtune_ext.model.smollm2_135m``; the former ``torchtune_ext.models``).
"""

from torchtune_ext.model.build import (
    adapter_params,
    build_model,
    check_tensor_parallel,
    decoder_layer_classes,
    initialize_adapters,
    instantiate_lora_model,
    is_hf_config,
    is_hf_model,
    load_model_state,
    load_sharded_model_state,
    nf4_error,
    quantizes_base,
    shard_model,
)
from torchtune_ext.model.builders import (
    initialize_torchtune_adapters,
    lora_smollm2_135m,
    lora_tiny_llama,
    smollm2_135m,
    tiny_llama,
)

__all__ = ["adapter_params", "build_model", "check_tensor_parallel", "decoder_layer_classes", "initialize_adapters",
           "initialize_torchtune_adapters", "instantiate_lora_model", "is_hf_config", "is_hf_model",
           "load_model_state", "load_sharded_model_state", "lora_smollm2_135m", "lora_tiny_llama", "nf4_error",
           "quantizes_base", "shard_model", "smollm2_135m", "tiny_llama"]
