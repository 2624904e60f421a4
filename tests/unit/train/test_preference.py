"""Preference tuning's step is exact under any split of its pairs (torchtune_ext.train.preference).

The reference is computed here, pair by pair, from unpadded forwards of the
two tiny models: each response's log-probability summed over its trainable
tokens after the shift, the per-pair loss by its formula, the mean over the
step's pairs. Every split (one micro-batch, one pair per micro-batch,
uneven micro-batches, simulated data-parallel ranks, a short last window)
must give that mean, its gradient and the pair metrics to fp32 precision.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.helpers import IGNORE, VOCAB, backward_mode, clone, rel_diff, tiny_model
from torchtune_ext.data.preference import collate_pairs
from torchtune_ext.train.accounting import TokenTally
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.preference import ModelReference, PreferenceLoss, PreferenceObjective
from torchtune_ext.train.step import forward_backward, train_step

CPU = torch.device("cpu")
TOL = 1e-5


def pairs(n: int = 4, seed: int = 5):
    """``n`` pair samples of varied prompt and response lengths (prompt labels masked)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, VOCAB, (3 + 2 * i,), generator=g).tolist()
        chosen = torch.randint(3, VOCAB, (2 + 3 * i,), generator=g).tolist()
        rejected = torch.randint(3, VOCAB, (9 - 2 * i,), generator=g).tolist()
        c_tokens, r_tokens = prompt + chosen, prompt + rejected
        out.append({"tokens": c_tokens + r_tokens,
                    "labels": [IGNORE] * len(prompt) + chosen + [IGNORE] * len(prompt) + rejected,
                    "chosen_len": len(c_tokens)})
    return out


