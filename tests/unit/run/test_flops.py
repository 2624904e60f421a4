"""MFU arithmetic: the FLOP count of a tiny model by hand, the peak table, the measured CPU peak."""

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.support.helpers import tiny_lora_model, tiny_model
from torchtune_ext.run.metrics import flops, step_record
from torchtune_ext.run.metrics.flops import ModelFlops, flops_per_token, peak_tflops_per_device, table_peak_tflops
from torchtune_ext.train.step import StepResult

CPU = torch.device("cpu")

# tests.support.helpers.tiny_model: vocabulary 128, 2 layers, width 32, 4 heads of 8, 2 KV heads, MLP 64, tied output.
Q, K, V, O = 32 * 32, 32 * 16, 32 * 16, 32 * 32      # k and v: 2 KV heads x 8 = 16 wide
MLP = 3 * 32 * 64                                    # w1, w2, w3
PER_LAYER = Q + K + V + O + MLP                      # 9,216
TIED_OUTPUT = 128 * 32                               # the embedding, counted once as the output projection
WEIGHTS = 2 * PER_LAYER + TIED_OUTPUT                # 22,528; norms' scales are not matmul weights


def test_tiny_model_by_hand():
    counted = ModelFlops.from_model(tiny_model())
    assert counted == ModelFlops(trainable_params=WEIGHTS, frozen_params=0, num_layers=2, attn_dim=32)
    # one micro-batch of 2 rows padded to 10, real lengths 10 and 6
    padded = 6 * WEIGHTS * 20 + 12 * 2 * 32 * (10**2 + 10**2)
    useful = 6 * WEIGHTS * 16 + 12 * 2 * 32 * (10**2 + 6**2)
    assert counted.step_flops(20, 200) == padded == 2_856_960
    assert counted.step_flops(16, 136) == useful == 2_267_136
    # the per-token formula (moved here from bench/analysis.py) says the same for one full row
    assert counted.step_flops(10, 100) == 10 * flops_per_token(WEIGHTS, 0, 2, 32, 10)


def test_untied_embedding_lookup_and_lora_base_count_as_they_cost():
    from torchtune.models.llama3_2 import llama3_2

    untied = llama3_2(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                      intermediate_dim=64, scale_factor=1, tie_word_embeddings=False)
    # the input embedding is a lookup; the separate output projection is a matmul weight
    assert ModelFlops.from_model(untied).trainable_params == WEIGHTS
    lora = ModelFlops.from_model(tiny_lora_model())
    adapters = sum(p.numel() for p in tiny_lora_model().parameters() if p.requires_grad)
    assert (lora.trainable_params, lora.frozen_params) == (adapters, WEIGHTS)
    assert lora.step_flops(1, 0) == 6 * adapters + 4 * WEIGHTS
    assert ModelFlops.from_model(torch.nn.Linear(2, 2)) is None


def test_step_record_mfu_padding_and_tokens_seen():
    data = SimpleNamespace(num_padded_positions=20, num_real_tokens=16, padded_squared_lengths=200,
                           real_squared_lengths=136)
    result = StepResult(loss=1.0, num_tokens=12, local_num_tokens=12, grad_norm=1.0)
    record = step_record(result, step=3, epoch=0, lr=1e-3, step_seconds=2.0, device=CPU, tokens_seen=40,
                         data=data, flops=ModelFlops.from_model(tiny_model()), peak_tflops=1e-6)
    assert record["tokens_seen"] == 40
    assert record["padding_fraction"] == pytest.approx(0.2)
    assert record["tflops_per_device"] == pytest.approx(2_856_960 / 2.0 / 1e12)
    assert record["useful_tflops_per_device"] == pytest.approx(2_267_136 / 2.0 / 1e12)
    assert record["mfu"] == pytest.approx(2_856_960 / 2.0 / 1e6)  # FLOP/s over 1 MFLOP/s of peak
    assert record["useful_mfu"] == pytest.approx(2_267_136 / 2.0 / 1e6)
    # no peak: FLOP/s but no MFU; no data: neither
    no_peak = step_record(result, step=3, epoch=0, lr=1e-3, step_seconds=2.0, device=CPU, data=data,
                          flops=ModelFlops.from_model(tiny_model()))
    assert "tflops_per_device" in no_peak and "mfu" not in no_peak
    bare = step_record(result, step=3, epoch=0, lr=1e-3, step_seconds=2.0, device=CPU)
    assert not {"padding_fraction", "tflops_per_device", "mfu"} & set(bare)


