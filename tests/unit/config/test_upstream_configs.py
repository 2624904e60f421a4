"""Every torchtune 0.6.1 config of our four recipes, and every config of ours, is accepted as written.

For each config (the list comes from the installed torchtune's registry and
from ``configs/``, not typed here):

* the config check accepts every key, or refuses it with a one-line error
  that names the key, why, and what to use (multimodal models; the
  bitsandbytes optimizer, which is not installed here); a config whose
  weights are not downloaded stops with the ``tune download`` command from
  its header;
* its model builds on the meta device with the parameter count that its
  architecture has: the count is computed here from the hyperparameters the
  builder passes to its family's component builder (vocabulary, width,
  layers, heads, MLP width, tying, biases, norms, adapters), not read from
  the built model.
"""

import functools
import math
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT
from torchtune_ext.config import DISTILLATION_KEYS, DISTRIBUTED_KEYS, LORA_KEYS, ConfigError, validate
from torchtune_ext.config.preference import PREFERENCE_KEYS
from torchtune_ext.config.upstream import (
    FAMILY_MODEL_TYPES,
    RECIPES,
    check_model_type,
    download_command,
    model_family,
    packaged_configs,
)
from torchtune_ext.model.build import is_hf_config

SCHEMAS = {
    "full_finetune_single_device": None,
    "full_finetune_distributed": DISTRIBUTED_KEYS,
    "lora_finetune_single_device": LORA_KEYS,
    "lora_finetune_distributed": {**LORA_KEYS, **DISTRIBUTED_KEYS},
    # the distillation recipes add the LoRA keys for a LoRA student only (schema_for)
    "knowledge_distillation_single_device": DISTILLATION_KEYS,
    "knowledge_distillation_distributed": {**DISTILLATION_KEYS, **DISTRIBUTED_KEYS},
    "full_dpo_single_device": PREFERENCE_KEYS,
    "full_dpo_distributed": {**DISTRIBUTED_KEYS, **PREFERENCE_KEYS},
    "lora_dpo_single_device": {**LORA_KEYS, **PREFERENCE_KEYS},
    "lora_dpo_distributed": {**LORA_KEYS, **DISTRIBUTED_KEYS, **PREFERENCE_KEYS},
}


def schema_for(recipe: str, cfg):
    from torchtune_ext.run.distillation import student_is_lora

    if recipe.startswith("knowledge_distillation") and student_is_lora(cfg.model):
        return {**SCHEMAS[recipe], **LORA_KEYS}
    return SCHEMAS[recipe]


def _our_recipe(path: Path) -> str:
    """The recipe named in a config's header (``tune run ... recipes/<recipe>.py``)."""
    match = re.search(r"recipes/(\w+)\.py", path.read_text().split("\n\n")[0])
    assert match and match.group(1) in RECIPES, f"{path}: the header names no recipe"
    return match.group(1)


UPSTREAM = [(recipe, name, path) for recipe in RECIPES for name, path in packaged_configs(recipe)]
# Ours with a torchtune model; those of transformers models (configs/hf and the named configs built on them, whose
# one required key is model_dir) are checked by tests/unit/config/test_named_configs.py and
# tests/unit/config/test_shipped_configs.py.
OURS = [(_our_recipe(path), str(path.relative_to(REPO_ROOT)), path)
        for path in sorted((REPO_ROOT / "configs").rglob("*.yaml"))
        if not is_hf_config(OmegaConf.load(path).model)]


def test_the_list_is_torchtunes():
    # torchtune 0.6.1: 17 + 27 + 41 + 36 fine-tuning, 2 + 2 knowledge distillation, 5 DPO (0 + 1 + 2 + 2)
    assert len(UPSTREAM) == 130
    assert len({name for _, name, _ in UPSTREAM}) == len(UPSTREAM)
    assert (len(NOT_LORA), len(LORA)) == (53, 77)  # the two files check every one of them


def test_family_model_types_agree_with_torchtune_configs():
    """The table behind the checkpointer.model_type check matches what torchtune's configs use."""
    for recipe, name, path in UPSTREAM:
        cfg = OmegaConf.load(path)
        if recipe.startswith("knowledge_distillation"):
            # the Llama 3.2 1B student's checkpointer says LLAMA3 (its teacher's type), which converts alike:
            # the check accepts it, and refuses a type that converts otherwise
            assert check_model_type(cfg.model._component_, cfg.checkpointer.model_type) is None, name
            assert check_model_type(cfg.model._component_, "QWEN2" if "llama" in name else "LLAMA3"), name
            continue
        assert FAMILY_MODEL_TYPES[model_family(cfg.model._component_)] == cfg.checkpointer.model_type, name


