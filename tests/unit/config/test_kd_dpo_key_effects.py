"""Every distillation and preference key is checked by the schema and does what its doc line says.

The values' own checks have their tests (test_distillation_config.py,
test_preference_config.py); here the schema's entries are run, so a key whose
check were swapped for a permissive one fails, and a key added without a bad
value here fails too. Then each key's effect, computed by hand on tiny
tensors or models built here: the temperature softens both models' logits and
scales the term by its square, each divergence is its formula, the teacher's
dtype is its parameters', the on_policy_* keys reach the settings the student
samples with and change the draws, and each preference argument (beta,
label_smoothing, gamma, loss_type) changes a pair's loss as its formula says.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from tests.support.helpers import tiny_model, write_tiny_hf_checkpoint
from tests.support.threads import one_thread  # noqa: F401  (autouse: one CPU thread)
from torchtune_ext.config.distillation import check_teacher
from torchtune_ext.config.preference import PREFERENCE_KEYS
from torchtune_ext.config.schema import DISTILLATION_KEYS
from torchtune_ext.errors import ConfigError
from torchtune_ext.model.teacher import build_teacher
from torchtune_ext.run.distillation import distillation_keys, on_policy_settings
from torchtune_ext.train.distill import DIVERGENCES, KDLoss
from torchtune_ext.train.on_policy import OnPolicySettings, chosen, generate, sample_generator
from torchtune_ext.train.preference import PreferenceLoss

CPU = torch.device("cpu")

# One bad value per key, and the key the error must name.
BAD_DISTILLATION = {
    "teacher_model": ("smollm2_135m", "teacher_model"),
    "teacher_checkpointer": ({"_component_": 3, "checkpoint_dir": "x"}, "teacher_checkpointer"),
    "teacher_model_dir": (3, "teacher_model_dir"),
    "teacher_dtype": ("float16", "teacher_dtype"),
    "kd_loss": ("forward_kl", "kd_loss"),
    "kd_ratio": (1.5, "kd_ratio"),
    "on_policy_ratio": (-0.1, "on_policy_ratio"),
    "on_policy_max_new_tokens": (0, "on_policy_max_new_tokens"),
    "on_policy_temperature": (0.0, "on_policy_temperature"),
    "on_policy_top_k": (0, "on_policy_top_k"),
}
BAD_PREFERENCE = {
    "loss": ({"_component_": "torchtune.rlhf.loss.DPOLoss", "beta": 0.0}, "loss.beta"),
    "dataset": ({"_component_": "torchtune.datasets.preference_dataset", "packed": True}, "dataset.packed"),
    "dataset_val": ({"_component_": "torchtune.datasets.preference_dataset", "packed": True}, "dataset_val.packed"),
    "pack_micro_batches": (True, "pack_micro_batches"),
    "precompute_reference_log_probs": ("maybe", "precompute_reference_log_probs"),
}


@pytest.mark.parametrize("keys,bad", [(DISTILLATION_KEYS, BAD_DISTILLATION), (PREFERENCE_KEYS, BAD_PREFERENCE)],
                         ids=["distillation", "preference"])
def test_each_key_refuses_a_bad_value_in_one_line_naming_it(keys, bad):
    assert set(keys) == set(bad), "a key without a bad value here is a key whose check nothing tests"
    for name, key in keys.items():
        value, named = bad[name]
        if not key.required:
            key.check(name, key.default)  # the default passes its own check
        with pytest.raises(ConfigError) as err:
            key.check(name, OmegaConf.create(value) if isinstance(value, dict) else value)
        assert err.value.key == named and "\n" not in str(err.value), name


# ---- distillation -----------------------------------------------------------------------------------------------

def hand_divergence(student_logits, teacher_logits, divergence, t):
    """T**2 * sum over rows of the divergence, from probabilities at temperature t (a loop over plain floats)."""
    total = 0.0
    for s_row, t_row in zip(student_logits.double().tolist(), teacher_logits.double().tolist()):
        def soft(row):
            exps = [math.exp(x / t) for x in row]
            return [e / sum(exps) for e in exps]
        p_s, p_t = soft(s_row), soft(t_row)
        kl = lambda p, q: sum(a * math.log(a / b) for a, b in zip(p, q))  # noqa: E731
        if divergence == "forward_kl":
            total += kl(p_t, p_s)
        elif divergence == "reverse_kl":
            total += kl(p_s, p_t)
        else:
            m = [(a + b) / 2 for a, b in zip(p_s, p_t)]
            total += (kl(p_t, m) + kl(p_s, m)) / 2
    return t * t * total


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kd_loss_divergence_and_temperature_soften_both_models_and_scale_by_its_square(divergence):
    """kd_loss.divergence picks its formula; kd_loss.temperature divides the student's AND the teacher's logits
    and multiplies the term by T**2 (dividing only one model's, or leaving out T**2, gives another number)."""
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 9, generator=g), 3 * torch.randn(3, 9, generator=g)
    for t in (1.0, 2.5):
        got = KDLoss(divergence, t)(student, teacher).item()
        assert abs(got - hand_divergence(student, teacher, divergence, t)) <= 1e-5 * got
    at_one, at_hot = KDLoss(divergence, 1.0)(student, teacher).item(), KDLoss(divergence, 2.5)(student, teacher).item()
    assert abs(at_hot - at_one) > 0.05 * at_one
    others = [d for d in DIVERGENCES if d != divergence]
    assert all(abs(KDLoss(d, 1.0)(student, teacher).item() - at_one) > 1e-3 * at_one for d in others)


