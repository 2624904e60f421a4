"""Tensor parallelism for transformers models: their own tp_plan in torch's styles, and its checks.

In this process, on tiny models built on the meta device. The exactness of the
training (1 data-parallel x 2 tensor-parallel ranks against 2 data-parallel
ranks, per family): tests/integration/distributed/test_hf_tensor_parallel.py.
"""

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from tests.support.hf_tiny import write_olmo2, write_tiny
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf import causal_lm, lora_causal_lm
from torchtune_ext.parallel.hf_plan import check_tensor_parallel, tensor_parallel_plan

COMPONENT = "torchtune_ext.model.hf.causal_lm"
# adapters on every projection the plan splits: q/v and the MLP by columns, o_proj and down_proj by rows
LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=4,
            lora_alpha=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp")
    out = {name: write_tiny(name, root / name) for name in ("llama", "qwen3", "qwen3_moe")}
    out["olmo2"] = write_olmo2(root / "olmo2")
    return out


def meta_model(folder, **kwargs):
    with torch.device("meta"):
        return causal_lm(folder, dtype="fp32", **kwargs)


# ------------------------------------------------------------- the plan and its checks
def test_the_plan_is_transformers_own_in_torch_styles(folders):
    untied = tensor_parallel_plan(meta_model(folders["llama"]))
    assert isinstance(untied["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(untied["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(untied["lm_head"], ColwiseParallel)  # split, its logits gathered
    assert len(untied) == 8
    tied = tensor_parallel_plan(meta_model(folders["qwen3"]))
    assert "lm_head" not in tied  # a tied output projection stays whole with its embedding
    assert isinstance(tied["model.layers.*.self_attn.q_norm"], SequenceParallel)
    check_tensor_parallel(meta_model(folders["qwen3"]), None, 2, COMPONENT)
    check_tensor_parallel(meta_model(folders["olmo2"]), None, 2, COMPONENT)


def test_tensor_parallel_dim_must_divide_the_head_counts(folders):
    """4 query heads, 2 key/value heads: 4 ranks would split a key/value head."""
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(meta_model(folders["qwen3"]), None, 4, COMPONENT)
    assert err.value.key == "tensor_parallel_dim"
    assert "does not divide the num_key_value_heads=2" in str(err.value) and "whole heads" in str(err.value)
    assert "use a divisor of 2" in str(err.value) and "\n" not in str(err.value)


def test_tensor_parallel_dim_must_divide_what_a_style_splits(folders):
    """OLMo 2 splits no head (q/k/v gathered), but q/k/v's 32 output features must split evenly."""
    check_tensor_parallel(meta_model(folders["olmo2"]), None, 4, COMPONENT)  # 4 heads, 2 kv heads: not checked
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(meta_model(folders["olmo2"]), None, 3, COMPONENT)
    assert err.value.key == "tensor_parallel_dim"
    assert "3 does not divide the 32 rows of model.layers.0.self_attn.q_proj" in str(err.value)


def test_expert_styles_are_refused(folders):
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(meta_model(folders["qwen3_moe"]), None, 2, COMPONENT)
    assert err.value.key == "tensor_parallel_plan" and "mlp.experts" in str(err.value)
    assert "tensor_parallel_dim=1" in str(err.value)


def test_lora_layers_split_and_dora_is_refused(folders):
    """PEFT's LoRA linears take the column or row split of the plan (torchtune_ext.parallel.lora); DoRA's
    magnitude normalizes over every input feature and is refused."""
    with torch.device("meta"):
        lora = lora_causal_lm(folders["llama"], dtype="fp32", **LORA)
        dora = lora_causal_lm(folders["llama"], dtype="fp32", use_dora=True, **LORA)
    check_tensor_parallel(lora, None, 2, COMPONENT)
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(dora, None, 2, COMPONENT)
    assert err.value.key == "tensor_parallel_plan" and "DoRA's magnitude" in str(err.value)
    assert "tensor_parallel_dim=1" in str(err.value)


def test_the_recipes_refuse_it_before_anything_loads(folders, smollm2_assets, monkeypatch, tmp_path):
    """configs/hf/full.yaml on 2 ranks with tensor_parallel_dim=2 and a mixture-of-experts folder: the
    start-up checks (model built on meta) name the key and the module; nothing is written."""
    from omegaconf import OmegaConf

    from tests.support.helpers import REPO_ROOT, copy_smollm2_tokenizer
    from torchtune_ext.config import DISTRIBUTED_KEYS, validate
    from torchtune_ext.run.preflight import check_components

    copy_smollm2_tokenizer(smollm2_assets, folders["qwen3_moe"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / "configs/hf/full.yaml"), OmegaConf.from_dotlist(
        [f"model_dir={folders['qwen3_moe']}", f"output_dir={tmp_path / 'out'}", "tensor_parallel_dim=2",
         "tokenizer.max_seq_len=256", f"dataset.data_files={smollm2_assets / 'data' / 'alpaca_en_demo.json'}",
         f"dataset_val.data_files={smollm2_assets / 'data' / 'alpaca_en_demo.json'}"]))
    with pytest.raises(ConfigError) as err:
        check_components(validate(cfg, extra_keys=DISTRIBUTED_KEYS), torch.device("cpu"))
    assert err.value.key == "tensor_parallel_plan" and "'packed_colwise'" in str(err.value)
    assert not (tmp_path / "out").exists()