# ---------------------------------------------------------------- parameter counts from the architecture
class _Captured(Exception):
    def __init__(self, name, kwargs):
        self.name, self.kwargs = name, kwargs


def builder_hyperparameters(component: str, args: dict):
    """(component builder name, its keyword arguments) that the model builder ``component`` calls."""
    from torchtune.config._utils import _get_component_from_path

    builder = _get_component_from_path(component)
    func = builder.func if isinstance(builder, functools.partial) else builder
    fixed = builder.keywords if isinstance(builder, functools.partial) else {}

    def recorder(name):
        def record(*a, **kw):
            assert not a, "component builders are called with keywords"
            raise _Captured(name, kw)
        return record

    patches = {name: recorder(name) for name, obj in func.__globals__.items()
               if callable(obj) and getattr(obj, "__module__", "").endswith("._component_builders")}
    with mock.patch.dict(func.__globals__, patches):
        try:
            func(**{**fixed, **args})
        except _Captured as captured:
            return captured.name, captured.kwargs
    raise AssertionError(f"{component} called no component builder")


def llama_mlp_width(dim: int, multiple_of: int = 256, ffn_dim_multiplier=None) -> int:
    """SwiGLU width of Llama 2/3 when the builder gives none: 2/3 of 4 * dim, rounded up (Meta's formula)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def expected_parameter_count(name: str, kw: dict) -> int:
    """Parameters of a decoder built by torchtune's component builder ``name`` with keywords ``kw``.

    Per layer: q, k, v, output projections (Qwen2: biases on q, k, v), a
    three-matrix gated MLP, RMSNorm scales (two per layer; Gemma 2 four);
    plus token embedding, final norm and an output projection unless tied.
    LoRA adds rank * (in + out) per adapted linear, DoRA also one magnitude
    per output feature.
    """
    family = name[len("lora_"):] if name.startswith("lora_") else name
    vocab, dim, layers = kw["vocab_size"], kw["embed_dim"], kw["num_layers"]
    heads, kv_heads = kw["num_heads"], kw["num_kv_heads"]
    head_dim = kw.get("head_dim") or dim // heads
    hidden = kw.get("intermediate_dim") or llama_mlp_width(dim)
    q, kv = heads * head_dim, kv_heads * head_dim
    linears = {"q_proj": (dim, q), "k_proj": (dim, kv), "v_proj": (dim, kv), "output_proj": (q, dim)}
    mlp = {"w1": (dim, hidden), "w2": (hidden, dim), "w3": (dim, hidden)}
    per_layer = sum(i * o for i, o in {**linears, **mlp}.values())
    per_layer += (q + 2 * kv) if family == "qwen2" else 0
    per_layer += (4 if family == "gemma2" else 2) * dim
    tied = family in ("gemma", "gemma2") or kw.get("tie_word_embeddings", False)
    total = layers * per_layer + vocab * dim + dim + (0 if tied else vocab * dim)
    if name.startswith("lora_"):
        rank = kw["lora_rank"]
        adapted = [linears[m] for m in kw["lora_attn_modules"]]
        adapted += list(mlp.values()) if kw.get("apply_lora_to_mlp") else []
        adapter = sum(rank * (i + o) + (o if kw.get("use_dora") else 0) for i, o in adapted)
        total += layers * adapter
        if kw.get("apply_lora_to_output"):
            total += rank * (dim + vocab) + (vocab if kw.get("use_dora") else 0)
    return total


def test_llama3_8b_has_its_published_size():
    """The formula against a number from outside: Meta's Llama 3 8B has 8.03 B parameters."""
    name, kw = builder_hyperparameters("torchtune.models.llama3.llama3_8b", {})
    assert round(expected_parameter_count(name, kw) / 1e9, 2) == 8.03


@functools.lru_cache(maxsize=None)
def _meta_count(model_yaml: str) -> int:
    """Parameters of the model config built on the meta device (bf16), cached per distinct model."""
    from torchtune import config, training

    cfg_model = OmegaConf.create(model_yaml)
    if cfg_model.get("quantize_base") or "qlora" in cfg_model._component_:
        # NF4 quantization of every weight on the meta device costs ~25 ms per linear layer
        # (minutes for 70B); an NF4 weight keeps its shape, so the count is the unquantized twin's.
        cfg_model.quantize_base = False
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
        model = config.instantiate(cfg_model)
    return sum(p.numel() for p in model.parameters())


