"""The benchmark's pure functions (bench/): log parsing, per-step numbers, statistics, FLOPs, targets.

Fast: no model is run (the FLOPs counts build SmolLM2 on the meta device).
"""

import json
from pathlib import Path

import pytest

from bench import analysis, report
from bench.cases import OURS_EACH, OURS_ONCE, PROFILES, UPSTREAM, Case, Group, command

REPO = Path(__file__).resolve().parents[3]

# Two calls of torchtune 0.6.1's DiskLogger.log_dict, as written to its file.
DISK_LOG = (
    "Step 1 | loss:1.7168010473251343 lr:1e-05 tokens_per_second_per_gpu:4.02747106552124 grad_norm:8.39527416229248 \n"
    "Step 2 | loss:1.7106633186340332 lr:2e-05 tokens_per_second_per_gpu:tensor(3.0990) grad_norm:7.923330783843994 \n"
)


def test_parse_disk_log():
    records = analysis.parse_disk_log(DISK_LOG)
    assert records == [
        {"step": 1, "loss": 1.7168010473251343, "lr": 1e-05, "tokens_per_second_per_gpu": 4.02747106552124,
         "grad_norm": 8.39527416229248},
        {"step": 2, "loss": 1.7106633186340332, "lr": 2e-05, "tokens_per_second_per_gpu": 3.099,
         "grad_norm": 7.923330783843994},
    ]


def test_parse_disk_log_matches_torchtune_writer(tmp_path):
    from torchtune.training.metric_logging import DiskLogger

    logger = DiskLogger(log_dir=str(tmp_path), filename="log.txt")
    logger.log_dict({"loss": 0.5, "lr": 3e-4, "tokens_per_second_per_gpu": 12.0}, step=7)
    logger.close()
    assert analysis.parse_disk_log((tmp_path / "log.txt").read_text()) == [
        {"step": 7, "loss": 0.5, "lr": 3e-4, "tokens_per_second_per_gpu": 12.0}
    ]


def test_last_record_per_step_keeps_the_last():
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.0}]
    assert analysis.last_record_per_step(records) == {1: {"step": 1, "loss": 3.0}, 2: {"step": 2, "loss": 1.0}}


def test_step_periods_and_tokens_per_step():
    assert analysis.step_periods([10.0, 12.5, 16.0]) == {2: 2.5, 3: 3.5}

    def mb(n, t, pre):
        return {"non_padding_tokens": n, "trainable_tokens": t, "trainable_tokens_pre_shift": pre}

    rank0 = [mb(10, 4, 4), mb(20, 8, 9), mb(30, 5, 5), mb(40, 6, 6), mb(99, 9, 9)]  # the last: fetched ahead
    rank1 = [mb(1, 1, 1), mb(2, 2, 2), mb(3, 3, 3), mb(4, 4, 4)]
    steps = analysis.tokens_per_step([rank0, rank1], ga=2, num_steps=2)
    assert steps == [
        {"non_padding_tokens": 33, "trainable_tokens": 15, "trainable_tokens_pre_shift": 16},
        {"non_padding_tokens": 77, "trainable_tokens": 18, "trainable_tokens_pre_shift": 18},
    ]
    with pytest.raises(ValueError):
        analysis.tokens_per_step([rank1], ga=2, num_steps=3)

    # With a token budget a step may have fewer micro-batches than GA: the probe's step_index decides.
    budget = [dict(mb(10, 4, 4), step_index=0), dict(mb(20, 8, 9), step_index=1), dict(mb(30, 5, 5), step_index=1),
              dict(mb(40, 6, 6), step_index=1), dict(mb(99, 9, 9), step_index=2)]
    assert [s["non_padding_tokens"] for s in analysis.tokens_per_step([budget], ga=2, num_steps=2)] == [10, 90]
    with pytest.raises(ValueError, match="step 3"):
        analysis.tokens_per_step([budget[:4]], ga=2, num_steps=3)


