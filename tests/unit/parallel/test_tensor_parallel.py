"""Tensor parallelism x FSDP2: the plan, and bad input refused before anything loads.

In this process, on models built on the meta device. The exactness of the
training (2 data-parallel x 2 tensor-parallel ranks against 4 data-parallel
ranks): tests/integration/distributed/test_tensor_parallel.py.
"""

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, ConfigError, validate
from torchtune_ext.parallel.tensor_parallel import PLAN_FAMILIES, check_tensor_parallel, tensor_parallel_plan
from torchtune_ext.train.grad_norm import split_dims

TINY = "torchtune_ext.model.builders.tiny_llama"


# ------------------------------------------------------------- the checks
def test_split_dims_count_each_part_once():
    """A weight split over dp and tp (FSDP2 over a tensor-parallel split: _StridedShard) adds its parts up over
    both; one whole on every tensor-parallel rank (a norm's) over dp only; pending sums have no norm of parts."""
    assert split_dims((_StridedShard(0, split_factor=2), Shard(0))) == (0, 1)
    assert split_dims((Shard(0), Shard(1))) == (0, 1)
    assert split_dims((Shard(0), Replicate())) == (0,)
    assert split_dims((Shard(0),)) == (0,)
    with pytest.raises(ValueError, match="pending reduction"):
        split_dims((Shard(0), Partial()))


def meta(component=TINY, **kwargs):
    from torchtune import config as tt_config

    with torch.device("meta"):
        return tt_config.instantiate(OmegaConf.create({"_component_": component, **kwargs}))


def test_the_llama_plan_fits_tied_and_untied_models():
    plan = tensor_parallel_plan(None, TINY)
    assert {"output", "tok_embeddings", "layers.*.attn.q_proj", "layers.*.mlp.w2"} <= set(plan)
    check_tensor_parallel(meta(), plan, 2, TINY)  # tied: the output is the split embedding
    qwen2 = "torchtune.models.qwen2.qwen2"
    check_tensor_parallel(meta(qwen2, vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                               intermediate_dim=64, max_seq_len=128, tie_word_embeddings=False),
                          tensor_parallel_plan(None, qwen2), 2, qwen2)
    assert "qwen2" in PLAN_FAMILIES and "gemma" not in PLAN_FAMILIES


@pytest.mark.parametrize("heads,kv_heads,tp,bad", [(4, 1, 2, "num_kv_heads=1"), (6, 6, 4, "num_heads=6")])
def test_tensor_parallel_dim_must_divide_the_head_counts(heads, kv_heads, tp, bad):
    model = meta(num_heads=heads, num_kv_heads=kv_heads, embed_dim=48)
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(model, tensor_parallel_plan(None, TINY), tp, TINY)
    assert err.value.key == "tensor_parallel_dim"
    assert bad in str(err.value) and "whole heads" in str(err.value) and "\n" not in str(err.value)


def test_the_fix_names_what_fits_both_the_model_and_the_ranks():
    """SmolLM2's 9 heads and 3 key/value heads on 2 ranks: only 1 fits; 3 needs a multiple of 3 ranks."""
    model = meta(num_heads=9, num_kv_heads=3, embed_dim=72)
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(model, tensor_parallel_plan(None, TINY), 2, TINY, world_size=2)
    assert str(err.value).endswith("on 2 ranks use 1 (3 needs a multiple of that many ranks)"), str(err.value)
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(model, tensor_parallel_plan(None, TINY), 2, TINY, world_size=6)
    assert str(err.value).endswith("on 6 ranks use 1 or 3"), str(err.value)


def test_a_model_without_a_plan_is_refused():
    with pytest.raises(ConfigError) as err:
        tensor_parallel_plan(None, "torchtune.models.gemma.gemma_2b")
    assert err.value.key == "tensor_parallel_plan" and "has no tensor-parallel plan" in str(err.value)
    assert "tensor_parallel_dim=1" in str(err.value)
    # a transformers model brings its own (tests/unit/parallel/test_hf_tensor_parallel.py)
    assert tensor_parallel_plan(None, "torchtune_ext.model.hf.causal_lm") is None


