"""Families whose layers are not all attention (LFM2, Qwen3-Next, Falcon-H1) or whose attention and experts are
unusual (DeepSeek-V3): packing, LoRA targets, the head, tensor parallelism.

Tiny random models built from a config (tests/support/hf_hybrid.py): hidden 16, one or two layers.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.hf_hybrid import HYBRID, document_leak, hybrid_model, write_hybrid
from tests.support.hf_tiny import tiny_config
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.hf.packing import mask_without_positions, packing_refusal

CPU = torch.device("cpu")
LEAK = 1e-4  # above float noise: experts regroup their tokens when another document changes (DeepSeek-V3: 7e-7)


def model_of(name):
    if name in HYBRID:
        return hybrid_model(name)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()


# ------------------------------------------------------------- packing
@pytest.mark.parametrize("name, names", [("lfm2", "Lfm2ShortConv"), ("qwen3_next", "Qwen3NextGatedDeltaNet"),
                                         ("falcon_h1", "FalconH1Mixer"), ("gpt_oss", "without the positions"),
                                         ("deepseek_v3", None), ("qwen3", None)])
def test_packing_is_refused_exactly_where_documents_see_each_other(name, names):
    """In transformers, the second document of a packed row moves when the first changes for the models refused
    (short convolution, Gated DeltaNet, Mamba2, gpt-oss's mask built without the positions), and not for the
    others; the refusal names the layer type."""
    model = model_of(name)
    why = packing_refusal(model)
    assert (document_leak(model) > LEAK) == (why is not None), (name, why)
    if names is not None:
        assert names in why


def test_a_mask_call_without_positions_is_found_in_the_source():
    """The source check itself: a stack whose mask builder gets the positions through a copied dict packs;
    the same without them does not; a stack with no mask builder does not."""
    class Good(torch.nn.Module):
        def forward(self, position_ids, create_causal_mask=None):
            kwargs = {"config": None, "position_ids": position_ids}
            sliding = kwargs.copy()
            return create_causal_mask(**kwargs), create_causal_mask(**sliding)

    class Bad(torch.nn.Module):
        def forward(self, position_ids, create_causal_mask=None):
            kwargs = {"config": None}
            return create_causal_mask(**kwargs)

    class NoBuilder(torch.nn.Module):
        def forward(self, attention_mask):
            return attention_mask

    assert mask_without_positions(Good()) is None
    assert "without the positions" in mask_without_positions(Bad())
    assert "without transformers' mask builders" in mask_without_positions(NoBuilder())


@pytest.mark.parametrize("key", ["dataset.packed", "pack_micro_batches"])
def test_the_recipes_refuse_packing_before_anything_loads(key, smollm2_assets, tmp_path):
    """configs/hf/full_single_device.yaml with an LFM2 folder, packed either way: the start-up checks name the
    key and the layer type; nothing is written."""
    from omegaconf import OmegaConf

    from tests.support.helpers import REPO_ROOT, copy_smollm2_tokenizer
    from torchtune_ext.config import validate
    from torchtune_ext.run.preflight import check_components

    folder = write_hybrid("lfm2", tmp_path / "lfm2")
    copy_smollm2_tokenizer(smollm2_assets, folder)
    data = smollm2_assets / "data" / "alpaca_en_demo.json"
    packing = ["dataset.packed=true"] if key == "dataset.packed" else [
        "pack_micro_batches=true", "max_tokens_per_micro_batch=64"]
    cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / "configs/hf/full_single_device.yaml"), OmegaConf.from_dotlist(
        [f"model_dir={folder}", f"output_dir={tmp_path / 'out'}", "tokenizer.max_seq_len=64",
         f"dataset.data_files={data}", f"dataset_val.data_files={data}", *packing]))
    with pytest.raises(ConfigError) as err:
        check_components(validate(cfg), CPU)
    assert err.value.key == key and "Lfm2ShortConv" in str(err.value) and f"{key}=false" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_packed_micro_batch_is_refused_by_the_forward(tmp_path):
    """Called outside the recipes with a packed micro-batch (a mask), the model refuses it too."""
    from tests.support.hf_tiny import build_loaded

    model = build_loaded(write_hybrid("lfm2", tmp_path / "lfm2"))
    tokens = torch.randint(3, 100, (1, 8))
    positions = torch.arange(4).repeat(2)[None]
    mask = torch.zeros(1, 8, 8, dtype=torch.bool)
    mask[:, :4, :4] = mask[:, 4:, 4:] = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="Lfm2ShortConv"):
        model(tokens, mask=mask, input_pos=positions)
    model(tokens)  # unpacked: trains as before


# ------------------------------------------------------------- LoRA targets
SHIPPED = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)  # configs/hf


def adapted(folder, **lora):
    """The names of the modules PEFT gave an adapter (fused experts: the experts module, per parameter)."""
    from peft.tuners.lora import LoraLayer

    from torchtune_ext.model.hf import lora_causal_lm

    with torch.device("meta"):
        model = lora_causal_lm(folder, **lora)
    names = [n.replace(".base_layer", "") for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    return {n for n in names if not n.endswith(".base_layer")}, model


@pytest.fixture(scope="module")
def hybrid_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {name: write_hybrid(name, root / name) for name in ("lfm2", "qwen3_next", "deepseek_v3")}


def test_lora_adapts_attention_in_every_layer_and_leaves_convolutions_and_routers_alone(hybrid_folders, caplog,
                                                                                          monkeypatch):
    """The shipped LoRA keys on LFM2 (attention in layer 1 only, behind a convolution layer) and Qwen3-Next
    (a Gated DeltaNet layer first): every attention projection and MLP linear gets an adapter; the
    convolution, the linear-attention projections and the routers (shared_expert_gate) do not; one log line
    counts them, once per process."""
    from torchtune_ext.model.hf import lora as lora_module

    monkeypatch.setattr(lora_module, "_LOGGED", set())
    with caplog.at_level("INFO", logger="torchtune_ext.model.hf.lora"):
        lfm2, _ = adapted(hybrid_folders["lfm2"], **SHIPPED)
        adapted(hybrid_folders["lfm2"], **SHIPPED)  # the recipe's build after the start-up check's: no second line
    assert {f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")} <= lfm2
    assert {f"model.layers.{i}.feed_forward.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")} <= lfm2
    assert not any(".conv." in n or n.endswith(".conv") for n in lfm2)
    assert len(lfm2) == 4 + 6
    line = [r.getMessage() for r in caplog.records if "LoRA adapters on" in r.getMessage()]
    assert len(line) == 1 and "1 q_proj" in line[0] and "2 w1" in line[0] and "1 conv (mixer)" in line[0]

    qwen, _ = adapted(hybrid_folders["qwen3_next"], **SHIPPED)
    assert {f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} <= qwen
    assert not any("linear_attn" in n or "shared_expert_gate" in n or n.endswith("mlp.gate") for n in qwen)
    assert {f"model.layers.{i}.mlp.experts" for i in (0, 1)} <= qwen  # fused experts of both layers


def test_lora_finds_experts_behind_dense_layers_and_takes_mla_names(hybrid_folders):
    """DeepSeek-V3: its first layer is dense, its experts are in the second (and get adapters); MLA has no
    q_proj, and the refusal lists the names it has; those names can be given."""
    folder = hybrid_folders["deepseek_v3"]
    with pytest.raises(ConfigError) as err:
        adapted(folder, **SHIPPED)
    assert err.value.key == "model.lora_attn_modules" and "q_a_proj" in str(err.value) and "kv_b_proj" in str(err.value)
    names, model = adapted(folder, lora_attn_modules=["q_b_proj", "kv_b_proj", "output_proj"], apply_lora_to_mlp=True)
    assert {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_b_proj", "kv_b_proj", "o_proj")} <= names
    assert "model.layers.1.mlp.experts" in names and model.peft_config["default"].target_parameters
    assert not any(n.endswith("mlp.gate") for n in names)


def test_the_config_takes_a_transformers_models_own_module_names():
    """Validation passes MLA's names for a transformers builder and still refuses them for torchtune's."""
    from omegaconf import OmegaConf

    from torchtune_ext.config import lora_settings

    hf = OmegaConf.create({"_component_": "torchtune_ext.model.hf.lora_causal_lm", "path": "/x",
                           "lora_attn_modules": ["q_a_proj", "kv_b_proj"]})
    assert lora_settings(hf).lora_attn_modules == ("q_a_proj", "kv_b_proj")
    tt = OmegaConf.create({"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b",
                           "lora_attn_modules": ["q_a_proj"]})
    with pytest.raises(ConfigError):
        lora_settings(tt)


# ------------------------------------------------------------- the head
def test_falcon_h1_logit_multiplier_is_applied_by_the_loss(tmp_path):
    """Falcon-H1 multiplies lm_head's output by lm_head_multiplier (0.5 here): our per-token losses, applying
    the output projection themselves, equal transformers' own, and differ without the multiplier."""
    import torch.nn.functional as F

    from tests.support.helpers import IGNORE
    from tests.support.hf_tiny import build_loaded, our_token_losses
    from torchtune_ext.train.loss import shift_labels

    model = build_loaded(write_hybrid("falcon_h1", tmp_path / "falcon_h1"))
    assert model._ext_head.multiply == 0.5
    tokens = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = tokens.clone()
    labels[0, :3] = IGNORE
    shifted = shift_labels(labels, IGNORE)
    keep = shifted != IGNORE
    with torch.no_grad():
        reference = model(input_ids=tokens, labels=labels)
        assert torch.equal(model(tokens), reference.logits)
        expected = F.cross_entropy(reference.logits[keep].float(), shifted[keep], reduction="none")
        hidden, ours, _ = our_token_losses(model, tokens, shifted, IGNORE)
        unscaled = F.cross_entropy(model.lm_head(hidden[keep]).float(), shifted[keep], reduction="none")
    assert (ours - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (unscaled - expected).abs().max() > 1e-2


def test_a_multiplier_that_is_not_one_number_is_refused():
    from torchtune_ext.model.hf.call import _scalar

    holder = torch.nn.Module()
    holder.scale = torch.ones(4)
    with pytest.raises(ConfigError, match="not one number"):
        _scalar(holder, "scale", torch.nn.Module)
    holder.scale = torch.tensor(0.25)
    assert _scalar(holder, "scale", torch.nn.Module) == 0.25


# ------------------------------------------------------------- tensor parallelism
def test_a_tensor_parallel_plan_that_splits_nothing_is_refused(hybrid_folders):
    """LFM2's own plan is its tied lm_head alone: tensor_parallel_dim=2 would split nothing."""
    from torchtune_ext.model.hf import causal_lm
    from torchtune_ext.parallel.hf_plan import check_tensor_parallel

    with torch.device("meta"):
        model = causal_lm(hybrid_folders["lfm2"], dtype="fp32")
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(model, None, 2, "torchtune_ext.model.hf.causal_lm")
    assert err.value.key == "tensor_parallel_dim" and "split nothing" in str(err.value)


# ------------------------------------------------------------- exactness of linear-attention layers
# batch 4 == batch 1 x 4 within docs/models.md's bound for linear-attention layers:
# tests/integration/test_hf_hybrid.py (20 s: the torch fallback of the Gated DeltaNet runs a Python loop per chunk).


def test_padding_changes_no_output_of_a_gated_deltanet_model():
    """A sample alone and padded past the next 64-token chunk gives the same logits: the chunks of the linear
    attention start at fixed positions, so the padded length changes none of them (batched rows:
    tests/integration/test_hf_hybrid.py)."""
    model = hybrid_model("qwen3_next")
    g = torch.Generator().manual_seed(0)
    sample = torch.randint(3, 100, (1, 70), generator=g)  # two chunks of 64
    padded = torch.cat([sample, torch.zeros(1, 70, dtype=torch.long)], 1)  # three chunks
    with torch.no_grad():
        alone = model(input_ids=sample, use_cache=False).logits
        row = model(input_ids=padded, use_cache=False).logits[:, :70]
    assert (row - alone).abs().max() <= 1e-5 * alone.abs().max()
