"""torchtune's config keys: each one does what it does upstream, or is refused in one line naming it."""

import logging
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ext.config import DISTRIBUTED_KEYS, LORA_KEYS, ConfigError, validate


def refused(cfg, key, *words, extra_keys=None):
    with pytest.raises(ConfigError) as err:
        validate(cfg, extra_keys=extra_keys)
    assert err.value.key == key, str(err.value)
    for word in words:
        assert word in str(err.value)
    assert "\n" not in str(err.value)


def test_optimizer_in_bwd_needs_one_micro_batch_and_no_clipping(cfg):
    cfg.optimizer_in_bwd = True
    assert validate(cfg).optimizer_in_bwd is True
    cfg.gradient_accumulation_steps = 4
    refused(cfg, "optimizer_in_bwd", "gradient_accumulation_steps=4", "clip_grad_norm")
    cfg.gradient_accumulation_steps = 1
    cfg.clip_grad_norm = 1.0
    refused(cfg, "optimizer_in_bwd", "gradient_accumulation_steps", "clip_grad_norm=1.0")


def test_resume_keeps_optimizer_in_bwd(cfg):
    """The saved optimizer state's layout follows optimizer_in_bwd: a resume that flips it is refused."""
    from torchtune_ext.checkpoint import Progress, ResumeState
    from torchtune_ext.run.resume import check_resume

    cfg = validate(cfg)
    saved = ResumeState(Progress(step=2), {}, [], config={**OmegaConf.to_container(cfg), "optimizer_in_bwd": True})
    with pytest.raises(ConfigError) as err:
        check_resume(saved, cfg)
    assert err.value.key == "optimizer_in_bwd" and "optimizer_in_bwd=true" in str(err.value)
    cfg.optimizer_in_bwd = True
    check_resume(saved, cfg)


def test_optimizer_package_not_installed(cfg):
    cfg.optimizer = {"_component_": "bitsandbytes.optim.PagedAdamW", "lr": 1e-5}
    refused(cfg, "optimizer._component_", "bitsandbytes.optim.PagedAdamW", "pip install bitsandbytes",
            "torch.optim.AdamW")


def test_multimodal_model_is_refused(cfg):
    cfg.model = {"_component_": "torchtune.models.llama3_2_vision.llama3_2_vision_11b", "image_size": 560}
    refused(cfg, "model._component_", "multimodal", "text-only model")
    cfg.model = {"_component_": "torchtune_ext.model.builders.tiny_llama"}
    cfg.collate_fn = "torchtune.data.padded_collate_tiled_images_and_mask"
    refused(cfg, "collate_fn", "multimodal", "padded_collate_sft")


def test_checkpointer_model_type_must_convert_for_the_family(cfg):
    cfg.model = {"_component_": "torchtune.models.qwen2_5.qwen2_5_0_5b"}
    cfg.checkpointer.model_type = "LLAMA3"  # would permute q/k for interleaved RoPE: silently wrong weights
    refused(cfg, "checkpointer.model_type", "qwen2_5", "model_type: QWEN2")
    cfg.checkpointer.model_type = "QWEN2"
    validate(cfg)
    cfg.model = {"_component_": "torchtune.models.llama3_1.llama3_1_8b"}
    cfg.checkpointer.model_type = "LLAMA2"  # converted alike: accepted
    validate(cfg)


def test_missing_weights_name_the_tune_download_command(cfg):
    cfg.checkpointer.checkpoint_dir = "/tmp/Meta-Llama-3.1-8B-Instruct/"
    refused(cfg, "checkpointer.checkpoint_dir", "/tmp/Meta-Llama-3.1-8B-Instruct",
            "`tune download meta-llama/Meta-Llama-3.1-8B-Instruct --output-dir /tmp/Meta-Llama-3.1-8B-Instruct")
    cfg.checkpointer.checkpoint_dir = "/nonexistent/my-model"
    refused(cfg, "checkpointer.checkpoint_dir", "/nonexistent/my-model", "tune download <org>/<model>")


def test_formatted_checkpoint_files_are_checked(cfg, tmp_path):
    cfg.checkpointer.checkpoint_files = {"filename_format": "model-{}-of-{}.safetensors", "max_filename": "00002"}
    refused(cfg, "checkpointer.checkpoint_files", "model-00001-of-00002.safetensors")


def test_recipe_checkpoint_is_refused(cfg):
    cfg.checkpointer.recipe_checkpoint = None
    validate(cfg)
    cfg.checkpointer.recipe_checkpoint = "recipe_state.pt"
    refused(cfg, "checkpointer.recipe_checkpoint", "resume_from_checkpoint=true", "step_<N>")


def test_checkpointer_output_dir_elsewhere_is_refused(cfg, tmp_path):
    """Upstream saves where checkpointer.output_dir says; here checkpoints live in output_dir (resume, disk
    checks): a different folder is refused rather than silently not used."""
    cfg.output_dir = str(tmp_path / "run")
    cfg.checkpointer.output_dir = "${output_dir}"  # torchtune's configs
    validate(cfg)
    cfg.checkpointer.output_dir = str(tmp_path / "run") + "/"
    validate(cfg)
    cfg.checkpointer.output_dir = str(tmp_path / "big_disk")
    refused(cfg, "checkpointer.output_dir", str(tmp_path / "big_disk"), "output_dir/step_<N>")