def models():
    """(policy, reference): the reference a perturbed copy, so that margins and gradients are not trivial."""
    policy = tiny_model(seed=0, embedding_std=0.3)
    reference = clone(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, reference


def objective_for(policy, reference, loss):
    lm = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    lm.take_output_projection(policy)
    ref_lm = SummedCrossEntropyLoss(num_output_chunks=1, ignore_index=IGNORE)
    ref_lm.take_output_projection(reference)
    return PreferenceObjective(lm, loss, ModelReference(reference, ref_lm))


def logp(model, tokens, labels):
    """Summed log-probability of one unpadded sequence's trainable next tokens."""
    logits = model(torch.tensor([tokens]))[0, :-1]
    target = torch.tensor(labels[1:])
    keep = target != IGNORE
    return F.log_softmax(logits[keep].float(), -1).gather(1, target[keep, None]).sum(), int(keep.sum())


def by_hand(policy, reference, samples, loss_type="sigmoid", beta=0.1, eps=0.0, gamma=0.5):
    """The step's mean loss, gradient and metrics, pair by pair (the formulas of docs/preference.md)."""
    policy.zero_grad(set_to_none=True)
    losses, rewards_c, rewards_r, logps_c, logps_r = [], [], [], [], []
    for s in samples:
        n = s["chosen_len"]
        (pc, nc), (pr, nr) = (logp(policy, s["tokens"][:n], s["labels"][:n]),
                              logp(policy, s["tokens"][n:], s["labels"][n:]))
        with torch.no_grad():
            rc, rr = logp(reference, s["tokens"][:n], s["labels"][:n])[0], logp(reference, s["tokens"][n:],
                                                                                   s["labels"][n:])[0]
        if loss_type == "simpo":
            c, r = pc / nc, pr / nr
            z = beta * (c - r) - gamma
            loss = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        else:
            c, r = (pc, pr) if loss_type == "reference_free" else (pc - rc, pr - rr)
            h = c - r
            if loss_type == "ipo":
                loss = (h - 1 / (2 * beta)) ** 2
            elif loss_type == "hinge":
                loss = torch.relu(1 - beta * h)
            else:
                loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        losses.append(loss)
        rewards_c.append(beta * c.item())
        rewards_r.append(beta * r.item())
        logps_c.append(pc.item())
        logps_r.append(pr.item())
    mean = torch.stack(losses).mean()
    mean.backward()
    grads = {k: p.grad.clone() for k, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    k = len(samples)
    metrics = {"rewards/chosen": sum(rewards_c) / k, "rewards/rejected": sum(rewards_r) / k,
               "rewards/margins": (sum(rewards_c) - sum(rewards_r)) / k,
               "rewards/accuracies": sum(c > r for c, r in zip(rewards_c, rewards_r)) / k,
               "logps/chosen": sum(logps_c) / k, "logps/rejected": sum(logps_r) / k}
    return mean.item(), grads, metrics


def split(samples, sizes):
    """Consecutive micro-batches of ``sizes`` pairs each."""
    out, start = [], 0
    for size in sizes:
        out.append(collate_pairs(samples[start:start + size], 0, IGNORE))
        start += size
    return out


def grad_norm(grads):
    return torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()


def check(got_loss, got_grads, got_metrics, expected):
    loss, grads, metrics = expected
    assert abs(got_loss - loss) <= TOL * abs(loss), (got_loss, loss)
    for name in grads:
        assert rel_diff(got_grads[name], grads[name]) <= TOL, name
    assert abs(grad_norm(got_grads) - grad_norm(grads)) <= TOL * grad_norm(grads)
    for name, value in metrics.items():
        assert abs(got_metrics[name] - value) <= TOL * max(abs(value), 1e-3), (name, got_metrics[name], value)


def step_grads(policy, objective, micro_batches, once=True):
    totals = forward_backward(policy, objective, micro_batches, device=CPU, backward=backward_mode(once))
    grads = {k: p.grad.clone() for k, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    means = totals.means()
    return means.pop("loss"), grads, means, totals


@pytest.mark.parametrize("once", [True, False], ids=["once_per_step", "per_micro_batch"])
def test_any_split_of_the_step_gives_the_mean_over_its_pairs(once):
    """Batch 4 == 1 x 4 accumulation == 2 + 2 == uneven 3 + 1: loss, gradient (and its norm), rewards,
    accuracies and log-probabilities are the means over the 4 pairs. A mean per micro-batch divided by
    the number of micro-batches would weigh the 3 + 1 split's lone pair 1/2, not 1/4."""
    samples = pairs()
    policy, reference = models()
    expected = by_hand(policy, reference, samples)
    objective = objective_for(policy, reference, PreferenceLoss(beta=0.1))
    for sizes in ([4], [1, 1, 1, 1], [3, 1]):
        loss, grads, means, totals = step_grads(policy, objective, split(samples, sizes), once)
        assert totals.num_tokens == 4  # the unit: pairs
        check(loss, grads, means, expected)


def test_simulated_ranks_sum_to_the_one_device_step(monkeypatch):
    """4 ranks of one pair each (and 2 ranks of 2 + 1 + 1): each rank's local sum divided by the global
    pair count, the gradients summed over ranks as FSDP2 does with divide factor 1, equal one device."""
    samples = pairs()
    policy, reference = models()
    expected = by_hand(policy, reference, samples)
    objective = objective_for(policy, reference, PreferenceLoss(beta=0.1))
    monkeypatch.setattr(TokenTally, "global_num_tokens", lambda self, group=None: 4)  # the all-reduced count
    for per_rank in ([[1], [1], [1], [1]], [[2], [1, 1]]):
        grads, sums, start = None, {}, 0
        for sizes in per_rank:
            size = sum(sizes)
            _, rank_grads, _, totals = step_grads(policy, objective, split(samples[start:start + size], sizes))
            start += size
            grads = rank_grads if grads is None else {k: grads[k] + rank_grads[k] for k in grads}
            for name, value in totals.sums.items():
                sums[name] = sums.get(name, 0.0) + value
        means = {name: value / 4 for name, value in sums.items()}
        check(means.pop("loss"), grads, means, expected)


def test_a_short_last_window_weighs_each_of_its_pairs_a_third():
    """3 pairs left for a window of batch 2 x accumulation 2: micro-batches of 2 and 1, each pair 1/3 (none
    dropped, no empty micro-batch counted); train_step reports the unit, the pairs and their tokens."""
    samples = pairs()[:3]
    policy, reference = models()
    expected = by_hand(policy, reference, samples)
    objective = objective_for(policy, reference, PreferenceLoss(beta=0.1))
    loss, grads, means, _ = step_grads(policy, objective, split(samples, [2, 1]))
    check(loss, grads, means, expected)
    result = train_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), objective, split(samples, [2, 1]),
                        device=CPU)
    assert (result.unit, result.num_pairs) == ("pairs", 3)
    assert result.num_tokens == sum(len(s["tokens"]) for s in samples)  # non-padding tokens of both responses
    assert abs(result.loss - expected[0]) <= TOL * expected[0]
    assert abs(result.grad_norm - grad_norm(expected[1])) <= TOL * grad_norm(expected[1])
    assert abs(result.metrics["rewards/margins"] - expected[2]["rewards/margins"]) <= TOL * abs(
        expected[2]["rewards/margins"])
    assert "num_tokens" not in result.metrics


@pytest.mark.parametrize("loss_type,kwargs", [("sigmoid", {"label_smoothing": 0.2}), ("ipo", {}),
                                              ("hinge", {}), ("simpo", {"beta": 2.0, "gamma": 0.5}),
                                              ("reference_free", {})])
def test_variants_match_their_formulas(loss_type, kwargs):
    """DPO with label smoothing, IPO, hinge (RSO), SimPO, reference-free DPO: uneven 3 + 1 split."""
    samples = pairs()
    policy, reference = models()
    beta = kwargs.get("beta", 0.1)
    expected = by_hand(policy, reference, samples, loss_type, beta=beta, eps=kwargs.get("label_smoothing", 0.0),
                       gamma=kwargs.get("gamma", 0.5))
    objective = objective_for(policy, reference, PreferenceLoss(loss_type, **kwargs))
    loss, grads, means, _ = step_grads(policy, objective, split(samples, [3, 1]))
    check(loss, grads, means, expected)


def test_policy_equal_to_reference_gives_ln2_and_zero_margins():
    """At the first step of DPO the policy is the reference: every pair's loss is ln 2, every reward 0."""
    samples = pairs()
    policy = tiny_model(seed=0, embedding_std=0.3)
    objective = objective_for(policy, clone(policy), PreferenceLoss(beta=0.1))
    loss, _, means, _ = step_grads(policy, objective, split(samples, [2, 2]))
    assert abs(loss - math.log(2)) <= 1e-6
    assert means["rewards/margins"] == 0.0 and means["rewards/accuracies"] == 0.0


def test_a_stand_in_pair_counts_nothing():
    """A rank's label-masked stand-in (the step loader's filler) adds no pair, no loss and no metric."""
    samples = pairs()
    policy, reference = models()
    objective = objective_for(policy, reference, PreferenceLoss("ipo"))  # IPO's loss at h=0 is not 0
    masked = dict(samples[0], labels=[IGNORE] * len(samples[0]["labels"]))
    prepared = objective.prepare(collate_pairs([masked], 0, IGNORE), CPU)
    assert prepared.count == 0
    sums = objective(policy, prepared)
    assert sums.loss.item() == 0.0 and all(v.item() == 0.0 for v in sums.metrics.values())


def test_loss_arguments_are_checked():
    with pytest.raises(ValueError, match="beta"):
        PreferenceLoss(beta=0.0)
    with pytest.raises(ValueError, match="loss_type"):
        PreferenceLoss("kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        PreferenceLoss(label_smoothing=0.5)
