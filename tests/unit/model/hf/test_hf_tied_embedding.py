"""A transformers model's tied ``lm_head`` on CPU: the token embedding's gradient rows go straight into ``.grad``
(torchtune_ext.model.runtime.embedding_rows_into_grad), as for torchtune's ``TiedLinear``, with the same gradients
and updates as autograd's dense way, the embedding's ``padding_idx`` row included (transformers' Llama sets it to
``pad_token_id``; SmolLM2's is its ``<|im_end|>``, a token of every chat turn)."""

import pytest
import torch

from tests.support.helpers import IGNORE, backward_mode, instruct_samples, rel_diff, windows
from tests.support.hf_tiny import build_loaded, write_tiny
from torchtune_ext.model.runtime import embedding_rows_into_grad
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.step import forward_backward

CPU = torch.device("cpu")
PAD = 0  # hf_tiny's pad_token_id


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    return {"llama_tied": write_tiny("llama", root / "llama_tied", tie_word_embeddings=True),
            "llama_untied": write_tiny("llama", root / "llama_untied"),
            "qwen3": write_tiny("qwen3", root / "qwen3"),  # tied in hf_tiny
            "gemma3": write_tiny("gemma3", root / "gemma3")}  # tied, but a scaled embedding of its own class


def _with_padding_id(samples):
    """The padding id inside every sample, in the prompt and in the answer (as SmolLM2's <|im_end|>)."""
    for s in samples:
        for j in (1, len(s["tokens"]) - 2):
            s["tokens"][j] = PAD
            if s["labels"][j] != IGNORE:
                s["labels"][j] = PAD
    return samples


@pytest.mark.parametrize("once", [True, False], ids=["once_per_step", "per_micro_batch"])
def test_rows_into_grad_gives_a_tied_lm_head_the_same_gradients_and_updates(folders, once):
    samples = _with_padding_id(instruct_samples([6, 3, 12, 5, 9, 4], [4, 10, 2, 7, 3, 8]))
    nothing = {"tokens": [7, PAD, 9, 10], "labels": [IGNORE] * 4}  # a micro-batch with nothing to learn
    step_windows = windows(samples[:2] + [nothing] + samples[2:], batch_size=1, grad_accum=4)
    step_windows += windows(samples[::-1], batch_size=2, grad_accum=3)
    default, rows = build_loaded(folders["llama_tied"]), build_loaded(folders["llama_tied"])
    assert default.get_input_embeddings().padding_idx == PAD
    assert embedding_rows_into_grad(rows, CPU)
    assert rows.get_output_embeddings().weight is rows.get_input_embeddings().weight  # still tied
    probe_ids = torch.tensor([[1, 2, 3]])
    assert type(rows.get_input_embeddings()(probe_ids).grad_fn).__name__ == "_EmbeddingRowsIntoGradBackward"
    seen = []
    for model in (default, rows):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
        loss_fn.take_output_projection(model)
        grads = []
        for w in step_windows:
            forward_backward(model, loss_fn, w, device=CPU, backward=backward_mode(once))
            assert model.get_input_embeddings().weight.grad.layout == torch.strided
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        seen.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (grads_d, params_d), (grads_r, params_r) = seen
    name = "model.embed_tokens.weight"
    for k, (step_d, step_r) in enumerate(zip(grads_d, grads_r)):
        assert step_d[name].abs().sum() > 0
        # the first step from the same weights differs in the order of a float sum only; after Adam updates,
        # which amplify that where they divide by a tiny second moment, the project's 1e-5 bound applies
        for n in step_d:
            assert rel_diff(step_r[n], step_d[n]) <= (1e-6 if k == 0 else 1e-5), (k, n)
    for n in params_d:
        assert rel_diff(params_r[n], params_d[n]) <= 1e-5, n


@pytest.mark.parametrize("name, applies", [("llama_tied", True), ("qwen3", True), ("llama_untied", False),
                                           ("gemma3", False)])
def test_rows_into_grad_applies_to_a_plain_tied_embedding_only(folders, name, applies):
    """Untied: nothing to save; Gemma 3's scaled embedding has a forward of its own: both keep autograd's way."""
    model = build_loaded(folders[name])
    embedding = model.get_input_embeddings()
    assert embedding_rows_into_grad(model, CPU) is applies
    assert (type(embedding).__name__ == "_RowsIntoGradEmbedding") is applies
    assert not embedding_rows_into_grad(build_loaded(folders[name]), torch.device("cuda"))
