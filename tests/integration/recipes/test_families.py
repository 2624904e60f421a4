"""Each model family through both single-device recipes, from its torchtune config.

For every family (tests/support/families.py: Llama 3 and 3.2, Qwen 2.5, Gemma,
Gemma 2, Mistral, Phi-3) a tiny random model is written in the family's HF
layout with a tokenizer of the family's format, and the family's own
torchtune 0.6.1 single-device config runs with our recipe for two steps,
changed only by overrides: the tiny model's dimensions, the folder, local
data, CPU/fp32, two steps (and what this machine lacks: bitsandbytes, CUDA
activation offloading). Several of those configs use optimizer_in_bwd, the
profiler section and the DiskLogger as written.

Checked: the run trains (finite loss, the weights move); the saved ``step_2``
loads back with torchtune's own checkpointer into the weights the recipe
holds; for LoRA the merged model in ``step_2`` equals base + (alpha / rank) B A
from the saved adapter, and the base weights did not move.
"""


import pytest
import torch
from omegaconf import OmegaConf

from tests.support.families import FAMILIES, model_config, recipe_overrides
from tests.support.helpers import read_jsonl, recipe_class, run_recipe
from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, lora_settings, validate
from torchtune_ext.config.upstream import packaged_configs

RECIPES = {
    "full": ("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice", None),
    "lora": ("recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice", LORA_KEYS),
}
PACKAGED = {name: path for recipe in ("full_finetune_single_device", "full_finetune_distributed",
                                      "lora_finetune_single_device") for name, path in packaged_configs(recipe)}
PACKAGED_LORA = {name: path for recipe in ("lora_finetune_single_device", "lora_finetune_distributed")
                 for name, path in packaged_configs(recipe)}


def family_config(name: str, kind: str, folder, data, output_dir, *extra: str, path=None):
    """The family's torchtune config for ``kind`` (or the config file ``path``) with the tiny model and
    the overrides of tests/support/families.py."""
    family = FAMILIES[name]
    cfg = OmegaConf.load(path or PACKAGED[family.full_config if kind == "full" else family.lora_config])
    assert cfg.checkpointer.model_type == family.model_type
    assert cfg.tokenizer._component_.split(".")[-1] in family.tokenizer["_component_"] or name == "qwen2"
    if kind == "lora":
        cfg.model = model_config(family, {k: v for k, v in OmegaConf.to_container(cfg.model).items()
                                          if k.startswith(("lora_", "apply_lora", "use_dora"))})
    else:
        cfg.model = model_config(family)
        for key in DISTRIBUTED_KEYS:  # gemma's full configs are written for the distributed recipe
            cfg.pop(key, None)
    overrides = recipe_overrides(name, folder, data, output_dir) + [
        f"metric_logger.log_dir={output_dir}/logs", f"profiler.output_dir={output_dir}/profiling",
        "enable_activation_offloading=false"]  # CUDA only
    if str(cfg.optimizer._component_).startswith("bitsandbytes"):
        overrides.append("optimizer._component_=torch.optim.AdamW")  # not installed here
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides + list(extra)))


def load_with_torchtune(folder, model_type, files):
    from torchtune.training import FullModelHFCheckpointer

    checkpointer = FullModelHFCheckpointer(checkpoint_dir=str(folder), checkpoint_files=files, model_type=model_type,
                                           output_dir=str(folder.parent / "reload"))
    return checkpointer.load_checkpoint()["model"]


def merged(base, adapter, settings, name):
    """base + (alpha / rank) B A for every adapted linear: what a LoRA checkpoint's full model must hold."""
    out = {k: v.clone() for k, v in base.items()}
    for key in adapter:
        if key.endswith("lora_a.weight"):
            prefix = key[: -len("lora_a.weight")]
            b = adapter[prefix + "lora_b.weight"]
            out[prefix + "weight"] += settings.lora_alpha / settings.lora_rank * (b @ adapter[key])
    return out


