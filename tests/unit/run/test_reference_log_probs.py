"""Reference log-probabilities computed once (torchtune_ext/run/reference_log_probs.py, PrecomputedReference of
torchtune_ext/train/preference.py): the table, its look-up, its file. The recipes' use of it (equal training, no
reference call while training, resume, refusal of another run's file) is tested in
tests/integration/recipes/test_dpo_recipes.py."""

import pytest
import torch

from tests.support.helpers import IGNORE, VOCAB, clone, tiny_model
from torchtune_ext.data.preference import PairDataset, collate_pairs
from torchtune_ext.data.step_loader import StepLoader
from torchtune_ext.errors import ConfigError
from torchtune_ext.run.reference_log_probs import compute_table, load_table, save_table
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.preference import ModelReference, PrecomputedReference, PreferenceLoss, PreferenceObjective

CPU = torch.device("cpu")


def pairs(n: int, seed: int):
    """``n`` torchtune preference items of varied lengths, prompts masked."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt, chosen, rejected = (torch.randint(3, VOCAB, (k,), generator=g).tolist()
                                    for k in (2 + i % 4, 1 + (3 * i) % 7, 1 + (5 * i) % 6))
        out.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [IGNORE] * len(prompt) + chosen,
                    "rejected_input_ids": prompt + rejected, "rejected_labels": [IGNORE] * len(prompt) + rejected})
    return out


def objective_with_reference():
    """(policy, objective): the reference a perturbed copy of the policy, so that losses are not ln 2."""
    policy = tiny_model(seed=0, embedding_std=0.3)
    reference = clone(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lm, ref_lm = (SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE) for _ in range(2))
    lm.take_output_projection(policy)
    ref_lm.take_output_projection(reference)
    return policy, PreferenceObjective(lm, PreferenceLoss(beta=0.1), ModelReference(reference, ref_lm))


def collate(samples):
    return collate_pairs(samples, 0, IGNORE)


def test_the_table_holds_each_pairs_reference_sums_and_is_looked_up_by_pair_index():
    """7 training pairs of which epoch 0 covers 4 (max_steps_per_epoch=1), 3 validation pairs after them: every
    pair's row equals the reference run on that pair alone (chosen, rejected), whether epoch 0 or the pass over the
    rest computed it; a micro-batch of pairs 6, 2 reads rows 6 and 2, chosen first; the losses a step computes with
    the table equal those with the reference model."""
    policy, objective = objective_with_reference()
    train = PairDataset(pairs(7, seed=5))
    val = PairDataset(pairs(3, seed=8), index_offset=7)
    loaders = [StepLoader(train, collate, batch_size=2, gradient_accumulation_steps=2, seed=1, shuffle=True,
                          max_steps_per_epoch=1, ignore_index=IGNORE),
               StepLoader(val, collate, batch_size=2, shuffle=False, require_sample_per_rank=False,
                          ignore_index=IGNORE)]
    table = compute_table(objective.reference, lambda b: objective.prepare(b, CPU), loaders, collate, batch_size=2,
                          num_pairs=10, ignore_index=IGNORE)
    assert table.shape == (10, 2)
    for index, sample in enumerate([train[i] for i in range(7)] + [val[i] for i in range(3)]):
        alone = objective.reference(objective.prepare(collate([sample]), CPU))
        assert torch.allclose(table[index], alone, rtol=1e-6, atol=0), index

    batch = collate([train[6], train[2]])
    prepared = objective.prepare(batch, CPU)
    looked_up = PrecomputedReference(table)(prepared)
    assert looked_up.tolist() == [table[6, 0].item(), table[2, 0].item(), table[6, 1].item(), table[2, 1].item()]
    with_model = objective(policy, prepared).loss
    objective.use_reference(PrecomputedReference(table))
    assert abs(objective(policy, prepared).loss.item() - with_model.item()) <= 1e-5 * abs(with_model.item())
    del batch["pair_index"]
    with pytest.raises(ValueError, match="pair_index"):
        PrecomputedReference(table)(objective.prepare(batch, CPU))


def test_the_file_is_read_back_only_for_its_own_fingerprint(tmp_path):
    path = tmp_path / "reference_log_probs.pt"
    fingerprint = {"pairs": "abc", "model": "m"}
    assert load_table(path, fingerprint, 3) is None  # no file yet
    save_table(path, torch.arange(6.0).view(3, 2), fingerprint)
    assert load_table(path, fingerprint, 3).tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ConfigError, match=r"other pairs \(data, tokenizer or tokenizer.max_seq_len\) than"):
        load_table(path, {**fingerprint, "pairs": "abd"}, 3)
    with pytest.raises(ConfigError, match=r"other model \(config, base weights or dtype\) than"):
        load_table(path, {**fingerprint, "model": "n"}, 3)
    with pytest.raises(ConfigError, match=r"number of pairs \(3, this run 4\)"):
        load_table(path, fingerprint, 4)
    path.write_bytes(b"not a table")
    with pytest.raises(ConfigError, match="cannot be read .*; delete it") as err:
        load_table(path, fingerprint, 3)
    assert err.value.key == "precompute_reference_log_probs" and "\n" not in str(err.value)
