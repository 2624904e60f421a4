"""Sharded checkpoints resume exactly at another world size: 4 ranks -> 2 and 2 -> 4, full and LoRA.

Each run is a distributed recipe with ``sharded_checkpoints: true`` on the
tiny setup of tests/support/tiny_setup.py (4 optimizer steps of 4 samples), stopped
by a real SIGTERM after step 2 (the stop saves a sharded checkpoint, exit
75; on 2 ranks asynchronously, after every step, as ``enable_async_checkpointing``
does) and resumed on the other world size from a copy of that checkpoint. The
resumed steps 3-4 must equal the uninterrupted run's (loss and grad norm to
1e-5: the sums over ranks run in another order; token counts and learning
rates exactly): the data position, RNG states, LR schedule and optimizer
moments all come back, resharded by DCP (LoRA without dropout, whose masks
depend on which rank holds a sample). With the global batch changed at
the resume (4 -> 8 samples per step), the resumed run must equal a resume
of the same checkpoint on its own world size with the same change.

Four torchrun launches (4, 2, 4, then 2 ranks) serve every case
(tests/support/resume_worker.py); a model this small trains in milliseconds a step,
so the launches' start-up is most of the cost. The first launch also trains
the same runs with gathered saves: the final sharded checkpoint's Hugging
Face folder, exported file by file, must equal theirs.
"""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.support import resume_jobs
from tests.support.helpers import REPO_ROOT, run_tune
from torchtune_ext.checkpoint import is_sharded, list_checkpoints, verify_checkpoint
from torchtune_ext.tools.export import main as export_main

TOL = 1e-5
SHARDED = ["sharded_checkpoints=true", "epochs=1"]
GLOBAL_4 = {4: ["batch_size=1", "gradient_accumulation_steps=1"], 2: ["batch_size=1", "gradient_accumulation_steps=2"]}
GLOBAL_8 = {4: ["batch_size=2", "gradient_accumulation_steps=1"], 2: ["batch_size=2", "gradient_accumulation_steps=2"]}
RECIPES = ("full_dist", "lora_dist")
# Dropout draws from each rank's RNG for the samples that rank holds, so its masks depend on the world size
# (torchtune_ext.checkpoint.ResumeState.rng_for): LoRA trains without it here, to compare across world sizes.
NO_DROPOUT = {"full_dist": [], "lora_dist": ["model.lora_dropout=0.0"]}


def _launch(nproc, setup_yaml, jobs):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "tests.support.resume_worker", str(setup_yaml), json.dumps(jobs)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def _stopped_copy(root, source, name):
    """A new output folder holding a copy of ``source``'s step_2 (as if that run had been moved elsewhere)."""
    (root / name).mkdir()
    shutil.copytree(root / source / "step_2", root / name / "step_2")
    return str(root / name)


@pytest.fixture(scope="module")
def setup_yaml(tmp_path_factory):
    return resume_jobs.setup(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, setup_yaml):
    root = tmp_path_factory.mktemp("sharded")

    def job(recipe, out, world, batch=GLOBAL_4, **more):
        overrides = [*SHARDED, *batch[world], *NO_DROPOUT[recipe]]
        return {"recipe": recipe, "out": str(root / out), "overrides": overrides, **more}

    first = []
    for recipe in RECIPES:  # 4 ranks: the references of 4 -> 2, and runs stopped after step 2
        first += [job(recipe, f"{recipe}_ref4", 4), job(recipe, f"{recipe}_stop4", 4, stops=[2], finish=False)]
        gathered = job(recipe, f"{recipe}_gathered4", 4)  # today's gathered saves: what the export must equal
        gathered["overrides"] = [*gathered["overrides"][1:], "sharded_checkpoints=false", "save_every_n_steps=2"]
        first.append(gathered)
    logs = {4: _launch(4, setup_yaml, first)}
    second = []
    for recipe in RECIPES:  # 2 ranks: 4 -> 2 resumes, the references of 2 -> 4, runs stopped after step 2
        second += [job(recipe, _stopped_copy(root, f"{recipe}_stop4", f"{recipe}_4to2"), 2, resume=True),
                   job(recipe, f"{recipe}_ref2", 2), job(recipe, f"{recipe}_stop2", 2, stops=[2], finish=False)]
        # the 2-rank runs stopped save asynchronously after every step: the 2 -> 4 resumes read those saves
        second[-1]["overrides"] += ["enable_async_checkpointing=true", "save_every_n_steps=1"]
    # the global batch changed at the resume: 4 ranks' checkpoint on 2 ranks, and on 4 ranks for reference
    second.append(job("full_dist", _stopped_copy(root, "full_dist_stop4", "full_4to2_8"), 2, GLOBAL_8, resume=True))
    logs[2] = _launch(2, setup_yaml, second)
    third = [job(recipe, _stopped_copy(root, f"{recipe}_stop2", f"{recipe}_2to4"), 4, resume=True)
             for recipe in RECIPES]
    # the reference of 4 -> 2 with the global batch changed: the 4 ranks' checkpoint resumed on 4 ranks
    third.append(job("full_dist", _stopped_copy(root, "full_dist_stop4", "full_4to4_8"), 4, GLOBAL_8, resume=True))
    logs["4 again"] = _launch(4, setup_yaml, third)
    return root, logs


