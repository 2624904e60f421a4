"""QLoRA (``quantize_base: True``, torchao NF4) through the LoRA recipe on CPU.

torchtune's QLoRA quantizes every base projection with torchao's NF4, which
needs each weight to hold a multiple of 64 * 256 values. The bundled
SmolLM2-135M does not fit (its 576 x 576 attention projections), so the run
uses a tiny Llama 3.2 whose projections do (width 128, as many KV heads as
heads), from torchtune's own ``llama3_2/1B_qlora_single_device`` config; the
SmolLM2 case is checked to stop with a one-line error.
"""

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torchao.dtypes.nf4tensor import NF4Tensor

from tests.support.families import FAMILIES, recipe_overrides
from tests.support.helpers import REPO_ROOT, read_jsonl, recipe_class, run_recipe
from torchtune_ext.config import LORA_KEYS, ConfigError, validate
from torchtune_ext.config.upstream import packaged_configs

RECIPE = ("recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice")
ARCH = dict(vocab_size=528, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128, intermediate_dim=256,
            max_seq_len=256, tie_word_embeddings=True)


def write_nf4_friendly_llama(folder, tokenizer_folder):
    from torchtune.models import convert_weights
    from torchtune.models.llama3_2._component_builders import llama3_2

    torch.manual_seed(0)
    model = llama3_2(**ARCH)
    torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
    folder.mkdir()
    hf = convert_weights.tune_to_hf(model.state_dict(), num_heads=4, num_kv_heads=4, dim=128)
    save_file({k: v.contiguous() for k, v in hf.items()}, folder / "model.safetensors")
    config = dict(FAMILIES["llama3_2"].hf, hidden_size=128, intermediate_size=256, num_key_value_heads=4, head_dim=32)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.model", "tokenizer.json"):
        shutil.copy(tokenizer_folder / name, folder / name)


def test_qlora_trains_with_nf4_base(family_assets, tmp_path):
    tokenizer_folder, _, data = family_assets("llama3_2")
    folder = tmp_path / "base"
    write_nf4_friendly_llama(folder, tokenizer_folder)
    (path,) = [p for n, p in packaged_configs("lora_finetune_single_device") if n == "llama3_2/1B_qlora_single_device"]
    cfg = OmegaConf.load(path)
    assert cfg.model._component_ == "torchtune.models.llama3_2.qlora_llama3_2_1b"
    lora = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_component_"}
    cfg.model = {"_component_": "torchtune.models.llama3_2._component_builders.lora_llama3_2", **ARCH, **lora,
                 "quantize_base": True, "scale_factor": 32}
    out = tmp_path / "run"
    # the same 4 samples every step (4 epochs of 1 step): the loss must go down
    samples = json.loads(data.read_text())[:4]
    (tmp_path / "four.json").write_text(json.dumps(samples))
    overrides = recipe_overrides("llama3_2", folder, tmp_path / "four.json", out) + [
        "batch_size=4", "epochs=4", "shuffle=false", "optimizer.lr=0.01", "lr_scheduler=null", "metric_logger=null",
        "save_final_checkpoint=true"]
    cfg = validate(OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides)), extra_keys=LORA_KEYS)
    recipe = run_recipe(recipe_class(*RECIPE), cfg)

    losses = [r["loss"] for r in read_jsonl(out / "logs" / "metrics.jsonl")]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), losses
    quantized = [n for n, p in recipe.model.named_parameters() if isinstance(p.data, NF4Tensor)]
    # q, k, v, output projection and the 3 MLP projections of both layers stay NF4 after training
    assert len(quantized) == 2 * 7, quantized
    assert all(not p.requires_grad for n, p in recipe.model.named_parameters() if n in quantized)
    assert (out / "step_4" / "adapter" / "adapter_model.pt").is_file()
    assert (out / "step_4" / "model-00001-of-00001.safetensors").is_file()  # merged, dequantized


def test_qlora_on_smollm2_names_what_is_missing(smollm2_assets, tmp_path):
    cfg = OmegaConf.load(REPO_ROOT / "configs/smollm2/135M_lora_single_device.yaml")
    cfg.output_dir = str(tmp_path / "run")
    cfg.model.quantize_base = True
    cfg = validate(cfg, extra_keys=LORA_KEYS)
    recipe = recipe_class(*RECIPE)(cfg)
    with pytest.raises(ConfigError, match="torchao's NF4 cannot quantize") as err:
        recipe.setup()
    assert err.value.key == "model.quantize_base" and "16,384" in str(err.value) and "\n" not in str(err.value)
