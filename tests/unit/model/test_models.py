import pytest
import torch
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.modules import RotaryPositionalEmbeddings

from torchtune_ext.model.builders import lora_smollm2_135m, lora_tiny_llama, smollm2_135m, tiny_llama


def test_scale_factor_one_rope_is_plain_rope():
    scaled = Llama3ScaledRoPE(dim=64, max_seq_len=8192, base=100_000, scale_factor=1)
    plain = RotaryPositionalEmbeddings(dim=64, max_seq_len=8192, base=100_000)
    assert torch.equal(scaled.cache, plain.cache)
    x = torch.randn(2, 50, 3, 64)
    pos = torch.randint(0, 8192, (2, 50))
    assert torch.equal(scaled(x), plain(x))
    assert torch.equal(scaled(x, input_pos=pos), plain(x, input_pos=pos))
    # and the default llama3_2 scaling would not be: SmolLM2 must not use it
    assert not torch.allclose(Llama3ScaledRoPE(dim=64, max_seq_len=8192, base=100_000, scale_factor=32)(x), plain(x))


def test_smollm2_builders_use_plain_rope_and_smollm2_shapes():
    with torch.device("meta"):
        model = smollm2_135m()
        lora = lora_smollm2_135m(["q_proj", "v_proj"], lora_rank=8)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    rope = model.layers[0].attn.pos_embeddings
    assert rope.scale_factor == 1 and rope.base == 100_000
    assert model.tok_embeddings.weight.shape == (49_152, 576)
    base_keys = set(model.state_dict())
    assert base_keys <= set(lora.state_dict())
    assert {k for k in lora.state_dict() if "lora" in k} == {
        f"layers.{i}.attn.{p}.lora_{ab}.weight" for i in range(30) for p in ("q_proj", "v_proj") for ab in "ab"
    }
    with pytest.raises(ValueError):
        lora_smollm2_135m(["q_proj"], apply_lora_to_output=True)


def test_tiny_builders_construct_and_run():
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=128)
    lora = lora_tiny_llama(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, vocab_size=128)
    assert model.layers[0].attn.num_kv_heads == 2 and len(model.layers) == 2
    lora.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(0, 128, (2, 16))
    out, out_lora = model(tokens), lora(tokens)
    assert out.shape == (2, 16, 128)
    # LoRA's B starts at zero, so the adapted model starts as the base model
    torch.testing.assert_close(out_lora, out)
    assert tiny_llama().tok_embeddings.num_embeddings == 49_152