@pytest.fixture
def pretend_cuda():
    """The configs are written for a CUDA GPU (device: cuda, bf16, activation offloading): check them as there."""
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True):
        yield


def _check(recipe: str, name: str, path: Path, tmp_path: Path) -> None:
    cfg = OmegaConf.load(path)
    cfg.output_dir = str(tmp_path / "out")
    component = cfg.model._component_
    schema = schema_for(recipe, cfg)
    if component.startswith("torchtune.models.llama3_2_vision"):
        with pytest.raises(ConfigError, match="multimodal") as err:
            validate(cfg, extra_keys=schema)
        assert err.value.key == "model._component_" and "\n" not in str(err.value)
        return
    if str(cfg.optimizer._component_).startswith("bitsandbytes."):
        with pytest.raises(ConfigError, match="pip install bitsandbytes") as err:
            validate(cfg, extra_keys=schema)
        assert err.value.key == "optimizer._component_" and "torch.optim.AdamW" in str(err.value)
        cfg.optimizer._component_ = "torch.optim.AdamW"  # what the message offers instead
    checkpoint_dir = Path(cfg.checkpointer.checkpoint_dir)
    if checkpoint_dir.is_dir():
        validate(cfg, extra_keys=schema)  # the bundled SmolLM2 configs
    else:
        with pytest.raises(ConfigError) as err:
            validate(cfg, extra_keys=schema)
        assert err.value.key == "checkpointer.checkpoint_dir", err.value
        command = download_command(str(checkpoint_dir))
        assert command and command.startswith("tune download ") and f"`{command}`" in str(err.value)
        if path.is_relative_to(REPO_ROOT / "configs"):  # ours: exactly the line of its own header
            assert f"#   {command}\n" in path.read_text()
        assert "\n" not in str(err.value)

    model_args = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_component_"}
    if component.startswith("torchtune_ext.model"):
        builder, kw = "llama3_2", dict(model_args)  # SmolLM2: llama3_2 with its own dimensions
        from torchtune_ext.model import builders as models

        kw = {**models._SMOLLM2_135M, **kw}
        if "lora_attn_modules" in kw:
            from torchtune_ext.config import lora_settings

            builder, kw = "lora_llama3_2", {**kw, **lora_settings(cfg.model).__dict__}
    else:
        builder, kw = builder_hyperparameters(component, model_args)
    assert _meta_count(OmegaConf.to_yaml(cfg.model)) == expected_parameter_count(builder, kw), (builder, kw)


# The LoRA recipes' 77 configs: tests/unit/config/test_upstream_lora_configs.py, a file of their own so that the
# two pytest workers (which take a file each) share the meta-device builds.
NOT_LORA = [case for case in UPSTREAM if not case[0].startswith("lora_finetune")]
LORA = [case for case in UPSTREAM if case[0].startswith("lora_finetune")]


@pytest.mark.parametrize("recipe,name,path", NOT_LORA, ids=[f"{r}:{n}" for r, n, _ in NOT_LORA])
def test_torchtune_config_runs_unchanged(recipe, name, path, tmp_path, pretend_cuda):
    _check(recipe, name, path, tmp_path)


@pytest.mark.parametrize("recipe,name,path", OURS, ids=[n for _, n, _ in OURS])
def test_our_config(recipe, name, path, tmp_path, pretend_cuda):
    _check(recipe, name, path, tmp_path)


KD_UPSTREAM = [(recipe, name, path) for recipe, name, path in UPSTREAM if recipe.startswith("knowledge_distillation")]


@pytest.mark.parametrize("recipe,name,path", KD_UPSTREAM, ids=[n for _, n, _ in KD_UPSTREAM])
def test_torchtune_kd_config_without_weights_names_both_downloads(recipe, name, path):
    """torchtune's 4 KD configs: with neither model downloaded, one line names the teacher's and the student's
    `tune download` commands (the distillation recipes check the teacher first)."""
    from torchtune_ext.config.distillation import check_teacher

    cfg = OmegaConf.load(path)
    student, teacher = cfg.checkpointer.checkpoint_dir, cfg.teacher_checkpointer.checkpoint_dir
    if Path(student).exists() or Path(teacher).exists():
        pytest.skip("a model of this config is downloaded here")
    with pytest.raises(ConfigError) as err:
        check_teacher(cfg)
    assert err.value.key == "teacher_checkpointer.checkpoint_dir" and "\n" not in str(err.value)
    commands = [download_command(student), download_command(teacher)]
    assert all(c and c.startswith("tune download ") for c in commands) and commands[0] != commands[1]
    assert all(f"`{c}`" in str(err.value) for c in commands)
