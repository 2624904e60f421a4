"""The language model of an image-text folder, trained alone (``text_only``; torchtune_ext.model.hf).

Every folder is a tiny random image-text model written by transformers
(tests/support/hf_tiny.py: Gemma 3, Llama 4, Mistral 3, Qwen3.5), with a vision
tower and projector. Checked: the text model computes on text what the
image-text model computes (its own logits and loss, same weights); a saved
step is a text model's folder that plain transformers loads and a resume
loads back exactly; LoRA trains and saves; the folder is refused without
the flag, naming the key to set. Through the recipe: tests/integration/test_hf_text_only.py.
"""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tests.support.helpers import IGNORE, instruct_samples, rel_diff, windows
from tests.support.hf_tiny import (
    IMAGE_PROCESSOR_FILES,
    IMAGE_TEXT,
    TOKENIZER_FILES,
    TinyFolders,
    build_loaded,
    image_text_config,
    our_token_losses,
)
from torchtune_ext.checkpoint import CheckpointManager, Progress
from torchtune_ext.config import ConfigError
from torchtune_ext.model.hf import (
    HFCheckpointer,
    adapter_params,
    causal_lm,
    check_model_folder,
    initialize_adapters,
    load_state,
    lora_causal_lm,
    lora_checkpoint_state,
    model_keys,
)
from torchtune_ext.model.hf.folder import language_model_keys, read_model_folder
from torchtune_ext.train.loss import SummedCrossEntropyLoss, shift_labels
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
TOL = 1e-5
TEXT_CLASS = {"gemma3": "Gemma3ForCausalLM", "llama4": "Llama4ForCausalLM", "mistral3": "MistralForCausalLM",
              "qwen3_5": "Qwen3_5ForCausalLM"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return TinyFolders(tmp_path_factory.mktemp("hf_image_text"))


def text_batch():
    """Text only: ids below Gemma 3's image, begin- and end-of-image tokens (125-127 in the tiny vocabulary)."""
    tokens = torch.randint(3, 120, (3, 14), generator=torch.Generator().manual_seed(0))
    labels = tokens.clone()
    labels[0, :5] = IGNORE  # a masked prompt
    labels[1, -3:] = IGNORE  # padding
    return tokens, labels


def image_text_model(folder):
    """The folder as transformers loads it, with its own class (vision tower included)."""
    return AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()


def tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("name", sorted(IMAGE_TEXT))
def test_text_model_losses_equal_the_image_text_models(name, folders):
    """Loaded as the recipes load it (checkpointer and causal_lm with text_only), the language model alone
    gives the image-text model's per-token cross-entropies on text (its logits; its mean loss with labels=),
    ties its output projection as that model does, and holds none of the vision weights."""
    folder = folders.image_text(name)
    model = build_loaded(folder, text_only=True)
    reference_model = image_text_model(folder)
    assert type(model).__name__ == TEXT_CLASS[name]
    assert tied(model) == tied(reference_model)
    if name == "mistral3":  # the text config says untied, the image-text model (outer config) ties
        assert reference_model.config.text_config.tie_word_embeddings is False and tied(model)
    own_keys = AutoModelForCausalLM.from_config(model.config).state_dict().keys()
    assert set(model.state_dict()) == set(own_keys)

    tokens, labels = text_batch()
    with torch.no_grad():
        reference = reference_model(input_ids=tokens, labels=labels)
    shifted = shift_labels(labels, IGNORE)
    keep = shifted != IGNORE
    expected = F.cross_entropy(reference.logits[keep].float(), shifted[keep], reduction="none")
    with torch.no_grad():
        _, ours, total = our_token_losses(model, tokens, shifted, IGNORE)
    assert rel_diff(ours, expected) <= TOL
    assert abs(total.item() / keep.sum().item() - reference.loss.item()) <= TOL * reference.loss.item()


def test_the_checkpointer_says_what_it_drops(folders, tmp_path, caplog):
    """One log line names the image-text class, the text class and the modules left out (Gemma 3: its vision
    tower and projector, with their parameter count)."""
    checkpointer = HFCheckpointer(folders.image_text("gemma3"), tmp_path, text_only=True)
    with caplog.at_level(logging.INFO, logger="torchtune_ext.model.hf.checkpointer"):
        state = checkpointer.load_checkpoint()["model"]
    lines = [r.getMessage() for r in caplog.records if "text_only" in r.getMessage()]
    assert len(lines) == 1
    dropped = sum(p.numel() for n, p in image_text_model(folders.image_text("gemma3")).named_parameters()
                  if n.startswith(("model.vision_tower.", "model.multi_modal_projector.")))
    for part in ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM", "model.multi_modal_projector, "
                 "model.vision_tower", f"({dropped:,} parameters)"):
        assert part in lines[0], part
    assert not any("vision" in key or "projector" in key for key in state)


def train(model, steps=1, adapters=False):
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    params = adapter_params(model).values() if adapters else model.parameters()
    optimizer = torch.optim.SGD(list(params), lr=2.0 if adapters else 0.5)
    samples = instruct_samples([2, 4, 1, 3], [6, 3, 8, 5])
    for i, window in enumerate(windows(samples, 2, 1)[:steps]):
        assert train_step(model, optimizer, loss_fn, window, device=CPU, step=i + 1).skipped is None


