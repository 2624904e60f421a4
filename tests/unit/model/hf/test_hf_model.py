"""transformers models through the recipes' flow (torchtune_ext.model.hf): losses, exactness, packing.

Every model is a tiny random model of its family written as an HF folder
(tests/support/hf_tiny.py), built by ``causal_lm`` on the meta device and loaded
with the checkpointer's state dict, as the recipes will do.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.support.helpers import IGNORE, backward_mode, instruct_samples, rel_diff, windows
from tests.support.hf_tiny import GEMMA_SOFTCAP, TinyFolders, build_loaded, our_token_losses
from torchtune_ext.data import collate_as_pack, collate_packed
from torchtune_ext.train.loss import SummedCrossEntropyLoss, shift_labels
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
TOL = 1e-5
NAMES = ["gemma3", "llama", "mistral", "qwen3", "qwen3_moe"]  # gpt-oss: tests/unit/model/hf/test_hf_moe.py


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return TinyFolders(tmp_path_factory.mktemp("hf_models"))


def batch(seed=0, size=(3, 14)):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 128, size, generator=g)
    labels = tokens.clone()
    labels[0, :5] = IGNORE  # a masked prompt
    labels[1, -3:] = IGNORE  # padding
    return tokens, labels


@pytest.mark.parametrize("name", NAMES)
def test_per_token_losses_equal_transformers(name, folders):
    """Our loss, applying the output projection to trainable rows only, gives transformers' own
    per-token cross-entropies (its logits, its loss with labels=), Gemma 3's soft cap included."""
    model = build_loaded(folders(name))
    tokens, labels = batch()
    with torch.no_grad():
        reference = model(input_ids=tokens, labels=labels)  # transformers' own forward and loss
        assert torch.equal(model(tokens), reference.logits)  # torchtune's call: the same logits
    shifted = shift_labels(labels, IGNORE)
    keep = shifted != IGNORE
    expected = F.cross_entropy(reference.logits[keep].float(), shifted[keep], reduction="none")

    with torch.no_grad():
        hidden, ours, total = our_token_losses(model, tokens, shifted, IGNORE)
        assert hidden.shape == (*tokens.shape, model.config.hidden_size)
    assert rel_diff(ours, expected) <= TOL
    assert abs(total.item() / keep.sum().item() - reference.loss.item()) <= TOL * reference.loss.item()
    if name == "gemma3":  # the cap bites: without it the logits would differ a lot
        raw = model.lm_head(hidden[keep]).float()
        assert (raw - GEMMA_SOFTCAP * torch.tanh(raw / GEMMA_SOFTCAP)).abs().max() > 0.1


def run_steps(model, step_windows, once):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    results = [train_step(model, optimizer, loss_fn, w, device=CPU, backward=backward_mode(once), step=i + 1)
               for i, w in enumerate(step_windows)]
    return results, {n: p.detach().clone() for n, p in model.named_parameters()}


SAMPLES = instruct_samples([3, 0, 7, 2, 5, 1, 4, 6], [5, 9, 2, 11, 3, 8, 6, 1])  # masked prompts, padded batches


@pytest.mark.parametrize("once", [True, False], ids=["once", "per_mb"])
@pytest.mark.parametrize("name", NAMES)
def test_batch_4_equals_batch_1_times_4(name, once, folders):
    """batch 4 x GA 1 == batch 1 x GA 4: loss, grad norm and the weights after 2 SGD steps (fp32)."""
    whole, whole_params = run_steps(build_loaded(folders(name)), windows(SAMPLES, 4, 1), once)
    split, split_params = run_steps(build_loaded(folders(name)), windows(SAMPLES, 1, 4), once)
    for a, b in zip(whole, split):
        assert abs(a.loss - b.loss) <= TOL * abs(b.loss) and abs(a.grad_norm - b.grad_norm) <= TOL * b.grad_norm
        assert a.num_tokens == b.num_tokens
    for key in whole_params:
        assert rel_diff(split_params[key], whole_params[key]) <= TOL, key


# ----------------------------------------------------------------------------- packing
@pytest.mark.parametrize("once", [True, False], ids=["once", "per_mb"])
@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_packed_step_equals_padded_step(name, once, folders):
    """Samples packed in one row (positions restart, block-causal mask) train as padded rows: Gemma 3 with
    a sliding window shorter than the samples, Qwen3-MoE whose routing is per token."""
    padded, padded_params = run_steps(build_loaded(folders(name)), windows(SAMPLES, 2, 2), once)
    packed_windows = [[collate_as_pack(SAMPLES[i:i + 2]), collate_as_pack(SAMPLES[i + 2:i + 4])]
                      for i in range(0, len(SAMPLES), 4)]
    packed, packed_params = run_steps(build_loaded(folders(name)), packed_windows, once)
    for a, b in zip(packed, padded):
        assert a.num_tokens == b.num_tokens
        assert abs(a.loss - b.loss) <= TOL * b.loss and abs(a.grad_norm - b.grad_norm) <= TOL * b.grad_norm
    for key in padded_params:
        assert rel_diff(packed_params[key], padded_params[key]) <= TOL, key