def test_summarize():
    s = analysis.summarize([2.0, 4.0, 3.0])
    assert s == {"median": 3.0, "min": 2.0, "max": 4.0, "spread": pytest.approx(2 / 3), "n": 3}
    assert analysis.summarize([5.0])["spread"] == 0.0
    assert analysis.summarize([None, float("nan")])["median"] is None


def test_run_throughput_skips_the_first_steps_and_weighs_by_time():
    steps = [
        {"step": 1, "period": None, "non_padding_tokens": 100, "trainable_tokens": 50},
        {"step": 2, "period": 9.0, "non_padding_tokens": 100, "trainable_tokens": 50},
        {"step": 3, "period": 1.0, "non_padding_tokens": 100, "trainable_tokens": 40},
        {"step": 4, "period": 3.0, "non_padding_tokens": 300, "trainable_tokens": 80},
    ]
    t = analysis.run_throughput(steps, skip_steps=2)
    assert t == {"step_seconds": 2.0, "tokens_per_second": 100.0, "trainable_tokens_per_second": 30.0,
                 "measured_steps": 2}
    assert analysis.run_throughput(steps, skip_steps=4)["tokens_per_second"] is None


def test_max_relative_difference_and_foreign_load():
    assert analysis.max_relative_difference([1.0, 2.2, None], [1.0, 2.0, 3.0]) == pytest.approx(0.1)
    assert analysis.max_relative_difference([None], [1.0]) is None
    # 30 busy CPU-seconds in 10 s, 18 of them ours: others used 1.2 cores
    assert analysis.foreign_cpu_cores(30.0, 18.0, 10.0) == pytest.approx(1.2)
    assert analysis.foreign_cpu_cores(10.0, 12.0, 10.0) == 0.0


def test_flops_per_token_formula():
    # full fine-tune: 6 per trainable parameter, attention 12 * layers * width * seq
    assert analysis.flops_per_token(100, 0, 2, 8, 10) == 600 + 12 * 2 * 8 * 10
    # LoRA: frozen weights cost 4 (forward + input gradient), adapters 6
    assert analysis.flops_per_token(10, 100, 0, 8, 10) == 60 + 400
    assert analysis.mfu(10.0, 1e9, 1e11) == pytest.approx(0.1)
    assert analysis.mfu(None, 1e9, 1e11) is None
    assert analysis.matmul_flops(2048) == 2 * 2048**3


def test_smollm2_parameter_counts_full_and_lora():
    from bench.probes import model_counts

    full = model_counts("full", str(REPO / "configs/smollm2/135M_full_single_device.yaml"))
    lora = model_counts("lora", str(REPO / "configs/smollm2/135M_lora_single_device.yaml"))
    # the tied embedding counts once, the 61 RMSNorm scales (576 each) not at all: of the
    # 134,515,008 parameters in README / docs/lora.md, 134,479,872 are matmul weights
    assert full == {"trainable_params": 134_515_008 - 61 * 576, "frozen_params": 0, "num_layers": 30,
                    "attn_dim": 576}
    # rank 8 on q, k, v, output_proj and the three MLP projections: r * (in + out) per adapter
    dim, kv_dim, hidden, rank = 576, 192, 1536, 8
    per_layer = rank * (2 * (dim + dim) + 2 * (dim + kv_dim) + 3 * (dim + hidden))
    assert lora["trainable_params"] == 30 * per_layer == 2_442_240
    assert lora["frozen_params"] == 134_515_008 - 61 * 576
    full_fpt = analysis.flops_per_token(**full, seq_len=200)
    lora_fpt = analysis.flops_per_token(**lora, seq_len=200)
    # LoRA skips the weight gradients of the base (2 of 6 FLOPs per weight)
    assert lora_fpt / full_fpt == pytest.approx((4 * 134.5 + 6 * 2.44 + 41.5) / (6 * 134.5 + 41.5), rel=1e-2)


