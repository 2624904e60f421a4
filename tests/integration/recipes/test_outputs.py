"""A run's checkpoint loads as what it is, wherever a user takes it: transformers and PEFT.

* ``AutoModelForCausalLM.from_pretrained(step_N)`` gives the trained model: the
  full fine-tune, or for LoRA the merged model, with no adapter attached
  (torchtune's layout put the adapter beside the merged weights, and
  transformers applied it a second time);
* ``AutoPeftModelForCausalLM.from_pretrained(step_N / "adapter")`` loads the
  base model named in ``adapter_config.json`` plus the adapter, and gives the
  same logits (Llama with tied and untied output, LoRA on the output
  projection, DoRA; Qwen2, whose q/k rows HF does not permute; Gemma);
* every file is readable by others, as files the user creates are.
"""

import stat

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.families import FAMILIES, model_config, recipe_overrides
from tests.support.helpers import recipe_class, run_recipe
from torchtune_ext.config import LORA_KEYS, validate
from torchtune_ext.config.upstream import packaged_configs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PACKAGED = {name: path for recipe in ("full_finetune_single_device", "lora_finetune_single_device")
            for name, path in packaged_configs(recipe)}
TOKENS = torch.tensor([[5, 17, 42, 99, 230, 7, 64, 128, 3, 250, 11, 12]])
RECIPES = {"full": ("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice", None),
           "lora": ("recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice", LORA_KEYS)}


def train(name, kind, family_assets, out, *extra):
    folder, _, data = family_assets(name)
    family = FAMILIES[name]
    cfg = OmegaConf.load(PACKAGED[family.full_config if kind == "full" else family.lora_config])
    lora = {k: v for k, v in OmegaConf.to_container(cfg.model).items()
            if k.startswith(("lora_", "apply_lora", "use_dora"))} if kind == "lora" else None
    cfg.model = model_config(family, lora)
    overrides = recipe_overrides(name, folder, data, out) + [
        "metric_logger=null", "enable_activation_offloading=false", "optimizer._component_=torch.optim.AdamW",
        "optimizer.lr=0.02", "optimizer_in_bwd=false", "lr_scheduler=null", *extra]
    cfg = validate(OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides)), extra_keys=RECIPES[kind][2])
    recipe = run_recipe(recipe_class(*RECIPES[kind][:2]), cfg)
    with torch.no_grad():  # the recipe's model returns normed hidden states; its loss applies the output
        logits = recipe.model.output(recipe.model(TOKENS))
    return out / "step_2", logits


def hf_logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


CASES = [("llama3_2", "full", []), ("llama3_2", "lora", []), ("llama3", "lora", ["model.apply_lora_to_output=true"]),
         ("llama3", "lora", ["model.use_dora=true"]), ("qwen2", "lora", []), ("gemma", "lora", [])]


@pytest.mark.parametrize("name,kind,extra", CASES, ids=[f"{n}-{k}{'-' + e[0] if e else ''}" for n, k, e in CASES])
def test_checkpoint_loads_in_transformers_and_peft(name, kind, extra, family_assets, tmp_path):
    step, trained = train(name, kind, family_assets, tmp_path / "run", *extra)
    model = transformers.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32)
    assert not getattr(model, "_hf_peft_config_loaded", False)  # nothing attached to the merged weights
    torch.testing.assert_close(hf_logits(model), trained, rtol=1e-4, atol=1e-4)
    for path in step.rglob("*"):
        if path.is_file():
            assert path.stat().st_mode & stat.S_IROTH, path  # world-readable, like the user's own files
    if kind == "full":
        return
    base, _, _ = family_assets(name)
    config = peft.PeftConfig.from_pretrained(step / "adapter")
    assert (config.base_model_name_or_path, config.task_type) == (str(base), "CAUSAL_LM")
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(step / "adapter", dtype=torch.float32)
    assert isinstance(adapted, peft.PeftModel)
    torch.testing.assert_close(hf_logits(adapted), trained, rtol=1e-4, atol=1e-4)
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert (hf_logits(plain) - trained).abs().max() > 1e-3  # the adapter does change the model
