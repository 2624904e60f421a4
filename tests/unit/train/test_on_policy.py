"""On-policy distillation (torchtune_ext.train.on_policy, and its loss in torchtune_ext.train.distill).

The student completes a seeded share of the step's samples; the generated
tokens train on the reverse KL KL(p_student || p_teacher), counted in the
same tally as the offline tokens. Checked here: the loss of a generated
sample against the KL written by hand, the same samples chosen and the same
tokens generated however the step is split (so the same loss and gradient),
the same tokens again for the same (seed, step) as a resumed run sees them,
the KV-cache decoding against full forwards, and ratio 0 being offline.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.support.helpers import IGNORE, backward_mode, clone, collate, instruct_samples, tiny_model, windows
from tests.support.threads import one_thread  # noqa: F401  (autouse: one CPU thread)
from torchtune_ext.train.distill import DistillationObjective, KDLoss
from torchtune_ext.train.loss import SummedCrossEntropyLoss
from torchtune_ext.train.on_policy import (
    OnPolicySettings,
    chosen,
    complete_micro_batch,
    generate,
    sample_generator,
    split_sample,
)
from torchtune_ext.train.step import train_step

CPU = torch.device("cpu")
TOL = 1e-5
STEP = 3


def settings(ratio, **kw):
    return OnPolicySettings(**{"ratio": ratio, "max_new_tokens": 6, "temperature": 1.0, "seed": 5, **kw})


def teacher_model():
    teacher = tiny_model(seed=7, embedding_std=0.3)
    teacher.requires_grad_(False)
    return teacher.eval()


def objective_for(student, teacher, kd_ratio=0.5, on_policy=None):
    """The recipes' wiring: the CE loss owns the student's projection, a second one the teacher's."""
    loss_fn = SummedCrossEntropyLoss(num_output_chunks=2, ignore_index=IGNORE)
    loss_fn.take_output_projection(student)
    head = SummedCrossEntropyLoss(ignore_index=IGNORE)
    head.take_output_projection(teacher)
    return DistillationObjective(loss_fn, teacher, head.project, KDLoss("forward_kl"), kd_ratio,
                                 on_policy=on_policy, student=student)


def on_policy_objective(student, teacher, ratio, kd_ratio=0.5, **kw):
    """With on-policy settings, after the loop's begin_step for step STEP."""
    objective = objective_for(student, teacher, kd_ratio, settings(ratio, **kw))
    objective.begin_step(STEP)
    return objective


def step(student, teacher, micro_batches, ratio, kd_ratio=0.5, once=True):
    objective = on_policy_objective(student, teacher, ratio, kd_ratio)
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    r = train_step(student, opt, objective, micro_batches, device=CPU, backward=backward_mode(once))
    return r, objective.step_metrics()


def samples():
    return instruct_samples([5, 9, 3, 12, 7, 4, 10, 6], [4, 7, 3, 5, 2, 6, 3, 8])


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_any_split_gives_the_same_samples_loss_and_gradient(ratio):
    """batch 8 == batch 1 x 8 (backward once per step, its chunks recomputed, and per micro-batch) == batch
    2 x 4 (padded wider): same generated tokens, count, loss and grad norm."""
    data = samples()
    teacher, student = teacher_model(), tiny_model(seed=0, embedding_std=0.3)
    whole, record = step(clone(student), clone(teacher), [collate(data)], ratio)
    offline = sum(1 for s in data for i in range(1, len(s["labels"])) if s["labels"][i] != IGNORE)
    picked = [chosen(settings(ratio), STEP, split_sample(torch.tensor(s["tokens"]), torch.tensor(s["labels"]),
                                                         IGNORE)[1]) for s in data]
    assert (0 < sum(picked) < len(data)) if ratio == 0.5 else all(picked)
    assert record["generated_tokens"] > 0 and record["generation_seconds"] > 0
    assert whole.num_tokens != offline  # the count is of the generated tokens for the chosen samples
    one_by_eight = [collate([s]) for s in data]
    for split, once in ((one_by_eight, True), (one_by_eight, False),
                        (windows(data, batch_size=2, grad_accum=4, pad_to=40)[0], True)):
        got, got_record = step(clone(student), clone(teacher), split, ratio, once=once)
        assert got.num_tokens == whole.num_tokens
        assert got_record["generated_tokens"] == record["generated_tokens"]
        assert abs(got.loss - whole.loss) <= TOL * abs(whole.loss)
        assert abs(got.metrics["kd_loss"] - whole.metrics["kd_loss"]) <= TOL * abs(whole.metrics["kd_loss"])
        assert abs(got.grad_norm - whole.grad_norm) <= TOL * whole.grad_norm


