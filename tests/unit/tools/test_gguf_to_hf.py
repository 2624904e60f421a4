"""The GGUF -> HF converter on a tiny GGUF written here the way llama.cpp writes one."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torchtune.training import FullModelHFCheckpointer

from torchtune_ext.model.builders import tiny_llama
from torchtune_ext.tools.gguf_to_hf import convert_gguf_to_hf, permute_qk_to_interleaved

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 16, 4, 2, 32, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
MERGES = ["Ġ t", "h e", "Ġt he", "4 2"]  # "4 2" exists so that splitting digits is observable
TOKENS = SPECIALS + BYTES + ["Ġt", "he", "Ġthe", "42"]


def _hf_weights(rng):
    head_dim = HIDDEN // HEADS
    w = {"model.embed_tokens.weight": (len(TOKENS), HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {k: rng.standard_normal(shape).astype(np.float32) for k, shape in w.items()}


_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf(path, hf):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, array in hf.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_TO_GGUF[rest.removesuffix('.weight')]}.weight"
        # llama.cpp's converter reorders q/k rows before writing
        if "q_proj" in name:
            array = permute_qk_to_interleaved(torch.from_numpy(array), HEADS).numpy()
        elif "k_proj" in name:
            array = permute_qk_to_interleaved(torch.from_numpy(array), KV_HEADS).numpy()
        if name.endswith("mlp.down_proj.weight"):  # quantized, as in real files (rows of 32)
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    hf = _hf_weights(np.random.default_rng(0))
    _write_gguf(folder / "tiny.gguf", hf)
    out = folder / "hf"
    out.mkdir()
    convert_gguf_to_hf(folder / "tiny.gguf", out)
    return hf, out


def test_weights_round_trip_to_hf_layout(converted):
    hf, out = converted
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == set(hf)  # no lm_head: tied
    for name, expected in hf.items():
        assert state[name].dtype == torch.float32 and tuple(state[name].shape) == expected.shape, name
        if "down_proj" in name:  # Q8_0 keeps ~8 bits
            torch.testing.assert_close(state[name], torch.from_numpy(expected), atol=0.05, rtol=0.02)
        else:
            assert torch.equal(state[name], torch.from_numpy(expected)), name


def test_config_and_torchtune_load(converted, tmp_path):
    _, out = converted
    config = json.loads((out / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0 and config["tie_word_embeddings"]
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (KV_HEADS, 4, len(TOKENS))
    ckpt = FullModelHFCheckpointer(str(out), ["model.safetensors"], "LLAMA3_2", str(tmp_path / "o"))
    model = tiny_llama(
        vocab_size=len(TOKENS),
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=HIDDEN,
        intermediate_dim=FFN,
        rope_base=100_000,
    )
    model.load_state_dict(ckpt.load_checkpoint()["model"], strict=True)


def test_tokenizer_from_gguf_metadata(converted):
    _, out = converted
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("the 42").tokens == ["t", "he", "Ġ", "4", "2"]  # SmolLM2 splits every digit
    assert tok.encode(" the").ids == [TOKENS.index("Ġthe")]
    assert tok.encode("<|im_start|>x").ids == [1, TOKENS.index("x")]
    assert tok.decode(tok.encode(" the 42!").ids) == " the 42!"
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["add_bos_token"]) == (
        SPECIALS[1],
        SPECIALS[2],
        False,
    )