@pytest.mark.parametrize("name,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0), ("NVIDIA H100 80GB HBM3", torch.float32, 67.0),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.0), ("NVIDIA H200", torch.bfloat16, 989.0),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0), ("NVIDIA L4", torch.bfloat16, 121.0),
    ("NVIDIA L40S", torch.bfloat16, 362.0), ("NVIDIA A10", torch.bfloat16, 125.0),
    ("NVIDIA GeForce RTX 4090", torch.float16, 165.2),
    ("NVIDIA A10G", torch.bfloat16, None), ("Some Future GPU", torch.bfloat16, None),
])
def test_peak_table(name, dtype, peak):
    assert table_peak_tflops(name, dtype) == peak


def test_peak_from_config_table_or_measurement(monkeypatch, caplog):
    assert peak_tflops_per_device(CPU, torch.float32, configured=12.5) == (12.5, "peak_tflops_per_device")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    assert peak_tflops_per_device(torch.device("cuda"), torch.bfloat16)[0] == 121.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    with caplog.at_level(logging.WARNING, logger="torchtune_ext.run.metrics.flops"):
        assert peak_tflops_per_device(torch.device("cuda"), torch.bfloat16) == (None, "unknown")
    (warning,) = caplog.records
    assert "Some Future GPU" in warning.getMessage() and "peak_tflops_per_device" in warning.getMessage()


def test_cpu_peak_is_measured_within_its_time_budget(monkeypatch):
    # A fake clock that moves 10 ms per reading: the timed loop must stop at its deadline (0.3 s by default),
    # whatever the machine's speed, so start-up pays about 0.3 s plus two warm-up products, not more.
    monkeypatch.setattr(flops, "_MEASURED_PEAKS", {})  # not one measured earlier in this process
    readings = iter(range(10**6))
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(readings) * 0.01)
    products = []
    real_mm = torch.mm
    monkeypatch.setattr(flops.torch, "mm", lambda a, b: products.append(a.shape) or real_mm(a, b))

    rng = torch.get_rng_state()
    peak, source = peak_tflops_per_device(CPU, torch.float32)
    # three clock readings per timed product: 0.3 s / 0.03 s = 10 timed products, after 2 warm-ups
    assert len(products) == 2 + 10
    assert torch.equal(torch.get_rng_state(), rng)  # training's random stream is left alone
    assert peak > 0 and "measured" in source


def test_cpu_peak_is_a_plausible_number():
    # a 256^3 product takes 33.5 MFLOP: the measurement is that divided by the best time
    assert 1e-4 < flops.measure_peak_tflops(CPU, torch.float32, seconds=0.05, n=256) < 100


def test_cpu_peak_is_measured_once_per_process_and_thread_count(monkeypatch):
    calls = []
    monkeypatch.setattr(flops, "_MEASURED_PEAKS", {})
    monkeypatch.setattr(flops, "measure_peak_tflops", lambda device, dtype: calls.append(dtype) or 0.5 * len(calls))
    first = peak_tflops_per_device(CPU, torch.float32)
    assert peak_tflops_per_device(CPU, torch.float32) == first == (0.5, first[1]) and len(calls) == 1
    assert peak_tflops_per_device(CPU, torch.bfloat16)[0] == 1.0 and len(calls) == 2  # another dtype: measured
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert peak_tflops_per_device(CPU, torch.float32)[0] == 1.5 and len(calls) == 3  # other threads: measured
    finally:
        torch.set_num_threads(threads)