def manager(folder, run):
    cfg = OmegaConf.create({"_component_": "torchtune_ext.model.hf.HFCheckpointer", "checkpoint_dir": str(folder),
                            "output_dir": str(run), "text_only": True})
    return CheckpointManager(cfg, str(run))


def logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_saved_step_is_a_text_model_folder_and_resumes_exactly(name, folders, tmp_path):
    """A step saved through CheckpointManager is the text model's folder (its config.json, architectures,
    weights; the image-text folder's generation config and tokenizer files; no image processor file):
    AutoModelForCausalLM loads it as the text class with the trained logits, and a resume (still
    text_only, as the config says) loads the saved state tensor for tensor."""
    folder = folders.image_text(name)
    model = build_loaded(folder, text_only=True)
    train(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = manager(folder, tmp_path / "run")
    run.load()
    step = run.save({"model": state}, Progress(step=1), optimizer_state={})

    names = {p.name for p in step.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", *TOKENIZER_FILES} <= names
    assert not names & set(IMAGE_PROCESSOR_FILES)
    config = json.loads((step / "config.json").read_text())
    assert config["architectures"] == [TEXT_CLASS[name]] and config["model_type"] == model.config.model_type
    assert "vision_config" not in config and "text_config" not in config
    assert (json.loads((step / "generation_config.json").read_text())
            == json.loads((folder / "generation_config.json").read_text()) | {"transformers_version": config[
                "transformers_version"]})

    tokens = text_batch()[0]
    reloaded = AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32)
    assert type(reloaded).__name__ == TEXT_CLASS[name]
    assert torch.allclose(logits(reloaded, tokens), logits(model, tokens), rtol=0, atol=1e-6)

    resumed = manager(folder, tmp_path / "run").load(step)["model"]
    assert resumed.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_lora_on_the_language_model(name, folders, tmp_path):
    """lora_causal_lm with text_only: adapters on the text model's attention and MLP (Llama 4: its fused
    experts too) train alone; the merged step loads with AutoModelForCausalLM, and the adapter with PEFT onto
    the text model, both with the trained logits."""
    folder = folders.image_text(name)
    with torch.device("meta"):
        model = lora_causal_lm(folder, dtype="fp32", text_only=True, lora_attn_modules=["q_proj", "v_proj"],
                               apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8)
    initialize_adapters(model, 7)
    base = HFCheckpointer(folder, tmp_path / "unused", text_only=True).load_checkpoint()["model"]
    missing, unexpected = load_state(model, model_keys(model, base), CPU, strict=False)
    assert missing and all(".lora_" in key for key in missing) and not unexpected
    train(model, steps=2, adapters=True)
    tokens = text_batch()[0]
    trained = logits(model, tokens)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, value in model_keys(model, base).items():  # the base did not move
        assert torch.equal(state[key], value), key
    assert any(".lora_" in key and "experts" in key for key in state) == (name == "llama4")

    run = manager(folder, tmp_path / "run")
    run.load()
    step = run.save(lora_checkpoint_state(model, state), Progress(step=2), optimizer_state={})
    merged = AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32)
    assert type(merged).__name__ == TEXT_CLASS[name]
    assert rel_diff(logits(merged, tokens), trained) <= TOL
    text_base = build_loaded(folder, text_only=True)
    with_adapter = PeftModel.from_pretrained(text_base, str(step / "adapter"))
    assert rel_diff(logits(with_adapter, tokens), trained) <= TOL


