"""The distillation recipe, in process on tiny checkpoints: one LoRA run, one full run and one on-policy run;
and through `tune run` as a user types it (2 on-policy steps, two refusals).

The teacher is a random 3-layer ``tiny_llama``, the student a 2-layer one with
the same (SmolLM2) vocabulary. What the recipe adds is checked here: the
logged loss is ``(1 - kd_ratio) * ce_loss + kd_ratio * kd_loss`` over the
step's trainable tokens, the teacher is frozen and absent from every
checkpoint, the student alone trains; the exactness of the loss itself is
tests/unit/train/test_distill.py.
"""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.support.helpers import read_jsonl, recipe_class, run_recipe, run_tune, tiny_alpaca16_config
from tests.support.wandb_reader import read_offline_run
from torchtune_ext.config import ConfigError, validate
from torchtune_ext.run.distillation import distillation_keys

RECIPE = recipe_class("recipes/knowledge_distillation_single_device.py", "KDRecipeSingleDevice")
TINY_LORA = {"_component_": "torchtune_ext.model.builders.lora_tiny_llama", "lora_attn_modules": ["q_proj", "v_proj"],
             "apply_lora_to_mlp": True, "apply_lora_to_output": False, "lora_rank": 4, "lora_alpha": 8}
TINY = {"_component_": "torchtune_ext.model.builders.tiny_llama"}
KD_RATIO = 0.3


def write_teacher(path, num_layers=3, vocab_size=49_152):
    """A random tiny_llama of ``num_layers`` layers as an HF checkpoint folder; returns its HF state dict."""
    from safetensors.torch import save_file
    from torchtune.models import convert_weights

    from torchtune_ext.model.builders import tiny_llama

    torch.manual_seed(11)
    model = tiny_llama(num_layers=num_layers, vocab_size=vocab_size)
    torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
    hf = convert_weights.tune_to_hf(model.state_dict(), num_heads=4, num_kv_heads=2, dim=64, head_dim=16)
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                  "hidden_size": 64, "head_dim": 16, "tie_word_embeddings": True}))
    return hf


def kd_config(assets, tmp_path, name, model, *overrides):
    teacher_dir = tmp_path / "teacher"
    if not teacher_dir.exists():
        write_teacher(teacher_dir)
    cfg = tiny_alpaca16_config(
        "configs/smollm2/135M_KD_lora_single_device.yaml", model, assets, tmp_path, tmp_path / name,
        f"teacher_checkpointer.checkpoint_dir={teacher_dir}", f"kd_ratio={KD_RATIO}", "max_steps_per_epoch=3",
        "batch_size=2", "gradient_accumulation_steps=2", "optimizer.lr=1e-3", "lr_scheduler.num_warmup_steps=1",
        *overrides)
    cfg.teacher_model = {"_component_": "torchtune_ext.model.builders.tiny_llama", "num_layers": 3}
    return cfg


# batch 4 on one device against 2 ranks x batch 2 (the job "kd_two_ranks" of the shared 2-rank launch,
# tests/integration/recipes/test_distributed_recipes.py, which compares them)
KD_LORA_ALIKE = ["max_steps_per_epoch=2", "gradient_accumulation_steps=1", "lr_scheduler=null",
                 "save_final_checkpoint=false"]


# on-policy: half of the samples (a seeded draw per sample and step) completed by the student, 4 tokens at most
ON_POLICY = ["on_policy_ratio=0.5", "on_policy_max_new_tokens=4"]


@pytest.fixture(scope="module")
def runs(smollm2_assets, tmp_path_factory):
    """One LoRA, one full and one on-policy full distillation run (3 steps of 2 x 2 samples each): (recipe,
    checked config) by name."""
    tmp = tmp_path_factory.mktemp("kd")
    out = {}
    for name, model, extra in (("lora", TINY_LORA, []), ("full", TINY, []), ("on_policy", TINY, ON_POLICY)):
        cfg = kd_config(smollm2_assets, tmp, name, model, "save_every_n_steps=2", *extra)  # step_2, step_3 saved
        cfg = validate(cfg, extra_keys=distillation_keys(cfg))
        out[name] = (run_recipe(RECIPE, cfg), cfg)
    return out


