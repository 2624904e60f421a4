"""The named Hugging Face configs (configs/qwen3, gemma3, qwen3_moe) are their generic config plus a few settings.

Each names the generic config it derives from (``configs/hf/<name>.yaml``)
in its header; a key other than the per-model settings below that differs
from the generic config is drift, and fails here. Each also passes the
config checks and the component checks (model built on the meta device,
tokenizer, optimizer) on a tiny folder of its family, so a typo in a named
config is found without downloading the model.
"""

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.helpers import REPO_ROOT, copy_smollm2_tokenizer
from tests.support.hf_tiny import write_tiny, write_tiny_image_text
from tests.support.tokenizer_cache import each_tokenizer_loaded_once

NAMED = sorted(p for family in ("qwen3", "gemma3", "qwen3_moe")
               for p in (REPO_ROOT / "configs" / family).glob("*.yaml"))
# what a named config may set differently from its generic config
PER_MODEL = {"model_dir", "output_dir", "batch_size", "gradient_accumulation_steps", "optimizer.lr",
             "enable_activation_checkpointing", "fsdp_cpu_offload", "tokenizer.max_seq_len", "model.lora_rank",
             "model.lora_alpha", "model.lora_dropout", "model.text_only"}
FAMILY = {"qwen3": "qwen3", "gemma3": "gemma3", "qwen3_moe": "qwen3_moe"}


def _flat(node, prefix=""):
    out = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _generic(path: Path) -> Path:
    match = re.search(r"configs/hf/(\w+)\.yaml", path.read_text())
    assert match, f"{path} does not name its generic config (configs/hf/<name>.yaml) in its header"
    return REPO_ROOT / "configs" / "hf" / f"{match.group(1)}.yaml"


def test_there_are_named_configs_for_the_common_models():
    names = {p.relative_to(REPO_ROOT / "configs").as_posix() for p in NAMED}
    for size in ("0.6B", "1.7B", "8B"):
        for kind in ("full_single_device", "full", "lora_single_device", "lora"):
            assert f"qwen3/{size}_{kind}.yaml" in names
    assert {"gemma3/1B_full_single_device.yaml", "gemma3/1B_lora_single_device.yaml",
            "gemma3/4B_lora_single_device.yaml", "qwen3_moe/30B_A3B_lora.yaml"} <= names


@pytest.mark.parametrize("path", NAMED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_named_config_is_its_generic_config_with_per_model_settings(path):
    named = _flat(OmegaConf.to_container(OmegaConf.load(path)))
    generic = _flat(OmegaConf.to_container(OmegaConf.load(_generic(path))))
    drift = sorted(k for k in set(named) | set(generic) if k not in PER_MODEL and named.get(k) != generic.get(k))
    assert not drift, f"{path.name} differs from {_generic(path).name} in {drift}"
    # the folder the header downloads is the model_dir it reads
    download = re.search(r"--local-dir (\S+)", path.read_text()).group(1)
    assert named["model_dir"] == download


@pytest.fixture(scope="module", autouse=True)
def _load_each_tokenizer_once():
    """Every named config reads the same SmolLM2 tokenizer in its family's folder: once per folder
    (tests/support/tokenizer_cache.py; the tokenizer's own tests load it afresh each time)."""
    with each_tokenizer_loaded_once():
        yield


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, smollm2_assets):
    root = tmp_path_factory.mktemp("named")
    folders = {}
    for family in set(FAMILY.values()):
        folders[family] = write_tiny(family, root / family, vocab_size=49_152, max_position_embeddings=4096)
    # Gemma 3 4B and larger are image-text folders (model.text_only)
    folders["gemma3 image-text"] = write_tiny_image_text(
        "gemma3", root / "gemma3_image_text", text=dict(vocab_size=49_152, max_position_embeddings=4096))
    for folder in folders.values():
        copy_smollm2_tokenizer(smollm2_assets, folder)
    return folders


@pytest.mark.parametrize("path", NAMED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_named_config_passes_the_checks_on_a_folder_of_its_family(path, tiny_folders, tmp_path):
    from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, validate
    from torchtune_ext.run.preflight import check_components

    cfg = OmegaConf.load(path)
    family = FAMILY[path.parent.name] + (" image-text" if cfg.model.get("text_only") else "")
    cfg.model_dir = str(tiny_folders[family])
    cfg.output_dir = str(tmp_path / "out")
    cfg.metric_logger = None
    keys = {**(LORA_KEYS if "lora" in path.stem else {}),
            **(DISTRIBUTED_KEYS if not path.stem.endswith("single_device") else {})}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO_ROOT)  # the bundled data path is relative to the repository
        check_components(validate(cfg, extra_keys=keys), torch.device("cpu"))


@pytest.mark.parametrize("path", NAMED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_named_configs_missing_model_names_model_dir_and_its_download_line(path, tmp_path):
    """The folder is not downloaded yet: one line naming model_dir (the key the user sets) and the
    `hf download` line of the config's own header; a file in its place is said to be a file."""
    from torchtune_ext.config import ConfigError
    from torchtune_ext.config.files import check_input_files

    cfg = OmegaConf.load(path)
    header = re.search(r"^#\s+(hf download .+?)\s*$", path.read_text(), flags=re.M)
    assert header, f"{path} has no `hf download` line in its header"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)  # models/<name> does not exist here
        with pytest.raises(ConfigError) as err:
            check_input_files(cfg, dataset_keys=())
        assert err.value.key == "model_dir"
        assert f"'{cfg.model_dir}' does not exist. Download the model first: `{header.group(1)}`" in str(err.value)
        Path(cfg.model_dir).parent.mkdir(parents=True)
        Path(cfg.model_dir).write_text("not a folder")
        with pytest.raises(ConfigError, match=r"'model_dir'.* is a file, not a folder"):
            check_input_files(cfg, dataset_keys=())