def hidden_of(model, micro_batch):
    inputs = {k: v for k, v in micro_batch.items() if k in ("mask", "input_pos")}
    with torch.no_grad():
        return model(micro_batch["tokens"], **inputs)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_documents_of_a_pack_do_not_see_each_other(name, folders):
    """Changing the first document of a pack changes nothing in the second; in one row without the
    positions' restart (a single document), the same change does reach it."""
    model = build_loaded(folders(name))
    first, second = SAMPLES[3], SAMPLES[1]
    changed = dict(first, tokens=[(t + 7) % 120 + 3 for t in first["tokens"]])
    n = len(first["tokens"])
    a, b = collate_as_pack([first, second]), collate_as_pack([changed, second])
    assert torch.equal(hidden_of(model, a)[:, n:], hidden_of(model, b)[:, n:])
    assert not torch.equal(hidden_of(model, a)[:, :n], hidden_of(model, b)[:, :n])
    # the control: the same rows as one document (plain causal attention)
    joined = {"tokens": a["tokens"]}
    assert not torch.allclose(hidden_of(model, joined)[:, n:], hidden_of(model, {"tokens": b["tokens"]})[:, n:])


def test_torchtune_packed_dataset_with_padding_equals_unpacked(folders):
    """torchtune's PackedDataset (its padding continues the last document's positions, its mask makes the
    padding a document of its own) gives the per-sample losses of the unpacked samples."""
    from torchtune.datasets import PackedDataset

    samples = SAMPLES[:3]
    pack = collate_packed([PackedDataset(samples, max_seq_len=64, padding_idx=0)[0]])
    assert pack["tokens"].shape[1] == 64 > sum(len(s["tokens"]) for s in samples)  # padded
    model = build_loaded(folders("llama"))
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    loss_fn.take_output_projection(model)
    with torch.no_grad():
        packed = loss_fn(hidden_of(model, pack), shift_labels(pack["labels"], IGNORE, pack["document_ids"])).loss
        single = sum(loss_fn(model(torch.tensor([s["tokens"]])), shift_labels(torch.tensor([s["labels"]]), IGNORE)).loss
                     for s in samples)
    assert abs(packed.item() - single.item()) <= TOL * single.item()


def test_mask_that_positions_contradict_is_refused(folders):
    """A block-causal mask whose second document does not restart its positions would let the documents
    attend to each other (transformers reads documents off the positions): refused."""
    model = build_loaded(folders("llama"))
    pack = collate_as_pack(SAMPLES[:3])
    bad = dict(pack, input_pos=torch.arange(pack["tokens"].shape[1])[None])
    with pytest.raises(ValueError, match="does not restart"):
        hidden_of(model, bad)
    with pytest.raises(ValueError, match="needs input_pos"):
        with torch.no_grad():
            model(pack["tokens"], mask=pack["mask"])


def test_flex_block_mask_is_checked_like_a_dense_one(folders):
    """On CUDA torchtune's packed collator gives a flex-attention BlockMask instead of a dense mask: the same
    check applies (built here on CPU with torchtune's mask rule)."""
    from torch.nn.attention.flex_attention import create_block_mask

    pack = collate_as_pack(SAMPLES[:3])
    documents = pack["document_ids"]
    length = documents.shape[1]
    block_mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (documents[b, q] == documents[b, kv]),
                                   1, None, length, length, device="cpu")
    model = build_loaded(folders("llama"))
    with torch.no_grad():
        dense = model(pack["tokens"], mask=pack["mask"], input_pos=pack["input_pos"])
        assert torch.equal(model(pack["tokens"], mask=block_mask, input_pos=pack["input_pos"]), dense)
        with pytest.raises(ValueError, match="does not restart"):
            model(pack["tokens"], mask=block_mask, input_pos=torch.arange(length)[None])


def test_activation_checkpointing_per_decoder_layer_changes_nothing(folders):
    """Every decoder layer (the model's _no_split_modules) recomputes in backward; the state dict keys,
    loading on meta and the step's loss, grad norm and weights are as without it."""
    from tests.support.hf_tiny import build_loaded as plain
    from torchtune_ext.model.hf import HFCheckpointer, causal_lm, load_state, set_activation_checkpointing

    folder = folders("gemma3")
    reference, reference_params = run_steps(plain(folder), windows(SAMPLES, 2, 2)[:1], once=True)
    with torch.device("meta"):
        model = causal_lm(folder, dtype="fp32")
    keys = set(model.state_dict())
    set_activation_checkpointing(model)
    assert set(model.state_dict()) == keys
    assert sum(1 for name, _ in model.named_modules() if name.endswith("._checkpoint_wrapped_module")) == 2
    load_state(model, HFCheckpointer(folder, folder.parent / "unused_out").load_checkpoint()["model"], CPU)
    checkpointed, params = run_steps(model, windows(SAMPLES, 2, 2)[:1], once=True)
    params = {key.replace("._checkpoint_wrapped_module", ""): value for key, value in params.items()}
    assert abs(checkpointed[0].loss - reference[0].loss) <= TOL * reference[0].loss
    assert abs(checkpointed[0].grad_norm - reference[0].grad_norm) <= TOL * reference[0].grad_norm
    for key, value in reference_params.items():
        assert rel_diff(params[key], value) <= TOL, key
