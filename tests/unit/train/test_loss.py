"""Sum-reduced, shifted, chunked cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.helpers import IGNORE, backward_mode, rel_diff
from torchtune_ext.train.accounting import count_trainable_tokens, global_sum
from torchtune_ext.train.loss import SummedCrossEntropyLoss, shift_labels


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3], [IGNORE, 5, IGNORE]])
    assert shift_labels(labels, IGNORE).tolist() == [[2, 3, IGNORE], [5, IGNORE, IGNORE]]
    with pytest.raises(ValueError):
        shift_labels(torch.tensor([1, 2, 3]))


def test_count_trainable_tokens():
    shifted = torch.tensor([[2, 3, IGNORE], [5, IGNORE, IGNORE]])
    assert count_trainable_tokens(shifted, IGNORE) == 3
    assert count_trainable_tokens(torch.full((2, 4), IGNORE), IGNORE) == 0


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_sum_equals_mean_times_count_reference(chunks):
    torch.manual_seed(0)
    logits = torch.randn(3, 10, 17)
    labels = torch.randint(0, 17, (3, 10))
    labels[0, :4] = IGNORE
    labels[2, 7:] = IGNORE
    expected = F.cross_entropy(logits.reshape(-1, 17), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=chunks, ignore_index=IGNORE)
    got = loss_fn(list(logits.chunk(chunks, dim=1)), labels).loss
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_all_ignored_is_zero_not_nan():
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=2, ignore_index=IGNORE)
    logits = torch.randn(2, 4, 5, requires_grad=True)
    sums = loss_fn(list(logits.chunk(2, dim=1)), torch.full((2, 4), IGNORE))
    sums.loss.backward()
    assert sums.loss.item() == 0.0
    assert {k: v.item() for k, v in sums.metrics.items()} == {"token_accuracy": 0.0, "entropy": 0.0}
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bf16_logits_are_upcast():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 6))
    out = SummedCrossEntropyLoss(1, IGNORE)(logits, labels).loss
    ref = F.cross_entropy(logits.float().reshape(-1, 11), labels.reshape(-1), reduction="sum")
    assert out.dtype == torch.float32 and out.item() == pytest.approx(ref.item(), rel=1e-6)


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="positions"):
        SummedCrossEntropyLoss(1, IGNORE)(torch.randn(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))


def test_global_sum_single_process_is_identity_copy():
    t = torch.tensor(3.0)
    s = global_sum(t)
    assert s.item() == 3.0 and s is not t


@pytest.mark.parametrize("chunks", [1, 4])
def test_token_metrics_are_sums_over_trainable_positions(chunks):
    """token_accuracy counts argmax hits and entropy sums -sum p log p, over exactly the counted positions."""
    torch.manual_seed(1)
    logits = torch.randn(2, 8, 13)
    labels = logits.argmax(-1)
    labels[0, :3] = IGNORE            # masked prompt
    labels[1, 5:] = IGNORE            # padding
    labels[0, 6] = (labels[0, 6] + 1) % 13   # one wrong prediction
    sums = SummedCrossEntropyLoss(chunks, IGNORE)(list(logits.chunk(chunks, dim=1)), labels)
    keep = labels != IGNORE
    probs = logits[keep].softmax(-1)
    assert sums.metrics["token_accuracy"].item() == keep.sum().item() - 1
    expected_entropy = -(probs * probs.log()).sum()
    assert sums.metrics["entropy"].item() == pytest.approx(expected_entropy.item(), rel=1e-5)
    # uniform logits: entropy of each position is ln(vocab)
    uniform = SummedCrossEntropyLoss(1, IGNORE)(torch.zeros(1, 4, 13), torch.zeros(1, 4, dtype=torch.long))
    assert uniform.metrics["entropy"].item() == pytest.approx(4 * math.log(13), rel=1e-6)


@pytest.mark.parametrize("rows", [0, 1, 7, 20])
def test_token_metrics_in_cpu_blocks_equal_the_whole_chunk(monkeypatch, rows):
    """On CPU the metrics go through the rows in blocks (cache-sized); blocks of 3 rows, with a
    remainder, and of one row give the whole-chunk counts and entropy."""
    import torchtune_ext.train.loss as loss_module

    torch.manual_seed(2)
    log_probs = torch.log_softmax(torch.randn(rows, 13) * 3, dim=-1)
    targets = torch.randint(0, 13, (rows,))
    targets[: rows // 2] = log_probs[: rows // 2].argmax(-1)
    expected_correct = (log_probs.argmax(-1) == targets).sum().item()
    expected_entropy = -(log_probs.exp() * log_probs).sum().item()
    row_bytes = 13 * 4
    for block_rows in (1, 3, 1000):
        monkeypatch.setattr(loss_module, "METRIC_BLOCK_BYTES", block_rows * row_bytes)
        correct, entropy = loss_module.token_metric_sums(log_probs, targets)
        assert correct.item() == expected_correct
        assert entropy.item() == pytest.approx(expected_entropy, rel=1e-6, abs=1e-6)


def test_token_metrics_can_be_turned_off():
    loss_fn = SummedCrossEntropyLoss(1, IGNORE, token_metrics=False)
    assert loss_fn.metric_names == ()
    assert loss_fn(torch.randn(1, 3, 5), torch.zeros(1, 3, dtype=torch.long)).metrics == {}


def test_shift_never_crosses_documents():
    """Inside a pack, the last position of a document predicts nothing (not the next document's first token)."""
    labels = torch.tensor([[10, 11, 12, 20, 21, IGNORE]])
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert shift_labels(labels, IGNORE).tolist() == [[11, 12, 20, 21, IGNORE, IGNORE]]
    assert shift_labels(labels, IGNORE, document_ids).tolist() == [[11, 12, IGNORE, 21, IGNORE, IGNORE]]
    with pytest.raises(ValueError, match="document_ids"):
        shift_labels(labels, IGNORE, document_ids[:, :3])


def test_torchtune_losses_become_summed(caplog):
    """torchtune's mean-reduced CE configs map to ours with the same chunking and ignore_index; the replacement
    is said on torchtune's logger, the one whose INFO lines the recipes show (a module logger has no handler)."""
    import logging

    from omegaconf import OmegaConf

    from torchtune_ext.config import ConfigError
    from torchtune_ext.train.loss import build_loss

    upstream = OmegaConf.create({"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss",
                                 "num_output_chunks": 4, "ignore_index": -1})
    with caplog.at_level(logging.INFO):
        loss_fn = build_loss(upstream)
    said = [r for r in caplog.records if "is computed as torchtune_ext.train.loss.SummedCrossEntropyLoss" in r.message]
    assert [r.name for r in said] == ["torchtune.utils._logging"]
    assert isinstance(loss_fn, SummedCrossEntropyLoss)
    assert (loss_fn.num_output_chunks, loss_fn.ignore_index) == (4, -1)
    plain = build_loss(OmegaConf.create({"_component_": "torch.nn.CrossEntropyLoss"}))
    assert isinstance(plain, SummedCrossEntropyLoss) and plain.ignore_index == IGNORE
    with pytest.raises(ConfigError, match="loss.label_smoothing': is not supported with torch.nn.CrossEntropyLoss, "
                       "which runs as torchtune_ext.train.loss.SummedCrossEntropyLoss .*; it takes ignore_index$"):
        build_loss(OmegaConf.create({"_component_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1}))
    with pytest.raises(ConfigError, match="cannot be normalized exactly"):
        build_loss(OmegaConf.create({"_component_": "torch.nn.MSELoss"}))


# ----------------------------------------------------------- the loss applies the output projection

def _models(lora_dropout=0.0):
    """Tied (SmolLM2's layout), untied, and a LoRA adapter on an untied output."""
    from torchtune.models.llama3 import lora_llama3
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    arch = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                intermediate_dim=48)
    torch.manual_seed(0)
    tied = llama3_2(**arch, scale_factor=1)
    torch.manual_seed(0)
    untied = llama3_2(**arch, scale_factor=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    lora = lora_llama3(["q_proj", "v_proj"], apply_lora_to_output=True, lora_rank=4, lora_alpha=8,
                       lora_dropout=lora_dropout, **arch)
    set_trainable_params(lora, get_adapter_params(lora))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_b" in name:
                p.normal_(std=0.05)  # B = 0 would give A no gradient
    return {"tied": tied, "untied": untied, "lora_output": lora}


def _micro_batches():
    from tests.support.helpers import collate, instruct_samples

    samples = instruct_samples([3, 9, 1, 6, 0], [12, 2, 30, 7, 5])
    samples = [{"tokens": [t % 96 for t in s["tokens"]],
                "labels": [l if l == IGNORE else l % 96 for l in s["labels"]]} for s in samples]
    return [collate(samples[:2], pad_to=40), collate(samples[2:4]), collate(samples[4:])]


def _step_grads(model, loss_fn, once, seed=7):
    from torchtune_ext.train.step import forward_backward

    torch.manual_seed(seed)  # LoRA dropout draws the same masks in every run
    model.zero_grad(set_to_none=True)
    totals = forward_backward(model, loss_fn, _micro_batches(), device=torch.device("cpu"),
                              backward=backward_mode(once))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return totals, grads


@pytest.mark.parametrize("kind", ["tied", "untied", "lora_output"])
@pytest.mark.parametrize("once", [True, False], ids=["once_recomputed", "per_micro_batch"])
@pytest.mark.parametrize("chunks", [1, 3, "auto"])
def test_loss_projection_equals_model_logits(kind, once, chunks):
    """Sums, token metrics and gradients are those of the model's own logits, for a tied, an untied
    and a LoRA output projection, in both modes."""
    import copy

    model = _models()[kind]
    reference_model = copy.deepcopy(model)
    reference_model.set_num_output_chunks(0)
    ref_totals, ref_grads = _step_grads(reference_model, SummedCrossEntropyLoss(1, IGNORE), once=False)
    loss_fn = SummedCrossEntropyLoss(chunks, IGNORE)
    loss_fn.take_output_projection(model)
    totals, grads = _step_grads(model, loss_fn, once)
    assert totals.num_tokens == ref_totals.num_tokens > 0
    for name in ("loss", "token_accuracy", "entropy"):
        assert totals.sums[name] == pytest.approx(ref_totals.sums[name], rel=1e-5), name
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert rel_diff(grads[name], ref_grads[name]) <= 1e-5, name


def _family_models():
    """Other families' output paths: Qwen2 (q/k/v biases, untied output with a LoRA adapter), Gemma
    (embeddings scaled by sqrt(dim), tied), Gemma 2 (its final norm caps the normed hidden state with
    tanh: torchtune 0.6.1's Gemma2FinalNorm; a cap of 0.5 makes it bite)."""
    from torchtune.models.gemma import gemma
    from torchtune.models.gemma2 import gemma2
    from torchtune.models.qwen2 import lora_qwen2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    arch = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                intermediate_dim=48)
    torch.manual_seed(0)
    qwen = lora_qwen2(["q_proj", "k_proj"], apply_lora_to_output=True, lora_rank=4, lora_alpha=8,
                      tie_word_embeddings=False, **arch)
    set_trainable_params(qwen, get_adapter_params(qwen))
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if "lora_b" in name or name.endswith(".bias"):
                p.normal_(std=0.05)  # nonzero: the biases and B matter
    torch.manual_seed(0)
    gemma_model = gemma(head_dim=8, **arch)
    torch.manual_seed(0)
    capped = gemma2(head_dim=8, final_capping_value=0.5, sliding_window_size=16, query_pre_attn_scalar=8, **arch)
    for model in (gemma_model, capped):
        torch.nn.init.normal_(model.tok_embeddings.weight, std=0.05)
    return {"qwen2_lora_output": qwen, "gemma": gemma_model, "gemma2_capped": capped}


@pytest.mark.parametrize("kind", ["qwen2_lora_output", "gemma", "gemma2_capped"])
@pytest.mark.parametrize("once", [True, False], ids=["once_recomputed", "per_micro_batch"])
def test_loss_projection_equals_model_logits_other_families(kind, once):
    """The loss's projection is exactly the model's output for Qwen2 and Gemma too; for Gemma 2 the
    soft cap (in the final norm, which the model still applies) is kept, and does change the loss."""
    import copy

    model = _family_models()[kind]
    reference_model = copy.deepcopy(model)
    reference_model.set_num_output_chunks(0)
    ref_totals, ref_grads = _step_grads(reference_model, SummedCrossEntropyLoss(1, IGNORE), once=False)
    loss_fn = SummedCrossEntropyLoss(3, IGNORE)
    loss_fn.take_output_projection(model)
    totals, grads = _step_grads(model, loss_fn, once)
    for name in ("loss", "token_accuracy", "entropy"):
        assert totals.sums[name] == pytest.approx(ref_totals.sums[name], rel=1e-5), name
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert rel_diff(grads[name], ref_grads[name]) <= 1e-5, name
    if kind == "gemma2_capped":
        uncapped = copy.deepcopy(reference_model)
        uncapped.norm.logit_capping.capping_value = 1e6
        loss = _step_grads(uncapped, SummedCrossEntropyLoss(1, IGNORE), once=False)[0].sums["loss"]
        assert loss != pytest.approx(ref_totals.sums["loss"], rel=1e-3)


@pytest.mark.parametrize("chunks", [1, 3])
def test_recompute_draws_the_same_dropout_masks(chunks):
    """LoRA dropout on the output adapter: the once-per-step backward recomputes each chunk with the
    RNG state of its forward, so it equals the per-micro-batch run (which recomputes nothing). (Against
    the model's own logits the masks differ: there dropout covers every position, here only trainable rows.)"""
    results = {}
    for once in (True, False):
        model = _models(lora_dropout=0.3)["lora_output"]
        loss_fn = SummedCrossEntropyLoss(chunks, IGNORE)
        loss_fn.take_output_projection(model)
        results[once] = _step_grads(model, loss_fn, once)
    (once_totals, once_grads), (each_totals, each_grads) = results[True], results[False]
    assert once_totals.sums["loss"] == pytest.approx(each_totals.sums["loss"], rel=1e-6)
    for name in each_grads:
        assert rel_diff(once_grads[name], each_grads[name]) <= 1e-5, name
    # and the dropout did something: without it the loss differs
    model = _models()["lora_output"]
    loss_fn = SummedCrossEntropyLoss(chunks, IGNORE)
    loss_fn.take_output_projection(model)
    assert _step_grads(model, loss_fn, True)[0].sums["loss"] != pytest.approx(once_totals.sums["loss"], rel=1e-4)


def test_take_output_projection_leaves_weights_and_state_dict_alone():
    model = _models()["tied"]
    keys = list(model.state_dict())
    loss_fn = SummedCrossEntropyLoss("auto", IGNORE)
    loss_fn.take_output_projection(model)
    assert list(model.state_dict()) == keys and list(loss_fn.parameters()) == []
    assert loss_fn.owns_output_projection and loss_fn.vocab_size == 96
    hidden = model(torch.randint(0, 96, (2, 5)))
    assert hidden.shape == (2, 5, 32)
    with pytest.raises(ValueError, match="hidden states"):
        loss_fn([hidden], torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="TransformerDecoder"):
        SummedCrossEntropyLoss().take_output_projection(torch.nn.Linear(2, 2))


def _saved_bytes(fn):
    """Bytes of the distinct tensors autograd saves for backward while ``fn`` runs (parameters excluded)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_recompute_keeps_hidden_states_not_log_probabilities():
    """With recompute_output, what the loss keeps for backward is O(rows x hidden), not O(rows x vocab);
    the gradient is the same."""
    from torchtune.models.llama3_2 import llama3_2

    torch.manual_seed(0)
    model = llama3_2(vocab_size=4096, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                     intermediate_dim=48, scale_factor=1)
    loss_fn = SummedCrossEntropyLoss("auto", IGNORE)
    loss_fn.take_output_projection(model)
    hidden = model(torch.randint(0, 4096, (4, 50))).detach().requires_grad_()
    labels = torch.randint(0, 4096, (4, 50))
    labels[:, :10] = IGNORE
    rows = int((labels != IGNORE).sum())
    results = {}
    for recompute in (False, True):
        hidden.grad = None
        sums, saved = _saved_bytes(lambda: loss_fn(hidden, labels, recompute_output=recompute))
        sums.loss.backward()
        results[recompute] = (sums, saved, hidden.grad.clone())
    vocab_wide = rows * 4096 * 4
    assert results[False][1] >= vocab_wide          # log-probabilities kept until backward
    assert results[True][1] < vocab_wide / 20       # indices and nothing vocabulary-wide
    assert results[True][0].loss.item() == pytest.approx(results[False][0].loss.item(), rel=1e-6)
    assert rel_diff(results[True][2], results[False][2]) <= 1e-6


def test_recompute_in_bf16_gives_the_same_gradient():
    from torchtune.models.llama3_2 import llama3_2

    torch.manual_seed(0)
    model = llama3_2(vocab_size=512, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                     intermediate_dim=48, scale_factor=1).to(torch.bfloat16)
    loss_fn = SummedCrossEntropyLoss(2, IGNORE)
    loss_fn.take_output_projection(model)
    tokens, labels = torch.randint(0, 512, (2, 30)), torch.randint(0, 512, (2, 30))
    grads = {}
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        sums = loss_fn(model(tokens), labels, recompute_output=recompute)
        assert sums.loss.dtype == torch.float32
        sums.loss.backward()
        grads[recompute] = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    for name in grads[False]:
        assert torch.equal(grads[True][name], grads[False][name]), name


def test_no_trainable_row_still_reaches_every_parameter():
    """A micro-batch with nothing to learn gives 0 (not NaN) and a zero gradient for every parameter,
    so data-parallel ranks run the same backward."""
    model = _models()["tied"]
    loss_fn = SummedCrossEntropyLoss("auto", IGNORE)
    loss_fn.take_output_projection(model)
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        sums = loss_fn(model(torch.randint(0, 96, (2, 6))), torch.full((2, 6), IGNORE), recompute_output=recompute)
        sums.loss.backward()
        assert sums.loss.item() == 0.0 and sums.metrics["entropy"].item() == 0.0
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_output_chunk_rule():
    """auto: fp32 logits per chunk under 256 MiB, never under 1024 rows; an integer n: n equal chunks."""
    from torchtune_ext.train.loss import AUTO_CHUNK_BYTES, MIN_CHUNK_ROWS, rows_per_output_chunk

    assert rows_per_output_chunk("auto", 5000, 49_152) == 1365          # SmolLM2: 1365 x 49152 x 4 B < 256 MiB
    assert 1365 * 49_152 * 4 <= AUTO_CHUNK_BYTES < 1366 * 49_152 * 4
    assert rows_per_output_chunk("auto", 5000, 128_256) == MIN_CHUNK_ROWS == 1024   # Llama 3: the floor wins
    assert rows_per_output_chunk("auto", 10, 1000) == AUTO_CHUNK_BYTES // 4000      # small vocabulary: big chunks
    assert rows_per_output_chunk("auto", 10, None) == MIN_CHUNK_ROWS
    assert rows_per_output_chunk(8, 100, 49_152) == 13 and rows_per_output_chunk(8, 0, 49_152) == 1


def test_chunks_follow_the_rule():
    """The projection runs once per chunk of trainable rows: ceil(rows / rows_per_chunk) calls."""
    model = _models()["tied"]
    calls = []
    hook = model.output.linear.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    loss_fn = SummedCrossEntropyLoss(3, IGNORE)
    loss_fn.take_output_projection(model)
    labels = torch.randint(0, 96, (2, 20))
    labels[0, :7] = IGNORE  # 33 trainable rows -> chunks of 11
    loss_fn(model(torch.randint(0, 96, (2, 20))), labels)
    hook.remove()
    assert calls == [11, 11, 11]


def test_num_output_chunks_is_checked():
    from omegaconf import OmegaConf

    from torchtune_ext.config import ConfigError
    from torchtune_ext.train.loss import build_loss

    ours = OmegaConf.create({"_component_": "torchtune_ext.train.loss.SummedCrossEntropyLoss"})
    assert build_loss(ours).num_output_chunks == "auto"
    for bad in (0, "many", True):
        with pytest.raises(ConfigError, match="loss.num_output_chunks"):
            build_loss(OmegaConf.create({"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss",
                                         "num_output_chunks": bad}))
    with pytest.raises(ValueError):
        SummedCrossEntropyLoss(0)
