"""A sharded checkpoint of a transformers model becomes the folder HFCheckpointer writes, file by file.

In one process (DCP without a process group), on tiny random folders (tests/support/hf_tiny.py): the model's state is
saved as shards, exported with :func:`torchtune_ext.checkpoint.export_hf`, and loaded back with
``from_pretrained`` (LoRA: also ``PeftModel.from_pretrained`` on the base folder), whose logits must be the
trained model's. The multi-rank runs through the recipes are in tests/integration/recipes/test_hf.py.
"""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM

from tests.support.hf_tiny import build_loaded, write_tiny
from torchtune_ext.checkpoint import export_hf, load_model_shards
from torchtune_ext.checkpoint.sharded import sharded_state_dict
from torchtune_ext.config import ConfigError
from torchtune_ext.config.combinations import check_sharded_checkpoints
from torchtune_ext.model.hf import causal_lm

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))


def _lora_model(folder):
    from torchtune import config as tt_config

    from torchtune_ext.model.hf import HFCheckpointer, initialize_adapters, model_keys

    cfg = OmegaConf.create({"_component_": "torchtune_ext.model.hf.lora_causal_lm", "path": str(folder),
                            "lora_attn_modules": ["q_proj", "v_proj"], "apply_lora_to_mlp": True, "lora_rank": 4,
                            "lora_alpha": 8})
    model = tt_config.instantiate(cfg)
    state = HFCheckpointer(folder, folder.parent / "unused").load_checkpoint()["model"]
    model.load_state_dict(model_keys(model, state), strict=False)
    initialize_adapters(model, seed=0)
    with torch.no_grad():  # B starts at zero: a nonzero B makes the merge count
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return cfg, model


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_export_of_a_transformers_model_loads_with_its_logits(tmp_path, family, kind):
    # several base files (an index): the export follows them
    folder = write_tiny(family, tmp_path / "base")
    AutoModelForCausalLM.from_pretrained(str(folder)).save_pretrained(str(folder), max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    if kind == "full":
        cfg = OmegaConf.create({"_component_": "torchtune_ext.model.hf.causal_lm", "path": str(folder)})
        model = build_loaded(folder)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)  # not the base folder's weights
    else:
        cfg, model = _lora_model(folder)
    step = tmp_path / "step_1"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(step / "dcp"), no_dist=True)
    out = tmp_path / "hf"
    out.mkdir()
    checkpointer = OmegaConf.create({"_component_": "torchtune_ext.model.hf.HFCheckpointer",
                                     "checkpoint_dir": str(folder),
                                     "output_dir": str(tmp_path / "unused")})
    export_hf(step, out, checkpointer, cfg)
    weights = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    base = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weights) == sorted(base) and len(set(weights.values())) > 1  # the base folder's tensors, split
    with torch.no_grad():
        want = model.eval()(IDS)  # torchtune's call convention: the logits tensor
        got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(IDS).logits
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        if kind == "lora":
            from peft import PeftModel

            adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(folder)), str(out / "adapter"))
            assert (adapted.eval()(IDS).logits - want).abs().max() <= 1e-5 * want.abs().max()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name


def test_sharded_checkpoints_take_the_hf_checkpointer_and_refuse_others():
    cfg = OmegaConf.create({"sharded_checkpoints": True,
                            "checkpointer": {"_component_": "torchtune_ext.model.hf.HFCheckpointer"}})
    check_sharded_checkpoints(cfg)
    cfg.checkpointer._component_ = "torchtune.training.FullModelMetaCheckpointer"
    with pytest.raises(ConfigError, match="^config key 'sharded_checkpoints'.*FullModelMetaCheckpointer"):
        check_sharded_checkpoints(cfg)


def test_shards_load_into_a_transformers_model_built_on_meta_with_its_computed_buffers(tmp_path):
    """causal_lm on the meta device computes its RoPE frequencies on CPU (non-persistent buffers, in no
    checkpoint): loading the shards gives the parameters storage and must keep those buffers' values."""
    folder = write_tiny("qwen3", tmp_path / "base")
    trained = build_loaded(folder)
    step = tmp_path / "step_1"
    dcp.save({"model": get_model_state_dict(trained)}, checkpoint_id=str(step / "dcp"), no_dist=True)
    with torch.device("meta"):
        model = causal_lm(folder, dtype="fp32")
    load_model_shards(model, sharded_state_dict(step), torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(model.eval()(IDS), trained.eval()(IDS))
