"""HFCheckpointer: HF folders in and out, through the recipes' CheckpointManager; bad model folders.

A saved step is a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained``
loads with the trained model's logits, and from which a resumed run loads
exactly the state it saved (also for Qwen3-MoE, whose files hold one tensor
per expert while transformers 5's model fuses them).
"""

import json

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support.helpers import IGNORE, instruct_samples, windows
from tests.support.hf_tiny import TOKENIZER_FILES, TinyFolders, build_loaded
from torchtune_ext.checkpoint import CheckpointManager, Progress
from torchtune_ext.config import ConfigError
from torchtune_ext.model.hf import HFCheckpointer, causal_lm, check_model_folder
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return TinyFolders(tmp_path_factory.mktemp("hf_models"))


def trained(folder, steps=1, **kwargs):
    """A model of ``folder`` after ``steps`` SGD steps (its weights differ from the folder's)."""
    model = build_loaded(folder, **kwargs)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    samples = instruct_samples([2, 4, 1, 3], [6, 3, 8, 5])
    results = [train_step(model, optimizer, loss_fn, w, device=CPU) for w in windows(samples, 2, 2)[:steps]]
    assert all(r.skipped is None for r in results)
    return model, results


def cfg_checkpointer(folder, output_dir):
    return OmegaConf.create({"_component_": "torchtune_ext.model.hf.HFCheckpointer", "checkpoint_dir": str(folder),
                             "output_dir": str(output_dir)})


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "gemma3"])
def test_saved_step_is_an_hf_folder_and_resumes_exactly(name, folders, tmp_path):
    """Through CheckpointManager as the recipes save: step_1 holds safetensors, config.json,
    generation_config.json and the source folder's tokenizer files; transformers loads it with the
    trained model's logits; loading it back (a resume) gives the saved state tensor for tensor. Qwen3 and
    Gemma 3 tie lm_head to the embedding."""
    folder = folders(name)
    model, _ = trained(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(cfg_checkpointer(folder, tmp_path / "run"), str(tmp_path / "run"))
    manager.load()
    step = manager.save({"model": state}, Progress(step=1), optimizer_state={})

    names = {p.name for p in step.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", *TOKENIZER_FILES} <= names
    for file in TOKENIZER_FILES:
        assert (step / file).read_bytes() == (folder / file).read_bytes()
    assert json.loads((step / "config.json").read_text())["architectures"] == [model._ext_hf_class.__name__]
    # the same tensors as the folder transformers wrote: a tied lm_head, a tensor of its own in this state
    # (as in a gathered FSDP state), is not written a second time
    assert load_file(step / "model.safetensors").keys() == load_file(folder / "model.safetensors").keys()

    tokens = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    reloaded = AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(reloaded(tokens).logits, model(input_ids=tokens).logits, rtol=0, atol=1e-6)

    resumed = CheckpointManager(cfg_checkpointer(folder, tmp_path / "run"), str(tmp_path / "run")).load(step)["model"]
    assert resumed.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(resumed[key], value), key


def test_moe_experts_are_per_expert_in_the_files_and_fused_in_the_state(folders, tmp_path):
    """transformers 5 fuses Qwen3-MoE's experts in the model; the saved files hold them one by one, as
    the hub checkpoints do, and the round trip gives back the fused tensors."""
    folder = folders("qwen3_moe")
    model, _ = trained(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpointer = HFCheckpointer(folder, tmp_path)
    checkpointer.load_checkpoint()
    written = load_file(checkpointer.save_checkpoint({"model": state}, epoch=3) / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in written
    assert not any("gate_up_proj" in key for key in written)
    back = HFCheckpointer(tmp_path / "epoch_3", tmp_path / "again").load_checkpoint()["model"]
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_weights_that_do_not_fit_the_config_are_refused(folders, tmp_path):
    source = folders("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((source / "config.json").read_text())
    weights = load_file(source / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        HFCheckpointer(bad, tmp_path / "out").load_checkpoint()
    assert err.value.key == "checkpointer.checkpoint_dir"
    assert "model.layers.1.mlp.up_proj.weight missing" in str(err.value)


def test_head_counts_that_do_not_fit_the_weights_are_one_line_naming_the_tensor_and_shapes(folders, tmp_path,
                                                                                           capfd, caplog):
    """transformers logged an 11-line load report and raised "look at the above report!"."""
    source = folders("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((source / "config.json").read_text())
    heads, head_dim, hidden = config["num_attention_heads"], config["head_dim"], config["hidden_size"]
    config["num_attention_heads"] = heads * 2
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError) as err:
        HFCheckpointer(bad, tmp_path / "out").load_checkpoint()
    message = str(err.value)
    assert err.value.key == "checkpointer.checkpoint_dir" and "\n" not in message
    assert f"do not fit its config.json (num_attention_heads={heads * 2}, " in message
    assert (f"model.layers.0.self_attn.o_proj.weight is [{hidden}, {heads * head_dim}] in the files, but config.json "
            f"makes it [{hidden}, {heads * 2 * head_dim}]") in message
    assert "config.json must describe the weights" in message
    assert "LOAD REPORT" not in capfd.readouterr().err + caplog.text  # transformers' own report is not printed
    manager = CheckpointManager(OmegaConf.create({"_component_": "torchtune_ext.model.hf.HFCheckpointer",
                                                 "checkpoint_dir": str(bad), "output_dir": str(tmp_path / "o")}),
                                str(tmp_path / "o"))
    with pytest.raises(ConfigError) as through_the_recipes_load:
        manager.load()
    assert str(through_the_recipes_load.value) == message  # not wrapped in a second "config key ..." prefix


# ----------------------------------------------------------------------------- bad model folders
def write_config(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def refused(path, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        check_model_folder(path, **kwargs)
    assert "\n" not in str(err.value)
    return err.value


def test_folder_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    err = refused(tmp_path / "empty")
    assert err.key == "model.path" and "has no config.json" in str(err)
    assert "is not a folder" in str(refused(tmp_path / "nowhere"))


def test_model_type_unknown_to_this_transformers(tmp_path):
    err = refused(write_config(tmp_path / "m", model_type="llama99", architectures=["Llama99ForCausalLM"]))
    assert err.key == "model.path" and "'llama99'" in str(err)
    assert f"transformers {transformers.__version__}" in str(err)


def test_model_needing_remote_code_is_refused_unless_trusted(tmp_path):
    folder = write_config(tmp_path / "m", model_type="acme_lm", auto_map={
        "AutoConfig": "configuration_acme.AcmeConfig", "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"})
    err = refused(folder)
    assert err.key == "model.trust_remote_code" and "trust_remote_code=true" in str(err)
    assert refused(folder, key="checkpointer.checkpoint_dir").key == "checkpointer.trust_remote_code"


def test_a_known_family_with_code_in_its_folder_runs_transformers_own_class_and_says_so(folders, tmp_path, caplog):
    """As transformers does without trust_remote_code: a family it knows runs its built-in class even if
    config.json's auto_map names code in the folder; one line says so (once per folder), nothing is refused."""
    folder = tmp_path / "qwen3_with_code"
    folder.mkdir()
    raw = json.loads((folders("qwen3") / "config.json").read_text())
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(json.dumps(raw))
    with caplog.at_level("WARNING", logger="torchtune_ext.model.hf.causal_lm"):
        assert check_model_folder(folder).model_type == "qwen3"
        check_model_folder(folder)
    said = [r.getMessage() for r in caplog.records if "auto_map" in r.getMessage()]
    assert len(said) == 1 and "built-in Qwen3ForCausalLM is used instead" in said[0]
    assert "model.trust_remote_code=true" in said[0]


def test_encoders_are_refused_as_not_causal_language_models(tmp_path):
    """transformers maps BERT-like encoders to a causal LM class that needs is_decoder: true; a folder of
    such an encoder (or of an encoder-decoder) is one line naming what it is."""
    AutoConfig.for_model("bert").save_pretrained(str(tmp_path / "bert"))
    err = refused(tmp_path / "bert")
    assert err.key == "model.path" and "(model_type 'bert') is an encoder model, not a causal language" in str(err)
    AutoConfig.for_model("t5").save_pretrained(str(tmp_path / "t5"))
    assert "is an encoder-decoder model" in str(refused(tmp_path / "t5"))


def test_vision_language_models_are_refused_naming_their_class(tmp_path):
    gemma3 = tmp_path / "gemma3"
    AutoConfig.for_model("gemma3").save_pretrained(str(gemma3))  # Gemma 3 4B's layout: text + vision
    assert "Gemma3ForConditionalGeneration is an image-text model (vision_config); set model.text_only=true" \
        in str(refused(gemma3))  # its language model can train alone: tests/unit/model/hf/test_hf_text_only.py
    qwen_vl = write_config(tmp_path / "qwen2_vl", model_type="qwen2_vl",
                           architectures=["Qwen2VLForConditionalGeneration"])
    assert "Qwen2VLForConditionalGeneration is a multimodal model (vision_config) whose language model " \
        "transformers" in str(refused(qwen_vl))
    bert = write_config(tmp_path / "bert", model_type="bert", architectures=["BertForMaskedLM"])
    assert "BertForMaskedLM" in str(refused(bert)) and "not a causal language model" in str(refused(bert))


def test_attention_that_cannot_run_here(folders):
    folder = folders("llama")
    err = refused(folder, attn_implementation="flash_attention_2", device="cpu")
    assert err.key == "model.attn_implementation" and "CUDA" in str(err)
    assert "CUDA" in str(refused(folder, attn_implementation="flex_attention", device="cpu"))
    assert "expected one of sdpa" in str(refused(folder, attn_implementation="fast"))
    assert check_model_folder(folder, attn_implementation="eager", device="cpu").model_type == "llama"


def test_attention_defaults_to_sdpa_where_the_model_has_it(folders):
    """Left out, attn_implementation is transformers' choice: sdpa, or eager for a model without sdpa
    (gpt-oss, whose attention sinks sdpa cannot take); asking sdpa of that model is refused."""
    assert causal_lm(folders("qwen3")).config._attn_implementation == "sdpa"
    assert causal_lm(folders("gpt_oss")).config._attn_implementation == "eager"
    err = refused(folders("gpt_oss"), attn_implementation="sdpa")
    assert err.key == "model.attn_implementation" and "GptOssForCausalLM does not support sdpa" in str(err)


def test_the_check_reads_no_weights(folders, tmp_path):
    """check_model_folder runs before anything loads: a folder whose weights are unreadable passes it."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((folders("qwen3") / "config.json").read_text())
    (folder / "model.safetensors").write_text("not safetensors")
    assert check_model_folder(folder).model_type == "qwen3"


def test_dtype_is_the_recipes_unless_asked(folders):
    """dtype left out: the default dtype the recipe sets around instantiation; auto: config.json's; or named."""
    from torchtune import training

    folder = folders("qwen3")
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
        assert causal_lm(folder).dtype == torch.bfloat16
        assert causal_lm(folder, dtype="auto").dtype == torch.float32  # the tiny folder was saved in fp32
        assert causal_lm(folder, dtype="fp16").dtype == torch.float16
    with pytest.raises(ConfigError) as err:
        causal_lm(folder, dtype="int3")
    assert err.value.key == "model.dtype"


def test_checkpoint_files_must_be_in_the_folder(folders, tmp_path):
    folder = folders("qwen3")
    HFCheckpointer(folder, tmp_path, checkpoint_files=["model.safetensors"])
    with pytest.raises(ConfigError) as err:
        HFCheckpointer(folder, tmp_path, checkpoint_files=["model-00001-of-00002.safetensors"])
    assert err.value.key == "checkpointer.checkpoint_files"