CASES = [(name, kind) for name in FAMILIES for kind in ("full", "lora")]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_family_trains_and_saves(name, kind, family_assets, tmp_path):
    folder, base, data = family_assets(name)
    family = FAMILIES[name]
    recipe_file, cls_name, schema = RECIPES[kind]
    out = tmp_path / "run"
    extra = []
    if kind == "lora" and not family.tied:
        extra.append("model.apply_lora_to_output=true")  # the model's own output projection gets an adapter
    cfg = validate(family_config(name, kind, folder, data, out, *extra), extra_keys=schema)
    recipe = run_recipe(recipe_class(recipe_file, cls_name), cfg)

    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 and r["num_tokens"] > 0 for r in rows)
    trained = {k: v.detach() for k, v in recipe.model.state_dict().items()}
    step = out / "step_2"
    weights = sorted(p.name for p in step.glob("model-*.safetensors"))
    saved = load_with_torchtune(step, family.model_type, weights)
    if kind == "full":
        assert saved.keys() == base.keys()
        for key, value in saved.items():
            assert torch.equal(value, trained[key]), key
        assert any(not torch.equal(trained[k], base[k]) for k in base)
        if cfg.optimizer_in_bwd:  # the packaged config's optimizer_in_bwd: true ran as written
            from torchtune_ext.train.optim_in_bwd import OptimizerInBackward

            assert isinstance(recipe.run.optimizer, OptimizerInBackward)
        return
    settings = lora_settings(cfg.model)
    adapter = {k: v for k, v in trained.items() if "lora_" in k}
    assert adapter and all(torch.equal(trained[k], base[k]) for k in base)  # the base did not move
    if settings.apply_lora_to_output:
        assert "output.lora_a.weight" in adapter
    expected = merged(base, adapter, settings, name)
    assert saved.keys() == base.keys()
    for key, value in saved.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-6, msg=key)


OUR_CONFIGS = [("llama3", "full", "configs/llama3/8B_full_single_device.yaml"),
               ("gemma2", "lora", "configs/gemma2/2B_lora_single_device.yaml")]


@pytest.mark.parametrize("name,kind,path", OUR_CONFIGS, ids=[p for _, _, p in OUR_CONFIGS])
def test_our_gpu_config_runs(name, kind, path, family_assets, tmp_path):
    """Our own GPU-sized configs with the same overrides (tiny model, CPU, two steps)."""
    from tests.support.helpers import REPO_ROOT

    folder, _, data = family_assets(name)
    recipe_file, cls_name, schema = RECIPES[kind]
    out = tmp_path / "run"
    # The tiny tokenizers spend about a token per byte: Alpaca's prompt alone fills 128 tokens, and
    # with train_on_input: false (our configs) nothing would be left to train on.
    cfg = family_config(name, kind, folder, data, out, "metric_logger=null", "dataset.train_on_input=true",
                        path=REPO_ROOT / path)
    run_recipe(recipe_class(recipe_file, cls_name), validate(cfg, extra_keys=schema))
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["num_tokens"] > 0 and r["loss"] > 0 for r in rows)
    assert (out / "step_2" / "config.json").is_file()


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_checkpoint_of_another_architecture_names_family_and_key(kind, family_assets, tmp_path):
    """A model config that does not match the checkpoint stops before training, naming both."""
    from torchtune_ext.config import ConfigError

    folder, _, data = family_assets("qwen2")
    recipe_file, cls_name, schema = RECIPES[kind]
    out = tmp_path / "run"
    cfg = validate(family_config("qwen2", kind, folder, data, out, "model.num_kv_heads=4"), extra_keys=schema)
    recipe = recipe_class(recipe_file, cls_name)(cfg)
    with pytest.raises(ConfigError) as err:
        recipe.setup()
    message = str(err.value)
    assert err.value.key == "checkpointer.checkpoint_dir" and "family qwen2" in message
    assert "'layers.0.attn.k_proj.weight' has shape [16, 32] in the checkpoint, [32, 32] in the model" in message