def teacher_config(folder, teacher_dtype):
    """A teacher of torchtune's tiny_llama, read from ``folder/teacher`` (write_tiny_hf_checkpoint's files)."""
    out = str(folder / "out")
    folder = folder / "teacher"
    return OmegaConf.create({
        "dtype": "fp32", "output_dir": out, "teacher_dtype": teacher_dtype,
        "teacher_model": {"_component_": "torchtune_ext.model.builders.tiny_llama"},
        "teacher_checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                                 "checkpoint_dir": str(folder), "checkpoint_files": ["model.safetensors"],
                                 "model_type": "LLAMA3_2", "output_dir": out}})


def test_teacher_model_and_checkpointer_load_the_teacher_in_teacher_dtype(tmp_path):
    """teacher_model builds, teacher_checkpointer loads its weights; teacher_dtype is every parameter's dtype
    (null: the student's dtype). The teacher is frozen and in eval mode."""
    state = write_tiny_hf_checkpoint(tmp_path / "teacher", seed=3)
    for teacher_dtype, want in ((None, torch.float32), ("bf16", torch.bfloat16)):
        teacher, project = build_teacher(teacher_config(tmp_path, teacher_dtype), CPU)
        params = dict(teacher.named_parameters())
        assert {p.dtype for p in params.values()} == {want}, teacher_dtype
        assert not any(p.requires_grad for p in params.values()) and not teacher.training
        embedding = params["tok_embeddings.weight"]
        assert torch.equal(embedding, state["tok_embeddings.weight"].to(want))  # the checkpoint's weights
        if want == torch.float32:
            hidden = teacher(torch.tensor([[5, 9, 2]]))
            assert project(hidden[0]).shape == (3, embedding.shape[0])  # the tied head, applied by the loss


def test_teacher_model_dir_loads_a_hugging_face_teacher_in_teacher_dtype(tmp_path):
    """teacher_model_dir alone names the teacher: transformers builds it from the folder, its weights load, in
    teacher_dtype; its hidden states through the returned head give the folder's model's logits."""
    from transformers import AutoModelForCausalLM

    from tests.support.hf_tiny import write_tiny

    folder = write_tiny("qwen3", tmp_path / "qwen3", seed=4)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 9, 2, 40]])
    for teacher_dtype, want in ((None, torch.float32), ("bf16", torch.bfloat16)):
        cfg = OmegaConf.create({"dtype": "fp32", "output_dir": str(tmp_path / "out"), "teacher_dtype": teacher_dtype,
                                "teacher_model_dir": str(folder)})
        teacher, project = build_teacher(cfg, CPU)
        assert {p.dtype for p in teacher.parameters()} == {want}, teacher_dtype
        if want == torch.float32:
            with torch.no_grad():
                got, expected = project(teacher(tokens)[0]), reference(tokens).logits[0]
            assert torch.allclose(got.float(), expected, atol=1e-5)


def test_a_teacher_node_without_its_component_is_refused_before_anything_loads(tmp_path):
    """The schema reads a node without _component_ as switched off and check_teacher only asks that it be there:
    a checkpointer of checkpoint_dir alone used to reach torchtune's instantiate after the student had loaded.
    The recipes' key check (distillation_keys) now refuses it in one line."""
    write_tiny_hf_checkpoint(tmp_path / "teacher")
    good = teacher_config(tmp_path, None)
    distillation_keys(good)
    distillation_keys(OmegaConf.create({"teacher_model_dir": str(tmp_path / "teacher")}))
    for key in ("teacher_model", "teacher_checkpointer"):
        cfg = good.copy()
        del cfg[key]["_component_"]
        check_teacher(cfg)  # the folder is there: this check alone let it through
        with pytest.raises(ConfigError) as err:
            distillation_keys(cfg)
        assert err.value.key == key and "\n" not in str(err.value)


class StopTokenizer:
    stop_tokens = [2, 7]


def test_on_policy_keys_reach_the_settings_the_student_samples_with():
    cfg = OmegaConf.create({"on_policy_ratio": 0.25, "on_policy_max_new_tokens": 7, "on_policy_temperature": 0.5,
                            "on_policy_top_k": 3})
    got = on_policy_settings(cfg, seed=11, tokenizer=StopTokenizer())
    assert (got.ratio, got.max_new_tokens, got.temperature, got.top_k, got.seed, got.stop_ids) == (
        0.25, 7, 0.5, 3, 11, (2, 7))


