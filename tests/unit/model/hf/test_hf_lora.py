"""LoRA and DoRA on transformers models through PEFT, from torchtune's LoRA keys (torchtune_ext.model.hf.lora).

Checked: which modules get adapters per family; a trained adapter saved by
HFCheckpointer loads with ``PeftModel.from_pretrained`` onto the base folder,
and the merged folder with plain transformers, both with the trained model's
logits; the resume file loads back into a fresh model; the base never moves.
"""

import json

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.support.helpers import IGNORE, instruct_samples, rel_diff, windows
from tests.support.hf_tiny import TinyFolders
from torchtune_ext.checkpoint import CheckpointManager, Progress
from torchtune_ext.config import ConfigError
from torchtune_ext.model.hf import (
    HFCheckpointer,
    adapter_params,
    initialize_adapters,
    initialize_dora_magnitude,
    load_state,
    lora_causal_lm,
    lora_checkpoint_state,
    lora_config,
    model_keys,
)
from torchtune_ext.model.hf.build import causal_lm
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
ALL_ATTENTION = ["q_proj", "k_proj", "v_proj", "output_proj"]
TOKENS = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return TinyFolders(tmp_path_factory.mktemp("hf_lora"))


def test_torchtune_keys_map_onto_each_familys_modules(folders):
    config = lora_config(causal_lm(folders("llama")), lora_attn_modules=ALL_ATTENTION, apply_lora_to_mlp=True,
                         apply_lora_to_output=True, lora_rank=4, lora_alpha=8)
    assert config.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "lm_head"}
    assert config.r == 4 and config.lora_alpha == 8 and not config.target_parameters
    moe = lora_config(causal_lm(folders("qwen3_moe")), lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True)
    assert moe.target_modules == {"q_proj", "v_proj"}  # the router (mlp.gate) gets none
    assert moe.target_parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    oss = lora_config(causal_lm(folders("gpt_oss")), lora_attn_modules=["output_proj"], apply_lora_to_mlp=True)
    assert oss.target_modules == {"o_proj"} and oss.target_parameters == ["mlp.experts.down_proj",
                                                                          "mlp.experts.gate_up_proj"]


def test_what_peft_cannot_do_is_refused_naming_the_key(folders):
    qwen3 = causal_lm(folders("qwen3"))  # tied embeddings
    with pytest.raises(ConfigError) as err:
        lora_config(qwen3, lora_attn_modules=["q_proj"], apply_lora_to_output=True)
    assert err.value.key == "model.apply_lora_to_output" and "tied" in str(err.value)
    with pytest.raises(ConfigError) as err:
        lora_config(qwen3, lora_attn_modules=["qkv_proj"])
    assert err.value.key == "model.lora_attn_modules"
    with pytest.raises(ConfigError) as err:
        lora_config(causal_lm(folders("qwen3_moe")), lora_attn_modules=["q_proj"], apply_lora_to_mlp=True,
                    use_dora=True)
    assert err.value.key == "model.use_dora"


def build(folder, seed=7, **lora):
    """The LoRA recipes' flow: on meta, adapters initialized from the seed, base weights loaded."""
    with torch.device("meta"):
        model = lora_causal_lm(folder, dtype="fp32", **lora)
    initialize_adapters(model, seed)
    base = HFCheckpointer(folder, folder.parent / "unused_out").load_checkpoint()["model"]
    missing, unexpected = load_state(model, model_keys(model, base), CPU, strict=False)
    assert missing and all(".lora_" in key for key in missing) and not unexpected
    if lora.get("use_dora"):
        initialize_dora_magnitude(model)
    return model, base


def train(model, steps=2):
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    optimizer = torch.optim.SGD(list(adapter_params(model).values()), lr=2.0)
    samples = instruct_samples([2, 4, 1, 3], [6, 3, 8, 5])
    for i, window in enumerate(windows(samples, 2, 1)[:steps]):
        assert train_step(model, optimizer, loss_fn, window, device=CPU, step=i + 1).skipped is None


def logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


CASES = {
    "llama": dict(lora_attn_modules=ALL_ATTENTION, apply_lora_to_mlp=True, apply_lora_to_output=True),
    "qwen3_moe": dict(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True),
    "llama-dora": dict(lora_attn_modules=["q_proj", "output_proj"], apply_lora_to_mlp=True, use_dora=True),
}


@pytest.mark.parametrize("case", CASES)
def test_adapter_and_merged_model_load_with_the_trained_logits(case, folders, tmp_path):
    folder = folders(case.split("-")[0])
    model, base = build(folder, lora_rank=4, lora_alpha=8, **CASES[case])
    with torch.no_grad():  # B = 0: the adapted model starts as the base model (DoRA: magnitude = norms of W)
        assert rel_diff(logits(model), logits(AutoModelForCausalLM.from_pretrained(str(folder)))) <= 1e-6
    train(model)
    trained = logits(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, value in model_keys(model, base).items():  # the base did not move
        assert torch.equal(state[key], value), key

    cfg = OmegaConf.create({"_component_": "torchtune_ext.model.hf.HFCheckpointer", "checkpoint_dir": str(folder),
                            "output_dir": str(tmp_path / "run")})
    manager = CheckpointManager(cfg, str(tmp_path / "run"))
    manager.load()
    step = manager.save(lora_checkpoint_state(model, state), Progress(step=2), optimizer_state={})

    peft_config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert peft_config["base_model_name_or_path"] == str(folder.resolve()) and peft_config["peft_type"] == "LORA"
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(folder)), str(step / "adapter"))
    assert rel_diff(logits(with_adapter), trained) <= 1e-5
    merged = AutoModelForCausalLM.from_pretrained(str(step))
    assert rel_diff(logits(merged), trained) <= 1e-5

    # resume: the base from the base folder, the adapter from the step (the manager's adapter file)
    adapter = CheckpointManager(cfg, str(tmp_path / "run")).load(step, adapter=True)["adapter"]
    fresh, _ = build(folder, seed=8, lora_rank=4, lora_alpha=8, **CASES[case])
    missing, unexpected = fresh.load_state_dict(adapter, strict=False)
    assert not unexpected and not any(".lora_" in key for key in missing)
    assert torch.equal(logits(fresh), trained)


def test_adapter_only_checkpoint(folders, tmp_path):
    folder = folders("llama")
    model, _ = build(folder, lora_rank=4, lora_alpha=8, lora_attn_modules=["q_proj", "v_proj"])
    train(model, steps=1)
    state = lora_checkpoint_state(model, model.state_dict(), adapter_only=True)
    checkpointer = HFCheckpointer(folder, tmp_path)
    checkpointer.load_checkpoint()
    saved = checkpointer.save_checkpoint(state, epoch=1, adapter_only=True)
    assert sorted(p.name for p in saved.iterdir()) == ["adapter"]
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(folder)), str(saved / "adapter"))
    assert rel_diff(logits(with_adapter), logits(model)) <= 1e-5