def _run(case, repeat, tps_steps, peak_gib=1.0, loss=(1.0, 1.0, 1.0), acc=None):
    steps = [{"step": i + 1, "period": p, "non_padding_tokens": 100, "trainable_tokens": 40,
              "trainable_tokens_pre_shift": 40, "loss": loss[i], "grad_norm": 1.0, "logged_tokens": 40}
             for i, p in enumerate(tps_steps)]
    return {"case": case.name, "group": case.group.name, "variant": case.variant, "repeat": repeat,
            "steps": steps, "peak_memory_bytes": [peak_gib * analysis.GIB], "mean_sample_tokens": 100.0,
            "accounting": acc or {}, "foreign_cpu": 0.0}


def test_summary_comparison_and_targets():
    g1, g8 = Group("full", 1, 1), Group("full", 1, 8)
    up, once, each = (Case(g1, v) for v in (UPSTREAM, OURS_ONCE, OURS_EACH))
    each8 = Case(g8, OURS_EACH)
    acc = {"count_tokens": {"2": 0.001, "3": 0.001}, "global_sum": {"2": 0.0005, "3": 0.0005},
           "logging": {"2": 0.002, "3": 0.002}, "peer_wait": {"2": 0.5, "3": 0.3}}
    runs = {
        up.name: [_run(up, r, [None, 2.0, 2.0]) for r in range(3)],
        once.name: [_run(once, r, [None, 1.6, 1.6], loss=(1.0, 1.0, 1.01)) for r in range(3)],
        each.name: [_run(each, r, [None, 2.0, 2.0], acc=acc) for r in range(3)],
        each8.name: [_run(each8, r, [None, 2.0, 2.0], peak_gib=1.05) for r in range(3)],
    }
    cases = {}
    for name, rs in runs.items():
        c = rs[0]
        case = {up.name: up, once.name: once, each.name: each, each8.name: each8}[name]
        cases[name] = {"group": c["group"], "variant": c["variant"], "kind": "full", "nproc": 1, "ga": case.group.ga,
                       "summary": report.summarize_case(rs, 1, lambda s: 1e9, 1e12)}
    assert cases[up.name]["summary"]["tokens_per_second"]["median"] == pytest.approx(50.0)
    assert cases[up.name]["summary"]["mfu"]["median"] == pytest.approx(50 * 1e9 / 1e12)
    share = cases[each.name]["summary"]["accounting"]["share"]["median"]
    assert share == pytest.approx(0.0035 * 2 / 4.0)  # the wait for peers is not counted
    assert cases[each.name]["summary"]["accounting"]["peer_wait_ms_per_step"]["median"] == pytest.approx(400.0)

    comp_once = report.compare_to_upstream(runs[once.name], runs[up.name], 1)
    assert comp_once["ratio"] == pytest.approx(1.25)
    assert comp_once["paired_ratio"]["median"] == pytest.approx(1.25)
    assert comp_once["max_rel_diff_loss"] == pytest.approx(0.01)
    assert comp_once["same_tokens"] is True
    comp_each = report.compare_to_upstream(runs[each.name], runs[up.name], 1)
    groups = {g1.name: {"kind": "full", "nproc": 1, "ga": 1, "label": g1.label,
                        "comparisons": {OURS_ONCE: comp_once, OURS_EACH: comp_each}}}
    targets = report.evaluate_targets(cases, groups)
    assert [t["met"] for t in targets] == [True, False, True, True]  # no 2-process group: not met, no values
    assert targets[2]["values"][0]["ratio"] == pytest.approx(1.05)
    table = report.results_table(cases, groups, [g1.name])
    assert "| full · 1 device · GA 1 | ours, backward=auto |" in table
    assert "1.25" in table
    assert "GA 8" in report.memory_table(cases)
    assert "not met" not in report.targets_table(targets).splitlines()[2]


def test_usable_runs_drops_failed_and_superseded():
    runs = [{"steps": []}, {"steps": [], "error": "x"}, {"steps": [], "used": False}, {"error": "y"}]
    assert report.usable_runs(runs) == [runs[0]]