def test_on_policy_ratio_is_the_share_of_samples_the_student_completes():
    """Over 400 distinct samples the seeded draw picks about ratio of them: none at 0, all at 1."""
    contents = [[i, i + 1, 3 * i] for i in range(400)]
    for ratio in (0.0, 0.25, 0.75, 1.0):
        share = sum(chosen(OnPolicySettings(ratio=ratio, seed=5), 3, c) for c in contents) / len(contents)
        assert abs(share - ratio) <= 0.07, (ratio, share)


def test_on_policy_temperature_sharpens_or_flattens_the_students_draws():
    """A near-zero temperature always draws the argmax; at 1 the draws differ from it at times, and at 50 they
    spread over many tokens (so a temperature that did nothing would fail one of the three)."""
    student = tiny_model(seed=0, embedding_std=0.3)
    prompt = torch.tensor([5, 9, 2, 40, 17])
    with torch.no_grad():
        argmax = int(student(prompt[None])[0, -1].argmax())

    def draws(temperature):
        settings = OnPolicySettings(ratio=1.0, max_new_tokens=1, temperature=temperature, seed=0)
        return [generate(student, lambda h: h, prompt, settings, sample_generator(seed, 1, [1], "g"))[0]
                for seed in range(16)]

    assert set(draws(1e-4)) == {argmax}
    assert set(draws(1.0)) != {argmax}
    assert len(set(draws(50.0))) >= 8



# ---- preference -------------------------------------------------------------------------------------------------

# One pair: summed log-probabilities of the policy and the reference, and the responses' trainable tokens.
PC, PR, RC, RR, NC, NR = -3.0, -5.0, -4.0, -4.5, 4, 10
H = (PC - RC) - (PR - RR)  # 1.5: the policy prefers the chosen response more than the reference does


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def pair_loss(loss_type, beta=0.1, label_smoothing=0.0, gamma=0.5):
    loss = PreferenceLoss(loss_type, beta=beta, label_smoothing=label_smoothing, gamma=gamma)
    tensor = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    ref = (tensor(RC), tensor(RR)) if loss.needs_reference else (None, None)
    losses, chosen_reward, rejected_reward = loss(tensor(PC), tensor(PR), *ref, tensor(NC), tensor(NR))
    return losses.item(), chosen_reward.item(), rejected_reward.item()


def smoothed(z, eps):
    return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


HAND = {  # docs/preference.md's formulas, with plain floats
    "sigmoid": lambda beta, eps, gamma: smoothed(beta * H, eps),
    "ipo": lambda beta, eps, gamma: (H - 1 / (2 * beta)) ** 2,
    "hinge": lambda beta, eps, gamma: max(0.0, 1 - beta * H),
    "reference_free": lambda beta, eps, gamma: smoothed(beta * (PC - PR), eps),
    "simpo": lambda beta, eps, gamma: smoothed(beta * (PC / NC - PR / NR) - gamma, eps),
}


@pytest.mark.parametrize("loss_type", sorted(HAND))
def test_each_loss_type_beta_label_smoothing_and_gamma_change_the_pair_loss_as_written(loss_type):
    """Each argument, at two values, against the hand formula; and each one that the loss type reads changes
    the loss (IPO and hinge read no label_smoothing, only SimPO reads gamma)."""
    settings = [dict(beta=0.1, eps=0.0, gamma=0.5), dict(beta=0.4, eps=0.0, gamma=0.5),
                dict(beta=0.1, eps=0.2, gamma=0.5), dict(beta=0.1, eps=0.0, gamma=1.5)]
    values = []
    for s in settings:
        got = pair_loss(loss_type, s["beta"], s["eps"], s["gamma"])[0]
        want = HAND[loss_type](s["beta"], s["eps"], s["gamma"])
        assert abs(got - want) <= 1e-9 + 1e-9 * abs(want), (s, got, want)
        values.append(got)
    assert values[1] != values[0]  # beta
    assert (values[2] != values[0]) == (loss_type in ("sigmoid", "reference_free", "simpo"))  # label_smoothing
    assert (values[3] != values[0]) == (loss_type == "simpo")  # gamma


def test_each_loss_type_is_its_own_formula_and_rewards_are_beta_times_the_log_ratio():
    losses = {t: pair_loss(t)[0] for t in HAND}
    assert len(set(losses.values())) == len(HAND)
    assert pair_loss("sigmoid", beta=0.3)[1:] == pytest.approx((0.3 * (PC - RC), 0.3 * (PR - RR)))
    assert pair_loss("reference_free", beta=0.3)[1:] == pytest.approx((0.3 * PC, 0.3 * PR))
    assert pair_loss("simpo", beta=0.3)[1:] == pytest.approx((0.3 * PC / NC, 0.3 * PR / NR))