def _assert_close(got, ref, steps):
    for step in steps:
        assert got[step]["num_tokens"] == ref[step]["num_tokens"] and got[step]["lr"] == ref[step]["lr"], step
        for field in ("loss", "grad_norm"):
            assert abs(got[step][field] - ref[step][field]) <= TOL * abs(ref[step][field]), (step, field)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("direction", ["4to2", "2to4"])
def test_resume_on_another_world_size_continues_the_run(runs, recipe, direction):
    root, logs = runs
    saved, resumed = int(direction[0]), int(direction[-1])
    stopped = root / f"{recipe}_{direction}" / "step_2"
    assert is_sharded(stopped)
    if saved == 2:  # saved asynchronously after each step: step 1's save too
        assert [c.name for c in list_checkpoints(str(root / f"{recipe}_stop2"))] == ["step_1", "step_2"]
    assert len(list((stopped / "dcp").glob("*.distcp"))) == saved  # one file per rank that wrote it
    got = resume_jobs.by_step(root / f"{recipe}_{direction}")
    ref = resume_jobs.by_step(root / f"{recipe}_ref{saved}")
    assert sorted(got) == [3, 4] and sorted(ref) == [1, 2, 3, 4]  # the copy holds the checkpoint, not the logs
    assert all(got[s]["dp_world_size"] == resumed for s in (3, 4))
    _assert_close(got, ref, [3, 4])
    assert f"dp_world_size {saved} -> {resumed}" in logs[2 if resumed == 2 else "4 again"]
    final = list_checkpoints(str(root / f"{recipe}_{direction}"))[-1]
    assert final.name == "step_4" and len(list((final / "dcp").glob("*.distcp"))) == resumed
    verify_checkpoint(final, content=True)


@pytest.mark.parametrize("direction,reference", [("4to2", "4to4")])  # one direction: each costs a launch
def test_resume_with_another_global_batch_on_another_world_size(runs, direction, reference):
    """4 samples per step before the stop, 8 after: the same steps on either world size."""
    root, logs = runs
    got, ref = resume_jobs.by_step(root / f"full_{direction}_8"), resume_jobs.by_step(root / f"full_{reference}_8")
    assert sorted(got) == sorted(ref) == [3]  # 16 samples: 8 done in 2 steps, 8 left: 1 step
    assert got[3]["dp_world_size"] == int(direction[-1]) and ref[3]["dp_world_size"] == int(reference[-1])
    _assert_close(got, ref, [3])
    assert "The global batch changes" in logs[2] + logs["4 again"]


def _weights(folder):
    """name -> tensor of every safetensors file under ``folder``, by path relative to it."""
    return {(path.relative_to(folder).as_posix(), name): tensor
            for path in sorted(folder.rglob("*.safetensors")) for name, tensor in load_file(str(path)).items()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_final_sharded_checkpoint_is_the_hugging_face_folder_a_gathered_save_writes(runs, recipe):
    """The export, written file by file from 4 ranks' shards, equals rank 0's gathered save of the same run
    (LoRA: the adapter alone, ``save_adapter_weights_only``), and loads in transformers / PEFT."""
    root, _ = runs
    sharded, gathered = root / f"{recipe}_ref4" / "step_4", root / f"{recipe}_gathered4" / "step_4"
    assert is_sharded(sharded) and not is_sharded(gathered)
    own = {"dcp", "recipe_state.pt", "checkpoint.json"}  # what a step folder holds besides the HF folder
    files = {p.relative_to(sharded).as_posix() for p in sharded.rglob("*") if p.is_file()}
    files_gathered = {p.relative_to(gathered).as_posix() for p in gathered.rglob("*") if p.is_file()}
    assert {f for f in files if f.split("/")[0] not in own} == {f for f in files_gathered if f.split("/")[0] not in own}
    got, want = _weights(sharded), _weights(gathered)
    assert got.keys() == want.keys() and got
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=TOL, atol=1e-7), key
    if recipe == "full_dist":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(sharded), torch_dtype=torch.float32)
        loaded = model.state_dict()
        for (_, name), tensor in got.items():
            assert torch.equal(loaded[name], tensor), name
    else:
        from peft import PeftConfig

        assert PeftConfig.from_pretrained(str(sharded / "adapter")).r == 4


