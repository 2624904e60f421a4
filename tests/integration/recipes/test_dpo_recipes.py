"""The preference recipes, in process on a tiny checkpoint: two shared runs (LoRA, full) of the shipped configs.

7 pairs of the bundled preference data, batch 2 x accumulation 2: a step of 4
pairs, then the epoch's short last step of 3 (none dropped), validation on 3
held-out pairs. The exactness of the step itself is tested on the library
(tests/unit/train/test_preference.py); here what the recipes add: the
reference (the base with adapters off; a frozen copy), the records, the
checkpoint, bad input.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.support.dpo_tiny import RUNS as DPO_RUNS
from tests.support.dpo_tiny import tiny_dpo_config, write_tiny_pairs
from tests.support.helpers import read_jsonl, recipe_class, rel_diff, run_recipe
from torchtune_ext.checkpoint import list_checkpoints
from torchtune_ext.config import ConfigError
from torchtune_ext.errors import EXIT_STOPPED

RUNS = {kind: run for kind, run in DPO_RUNS.items() if not kind.endswith("_dist")}


@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory, smollm2_assets):
    return write_tiny_pairs(tmp_path_factory.mktemp("dpo"), smollm2_assets)


def config(kind, assets, root, output_dir, *overrides):
    return tiny_dpo_config(kind, assets, root, output_dir, *overrides)


@pytest.fixture(scope="module")
def runs(tiny_pairs, smollm2_assets, tmp_path_factory):
    """Each recipe once: (recipe object, its metrics.jsonl records, output_dir). On one thread, as
    tests/support/resume_jobs.py runs the stopped and resumed runs compared with these."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for kind, (path, name, *_) in RUNS.items():
            output_dir = tmp_path_factory.mktemp(kind)
            recipe = run_recipe(recipe_class(path, name), config(kind, smollm2_assets, tiny_pairs, output_dir))
            out[kind] = recipe, read_jsonl(output_dir / "logs" / "metrics.jsonl"), output_dir
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_steps_count_pairs_and_start_at_ln2(runs, kind):
    """Step 1: the policy is its reference, so the DPO loss is ln 2 and every margin 0 (a test of the
    reference: a LoRA reference with adapters on, or a reference that is the trained policy, would drift by step 2).
    The 7 pairs make a step of 4 and the short last step of 3; tokens count both responses, no padding."""
    _, records, _ = runs[kind]
    steps = [r for r in records if "num_pairs" in r]
    assert [r["num_pairs"] for r in steps] == [4, 3]
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-6 and steps[0]["rewards/margins"] == 0.0
    assert steps[1]["loss"] != pytest.approx(math.log(2), abs=1e-4)  # the policy moved away from its reference
    for r in steps:
        assert r["pairs_per_second"] == pytest.approx(r["num_pairs"] / r["step_seconds"])
        assert r["tokens_per_second"] == pytest.approx(r["num_tokens"] / r["step_seconds"])
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
        assert r["logps/chosen"] < 0 and r["logps/rejected"] < 0
    assert steps[0]["num_tokens"] + steps[1]["num_tokens"] == steps[1]["tokens_seen"]


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_validation_reports_pair_means(runs, kind):
    """Before training and after the last step, over the 3 held-out pairs: at the start ln 2 (policy == reference)."""
    _, records, _ = runs[kind]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 2]
    assert all(r["val_num_pairs"] == 3 and "val_perplexity" not in r for r in val)
    assert abs(val[0]["val_loss"] - math.log(2)) < 1e-6 and val[0]["val_rewards/accuracies"] == 0.0
    assert val[1]["val_loss"] != pytest.approx(math.log(2), abs=1e-4)


def test_lora_reference_is_the_base_and_full_reference_stays_frozen(runs):
    """LoRA: the reference is the same model object with adapters disabled (no copy); full: a second model whose
    weights are still the base's after training, while the policy's changed."""
    lora, _, _ = runs["lora"]
    assert lora.run.objective.reference.model is lora.model
    full, _, _ = runs["full"]
    reference = full.run.objective.reference.model
    assert reference is not full.model and not any(p.requires_grad for p in reference.parameters())
    changed = [not torch.equal(p, q) for p, q in zip(full.model.parameters(), reference.parameters())]
    assert all(changed)