def test_commands_give_both_implementations_the_same_settings(tmp_path):
    profile = PROFILES["cpu"]
    group = Group("full", 2, 4)
    up = command(Case(group, UPSTREAM), profile, tmp_path / "u")
    ours = command(Case(group, OURS_EACH), profile, tmp_path / "o")
    shared = {a for a in up if "=" in a and not a.startswith("output_dir")}
    assert shared <= set(ours)
    assert "backward=per_micro_batch" in ours and "--upstream" in up
    assert up[:5] == ours[:5] and "--nproc_per_node=2" in up
    assert "gradient_accumulation_steps=4" in up and "seed=0" in up


def test_upstream_lora_runs_start_from_our_adapter():
    """Upstream draws its initial adapter from another random stream than ours; the benchmark gives it ours
    (bench.launch.OurInitialAdapter, tested in tests/integration/recipes/test_lora_parity.py), drawn with the runs'
    seed."""
    for profile in PROFILES.values():
        for case in profile.cases():
            cmd = command(case, profile, Path("/tmp/x"))
            wanted = case.variant == UPSTREAM and case.group.kind == "lora"
            assert ("--adapter-seed" in cmd) == wanted, case.name
            if wanted:
                assert f"seed={cmd[cmd.index('--adapter-seed') + 1]}" in cmd


def test_an_upstream_lora_run_whose_adapter_was_not_replaced_is_not_read(tmp_path):
    from bench.runner import read_run

    case = Case(Group("lora", 1, 4), UPSTREAM)
    (tmp_path / "probe.json").write_text(json.dumps({"rank": 0, "initial_adapter": {"seed": 0, "applied": 0}}))
    with pytest.raises(ValueError, match="initial adapter was not replaced"):
        read_run(case, tmp_path, 3)


def test_every_profile_case_has_a_recipe_and_config():
    for profile in PROFILES.values():
        for case in profile.cases():
            cmd = command(case, profile, Path("/tmp/x"))
            config = Path(cmd[cmd.index("--config") + 1])
            assert (REPO / config).is_file(), config


def test_probes_find_what_they_time_in_torchtune_ext():
    """bench.launch times these by name; a rename must fail here, not silently stop measuring."""
    from torchtune_ext.data import datasets
    from torchtune_ext.run.metrics import MetricLogger, reporter
    from torchtune_ext.train import accounting, objective

    for name in ("count_trainable_tokens", "global_sum"):
        assert callable(getattr(accounting, name))
    assert callable(objective.prepare_micro_batch)
    # looked up in the step reporter's module when a step starts and ends
    assert callable(reporter.step_record) and callable(MetricLogger.log)
    assert callable(reporter.reset_peak_memory)
    assert hasattr(datasets, "padded_collate_sft")  # make_collate looks it up at call time


def test_render_rebuilds_the_tables_from_a_results_json(tmp_path):
    import argparse
    import json

    from bench.__main__ import render

    group = Group("full", 1, 1)
    profile = {**PROFILES["quick"].__dict__, "groups": [group.__dict__]}
    runs = [{**_run(Case(group, v), r, [None, p, p]), "tag": f"r{r}"}
            for r in range(2) for v, p in ((UPSTREAM, 2.0), (OURS_ONCE, 1.0), (OURS_EACH, 1.0))]
    result = {"profile": profile, "command": "python -m bench --quick", "finished": "2026-11-30T09:00:00",
              "machine": {"cpus": 2, "memory_gib": 24}, "runs": runs,
              "model": {"full": {"trainable_params": 100, "frozen_params": 0, "num_layers": 1, "attn_dim": 8}},
              "peak": {"flops_per_second": 1e12, "dtype": "float32", "n": 2048},
              "grad_norm": {"params": 100, "threads": 2,
                            **{k: {"seconds": 0.1, "relative_error": 1e-9}
                               for k in ("ours_blocked", "float64_per_entry", "upstream_clip_grad_norm_")}}}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(result))
    args = argparse.Namespace(results_dir=tmp_path / "out", work_dir=tmp_path / "work")
    assert render(path, args) == 0
    text = (tmp_path / "out" / "quick.md").read_text()
    assert "| full · 1 device · GA 1 | ours, backward=auto |" in text
    assert "| 2.00 (2.00–2.00) |" in text  # ratio of the medians, range of the per-repeat ratios
    assert "| upstream_clip_grad_norm_ | 0.100 | 1.0e-09 |" in text
    assert json.loads((tmp_path / "out" / "quick.json").read_text())["summary"]["cases"]

    # an interrupted run's runs.partial.json (no "finished"), its second repeat not reached
    del result["finished"]
    result["runs"] = [r for r in runs if r["tag"] == "r0"]
    result["profile"] = {**profile, "repeats": 3}
    path.write_text(json.dumps(result))
    assert render(path, args) == 0
    text = (tmp_path / "out" / "quick.md").read_text()
    assert "not finished" in text and "1 repeats." in text


