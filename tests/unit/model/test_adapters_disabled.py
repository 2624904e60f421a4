"""adapters_disabled: the base model inside the block (the LoRA preference recipes' reference), the adapters after."""

import torch

from tests.support.helpers import VOCAB, tiny_lora_model
from tests.support.hf_tiny import TinyFolders
from torchtune_ext.model.build import adapter_params
from torchtune_ext.model.lora import adapters_disabled

TOKENS = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def test_torchtune_lora_model_is_its_base_inside_the_block():
    model = tiny_lora_model(lora_b_std=0.3)  # B != 0: the adapters change the output
    with_adapters = model(TOKENS)
    with torch.no_grad():
        for name, p in adapter_params(model).items():
            if "lora_b" in name:
                p.zero_()  # now the model is its base
    base = model(TOKENS)
    assert not torch.allclose(with_adapters, base, atol=1e-4)
    model = tiny_lora_model(lora_b_std=0.3)
    with adapters_disabled(model):
        assert torch.equal(model(TOKENS), base)
    assert torch.equal(model(TOKENS), with_adapters)


def test_peft_model_is_its_base_inside_the_block(tmp_path):
    from torchtune_ext.model.hf import HFCheckpointer, initialize_adapters, load_state, lora_causal_lm, model_keys

    folder = TinyFolders(tmp_path)("qwen3")
    with torch.device("meta"):
        model = lora_causal_lm(folder, dtype="fp32", lora_attn_modules=["q_proj", "v_proj"])
    initialize_adapters(model, 3)
    base = HFCheckpointer(folder, tmp_path / "unused_out").load_checkpoint()["model"]
    load_state(model, model_keys(model, base), torch.device("cpu"), strict=False)
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert lora_b
    with torch.no_grad():
        for p in lora_b:
            p.normal_(std=0.3)  # the adapters change the output
    with_adapters = model(TOKENS)
    with adapters_disabled(model):
        disabled = model(TOKENS)
    assert torch.equal(model(TOKENS), with_adapters)  # back on after the block
    with torch.no_grad():
        for p in lora_b:
            p.zero_()  # now the model is its base
    assert torch.equal(model(TOKENS), disabled)
    assert not torch.allclose(disabled, with_adapters, atol=1e-4)