@pytest.mark.parametrize("override,key", [
    ("loss.beta=0", "loss.beta"),
    ("loss.beta=-1", "loss.beta"),
    ("loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss", "loss._component_"),
    ("pack_micro_batches=true", "pack_micro_batches"),
    ("dataset.packed=true", "dataset.packed"),
    ("precompute_reference_log_probs=maybe", "precompute_reference_log_probs"),
])
def test_bad_preference_config_is_one_line(tiny_pairs, smollm2_assets, tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        config("lora", smollm2_assets, tiny_pairs, tmp_path / "out", override)
    assert err.value.key == key and "\n" not in str(err.value)


def test_a_dataset_without_pairs_stops_before_the_model_loads(tiny_pairs, smollm2_assets, tmp_path):
    """An SFT file given to a DPO recipe: one line naming dataset and column_map, nothing written."""
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    cfg = config("full", smollm2_assets, tiny_pairs, tmp_path / "out", f"dataset.data_files={sft}")
    recipe = recipe_class(*RUNS["full"][:2])(cfg)
    with pytest.raises(ConfigError, match="has no column 'chosen'") as err:
        recipe.setup()
    recipe.cleanup()
    assert err.value.key == "dataset"
    assert not hasattr(recipe, "model")


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_token_ids_past_the_embedding_exit_2_in_one_line_before_anything(tiny_pairs, smollm2_assets, tmp_path,
                                                                           capsys, kind):
    """A model of 300 embedding rows under SmolLM2's tokenizer (ids up to 49,151): the pairs' check names the
    tokenizer, the model and both sizes in one line, exit 2, before the model is built; output_dir stays empty."""
    from torchtune_ext.run.control.exits import exit_on_user_error
    from torchtune_ext.run.loop import run_recipe as run_checked

    path, name, _, _, keys = RUNS[kind]
    out = tmp_path / "out"
    cfg = config(kind, smollm2_assets, tiny_pairs, out, "model.vocab_size=300")
    built = []
    recipe = recipe_class(path, name)

    class Watched(recipe):
        def setup(self):
            built.append(self)
            super().setup()

    with pytest.raises(SystemExit) as done:
        exit_on_user_error(run_checked)(Watched, cfg, keys)
    assert done.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert lines[0].startswith("error: config key 'tokenizer': the tokenizer torchtune_ext.data.tokenizer")
    assert f"('{cfg.tokenizer.path}') gives token id" in lines[0]
    assert "the model 'torchtune_ext.model.builders." in lines[0] and "has 300 token embeddings (ids 0-299)" in lines[0]
    assert not hasattr(built[0], "model")  # stopped in the data pass, before any model
    assert not out.exists() or not any(out.iterdir())  # no logs/, no metrics.jsonl, no lock


# Resume: the shared runs above (7 pairs: a step of 4, then the short last step of 3; validation before step 1
# and after step 2) against a run stopped after step 1, mid-epoch, and resumed.
RESUMED_FIELDS = ("loss", "grad_norm", "lr", "rewards/chosen", "rewards/rejected", "rewards/margins",
                  "rewards/accuracies", "logps/chosen", "logps/rejected", "val_loss", "val_rewards/margins",
                  "val_logps/chosen")


def _records(output_dir):
    """(step, kind) -> the last record: a resumed run logs its steps after the checkpoint again."""
    return {(r["step"], "val" if "val_loss" in r else "train"): r
            for r in read_jsonl(output_dir / "logs" / "metrics.jsonl")}


def _final_weights(output_dir):
    step = list_checkpoints(str(output_dir))[-1]
    return {str(f.relative_to(step)): (load_file(f) if f.suffix == ".safetensors" else torch.load(f, weights_only=True))
            for f in sorted(step.rglob("*")) if f.suffix in (".safetensors", ".pt") and f.name != "recipe_state.pt"}


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_a_stopped_and_resumed_run_equals_the_uninterrupted_one(runs, tiny_pairs, smollm2_assets, tmp_path, kind):
    """Stopped by SIGTERM after step 1 (the recipe saves and exits 75), resumed mid-epoch to the end: the loss,
    grad norm, lr, rewards and log-probabilities of both steps, the validations and the final weights equal the
    uninterrupted run's (fp32, <= 1e-5 relative). The full recipe's reference must come from the base
    checkpoint again, not from the resumed policy (step 2's loss would differ); LoRA's is the base with the
    resumed adapters off."""
    from tests.support import resume_jobs

    straight, resumed, recipe = runs[kind][2], tmp_path / "resumed", f"dpo_{kind}"
    assert resume_jobs.run(recipe, config(kind, smollm2_assets, tiny_pairs, resumed), stop_after=1) == EXIT_STOPPED
    assert [r["step"] for r in read_jsonl(resumed / "logs" / "metrics.jsonl") if "num_pairs" in r] == [1]
    assert resume_jobs.run(recipe, config(kind, smollm2_assets, tiny_pairs, resumed,
                                          "resume_from_checkpoint=true")) == 0
    want, got = _records(straight), _records(resumed)
    assert sorted(got) == sorted(want) == [(0, "val"), (1, "train"), (2, "train"), (2, "val")]
    for at, record in want.items():
        for key in ("num_pairs", "num_tokens", "val_num_pairs"):
            assert got[at].get(key) == record.get(key), (at, key)
        for key in RESUMED_FIELDS:
            if key in record:
                assert abs(got[at][key] - record[key]) <= 1e-5 * abs(record[key]), (at, key, got[at][key], record[key])
    assert got[(2, "train")]["loss"] != pytest.approx(math.log(2), abs=1e-4)  # the resumed step trained a moved policy
    final, again = _final_weights(straight), _final_weights(resumed)
    assert final and sorted(final) == sorted(again)
    for name in final:
        assert sorted(final[name]) == sorted(again[name]), name
        for key, tensor in final[name].items():
            assert rel_diff(again[name][key].float(), tensor.float()) <= 1e-5, (name, key)


@pytest.fixture
def reference_calls(monkeypatch):
    """Every call of a reference model, tagged 'setup' or 'training' (from setup_training on)."""
    from torchtune_ext.run.preference import PreferenceRun
    from torchtune_ext.train.preference import ModelReference

    calls, phase = [], ["setup"]
    call, setup_training = ModelReference.__call__, PreferenceRun.setup_training

    def counted(self, prepared):
        calls.append(phase[0])
        return call(self, prepared)

    def training_next(self, *args, **kwargs):
        phase[0] = "training"
        return setup_training(self, *args, **kwargs)

    monkeypatch.setattr(ModelReference, "__call__", counted)
    monkeypatch.setattr(PreferenceRun, "setup_training", training_next)

    def take():
        taken = list(calls)
        calls.clear()
        phase[0] = "setup"
        return taken
    return take


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_precomputed_reference_log_probs_train_alike_without_the_reference(runs, tiny_pairs, smollm2_assets,
                                                                            tmp_path, reference_calls, kind):
    """precompute_reference_log_probs: the reference runs over the 7 + 3 pairs in setup (the micro-batches of
    epoch 0 and of validation: 2 steps x 2, and 2), never while training; the table is stored with its
    fingerprint; stopped after step 1 and resumed, the run reads the file (no reference call, no reference
    model for the full recipe, the file untouched) and every record and the final weights equal the run that
    ran its reference in every step (measured: equal bit for bit)."""
    from tests.support import resume_jobs
    from torchtune_ext.train.preference import PrecomputedReference

    out, recipe = tmp_path / "pre", f"dpo_{kind}"
    on = "precompute_reference_log_probs=true"
    assert resume_jobs.run(recipe, config(kind, smollm2_assets, tiny_pairs, out, on), stop_after=1) == EXIT_STOPPED
    assert reference_calls() == ["setup"] * 6
    stored = torch.load(out / "reference_log_probs.pt", weights_only=True)
    assert stored["table"].shape == (10, 2) and (stored["table"] < 0).all()
    assert sorted(stored["fingerprint"]) == ["model", "pairs"]
    written = (out / "reference_log_probs.pt").stat().st_mtime_ns

    cls = recipe_class(*RUNS[kind][:2])
    resumed = cls(config(kind, smollm2_assets, tiny_pairs, out, on, "resume_from_checkpoint=true"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resumed.setup()
        assert isinstance(resumed.run.objective.reference, PrecomputedReference)
        assert resumed.train() == 0
        resumed.cleanup()
    finally:
        torch.set_num_threads(threads)
    assert reference_calls() == []
    assert (out / "reference_log_probs.pt").stat().st_mtime_ns == written
    want, got = _records(runs[kind][2]), _records(out)
    assert sorted(got) == sorted(want)
    for at, record in want.items():
        for key in RESUMED_FIELDS:
            if key in record:
                assert abs(got[at][key] - record[key]) <= 1e-5 * abs(record[key]), (at, key, got[at][key], record[key])
    final, again = _final_weights(runs[kind][2]), _final_weights(out)
    for name in final:
        for key, tensor in final[name].items():
            assert rel_diff(again[name][key].float(), tensor.float()) <= 1e-5, (name, key)


@pytest.mark.parametrize("change,what", [
    ("dataset.data_files={root}/val.jsonl", "pairs (data, tokenizer or tokenizer.max_seq_len)"),
    ("tokenizer.max_seq_len=200", "pairs (data, tokenizer or tokenizer.max_seq_len)"),
    ("model.norm_eps=1e-6", "model (config, base weights or dtype)"),
])
def test_a_reference_file_of_another_run_is_refused_in_one_line(tiny_pairs, smollm2_assets, tmp_path, capsys,
                                                                 change, what):
    """A stored table whose fingerprint is not this run's: exit 2, one line naming the file, what differs and
    the fix, before any model is built; the file is kept."""
    from torchtune_ext.data.tokenizer import build_tokenizer
    from torchtune_ext.run.control.exits import exit_on_user_error
    from torchtune_ext.run.loop import run_recipe as run_checked
    from torchtune_ext.run.reference_log_probs import save_table

    path, name, _, _, keys = RUNS["lora"]
    on = "precompute_reference_log_probs=true"
    first = config("lora", smollm2_assets, tiny_pairs, tmp_path / "first", on)
    built = []
    recipe = recipe_class(path, name)

    class Watched(recipe):
        def setup(self):
            built.append(self)
            super().setup()

    # the fingerprint of the run as configured, stored with a table (as a finished run leaves it)
    probe = Watched(first)
    probe.run.tokenizer = build_tokenizer(first.tokenizer)
    probe.run.build_objective_and_data()
    out = tmp_path / "out"
    save_table(out / "reference_log_probs.pt", torch.full((10, 2), -1.0), probe.run.reference_fingerprint)
    built.clear()
    cfg = config("lora", smollm2_assets, tiny_pairs, out, on, change.format(root=tiny_pairs))
    with pytest.raises(SystemExit) as done:
        exit_on_user_error(run_checked)(Watched, cfg, keys)
    assert done.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert lines[0].startswith(f"error: config key 'precompute_reference_log_probs': '{out}/reference_log_probs.pt' "
                               f"holds reference log-probabilities of other {what} than this run's; delete it")
    assert not hasattr(built[0], "model")
    assert sorted(p.name for p in out.iterdir()) == ["reference_log_probs.pt"]


def test_precomputing_for_a_loss_without_a_reference_is_refused_before_the_model(tiny_pairs, smollm2_assets, tmp_path):
    cfg = config("lora", smollm2_assets, tiny_pairs, tmp_path / "out", "precompute_reference_log_probs=true",
                 "loss._component_=torchtune_ext.train.preference.PreferenceLoss", "loss.loss_type=simpo")
    recipe = recipe_class(*RUNS["lora"][:2])(cfg)
    with pytest.raises(ConfigError, match="the simpo loss has no reference model whose log-probabilities could be "
                                          "precomputed; set it false") as err:
        recipe.setup()
    recipe.cleanup()
    assert err.value.key == "precompute_reference_log_probs" and not hasattr(recipe, "model")