def test_generated_tokens_are_scored_by_the_reverse_kl_written_by_hand():
    """A fully on-policy micro-batch: CE 0, KD = sum over generated tokens of KL(p_S || p_T) (torch's kl_div),
    divided by their number; the prompt is the sample's, the labels are the generated tokens."""
    data = samples()[:3]
    teacher, student = teacher_model(), tiny_model(seed=0, embedding_std=0.3)
    s_model, t_model = clone(student), clone(teacher)  # logits out (the objective's copies give hidden states)
    objective = on_policy_objective(student, teacher, 1.0, kd_ratio=1.0)
    prepared = objective.prepare(collate(data), CPU)
    sums = objective(student, prepared)
    total, count = 0.0, 0
    for row, sample in enumerate(data):
        prompt_len = next(i for i, label in enumerate(sample["labels"]) if label != IGNORE)
        tokens = prepared.inputs["tokens"][row]
        labels = prepared.labels[row]
        assert tokens[:prompt_len].tolist() == sample["tokens"][:prompt_len]
        keep = labels != IGNORE
        assert keep.nonzero()[0].item() == prompt_len - 1  # the first generated token is the prompt's next
        with torch.no_grad():
            s_logits = s_model(tokens[None])[0][keep]
            t_logits = t_model(tokens[None])[0][keep]
        total += F.kl_div(F.log_softmax(t_logits, -1), F.log_softmax(s_logits, -1), log_target=True,
                          reduction="sum").item()
        count += int(keep.sum())
    assert prepared.count == count == int(prepared.extra["generated"].sum())
    assert sums.metrics["ce_loss"].item() == 0.0
    assert abs(sums.metrics["kd_loss"].item() - total) <= TOL * total
    assert abs(sums.loss.item() - total) <= TOL * total


def test_the_same_seed_and_step_regenerate_the_same_tokens():
    """What a resumed run sees: fresh objectives, the same (seed, step) give the same tokens; another step or
    seed others. The model's mode is restored after generating."""
    data = samples()
    student = tiny_model(seed=0, embedding_std=0.3)
    student.train()

    def tokens(seed, at_step):
        mb, generated, n = complete_micro_batch(student, lambda h: h, collate(data), settings(1.0, seed=seed),
                                                at_step, IGNORE)
        return mb["tokens"].tolist()

    first = tokens(5, STEP)
    assert student.training
    assert tokens(5, STEP) == first
    assert tokens(5, STEP + 1) != first and tokens(6, STEP) != first


def test_kv_cache_decoding_matches_full_forwards():
    """top_k=1 (greedy): each generated token is the argmax of a full forward of the sequence so far."""
    student = tiny_model(seed=0, embedding_std=0.3)
    prompt = torch.tensor(samples()[1]["tokens"][:9])
    out = generate(student, lambda h: h, prompt, settings(1.0, top_k=1, max_new_tokens=8),
                   sample_generator(0, 1, [1], "generate"))
    assert len(out) == 8
    sequence = prompt.tolist()
    with torch.no_grad():
        for token in out:
            assert token == int(student(torch.tensor([sequence]))[0, -1].argmax())
            sequence.append(token)


