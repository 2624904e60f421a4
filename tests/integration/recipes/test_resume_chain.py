"""A run survives any number of stops, on one rank and two, and may come back on another world size.

Every run here is stopped the way a scheduler stops it: a real SIGTERM after
a chosen optimizer step, handled by the recipe (finish the step, save, exit
75), then resumed from the checkpoint that the previous, itself resumed, run
wrote. The chains are compared with an uninterrupted run of the same config:
bit for bit on the same world size; to fp32 precision (1e-5) where the run
comes back on another world size with the same global batch.

One rank runs in the pytest process; two ranks in one torchrun launch
(tests/support/resume_worker.py) that serves every two-rank job of this module.
"""

import json
import logging
import os
import signal
import subprocess
import time

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.support import resume_jobs
from tests.support.helpers import REPO_ROOT, run_worker
from torchtune_ext.checkpoint import list_checkpoints, verify_checkpoint
from torchtune_ext.errors import EXIT_STOPPED
from torchtune_ext.run.control.run_lock import OutputDirLock

TOL = 1e-5
STOPS = list(range(1, 11))  # ten stops: a fresh run, nine resumes that stop again, a tenth that finishes
# two ranks (4 steps per epoch): after the first step, at the first epoch's end, just after it, mid-epoch
STOPS_TWO_RANKS = [1, 4, 5, 9]
TWO_RANKS = ["batch_size=1", "gradient_accumulation_steps=2"]  # 2 x 1 x 2: 4 samples per step, as on one rank
LONG = ["epochs=12"]  # 48 steps: a signal from outside arrives mid-run


def weights(out, name):
    step = list_checkpoints(str(out))[-1]
    path = step / name
    return load_file(path) if name.endswith(".safetensors") else torch.load(path, weights_only=True)


def assert_exact(got, ref):
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    for step in ref:
        assert [got[step][f] for f in resume_jobs.FIELDS] == [ref[step][f] for f in resume_jobs.FIELDS], step


def assert_close(got, ref, steps):
    for step in steps:
        assert got[step]["num_tokens"] == ref[step]["num_tokens"] and got[step]["lr"] == ref[step]["lr"], step
        for field in ("loss", "grad_norm"):
            assert abs(got[step][field] - ref[step][field]) <= TOL * abs(ref[step][field]), (step, field)