@pytest.mark.parametrize("recipe", RECIPES)
def test_any_sharded_checkpoint_exports_on_request_to_what_a_gathered_save_writes(runs, recipe, tmp_path, capsys):
    """``python -m torchtune_ext.checkpoint.export``: a stop's checkpoint (shards only) of 4 ranks, in one process."""
    root, _ = runs
    stopped, gathered = root / f"{recipe}_stop4" / "step_2", root / f"{recipe}_gathered4" / "step_2"
    assert not list(stopped.glob("*.safetensors"))  # a stop's checkpoint holds the shards only
    assert export_main([str(stopped), str(tmp_path / "hf")]) == 0
    got, want = _weights(tmp_path / "hf"), _weights(gathered)
    assert got.keys() == want.keys() and got
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=TOL, atol=1e-7), key
    # bad input: one line, status 2, nothing overwritten
    assert export_main([str(stopped), str(tmp_path / "hf")]) == 2
    assert export_main([str(gathered), str(tmp_path / "other")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0] == f"error: '{tmp_path / 'hf'}' exists and is not an empty folder: nothing is overwritten; " \
        "give a new folder"
    assert errors[1].startswith(f"error: '{gathered}' is not a sharded checkpoint") and len(errors) == 2
    assert _weights(tmp_path / "hf").keys() == want.keys() and not (tmp_path / "other").exists()


def test_resume_from_a_sharded_checkpoint_with_another_model_is_one_line_and_exit_2(runs, setup_yaml):
    """One layer fewer than the checkpoint: refused before any weight is read (one rank: 4 -> 1), nothing lost."""
    root, _ = runs
    out = _stopped_copy(root, "full_dist_stop4", "other_model")
    before = {p.name: p.read_bytes() for p in (root / "other_model" / "step_2" / "dcp").iterdir()}
    proc = run_tune("--nproc_per_node", "1", "recipes/full_finetune_distributed.py", "--config", str(setup_yaml),
                    f"output_dir={out}", "sharded_checkpoints=true", "epochs=1",
                    "resume_from_checkpoint=true", "model.num_layers=1", extra_env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config key 'resume_from_checkpoint':") and "another model" in last, last
    assert "'layers.1.attn.q_proj.weight' is in the checkpoint but not in the model" in last
    assert "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in (root / "other_model" / "step_2" / "dcp").iterdir()} == before
    assert [c.name for c in list_checkpoints(out)] == ["step_2"]


def test_a_failed_asynchronous_save_stops_the_run_with_one_line_and_exit_74(setup_yaml, tmp_path):
    """A write that fails in the background (a file size limit: the shards do not fit, recipe_state.pt does) is
    reported by the next save as a failed save: one line naming the checkpoint, exit 74, nothing left behind."""
    out = tmp_path / "out"

    def limit_file_size():  # ulimit -f: a write past it fails with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    proc = subprocess.run(
        ["tune", "run", "--nproc_per_node", "1", "recipes/full_finetune_distributed.py", "--config",
         str(setup_yaml), f"output_dir={out}", "enable_async_checkpointing=true", "epochs=1",
         "save_every_n_steps=1"],
        cwd=REPO_ROOT, env=resume_jobs.subprocess_env(), capture_output=True, text=True, timeout=600,
        preexec_fn=limit_file_size)
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line[line.index("error:"):] for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: saving step_1 in output_dir '{out}' failed ("), errors
    assert "no checkpoint of this run exists yet" in errors[0]
    assert not (out / ".staging").exists() and list_checkpoints(str(out)) == []


def test_a_sharded_checkpoint_resumes_exactly_on_the_single_device_recipe(runs, setup_yaml):
    """2 ranks' shards read whole in one process (batch 1 x 4 accumulation steps: the same global batch)."""
    root, _ = runs
    out = _stopped_copy(root, "full_dist_stop2", "full_2to_single")
    cfg = resume_jobs.config(setup_yaml, "full_single", out, "epochs=1", "batch_size=1",
                             "gradient_accumulation_steps=4", "resume_from_checkpoint=true")
    assert resume_jobs.run("full_single", cfg) == 0
    got, ref = resume_jobs.by_step(root / "full_2to_single"), resume_jobs.by_step(root / "full_dist_ref2")
    assert sorted(got) == [3, 4]  # the single-device recipe logs no dp_world_size
    _assert_close(got, ref, [3, 4])