def test_pad_to_gives_fixed_shapes_without_trainable_tokens():
    import torch

    from bench.launch import _pad_to

    collated = {"tokens": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[-100, 6, 7]])}
    out = _pad_to(collated, 6, padding_idx=0, ignore_idx=-100)
    assert out["tokens"].tolist() == [[5, 6, 7, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7, -100, -100, -100]]
    assert _pad_to(out, 4, 0, -100)["tokens"].shape == (1, 6)  # never truncates


def test_memory_profile_pads_every_run():
    profile = PROFILES["memory"]
    for case in profile.cases():
        cmd = command(case, profile, Path("out"))
        assert cmd[cmd.index("--pad-to") + 1] == str(profile.pad_to)
    assert "--pad-to" not in command(PROFILES["cpu"].cases()[0], PROFILES["cpu"], Path("out"))


# ------------------------------------------------ the transformers path (python -m bench --hf)

def _recipe_config(cmd):
    """The config a recipe started by ``cmd`` (a bench.launch command) gets, parsed as torchtune parses it."""
    from omegaconf import OmegaConf
    from torchtune.config._parse import TuneRecipeArgumentParser
    from torchtune.config._utils import _merge_yaml_and_cli_args

    args = cmd[cmd.index("--config"):]
    args[1] = str(REPO / args[1])
    yaml_args, cli_args = TuneRecipeArgumentParser().parse_known_args(args)
    return OmegaConf.to_container(_merge_yaml_and_cli_args(yaml_args, cli_args), resolve=True)


def _flat(node, prefix=""):
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differences(a, b, skip):
    fa, fb = _flat(a), _flat(b)
    keys = (k for k in set(fa) | set(fb) if k.split(".")[0] not in skip)
    return sorted(k for k in keys if fa.get(k, "absent") != fb.get(k, "absent"))


@pytest.mark.parametrize("name", ["hf", "hf_quick"])
def test_the_transformers_path_trains_as_the_torchtune_path(name, tmp_path):
    """Both runs of a group get the same config but for what builds the model (and where it writes):
    the same tokenizer (the folder's own chat template would add a system prompt), schedule, sizes, mode."""
    from bench.cases import MODEL_KEYS, OURS_HF_EACH, TRANSFORMERS_CONFIGS

    profile = PROFILES[name]
    (group,) = profile.groups
    assert set(group.variants) == {OURS_EACH, OURS_HF_EACH}
    # the same output_dir for both: paths under it (metric_logger.log_dir) then compare too
    tt = _recipe_config(command(Case(group, OURS_EACH), profile, tmp_path))
    hf_cmd = command(Case(group, OURS_HF_EACH), profile, tmp_path)
    hf = _recipe_config(hf_cmd)
    assert hf_cmd[hf_cmd.index("--config") + 1] == TRANSFORMERS_CONFIGS["full"]
    assert _differences(tt, hf, MODEL_KEYS) == []
    assert hf["model"]["_component_"] == "torchtune_ext.model.hf.causal_lm"
    assert tt["model"]["_component_"] == "torchtune_ext.model.builders.smollm2_135m"
    assert hf["model"]["path"] == hf["checkpointer"]["checkpoint_dir"] == tt["checkpointer"]["checkpoint_dir"]
    assert hf["tokenizer"]["max_seq_len"] == profile.max_seq_len_of(group)
    assert hf["backward"] == "per_micro_batch" and hf["enable_activation_checkpointing"] is False

    # what the alignment does: without it, the two configs differ in these keys (among others)
    start = hf_cmd.index("--config") + 2
    unaligned = hf_cmd[:start] + ["model_dir=" + tt["checkpointer"]["checkpoint_dir"]] + [
        a for a in hf_cmd[start:] if a in command(Case(group, OURS_EACH), profile, tmp_path)]
    left = _differences(tt, _recipe_config(unaligned), MODEL_KEYS)
    assert {"tokenizer._component_", "lr_scheduler.num_warmup_steps"} <= set(left)