def test_a_completion_stops_at_the_models_maximum_length():
    """tiny_model takes 128 positions: a 125-token prompt gets at most 3 tokens, whatever max_new_tokens says."""
    student = tiny_model(seed=0, embedding_std=0.3)
    prompt = torch.randint(3, 100, (125,), generator=torch.Generator().manual_seed(0))
    out = generate(student, lambda h: h, prompt, settings(1.0, max_new_tokens=10), sample_generator(0, 1, [4], "g"))
    assert len(out) == 3
    with pytest.raises(ValueError, match="no room"):
        generate(student, lambda h: h, torch.zeros(128, dtype=torch.long), settings(1.0),
                 sample_generator(0, 1, [4], "g"))


def test_a_stop_token_ends_the_completion_and_top_k_limits_the_draws():
    student = tiny_model(seed=0, embedding_std=0.3)
    prompt = torch.tensor(samples()[0]["tokens"][:5])
    free = generate(student, lambda h: h, prompt, settings(1.0, max_new_tokens=8), sample_generator(0, 1, [2], "g"))
    stop = free[2]
    cut = generate(student, lambda h: h, prompt, settings(1.0, max_new_tokens=8, stop_ids=(stop,)),
                   sample_generator(0, 1, [2], "g"))
    assert cut == free[:free.index(stop) + 1]
    with torch.no_grad():
        logits = student(prompt[None])[0, -1]
    top = set(torch.topk(logits, 3).indices.tolist())
    for seed in range(20):
        first = generate(student, lambda h: h, prompt, settings(1.0, max_new_tokens=1, top_k=3, temperature=5.0),
                         sample_generator(seed, 1, [3], "g"))
        assert first[0] in top


def test_ratio_zero_is_offline_bit_for_bit():
    """on_policy_ratio 0 (and validation, outside a training step): the offline objective's exact numbers."""
    data = samples()
    teacher, student = teacher_model(), tiny_model(seed=0, embedding_std=0.3)
    model = clone(student)
    offline = objective_for(model, clone(teacher))
    want = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), offline, [collate(data)], device=CPU)
    got, record = step(clone(student), clone(teacher), [collate(data)], 0.0)
    assert (got.loss, got.grad_norm, got.num_tokens, got.metrics) == (want.loss, want.grad_norm, want.num_tokens,
                                                                         want.metrics)
    assert record == {"teacher_seconds": record["teacher_seconds"]}  # no generation keys
    validating = on_policy_objective(student, teacher, 1.0)
    validating.step_metrics()  # the step ended: validation's micro-batches stay offline
    assert validating.prepare(collate(data), CPU).extra == {}


def test_settings_are_checked():
    for bad in (dict(ratio=1.5), dict(ratio=-0.1), dict(max_new_tokens=0), dict(temperature=0.0), dict(top_k=0)):
        with pytest.raises(ValueError):
            OnPolicySettings(**bad)



def test_a_transformers_student_decodes_with_its_own_cache(tmp_path):
    """A transformers model (torchtune_ext.model.hf.causal_lm) whose head the loss took: greedy decoding through
    its cache equals the argmax of full forwards."""
    from tests.support.hf_tiny import write_tiny
    from torchtune_ext.model.hf import causal_lm

    torch.manual_seed(0)
    model = causal_lm(write_tiny("qwen3", tmp_path / "qwen3"), dtype=torch.float32)
    loss_fn = SummedCrossEntropyLoss(ignore_index=IGNORE)
    loss_fn.take_output_projection(model)  # the model now returns hidden states to torchtune's call
    prompt = torch.tensor(samples()[1]["tokens"][:9])
    out = generate(model, loss_fn.project, prompt, settings(1.0, top_k=1, max_new_tokens=6),
                   sample_generator(0, 1, [1], "generate"))
    assert len(out) == 6
    sequence = prompt.tolist()
    with torch.no_grad():
        for token in out:
            assert token == int(loss_fn.project(model(torch.tensor([sequence]))[0, -1:])[0].argmax())
            sequence.append(token)