# ----------------------------------------------------------------------------- what is refused
def refused(call, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        call(*args, **kwargs)
    assert "\n" not in str(err.value)
    return err.value


def test_image_text_folder_is_refused_without_text_only(folders, tmp_path):
    """Without the flag, the model and the checkpointer refuse an image-text folder in one line that names its
    class and the key to set (the checkpointer's own key; configs/hf/*.yaml set it from model.text_only)."""
    folder = folders.image_text("gemma3")
    for err in (refused(check_model_folder, folder), refused(causal_lm, folder)):
        assert err.key == "model.path"
        assert "Gemma3ForConditionalGeneration is an image-text model (vision_config)" in str(err)
        assert "set model.text_only=true" in str(err) and "Gemma3ForCausalLM" in str(err)
    err = refused(HFCheckpointer, folder, tmp_path)
    assert err.key == "checkpointer.checkpoint_dir" and "set checkpointer.text_only=true" in str(err)
    assert "Llama4ForConditionalGeneration" in str(refused(check_model_folder, folders.image_text("llama4")))


def test_a_language_model_that_computes_other_logits_is_refused(tmp_path):
    """Gemma3ForCausalLM applies its text config's final_logit_softcapping; Gemma3ForConditionalGeneration
    does not (Google's checkpoints set none). With a cap set, the text model's logits would differ from the
    folder's model (shown here): text_only refuses such a folder, naming the key."""
    config = image_text_config("gemma3", text={"final_logit_softcapping": 1.0})
    folder = tmp_path / "capped"
    config.save_pretrained(str(folder))
    err = refused(check_model_folder, folder, text_only=True)
    assert err.key == "model.text_only"
    assert "after lm_head it applies softcap 1.0, Gemma3ForConditionalGeneration nothing" in str(err)

    torch.manual_seed(0)
    image_text = AutoModelForImageTextToText.from_config(config).eval()
    text = AutoModelForCausalLM.from_config(config.text_config).eval()
    keys = language_model_keys(image_text, text)
    text.load_state_dict({key: image_text.state_dict()[mapped] for key, mapped in keys.items()})
    tokens = text_batch()[0]
    assert (logits(text, tokens) - logits(image_text, tokens)).abs().max() > 0.1


def test_a_language_model_that_cannot_tie_as_the_image_text_model_is_refused(folders, monkeypatch):
    """Were Gemma3ForCausalLM unable to tie its output projection (Gemma 3 ties it), its training would
    differ from the image-text model's: refused, naming model.text_only."""
    from transformers import Gemma3ForCausalLM

    monkeypatch.setattr(Gemma3ForCausalLM, "_tied_weights_keys", None)
    err = refused(check_model_folder, folders.image_text("gemma3"), text_only=True)
    assert err.key == "model.text_only" and "ties its output projection to its embedding and Gemma3ForCausalLM " \
        "cannot do the same" in str(err)


def test_image_text_model_whose_language_model_transformers_cannot_build_alone(tmp_path):
    """Qwen2-VL's text model has no causal LM class in transformers: refused with or without text_only."""
    folder = tmp_path / "qwen2_vl"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl",
                                                    "architectures": ["Qwen2VLForConditionalGeneration"]}))
    for text_only in (False, True):
        err = refused(check_model_folder, folder, text_only=text_only)
        assert err.key == "model.path" and "Qwen2VLForConditionalGeneration is a multimodal model" in str(err)
        assert "cannot build as a causal LM alone" in str(err)


def test_text_only_on_a_text_model_folder_changes_nothing(folders, tmp_path):
    """A text model's folder (as every saved step of a text_only run is) reads, builds and loads as without
    the flag, so one config resumes from its own steps."""
    folder = folders("qwen3")
    plain = read_model_folder(folder)
    flagged = read_model_folder(folder, text_only=True)
    assert flagged.image_text is None and flagged.config.to_dict() == plain.config.to_dict()
    state = HFCheckpointer(folder, tmp_path, text_only=True).load_checkpoint()["model"]
    reference = HFCheckpointer(folder, tmp_path).load_checkpoint()["model"]
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)
    assert type(causal_lm(folder, text_only=True)) is type(causal_lm(folder))


def test_missing_weights_matter_only_in_the_language_model(folders, tmp_path):
    """Files without the vision tower still give the language model; a missing weight of the language model
    is refused, named as the image-text model names it."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = folders.image_text("gemma3")
    weights = load_file(source / "model.safetensors")

    def folder_without(name, dropped):
        folder = tmp_path / name
        shutil.copytree(source, folder)
        save_file({k: v for k, v in weights.items() if not dropped(k)}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        return folder

    no_vision = folder_without("no_vision", lambda key: "vision_tower" in key)
    state = HFCheckpointer(no_vision, tmp_path / "out", text_only=True).load_checkpoint()["model"]
    reference = HFCheckpointer(source, tmp_path / "out", text_only=True).load_checkpoint()["model"]
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    no_norm = folder_without("no_norm", lambda key: key.endswith("layers.1.input_layernorm.weight"))
    err = refused(HFCheckpointer(no_norm, tmp_path / "out", text_only=True).load_checkpoint)
    assert err.key == "checkpointer.checkpoint_dir"
    assert "model.language_model.layers.1.input_layernorm.weight missing" in str(err)


def test_dtype_auto_is_the_image_text_folders(tmp_path):
    """Google's Gemma 3 config.json names its dtype at the top only (the text config has none): dtype=auto
    builds the language model in it."""
    config = image_text_config("gemma3").to_dict()
    config.pop("dtype", None)
    config["text_config"].pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    folder = tmp_path / "bf16"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        assert causal_lm(folder, dtype="auto", text_only=True).dtype == torch.bfloat16


@pytest.mark.parametrize("config", ["full", "full_single_device", "lora", "lora_single_device"])
def test_the_shipped_configs_set_the_checkpointer_from_the_model(config):
    """configs/hf/*.yaml: model.text_only and model.trust_remote_code are off by default and are the one key
    each to set; the checkpointer's follow them."""
    from omegaconf import OmegaConf

    from tests.support.helpers import REPO_ROOT

    cfg = OmegaConf.load(REPO_ROOT / "configs" / "hf" / f"{config}.yaml")
    assert cfg.model.text_only is False and cfg.checkpointer.text_only is False
    assert cfg.checkpointer.trust_remote_code is False
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["model.text_only=true", "model.trust_remote_code=true"]))
    assert cfg.checkpointer.text_only is True and cfg.checkpointer.trust_remote_code is True
