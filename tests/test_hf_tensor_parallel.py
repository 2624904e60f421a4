"""Tensor parallelism for transformers models: their own tp_plan, applied with torch's styles, equals data parallelism.

The checks run in this process on tiny models built on the meta device. The
exactness test is one 2-process launch (tests/hf_dist_worker.py, gloo on CPU):
1 data-parallel x 2 tensor-parallel ranks against 2 data-parallel ranks on the
same global batch, per family: Llama (untied output projection, split and
gathered), Qwen 3 (tied, q/k norms over each rank's own heads), Gemma 3 (tied,
a scaled embedding, a sliding window, a soft cap), OLMo 2 (q/k norms over every
head: q/k/v gathered, o_proj's input split again); and the Llama with activation
checkpointing, FSDP2's CPU offload, and torchtune's optimizer_in_bwd.
"""

import json

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import rel_diff, run_worker
from hf_tiny import COMMON, TOKENIZER_FILES, write_tiny
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf import causal_lm, lora_causal_lm
from torchtune_ext.parallel.hf_plan import check_tensor_parallel, tensor_parallel_plan

TOL = 1e-5
COMPONENT = "torchtune_ext.model.hf.causal_lm"
# adapters on every projection the plan splits: q/v and the MLP by columns, o_proj and down_proj by rows
LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=4,
            lora_alpha=8)


def write_olmo2(folder):
    """OLMo 2 is not among hf_tiny's families (nothing else tests it): its plan gathers q/k/v."""
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("olmo2", **COMMON), dtype=torch.float32)
    model.save_pretrained(str(folder))
    for file, text in TOKENIZER_FILES.items():
        (folder / file).write_text(text)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp")
    out = {name: write_tiny(name, root / name) for name in ("llama", "qwen3", "gemma3", "qwen3_moe")}
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

    from helpers import REPO_ROOT, copy_smollm2_tokenizer
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


# ------------------------------------------------------------- exactness
FAMILIES = ("llama", "qwen3", "gemma3", "olmo2")


def cases(folders):
    out = []
    for family in FAMILIES:
        # a global batch of 4 samples per step: 2 ranks x 1 x 2 micro-batches; 1 data-parallel rank x 2 x 2
        common = dict(folder=str(folders[family]), grad_accum=2, once=False)
        out += [dict(name=f"{family}_dp2", tp=1, batch_size=1, **common),
                dict(name=f"{family}_tp2", tp=2, batch_size=2, **common)]
    out.append(dict(out[1], name="llama_tp2_ac_once", ac=True, once=True))  # activation checkpointing
    out.append(dict(out[1], name="llama_tp2_offload", cpu_offload=True))  # FSDP2's CPU offload
    out += [dict(out[0], name="llama_lora_dp2", lora=LORA), dict(out[1], name="llama_lora_tp2", lora=LORA),
            dict(out[2], name="qwen3_lora_dp2", lora=LORA), dict(out[3], name="qwen3_lora_tp2", lora=LORA)]
    # torchtune's optimizer_in_bwd: one micro-batch per step, no clipping, against data parallelism so
    out += [dict(out[0], name="llama_dp2_noclip", batch_size=2, grad_accum=1, once=True, clip=None),
            dict(out[1], name="llama_tp2_in_backward", batch_size=4, grad_accum=1, once=True, clip=None,
                 in_backward=True)]
    # the mistake: the step's tokens summed over both ranks of the tensor-parallel group, i.e. counted twice
    out.append(dict(out[1], name="llama_tp2_counted_on_every_rank", count_all_ranks=True))
    return out


@pytest.fixture(scope="module")
def results(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tp_run") / "results.pt"
    proc = run_worker(2, "hf_dist_worker.py", str(out), str(folders["llama"]), json.dumps(cases(folders)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def assert_same_run(got, ref):
    assert len(got["steps"]) == len(ref["steps"]) == 2
    for a, b in zip(got["steps"], ref["steps"]):
        assert a["num_tokens"] == b["num_tokens"]
        assert abs(a["loss"] - b["loss"]) <= TOL * b["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * b["grad_norm"], (a, b)
    assert got["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        assert rel_diff(got["params"][key], value) <= TOL, key


REFERENCE = {"llama_tp2_in_backward": "llama_dp2_noclip", "llama_lora_tp2": "llama_lora_dp2",
             "qwen3_lora_tp2": "qwen3_lora_dp2"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"{f}_tp2" for f in FAMILIES] + ["llama_tp2_ac_once", "llama_tp2_offload",
                                                                      "llama_tp2_in_backward", "llama_lora_tp2",
                                                                      "qwen3_lora_tp2"])
def test_two_tensor_parallel_ranks_equal_two_data_parallel(results, name):
    """Loss, grad norm (before clipping) and trained weights (gathered: the state dict has no trace of the
    split) of 1 x 2 tensor parallel equal 2 x 1 data parallel on the same global batch."""
    reference = results[REFERENCE.get(name, f"{name.split('_')[0]}_dp2")]
    assert results[name]["mesh"] == (1, 2) and reference["mesh"] == (2, 1)
    assert_same_run(results[name], reference)


@pytest.mark.slow
def test_counting_tokens_on_every_rank_is_caught(results):
    got, ref = results["llama_tp2_counted_on_every_rank"], results["llama_dp2"]
    assert [s["num_tokens"] for s in got["steps"]] == [2 * s["num_tokens"] for s in ref["steps"]]
    assert got["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"] / 2, rel=1e-5)
    with pytest.raises(AssertionError):
        assert_same_run(got, ref)