def test_the_transformers_path_refuses_what_it_cannot_align(tmp_path, monkeypatch):
    from bench import cases

    with pytest.raises(ValueError, match="one device"):
        command(Case(Group("full", 2, 4, (cases.OURS_HF_EACH,)), cases.OURS_HF_EACH), PROFILES["hf"], tmp_path)
    # a key only the transformers config sets would train one path differently: refused, naming it
    extra = tmp_path / "hf.yaml"
    extra.write_text((REPO / cases.TRANSFORMERS_CONFIGS["full"]).read_text() + "\nlabel_smoothing: 0.1\n")
    monkeypatch.setitem(cases.TRANSFORMERS_CONFIGS, "full", str(extra))
    with pytest.raises(ValueError, match="label_smoothing"):
        cases.transformers_path_overrides("full")


def test_the_hf_profile_warms_up_both_paths(tmp_path, monkeypatch):
    """One warm-up per model code: the transformers path imports and loads other code than the torchtune path."""
    import argparse

    from bench import __main__ as bench_main
    from bench import runner

    started = []
    monkeypatch.setattr(runner, "execute", lambda case, profile, out, steps=None: started.append(case.variant) or {})
    bench_main.warmups(PROFILES["hf"], argparse.Namespace(work_dir=tmp_path))
    assert sorted(started) == sorted(PROFILES["hf"].groups[0].variants)


def _timed_run(case, repeat, periods, peak_gib, loss, tokens=(100, 100, 300, 200)):
    steps = [{"step": i + 1, "period": p, "non_padding_tokens": tokens[i], "trainable_tokens": 40,
              "trainable_tokens_pre_shift": 41, "loss": loss[i], "grad_norm": 1.0, "logged_tokens": 40}
             for i, p in enumerate(periods)]
    return {"case": case.name, "group": case.group.name, "variant": case.variant, "repeat": repeat,
            "steps": steps, "peak_memory_bytes": [peak_gib * analysis.GIB], "mean_sample_tokens": 100.0,
            "accounting": {}, "foreign_cpu": 0.1 * repeat, "load_samples": [[2.0 + repeat, 1.0, 1.0]]}