def test_lora_splits_with_its_base_but_dora_and_qlora_do_not():
    lora = meta("torchtune_ext.model.builders.lora_tiny_llama", lora_attn_modules=["q_proj", "v_proj"])
    check_tensor_parallel(lora, tensor_parallel_plan(None, TINY), 2, TINY)
    dora = meta("torchtune_ext.model.builders.lora_tiny_llama", lora_attn_modules=["q_proj", "v_proj"], use_dora=True)
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(dora, tensor_parallel_plan(None, TINY), 2, TINY)
    assert err.value.key == "tensor_parallel_plan" and "DoRA's magnitude" in str(err.value), str(err.value)
    # QLoRA: NF4 needs weights of 64 x 256 values at least, more than the tiny model's
    from torchtune.modules.peft import LoRALinear

    from torchtune_ext.parallel.lora import refusal

    assert refusal(LoRALinear(128, 128, rank=2, alpha=4, quantize_base=True)) == "its base weight is quantized (NF4)"
    assert refusal(LoRALinear(128, 128, rank=2, alpha=4)) is None


def test_a_plan_that_names_no_module_is_refused():
    plan = {**tensor_parallel_plan(None, TINY), "layers.*.attn.qkv_proj": tensor_parallel_plan(None, TINY)["output"]}
    with pytest.raises(ConfigError, match="'layers.*.attn.qkv_proj' names no module"):
        check_tensor_parallel(meta(), plan, 2, TINY)


def test_tensor_parallel_dim_must_divide_the_ranks(cfg, monkeypatch):
    cfg.tensor_parallel_dim = 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert validate(cfg, extra_keys=DISTRIBUTED_KEYS).tensor_parallel_dim == 2
    cfg.tensor_parallel_dim = 3
    with pytest.raises(ConfigError) as err:
        validate(cfg, extra_keys=DISTRIBUTED_KEYS)
    assert err.value.key == "tensor_parallel_dim"
    assert "3 does not divide the 4 ranks" in str(err.value) and "use one of 1, 2, 4" in str(err.value)


def test_compiling_is_refused_under_tensor_parallelism(cfg, monkeypatch):
    """Compiled tensor-parallel layers trained with other gradients than uncompiled ones (docs/distributed.md)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg.compile = True
    assert validate(cfg, extra_keys=DISTRIBUTED_KEYS).compile  # data parallel: compiled and exact
    cfg.tensor_parallel_dim = 2
    with pytest.raises(ConfigError) as err:
        validate(cfg, extra_keys=DISTRIBUTED_KEYS)
    assert err.value.key == "compile" and "set compile=false, or tensor_parallel_dim=1" in str(err.value)


def test_the_config_check_finds_them_before_anything_loads(cfg, monkeypatch):
    """preflight (run before the data, weights or output_dir are touched) builds the model on meta and checks."""
    from torchtune_ext.run.preflight import check_components

    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg.tensor_parallel_dim = 4
    cfg.model = {"_component_": TINY, "num_heads": 4, "num_kv_heads": 2}
    cfg = validate(cfg, extra_keys=DISTRIBUTED_KEYS)
    with pytest.raises(ConfigError, match="num_kv_heads=2"):
        check_components(cfg, torch.device("cpu"))
    dora = validate(OmegaConf.merge(cfg, {"model": {"_component_": "torchtune_ext.model.builders.lora_tiny_llama",
                                                    "lora_attn_modules": ["q_proj"], "num_kv_heads": 4,
                                                    "use_dora": True},
                                          "tensor_parallel_dim": 2}),
                    extra_keys={**LORA_KEYS, **DISTRIBUTED_KEYS})
    with pytest.raises(ConfigError, match="DoRA's magnitude normalizes"):
        check_components(dora, torch.device("cpu"))