@pytest.mark.parametrize("name", ["lora", "full"])
def test_logged_loss_is_the_weighted_sum_of_its_terms(runs, name):
    recipe, cfg = runs[name]
    rows = read_jsonl(f"{cfg.output_dir}/logs/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["kd_loss"] > 0 and r["ce_loss"] > 0 and r["num_tokens"] > 0
        assert abs(r["loss"] - ((1 - KD_RATIO) * r["ce_loss"] + KD_RATIO * r["kd_loss"])) <= 1e-5 * r["loss"]
        assert 0 < r["teacher_seconds"] < r["step_seconds"]  # the teacher's forwards, a share of the step


@pytest.mark.parametrize("name", ["lora", "full"])
def test_teacher_is_frozen_and_never_saved(runs, name):
    recipe, cfg = runs[name]
    teacher = recipe.run.teacher
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    optimized = {id(p) for group in recipe.run.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in teacher.parameters()}
    # the teacher's weights are unchanged (compared with its file), its third layer is nowhere in the checkpoint
    on_disk = load_file(f"{cfg.teacher_checkpointer.checkpoint_dir}/model.safetensors")
    assert torch.equal(teacher.tok_embeddings.weight, on_disk["model.embed_tokens.weight"])
    saved = load_file(f"{cfg.output_dir}/step_3/model-00001-of-00001.safetensors")
    assert any(k.startswith("model.layers.1.") for k in saved)
    assert not any(k.startswith("model.layers.2.") for k in saved)
    student = {n for n, p in recipe.model.named_parameters() if p.requires_grad}
    assert student and (name == "full") == (len(student) == len(list(recipe.model.parameters())))


def test_on_policy_steps_log_their_generation(runs):
    """Each step's generated tokens and generation time are logged; the count includes the generated tokens,
    and the loss is still (1 - kd_ratio) * ce_loss + kd_ratio * kd_loss."""
    _, cfg = runs["on_policy"]
    rows = read_jsonl(f"{cfg.output_dir}/logs/metrics.jsonl")
    offline = read_jsonl(f"{runs['full'][1].output_dir}/logs/metrics.jsonl")
    assert sum(r["generated_tokens"] for r in rows) > 0
    assert all(r["generation_seconds"] > 0 or r["generated_tokens"] == 0 for r in rows)
    assert [r["num_tokens"] for r in rows] != [r["num_tokens"] for r in offline]
    for r in rows:
        assert abs(r["loss"] - ((1 - KD_RATIO) * r["ce_loss"] + KD_RATIO * r["kd_loss"])) <= 1e-5 * r["loss"]
    assert "generated_tokens" not in offline[0]  # on_policy_ratio 0: the offline record, unchanged


@pytest.mark.parametrize("name", ["lora", "full", "on_policy"])
def test_resume_continues_as_the_straight_run(runs, smollm2_assets, tmp_path, name):
    """step_2 of the run, resumed: step 3 gives the same loss, kd_loss and grad_norm (the teacher is rebuilt from
    its checkpoint, nothing of it is in step_2); on-policy, the student regenerates the same step-3 samples."""
    import shutil

    recipe, cfg = runs[name]
    resumed = tmp_path / "resumed"
    shutil.copytree(f"{cfg.output_dir}/step_2", resumed / "step_2")
    again = OmegaConf.merge(cfg, {"output_dir": str(resumed), "resume_from_checkpoint": True})
    again.checkpointer.output_dir = str(resumed)
    again.teacher_checkpointer.output_dir = str(resumed)
    run_recipe(RECIPE, validate(again, extra_keys=distillation_keys(again)))
    (got,) = read_jsonl(resumed / "logs" / "metrics.jsonl")
    want = read_jsonl(f"{cfg.output_dir}/logs/metrics.jsonl")[2]
    assert got["step"] == want["step"] == 3 and got["num_tokens"] == want["num_tokens"]
    for key in ("loss", "kd_loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    assert got.get("generated_tokens") == want.get("generated_tokens")


def test_bad_distillation_input_is_one_line(smollm2_assets, tmp_path):
    """kd_ratio outside [0, 1], no teacher, another vocabulary: a config error naming the key, before any load."""
    cfg = kd_config(smollm2_assets, tmp_path, "bad", TINY, "kd_ratio=1.5")
    with pytest.raises(ConfigError) as err:
        validate(cfg, extra_keys=distillation_keys(cfg))
    assert err.value.key == "kd_ratio"
    no_teacher = kd_config(smollm2_assets, tmp_path, "bad", TINY)
    no_teacher.teacher_model = None
    with pytest.raises(ConfigError) as err:
        distillation_keys(no_teacher)
    assert err.value.key == "teacher_model"
    other = kd_config(smollm2_assets, tmp_path, "other", TINY)
    other.teacher_model.vocab_size = 1000
    other = validate(other, extra_keys=distillation_keys(other))
    recipe = RECIPE(other)
    try:
        with pytest.raises(ConfigError, match="vocabulary") as err:
            recipe.setup()
    finally:
        recipe.cleanup()
    assert err.value.key == "teacher_model" and "\n" not in str(err.value)
    assert not (tmp_path / "other" / "logs").exists()  # refused before the run wrote anything


def test_tune_run_distils_on_policy_and_refuses_bad_input_in_one_line(smollm2_assets, tmp_path):
    """`tune run recipes/knowledge_distillation_single_device.py --config ...`, as a user types it: 2 on-policy
    steps (the keys given on the command line) train and log their generation; on_policy_ratio 1.5, and a
    sharded (DCP) teacher checkpoint, each end with one line naming the key, exit 2, before anything loads or
    is written."""
    cfg = kd_config(smollm2_assets, tmp_path, "tune_run", TINY, "max_steps_per_epoch=2")
    cfg.pop("save_adapter_weights_only")  # a LoRA key (the config is the LoRA one): its warning is no error line
    cfg.metric_logger = {"_component_": "torchtune.training.metric_logging.WandBLogger", "project": "kd",
                         "mode": "offline", "log_dir": str(tmp_path / "tune_run" / "logs")}
    OmegaConf.save(cfg, tmp_path / "kd.yaml")
    recipe = "recipes/knowledge_distillation_single_device.py"
    proc = run_tune(recipe, "--config", str(tmp_path / "kd.yaml"), *ON_POLICY, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(tmp_path / "tune_run" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("generated_tokens" in r and r["num_tokens"] > 0 for r in rows)
    assert (tmp_path / "tune_run" / "step_2").is_dir()
    history = [h for h in read_offline_run(str(tmp_path / "tune_run" / "logs"))["history"] if "loss" in h]
    assert [(h["generated_tokens"], h["generation_seconds"]) for h in history] == [
        (r["generated_tokens"], r["generation_seconds"]) for r in rows]  # W&B (offline) logs them too

    step = tmp_path / "teacher_run" / "step_4"  # as a run with sharded_checkpoints writes it
    (step / "dcp").mkdir(parents=True)
    (step / "dcp" / ".metadata").write_bytes(b"\0")
    for name, override, words in (
            ("ratio", "on_policy_ratio=1.5", ["on_policy_ratio", "[0, 1]"]),
            ("sharded", f"teacher_checkpointer.checkpoint_dir={step}",
             ["teacher_checkpointer.checkpoint_dir", f"python -m torchtune_ext.checkpoint.export {step} OUT"])):
        out = tmp_path / name
        proc = run_tune(recipe, "--config", str(tmp_path / "kd.yaml"), f"output_dir={out}",
                        f"checkpointer.output_dir={out}", override, timeout=300)
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
        assert all(w in lines[0] for w in words), lines[0]
        assert not out.exists()  # refused before the run wrote anything