@pytest.fixture(scope="module")
def setup_yaml(tmp_path_factory):
    return resume_jobs.setup(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("recipe", ["full_single", "lora_single", "full_dist"])
def test_ten_resumes_in_a_row_are_exact(setup_yaml, tmp_path, recipe):
    """Ten SIGTERM stops and resumes (one at an epoch end) give the uninterrupted run, bit for bit."""
    straight, chained = tmp_path / "straight", tmp_path / "chained"
    assert resume_jobs.run(recipe, resume_jobs.config(setup_yaml, recipe, straight)) == 0
    statuses = resume_jobs.chain(recipe, setup_yaml, chained, STOPS)
    assert statuses == [EXIT_STOPPED] * len(STOPS) + [0]
    rows = [r["step"] for r in resume_jobs.read_jsonl(chained / "logs" / "metrics.jsonl")]
    assert rows == list(range(1, 13))  # a stop loses no step and repeats none
    assert_exact(resume_jobs.by_step(chained), resume_jobs.by_step(straight))
    name = "adapter/adapter_model.pt" if recipe.startswith("lora") else "model-00001-of-00001.safetensors"
    final, got = weights(straight, name), weights(chained, name)
    assert final.keys() == got.keys() and all(torch.equal(got[k], final[k]) for k in final)
    for step in list_checkpoints(str(chained)):
        verify_checkpoint(step)  # every checkpoint a resumed run wrote is itself resumable
    assert len(list((chained / "logs").glob("config_*.yaml"))) == len(STOPS) + 1


def test_resume_of_a_resumed_run_with_more_epochs(setup_yaml, tmp_path):
    """Train; resume with epochs=2; resume again with epochs=3 (it used to fail: manifest of the older checkpoint)."""
    out = tmp_path / "out"
    for epochs in (1, 2, 3):
        resume = ["resume_from_checkpoint=true"] if epochs > 1 else []
        cfg = resume_jobs.config(setup_yaml, "full_single", out, f"epochs={epochs}", *resume)
        assert resume_jobs.run("full_single", cfg) == 0
    assert [p.name for p in list_checkpoints(str(out))] == ["step_4", "step_8", "step_12"]
    manifest = verify_checkpoint(out / "step_12")
    assert "checkpoint.json" not in manifest["files"]
    assert sorted(resume_jobs.by_step(out)) == list(range(1, 13))


# ------------------------------------------------------------------ two ranks, one launch
def _launch(setup_yaml, jobs):
    proc = run_worker(2, "resume_worker", str(setup_yaml), json.dumps(jobs), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def two_ranks(setup_yaml, tmp_path_factory):
    """All two-rank runs of this module in one launch; the one-rank runs they continue are made first."""
    root = tmp_path_factory.mktemp("two_ranks")
    # 1 rank x batch 4 (single-device recipe): the reference, and a copy stopped after step 2
    one_rank = ["batch_size=4", "gradient_accumulation_steps=1"]
    assert resume_jobs.chain("full_single", setup_yaml, root / "to_two_ref", [], *one_rank) == [0]
    assert resume_jobs.chain("full_single", setup_yaml, root / "to_two", [2], *one_rank, finish=False) == [
        EXIT_STOPPED]
    signalled = {"rank_1": _tune_run_stopped_by_sigterm(setup_yaml, root / "signalled", rank=1),
                 "launcher": _tune_run_stopped_by_sigterm(setup_yaml, root / "signalled_launcher", rank=None)}
    jobs = [
        {"recipe": "full_dist", "out": str(root / "full_straight"), "overrides": TWO_RANKS},
        {"recipe": "full_dist", "out": str(root / "full_chain"), "overrides": TWO_RANKS, "stops": STOPS_TWO_RANKS,
         "stop_ranks": [0, 1]},
        {"recipe": "lora_dist", "out": str(root / "lora_straight"), "overrides": TWO_RANKS},
        {"recipe": "lora_dist", "out": str(root / "lora_chain"), "overrides": TWO_RANKS, "stops": STOPS_TWO_RANKS,
         "stop_ranks": [1, 0]},
        # 1 rank x batch 4 -> 2 ranks x batch 2
        {"recipe": "full_dist", "out": str(root / "to_two"), "resume": True,
         "overrides": ["batch_size=2", "gradient_accumulation_steps=1"]},
        # 2 ranks x accumulation 2, stopped after step 2: resumed on one rank x accumulation 4 by the test
        {"recipe": "full_dist", "out": str(root / "to_one"), "overrides": TWO_RANKS, "stops": [2], "finish": False},
        # the run stopped by a signal from outside, resumed to the end; and its uninterrupted reference
        {"recipe": "full_dist", "out": str(root / "signalled"), "overrides": [*TWO_RANKS, *LONG], "resume": True},
        {"recipe": "full_dist", "out": str(root / "signal_ref"), "overrides": [*TWO_RANKS, *LONG]},
        # a folder this test process holds (tests/integration/test_run_lock.py for one rank)
        {"held": True, "out": str(root / "held")},
    ]
    lock = OutputDirLock(str(root / "held"))
    try:
        proc = _launch(setup_yaml, jobs)
    finally:
        lock.release()
    return root, proc, signalled


def _worker_pid(launcher_pid, local_rank):
    """The pid of torchrun's worker ``local_rank`` (a child of the launcher)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        for task in os.listdir(f"/proc/{launcher_pid}/task"):
            for pid in open(f"/proc/{launcher_pid}/task/{task}/children").read().split():
                try:
                    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                except OSError:
                    continue
                if f"LOCAL_RANK={local_rank}".encode() in environ:
                    return int(pid)
        time.sleep(0.1)
    raise AssertionError("no worker found")


def _tune_run_stopped_by_sigterm(setup_yaml, out, rank):
    """``tune run --nproc_per_node 2``, SIGTERM from outside once 3 steps are logged: to worker ``rank``
    only, or (None) to the launcher, which forwards it to every worker (Ctrl-C, Kubernetes, ``kill``)."""
    config = out.parent / f"{out.name}.yaml"
    OmegaConf.save(resume_jobs.config(setup_yaml, "full_dist", out, *TWO_RANKS, *LONG), config)
    args = ["tune", "run", "--nproc_per_node", "2", "recipes/full_finetune_distributed.py", "--config", str(config)]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=resume_jobs.subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "logs" / "metrics.jsonl"
    target = proc.pid if rank is None else _worker_pid(proc.pid, rank)
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    os.kill(target, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    return {"returncode": proc.returncode, "stderr": stderr, "config": config,
            "steps": [r["step"] for r in resume_jobs.read_jsonl(metrics)],
            "checkpoint": list_checkpoints(str(out))[-1]}


def test_two_ranks_four_resumes_in_a_row_are_exact(two_ranks):
    """The signal reaches one rank only (alternating): both stop after the same step; bit-exact chains."""
    root = two_ranks[0]
    for kind, weights_file in (("full", "model-00001-of-00001.safetensors"), ("lora", "adapter/adapter_model.pt")):
        straight, chained = root / f"{kind}_straight", root / f"{kind}_chain"
        rows = [r["step"] for r in resume_jobs.read_jsonl(chained / "logs" / "metrics.jsonl")]
        assert rows == list(range(1, 13)), kind
        assert_exact(resume_jobs.by_step(chained), resume_jobs.by_step(straight))
        final, got = weights(straight, weights_file), weights(chained, weights_file)
        assert all(torch.equal(got[k], final[k]) for k in final), kind
        assert all(r["dp_world_size"] == 2 for r in resume_jobs.read_jsonl(chained / "logs" / "metrics.jsonl"))


def test_one_rank_batch_4_resumes_on_two_ranks_batch_2(two_ranks):
    root, proc, _ = two_ranks
    got, ref = resume_jobs.by_step(root / "to_two"), resume_jobs.by_step(root / "to_two_ref")
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    assert all("dp_world_size" not in got[s] for s in (1, 2))
    assert all(got[s]["dp_world_size"] == 2 for s in got if s > 2)
    assert_close(got, ref, range(3, 13))
    assert "The global batch changes" not in proc.stderr + proc.stdout  # 1 x 4 x 1 = 2 x 2 x 1
    assert "dp_world_size 1 -> 2" in proc.stderr + proc.stdout


def test_two_ranks_accumulation_2_resume_on_one_rank_accumulation_4(two_ranks, setup_yaml, caplog):
    """... on the single-device recipe: the two kinds of recipe write the same checkpoints."""
    root = two_ranks[0]
    out = root / "to_one"
    cfg = resume_jobs.config(setup_yaml, "full_single", out, "batch_size=1", "gradient_accumulation_steps=4",
                             "resume_from_checkpoint=true")
    with caplog.at_level(logging.INFO):
        assert resume_jobs.run("full_single", cfg) == 0
    changed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Resuming with changed")]
    assert changed == ["Resuming with changed settings, applied from step 3: dp_world_size 2 -> 1, "
                       "gradient_accumulation_steps 2 -> 4"]
    got, ref = resume_jobs.by_step(out), resume_jobs.by_step(root / "full_straight")
    assert sorted(got) == list(range(1, 13))
    assert_close(got, ref, range(3, 13))




def test_two_ranks_real_sigterm_to_one_worker(two_ranks):
    """``tune run --nproc_per_node 2``; SIGTERM from outside to rank 1 only: both ranks stop after the same
    step, rank 0 saves and says how to continue, the job exits 75 without torchrun's report; the resumed
    run is bit-exact."""
    root, _, stopped = two_ranks
    stopped = stopped["rank_1"]
    checkpoint = stopped["checkpoint"]
    step = int(checkpoint.name.split("_")[1])
    assert stopped["steps"] == list(range(1, step + 1)) and step < 48
    assert stopped["returncode"] == EXIT_STOPPED, stopped["stderr"][-3000:]
    assert "Traceback" not in stopped["stderr"] and "ChildFailedError" not in stopped["stderr"]
    assert stopped["stderr"].count(
        f"Stopped on a signal on another rank after optimizer step {step}; checkpoint: {checkpoint}. Continue "
        f"with: tune run --nproc_per_node 2 recipes/full_finetune_distributed.py --config {stopped['config']} "
        "resume_from_checkpoint=true") == 1
    got, ref = resume_jobs.by_step(root / "signalled"), resume_jobs.by_step(root / "signal_ref")
    assert sorted(got) == sorted(ref) == list(range(1, 49))
    for s in ref:
        assert [got[s][f] for f in resume_jobs.FIELDS] == [ref[s][f] for f in resume_jobs.FIELDS], s


def test_two_ranks_real_sigterm_to_the_launcher(two_ranks):
    """SIGTERM to the ``tune`` process (torchrun's agent forwards it to every worker): the job stops after a
    step with a checkpoint, rank 0 says so once, and the launcher exits 75 (not torchrun's traceback)."""
    stopped = two_ranks[2]["launcher"]
    checkpoint = stopped["checkpoint"]
    step = int(checkpoint.name.split("_")[1])
    assert stopped["returncode"] == EXIT_STOPPED, stopped["stderr"][-3000:]
    assert "Traceback" not in stopped["stderr"]
    assert stopped["stderr"].count(f"Stopped on SIGTERM after optimizer step {step}; checkpoint: {checkpoint}.") == 1
    assert stopped["steps"] == list(range(1, step + 1)) and step < 48
    verify_checkpoint(checkpoint)