def test_dora_config_with_meta_checkpoint(family_assets, tmp_path):
    """llama3/8B_dora_single_device as written: Meta's consolidated checkpoint (FullModelMetaCheckpointer)
    and DoRA; the merged model is m * (W + s B A) / ||W + s B A|| per output row (Liu et al., 2024)."""
    from torchtune.models import convert_weights

    folder, base, data = family_assets("llama3")
    original = tmp_path / "original"  # Meta's layout, as `tune download ... --ignore-patterns "*.safetensors"`
    original.mkdir()
    torch.save(convert_weights.tune_to_meta(dict(base)), original / "consolidated.00.pth")
    for name in ("tokenizer.model", "tokenizer.json"):
        (original / name).write_bytes((folder / name).read_bytes())
    cfg = OmegaConf.load(PACKAGED_LORA["llama3/8B_dora_single_device"])
    cfg.model = model_config(FAMILIES["llama3"], {k: v for k, v in OmegaConf.to_container(cfg.model).items()
                                                  if k.startswith(("lora_", "apply_lora", "use_dora"))})
    out = tmp_path / "run"
    overrides = [o for o in recipe_overrides("llama3", original, data, out) if not o.startswith("checkpointer.")]
    overrides += [f"checkpointer.checkpoint_dir={original}", f"metric_logger.log_dir={out}/logs",
                  f"profiler.output_dir={out}/profiling"]
    cfg = validate(OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides)), extra_keys=LORA_KEYS)
    assert cfg.checkpointer._component_.endswith("FullModelMetaCheckpointer") and lora_settings(cfg.model).use_dora
    recipe = run_recipe(recipe_class(*RECIPES["lora"][:2]), cfg)

    from torchtune.training import FullModelMetaCheckpointer

    step = out / "step_2"
    (weights,) = [p.name for p in step.glob("model-*")]
    saved = FullModelMetaCheckpointer(checkpoint_dir=str(step), checkpoint_files=[weights], model_type="LLAMA3",
                                      output_dir=str(tmp_path / "reload")).load_checkpoint()["model"]
    trained = recipe.model.state_dict()
    settings = lora_settings(cfg.model)
    checked = 0
    for key in saved:
        prefix = key[: -len("weight")]
        if prefix + "magnitude" in trained:
            w = base[key] + settings.lora_alpha / settings.lora_rank * (
                trained[prefix + "lora_b.weight"] @ trained[prefix + "lora_a.weight"])
            expected = trained[prefix + "magnitude"].view(-1, 1) * w / torch.linalg.norm(w, dim=1, keepdim=True)
            torch.testing.assert_close(saved[key], expected, rtol=1e-5, atol=1e-6, msg=key)
            checked += 1
        else:
            assert torch.equal(saved[key], base[key]), key
    assert checked == 2 * 6  # q, v, output and the 3 MLP projections in both layers


def _tune(*args, timeout=900):
    from tests.support.helpers import run_tune

    return run_tune(*args, timeout=timeout, extra_env={"OMP_NUM_THREADS": "1"})


DISTRIBUTED = [
    # (recipe, torchtune config by its packaged name, family, extra overrides)
    ("full_finetune_distributed", "qwen2_5/0.5B_full", "qwen2", ["optimizer_in_bwd=true"]),
    ("lora_finetune_distributed", "gemma2/2B_lora", "gemma2", ["fsdp_cpu_offload=true"]),
]