def test_activation_offloading_needs_cuda_and_checkpointing(cfg):
    cfg.enable_activation_offloading = True
    cfg.device = "cpu"
    refused(cfg, "enable_activation_offloading", "CUDA")
    cfg.device = "cuda"
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True):
        refused(cfg, "enable_activation_offloading", "enable_activation_checkpointing=true")
        cfg.enable_activation_checkpointing = True
        assert validate(cfg).enable_activation_offloading is True


def test_activation_offloading_wraps_every_forward():
    """The offloading context is entered before and left after each forward of the model."""
    from tests.support.helpers import tiny_model
    from torchtune_ext.model.runtime import offload_activations

    events = []

    class Context:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    model = tiny_model()
    offload_activations(model, False)
    model(torch.zeros(1, 4, dtype=torch.long))
    assert events == []
    with mock.patch("torchtune.training.get_act_offloading_ctx_manager", return_value=Context()) as get:
        offload_activations(model, True)
    get.assert_called_once_with(model, True)
    model(torch.zeros(1, 4, dtype=torch.long))
    model(torch.zeros(1, 4, dtype=torch.long))
    assert events == ["enter", "exit", "enter", "exit"]


def test_tensor_parallel_keys_as_in_torchtunes_70b_configs(cfg, monkeypatch):
    """torchtune's 70B configs name tensor_parallel_dim and the Llama plan; a dimension the job's ranks
    cannot be split by is refused (tests/unit/parallel/test_tensor_parallel.py: the rest)."""
    cfg.tensor_parallel_dim = 2
    cfg.tensor_parallel_plan = {"_component_": "torchtune.models.llama3.base_llama_tp_plan"}
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert validate(cfg, extra_keys=DISTRIBUTED_KEYS).tensor_parallel_dim == 2
    monkeypatch.delenv("WORLD_SIZE")  # one process: no tensor-parallel group of 2
    refused(cfg, "tensor_parallel_dim", "does not divide the 1 rank of this job", extra_keys=DISTRIBUTED_KEYS)


def test_fsdp_cpu_offload_section_is_reported_not_read(cfg, caplog):
    cfg.fsdp = {"cpu_offload": False}
    cfg.fsdp_cpu_offload = True
    with caplog.at_level(logging.WARNING):
        validate(cfg, extra_keys=DISTRIBUTED_KEYS)
    assert "'fsdp.cpu_offload' is not read" in caplog.text and "fsdp_cpu_offload=true applies" in caplog.text


def test_low_cpu_ram_only_in_the_single_device_lora_recipe(cfg):
    cfg.low_cpu_ram = True
    refused(cfg, "low_cpu_ram", "low_cpu_ram=false")
    cfg.model = {"_component_": "torchtune_ext.model.builders.lora_tiny_llama", "lora_attn_modules": ["q_proj"]}
    refused(cfg, "low_cpu_ram", "distributed", extra_keys={**LORA_KEYS, **DISTRIBUTED_KEYS})
    assert validate(cfg, extra_keys=LORA_KEYS).low_cpu_ram is True


def test_low_cpu_ram_switches_torchtunes_qlora_hook():
    from torchtune.modules import common_utils

    from torchtune_ext.model.runtime import use_low_cpu_ram

    try:
        use_low_cpu_ram(True)
        assert common_utils._use_low_cpu_ram is True
    finally:
        use_low_cpu_ram(False)
    assert common_utils._use_low_cpu_ram is False


def test_profiler_section(cfg):
    cfg.profiler = {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False}
    validate(cfg)
    cfg.profiler = {"_component_": "my.profiler", "enabled": True}
    refused(cfg, "profiler._component_", "torchtune.training.setup_torch_profiler")


def test_log_peak_memory_stats_false_leaves_the_memory_out():
    from torchtune_ext.run.metrics import step_record
    from torchtune_ext.train.step import StepResult

    result = StepResult(1.0, 10, 10, 0.5)
    kwargs = dict(step=1, epoch=0, lr=1e-3, step_seconds=1.0, device=torch.device("cpu"))
    assert "peak_memory_gib" in step_record(result, **kwargs)
    assert "peak_memory_gib" not in step_record(result, **kwargs, log_peak_memory=False)


def test_collate_fn_is_used(tmp_path):
    """A collate_fn with torchtune's arguments builds the micro-batches of unpacked data."""
    from types import SimpleNamespace

    from torchtune_ext.data import build_step_loader

    calls = []

    def collate(batch, padding_idx, ignore_idx):
        calls.append((len(batch), padding_idx, ignore_idx))
        from torchtune.data import padded_collate_sft

        return padded_collate_sft(batch, padding_idx=padding_idx, ignore_idx=ignore_idx)

    cfg = OmegaConf.create({
        "dataset": {"_component_": "tests.support.helpers.synthetic_sft_dataset", "num_samples": 4},
        "model": {"_component_": "torchtune_ext.model.builders.tiny_llama"},  # its max_seq_len bounds the samples
        "collate_fn": f"{__name__}.COLLATE", "batch_size": 2, "gradient_accumulation_steps": 1,
        "shuffle": False, "group_by_length": False, "max_tokens_per_micro_batch": None, "max_steps_per_epoch": None,
        "data_errors": "warn",
    })
    with mock.patch(f"{__name__}.COLLATE", collate, create=True):
        loader = build_step_loader(cfg, SimpleNamespace(pad_id=7), seed=0, ignore_index=-100)
        steps = list(loader.epoch(0))
    assert len(steps) == 2 and calls == [(2, 7, -100), (2, 7, -100)]