def test_transformers_report_ratios_targets_and_table():
    from bench.cases import OURS_HF_EACH

    group = Group("full", 1, 4, (OURS_EACH, OURS_HF_EACH))
    tt_case, hf_case = Case(group, OURS_EACH), Case(group, OURS_HF_EACH)
    # steps 3 and 4 are measured (skip 2); the torchtune path runs them at 100 tokens/s in repeat 0,
    # 50 tokens/s in repeat 1; the transformers path at 0.9x of that
    tt = [_timed_run(tt_case, 0, [None, 9.0, 3.0, 2.0], 3.0, (1.0, 1.0, 0.9, 0.8)),
          _timed_run(tt_case, 1, [None, 9.0, 6.0, 4.0], 3.2, (1.0, 1.0, 0.9, 0.8))]
    hf = [_timed_run(hf_case, 0, [None, 9.0, 3.0 / 0.9, 2.0 / 0.9], 3.3, (1.0, 1.0, 0.9, 0.8 * (1 + 2e-6))),
          _timed_run(hf_case, 1, [None, 9.0, 6.0 / 0.9, 4.0 / 0.9], 3.2, (1.0, 1.0, 0.9, 0.8))]
    comps = report.transformers_comparisons({OURS_EACH: tt, OURS_HF_EACH: hf}, skip_steps=2)
    comp = comps[OURS_HF_EACH]
    assert set(comps) == {OURS_HF_EACH}
    assert comp["step_median_ratio"] == pytest.approx(0.9)
    assert comp["paired_step_median_ratio"]["min"] == pytest.approx(0.9)
    assert comp["memory_ratio"] == pytest.approx(3.25 / 3.1)
    assert comp["paired_memory_ratio"]["max"] == pytest.approx(1.1)
    assert comp["max_rel_diff_loss"] == pytest.approx(2e-6)
    assert comp["same_tokens"] is True

    groups = {group.name: {"label": group.label, "comparisons": comps}}
    targets = report.evaluate_transformers_targets({}, groups)
    assert [t["met"] for t in targets] == [False, True, True, True]  # 0.9 < 0.95; 1.048 <= 1.05
    text = report.transformers_targets_table(targets)
    assert "**not met**" in text and "0.900" in text

    cases = {c.name: {"summary": report.summarize_case(runs, 2, lambda s: 1e9, 1e12)}
             for c, runs in ((tt_case, tt), (hf_case, hf))}
    table = report.transformers_table(cases, groups, [group.name], {tt_case.name: tt, hf_case.name: hf}, 2)
    rows = {line.split(" | ")[1]: line for line in table.splitlines()[2:]}
    hf_row = rows["ours, transformers model (configs/hf), backward=per_micro_batch"]
    # per-step medians over both repeats: torchtune path steps at 100, 100, 50, 50 tokens/s -> 75
    assert "| 75 |" in rows["ours, backward=per_micro_batch"]
    assert "| 0.900 (0.90–0.90) | 0.900 |" in hf_row and "| 1.048 |" in hf_row and "| 2.0e-06 |" in hf_row
    assert "| 2.50 |" in hf_row  # the median load average sampled during its runs


def test_the_hf_profiles_render(tmp_path):
    """The hf report renders from a results JSON (what a finished `python -m bench --hf` writes)."""
    import argparse

    from bench.__main__ import render
    from bench.cases import OURS_HF_EACH

    profile = PROFILES["hf_quick"]
    (group,) = profile.groups
    runs = [{**_timed_run(Case(group, v), 0, [None, 2.0 * k, 2.0 * k], 3.0, (1.0, 0.9, 0.8), (100, 100, 100)),
             "tag": "r0"} for v, k in ((OURS_EACH, 1.0), (OURS_HF_EACH, 1.25))]
    result = {"profile": {**profile.__dict__, "groups": [g.__dict__ for g in profile.groups]},
              "command": "python -m bench --hf-quick", "finished": "2026-12-04T09:00:00",
              "machine": {"cpus": 2, "memory_gib": 23}, "runs": runs,
              "model": {"full": {"trainable_params": 100, "frozen_params": 0, "num_layers": 1, "attn_dim": 8}},
              "peak": {"flops_per_second": 1e12, "dtype": "float32", "n": 2048}}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(result))
    assert render(path, argparse.Namespace(results_dir=tmp_path / "out", work_dir=tmp_path / "work")) == 0
    text = (tmp_path / "out" / "hf_quick.md").read_text()
    assert "the transformers path against the torchtune path" in text
    assert "| 0.800 |" in text and "**not met**" in text
    assert "grad_norm" not in json.loads((tmp_path / "out" / "hf_quick.json").read_text())


def test_run_timeout_from_the_command_line():
    """On a shared machine a run can outlast its profile's limit per run; --run-timeout-s raises it."""
    from bench.__main__ import build_profile, parse_args

    assert build_profile(parse_args(["--hf"])).run_timeout_s == PROFILES["hf"].run_timeout_s
    assert build_profile(parse_args(["--hf", "--run-timeout-s", "3600"])).run_timeout_s == 3600
