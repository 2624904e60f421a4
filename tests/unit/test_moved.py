"""The module paths of the library before its packages keep working (torchtune_ext.moved).

The commands under their old module paths: tests/integration/test_moved.py.

The list below is what the shipped configs, the docs and torchtune-style
configs named before the layout changed: every component must resolve to the
same object as its current path, every old module path must import as the
very module it moved to (one object: monkeypatching and isinstance see one
module), and the code that reads component paths as text must read the old
spelling as the new one.
"""

import importlib
import sys

import pytest
from omegaconf import OmegaConf
from torchtune.config._utils import _get_component_from_path

from torchtune_ext import moved

# _component_ paths of the configs shipped before the layered packages (git show 598b2e0:configs/...)
OLD_COMPONENTS = {
    "torchtune_ext.loss.SummedCrossEntropyLoss": "torchtune_ext.train.loss.SummedCrossEntropyLoss",
    "torchtune_ext.hf.HFCheckpointer": "torchtune_ext.model.hf.HFCheckpointer",
    "torchtune_ext.hf.checkpointer.HFCheckpointer": "torchtune_ext.model.hf.checkpointer.HFCheckpointer",
    "torchtune_ext.hf.tokenizer.hf_tokenizer": "torchtune_ext.data.hf_tokenizer.hf_tokenizer",
    "torchtune_ext.hf.causal_lm": "torchtune_ext.model.hf.causal_lm",
    "torchtune_ext.hf.lora_causal_lm": "torchtune_ext.model.hf.lora_causal_lm",
    "torchtune_ext.tokenizer.smollm2_tokenizer": "torchtune_ext.data.tokenizer.smollm2_tokenizer",
    "torchtune_ext.models.smollm2_135m": "torchtune_ext.model.builders.smollm2_135m",
    "torchtune_ext.models.lora_smollm2_135m": "torchtune_ext.model.builders.lora_smollm2_135m",
    "torchtune_ext.models.tiny_llama": "torchtune_ext.model.builders.tiny_llama",
    "torchtune_ext.models.lora_tiny_llama": "torchtune_ext.model.builders.lora_tiny_llama",
    "torchtune_ext.data.collate_packed": "torchtune_ext.data.datasets.collate_packed",
    "torchtune_ext.memory.MemoryGuard": "torchtune_ext.train.memory.MemoryGuard",
    "torchtune_ext.distributed.shard_model": "torchtune_ext.parallel.fsdp.shard_model",
    "torchtune_ext.runtime.embedding_rows_into_grad": "torchtune_ext.model.runtime.embedding_rows_into_grad",
}


@pytest.mark.parametrize("old,new", sorted(OLD_COMPONENTS.items()))
def test_an_old_component_path_resolves_to_the_same_object(old, new):
    assert _get_component_from_path(old) is _get_component_from_path(new)


@pytest.mark.parametrize("old", sorted(f"torchtune_ext.{name}" for name in moved.MOVED))
def test_an_old_module_path_is_the_module_it_moved_to(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(moved.current_module(old))
    assert sys.modules[old] is module


def test_a_module_of_a_package_that_moved_whole_is_found_under_its_old_package():
    assert importlib.import_module("torchtune_ext.control.exits") is importlib.import_module(
        "torchtune_ext.run.control.exits")
    # a module that is new in the package is still one object under the old package's name
    new_in_package = importlib.import_module("torchtune_ext.model.hf.folder")
    assert importlib.import_module("torchtune_ext.hf.folder") is new_in_package


def test_canonical_spells_names_as_they_are_now_and_leaves_others_alone():
    assert moved.canonical("torchtune_ext.models.smollm2_135m") == "torchtune_ext.model.smollm2_135m"
    assert moved.canonical("torchtune_ext.hf.causal_lm") == "torchtune_ext.model.hf.causal_lm"
    assert moved.canonical("torchtune_ext.hf.tokenizer.hf_tokenizer") == "torchtune_ext.data.hf_tokenizer.hf_tokenizer"
    assert moved.canonical("torchtune_ext.control.exits.run_main") == "torchtune_ext.run.control.exits.run_main"
    for same in ("torchtune_ext.train.loss.SummedCrossEntropyLoss", "torchtune.models.llama3_2.llama3_2_1b", "torch"):
        assert moved.canonical(same) == same


def test_code_that_reads_component_paths_reads_the_old_spelling_as_the_new():
    from torchtune_ext.config.combinations import HF_CHECKPOINTERS
    from torchtune_ext.config.upstream import model_family
    from torchtune_ext.model.build import is_hf_config

    assert is_hf_config(OmegaConf.create({"_component_": "torchtune_ext.hf.causal_lm"}))
    assert is_hf_config(OmegaConf.create({"_component_": "torchtune_ext.model.hf.lora_causal_lm"}))
    assert not is_hf_config(OmegaConf.create({"_component_": "torchtune_ext.models.smollm2_135m"}))
    for component in ("torchtune_ext.models.smollm2_135m", "torchtune_ext.model.builders.smollm2_135m",
                      "torchtune_ext.model.smollm2_135m"):
        assert model_family(component) == "llama3_2"
    assert model_family("torchtune_ext.hf.causal_lm") is None
    assert moved.canonical("torchtune_ext.hf.HFCheckpointer") in HF_CHECKPOINTERS