@pytest.mark.parametrize("recipe,config,name,extra", DISTRIBUTED, ids=[c for _, c, _, _ in DISTRIBUTED])
def test_packaged_config_on_two_ranks(recipe, config, name, extra, family_assets, tmp_path):
    """`tune run --nproc_per_node 2 recipes/<recipe>.py --config <packaged name> key=value ...`:
    the name resolves to torchtune's YAML and runs with our recipe, overrides only."""
    folder, base, data = family_assets(name)
    family = FAMILIES[name]
    out = tmp_path / "run"
    model = model_config(family)
    model_overrides = [f"model.{k}={v}" for k, v in model.items() if k != "_component_"]
    component = family.builder if recipe.startswith("full") else family.lora_builder
    proc = _tune("--nproc_per_node", "2", f"recipes/{recipe}.py", "--config", config,
                 *recipe_overrides(name, folder, data, out), f"model._component_={component}", *model_overrides,
                 f"metric_logger.log_dir={out}/logs", "gradient_accumulation_steps=1", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["dp_world_size"] == 2 for r in rows)
    step = out / "step_2"
    saved = load_with_torchtune(step, family.model_type, sorted(p.name for p in step.glob("model-*.safetensors")))
    assert saved.keys() == base.keys()
    if recipe.startswith("full"):
        assert any(not torch.equal(saved[k], base[k]) for k in base)
        return
    cfg = OmegaConf.load(PACKAGED_LORA[config])
    settings = lora_settings({**model_config(family), **{k: v for k, v in OmegaConf.to_container(cfg.model).items()
                                                        if k != "_component_"}, "_component_": component})
    adapter = torch.load(step / "adapter" / "adapter_model.pt", weights_only=True)
    expected = merged(base, adapter, settings, name)
    for key, value in saved.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-6, msg=key)


def test_profiler_section_writes_traces(family_assets, tmp_path):
    """torchtune's `profiler` section, enabled: the recipe steps the profiler and its traces appear."""
    folder, _, data = family_assets("llama3_2")
    out = tmp_path / "run"
    cfg = family_config("llama3_2", "full", folder, data, out, "profiler.enabled=true", "profiler.cuda=false",
                        "profiler.wait_steps=0", "profiler.warmup_steps=0", "profiler.active_steps=1",
                        "profiler.num_cycles=1", "metric_logger=null")
    run_recipe(recipe_class(*RECIPES["full"][:2]), validate(cfg))
    traces = list((out / "profiling").rglob("*"))
    assert any(p.name.endswith(".json") or "key_averages" in p.name for p in traces), traces


def test_meta_checkpoint_full_run_resumes_exactly(family_assets, tmp_path):
    """llama3/8B_full_single_device as written (Meta's consolidated checkpoint, optimizer_in_bwd: true):
    a run resumed from its step_1 folder (the model saved as Meta's .bin) repeats step 2 exactly."""
    import shutil

    from torchtune.models import convert_weights

    folder, base, data = family_assets("llama3")
    original = tmp_path / "original"
    original.mkdir()
    torch.save(convert_weights.tune_to_meta(dict(base)), original / "consolidated.00.pth")
    for name in ("tokenizer.model", "tokenizer.json"):
        shutil.copy(folder / name, original / name)

    def run(out, *more):
        cfg = OmegaConf.load(PACKAGED["llama3/8B_full_single_device"])
        cfg.model = model_config(FAMILIES["llama3"])
        overrides = [o for o in recipe_overrides("llama3", original, data, out) if not o.startswith("checkpointer.")]
        overrides += [f"checkpointer.checkpoint_dir={original}", "metric_logger=null", "save_every_n_steps=1",
                      "optimizer._component_=torch.optim.AdamW", "optimizer.lr=1e-3", *more]
        cfg = validate(OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides)))
        assert cfg.optimizer_in_bwd and cfg.checkpointer._component_.endswith("FullModelMetaCheckpointer")
        run_recipe(recipe_class(*RECIPES["full"][:2]), cfg)
        return read_jsonl(out / "logs" / "metrics.jsonl")

    straight = run(tmp_path / "straight")
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "straight" / "step_1", tmp_path / "resumed" / "step_1")
    assert any(p.suffix == ".bin" for p in (tmp_path / "resumed" / "step_1").iterdir())
    resumed = run(tmp_path / "resumed", "resume_from_checkpoint=true")
    assert [r["step"] for r in resumed] == [2]
    assert (resumed[0]["loss"], resumed[0]["grad_norm"]) == (straight[1]["loss"], straight[1]["grad_norm"])
