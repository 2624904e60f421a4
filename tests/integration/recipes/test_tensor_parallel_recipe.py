"""End to end: the distributed recipe with `tensor_parallel_dim=2` (gloo, CPU).

2 data-parallel x 2 tensor-parallel ranks train the tiny Llama exactly as 4
data-parallel ranks do on the same global batch of 4 samples per optimizer
step (4 ranks x batch 1; 2 ranks x batch 1 x 2 micro-batches), the
sharded checkpoint of the tensor-parallel run resumes on 4 data-parallel
ranks (the other direction: tests/integration/distributed/test_tensor_parallel.py): those
three runs share one torchrun launch of 4 processes. Through `tune run`: two
launchers of 2 processes meeting at a rendezvous on loopback (two "nodes")
train as the 4 data-parallel ranks; SIGTERM to a two-node tensor-parallel job
saves; bad settings stop before the model loads. Each 4-process launch costs
~1 min on 2 cores: the runs are shared by the tests of this module, and there
are few of them.
"""

import os
import signal
import socket
import subprocess
import time

import pytest
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.support import resume_jobs
from tests.support.helpers import REPO_ROOT, read_jsonl, rel_diff, run_tune, tiny_alpaca16_config
from torchtune_ext.checkpoint import list_checkpoints, verify_checkpoint
from torchtune_ext.errors import EXIT_STOPPED

RECIPE = "recipes/full_finetune_distributed.py"
CONFIG = "configs/smollm2/135M_full.yaml"
WEIGHTS = "model-00001-of-00001.safetensors"
TOL = 1e-5
SETTINGS = ["max_steps_per_epoch=4", "save_every_n_steps=2", "lr_scheduler.num_warmup_steps=1", "optimizer.lr=1e-3",
            "clip_grad_norm=1.0", "shuffle=true"]
# the same global batch: batch_size x gradient_accumulation_steps x data-parallel ranks = 4 (of 16 samples)
LAYOUTS = {"dp4": ["tensor_parallel_dim=1", "batch_size=1", "gradient_accumulation_steps=1"],
           # activation checkpointing changes no number: on here, the plan must find the layers inside its wrappers;
           # sharded (DCP) checkpoints: step_2 of each layout resumes on the other across both kinds of checkpoint
           "dp2_tp2": ["tensor_parallel_dim=2", "batch_size=1", "gradient_accumulation_steps=2",
                       "enable_activation_checkpointing=true", "sharded_checkpoints=true"]}


@pytest.fixture(scope="module")
def runs(smollm2_assets, tmp_path_factory):
    """The two layouts straight through 4 steps, and the 2 x 2 run's (sharded) step_2 resumed on 4 DP ranks: one
    torchrun launch of 4 processes (tests/support/resume_worker.py) for the three runs, which were three
    `tune run` launches of ~1 min each. Returns name -> (output folder, the launch's output)."""
    tmp_path = tmp_path_factory.mktemp("tp_recipe")
    jobs = []

    def job(name, *overrides):
        config = tmp_path / f"{name}.yaml"
        OmegaConf.save(tiny_alpaca16_config(CONFIG, {"_component_": "torchtune_ext.model.builders.tiny_llama"},
                                            smollm2_assets, tmp_path, tmp_path / name, *SETTINGS, *overrides), config)
        jobs.append({"recipe": "full_dist", "config": str(config)})

    for name, overrides in LAYOUTS.items():
        job(name, *overrides)
    # DP -> TP: tests/integration/distributed/test_tensor_parallel.py (one launch for all)
    for source, target in (("dp2_tp2", "dp4"),):
        name = f"{source}_then_{target}"
        # as if it had stopped there
        jobs.append({"copy": str(tmp_path / source / "step_2"), "to": str(tmp_path / name / "step_2")})
        job(name, *LAYOUTS[target], "resume_from_checkpoint=true")
    output = resume_jobs.launch(4, jobs)
    return {name: (tmp_path / name, output) for name in [*LAYOUTS, "dp2_tp2_then_dp4"]}


def assert_same_steps(got, expected):
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(got, expected):
        assert a["num_tokens"] == b["num_tokens"], a["step"]
        assert a["lr"] == b["lr"]
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(b[key]), (a["step"], key, a[key], b[key])


def assert_same_weights(got_dir, expected_dir):
    expected = load_file(expected_dir / WEIGHTS)
    got = load_file(got_dir / WEIGHTS)
    assert got.keys() == expected.keys()
    for key, weight in got.items():
        # AdamW moves each weight by about +-lr per step: compare on that scale
        assert rel_diff(weight, expected[key]) <= TOL, key


def test_two_by_two_tensor_parallel_equals_four_data_parallel(runs):
    """Same tokens counted once (num_tokens), same loss and grad norm at every step, same final weights.

    Counting the tokens (and summing the loss) over all 4 ranks instead of the 2 data-parallel ones doubles
    num_tokens and halves the gradient and its norm: this test fails then (checked by that change to
    TrainingRun.dp_group: num_tokens 420 vs 210 at step 1, grad norm 4.43 vs 8.85)."""
    (tp_out, output), (dp_out, _) = runs["dp2_tp2"], runs["dp4"]
    assert "2 data-parallel (FSDP2) x 2 tensor-parallel ranks" in output
    tp_rows, dp_rows = read_jsonl(tp_out / "logs" / "metrics.jsonl"), read_jsonl(dp_out / "logs" / "metrics.jsonl")
    assert [r["step"] for r in dp_rows] == [1, 2, 3, 4]
    assert all(r["dp_world_size"] == 2 and r["tp_world_size"] == 2 for r in tp_rows)
    assert all(r["dp_world_size"] == 4 and "tp_world_size" not in r for r in dp_rows)
    for r in tp_rows:  # 4 devices work on each step's tokens
        assert r["tokens_per_second_per_device"] == pytest.approx(r["tokens_per_second"] / 4)
    assert dp_rows[0]["grad_norm"] > 1.0  # clipping is active: the norm itself must be right
    assert_same_steps(tp_rows, dp_rows)
    assert_same_weights(tp_out / "step_4", dp_out / "step_4")


@pytest.mark.parametrize("name", ["dp2_tp2_then_dp4"])
def test_a_checkpoint_resumes_on_the_other_layout(runs, name):
    """step_2 of one layout, continued on the other: steps 3 and 4 as the uninterrupted run had them.

    The 2 x 2 run's checkpoints are sharded (each rank wrote its DTensor shards with DCP): resumed on 4
    data-parallel ranks they are resharded. (A gathered checkpoint split over the 2-D mesh:
    tests/integration/distributed/test_tensor_parallel.py::test_a_checkpoint_moves_between_tensor_and_data_parallel.)"""
    source = name.split("_then_")[0]
    assert (runs["dp2_tp2"][0] / "step_2" / "dcp").is_dir() and not (runs["dp4"][0] / "step_2" / "dcp").exists()
    got = read_jsonl(runs[name][0] / "logs" / "metrics.jsonl")
    assert [r["step"] for r in got] == [3, 4]
    assert_same_steps(got, read_jsonl(runs[source][0] / "logs" / "metrics.jsonl")[2:])
    assert_same_weights(runs[name][0] / "step_4", runs[source][0] / "step_4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch_nodes(config, nodes=2, nproc_per_node=2, later_nodes_env=None, **popen):
    """``nodes`` launchers of ``nproc_per_node`` processes meeting at one c10d rendezvous on loopback, as on ``nodes``
    machines. ``later_nodes_env``: the first launcher is started alone until it hosts the rendezvous store (it
    listens on the port), then the others, with these variables added."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), WANDB_SILENT="true")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    port = free_port()
    cmd = ["tune", "run", "--nnodes", str(nodes), "--nproc_per_node", str(nproc_per_node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "tp_test", RECIPE, "--config", str(config)]
    # the first launcher to bind the port hosts the rendezvous store; the others join it as clients
    launched = []
    for node in range(nodes):
        if node == 1 and later_nodes_env is not None:
            deadline = time.time() + 300
            while not listening(port):
                assert launched[0].poll() is None and time.time() < deadline
                time.sleep(0.2)
        node_env = dict(env, **later_nodes_env) if node and later_nodes_env is not None else env
        launched.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=node_env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, **popen))
    return launched


def listening(port: int) -> bool:
    """Whether a process of this machine listens on TCP ``port`` (Linux's socket tables; no connection is made)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


# What torch's TCP store prints for a failed request: a C++ stack dump of 16 lines or more.
STACK_DUMP = ("Exception raised from", "frame #")


def save_config(assets, tmp_path, name, *overrides):
    out, config = tmp_path / name, tmp_path / f"{name}.yaml"
    OmegaConf.save(tiny_alpaca16_config(CONFIG, {"_component_": "torchtune_ext.model.builders.tiny_llama"}, assets,
                                        tmp_path, out, *overrides), config)
    return out, config


def test_two_nodes_on_loopback_equal_one_node(runs, smollm2_assets, tmp_path):
    """Two `tune run --nnodes 2 --nproc_per_node 2` launchers meeting at a c10d rendezvous (as on two machines,
    here both on localhost) train as one 4-process launch: same steps, same weights.

    Both exit 0 without a C++ stack dump: the node that does not host the rendezvous store closes the
    rendezvous 3 s late here (tests/support/slow_rendezvous_close), as a loaded machine may; the host used to be
    gone by then, and torch's store printed a dump for each request that met the closed connection."""
    out, config = save_config(smollm2_assets, tmp_path, "two_nodes", *SETTINGS, *LAYOUTS["dp4"])
    slow = {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests' / 'support' / 'slow_rendezvous_close'}",
            "SLOW_RENDEZVOUS_CLOSE_S": "3"}
    nodes = launch_nodes(config, later_nodes_env=slow)
    outputs = [node.communicate(timeout=900) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-4000:]
        assert not any(mark in stderr for mark in STACK_DUMP), stderr[-4000:]
    rows = read_jsonl(out / "logs" / "metrics.jsonl")  # one writer: global rank 0, on whichever launcher
    assert all(r["dp_world_size"] == 4 for r in rows)
    assert_same_steps(rows, read_jsonl(runs["dp4"][0] / "logs" / "metrics.jsonl"))
    assert_same_weights(out / "step_4", runs["dp4"][0] / "step_4")


def test_sigterm_to_every_process_of_a_two_node_tensor_parallel_job_saves(smollm2_assets, tmp_path):
    """As SLURM preempts: SIGTERM to every process of both "nodes" (launchers and workers) of a tensor-parallel
    job (one process per node here, its tensor-parallel group spanning both, to keep it short). The ranks stop
    after the same step, rank 0 saves a complete checkpoint, and both launchers exit 75."""
    out, config = save_config(smollm2_assets, tmp_path, "preempted", *SETTINGS, "tensor_parallel_dim=2", "batch_size=1",
                              "gradient_accumulation_steps=2", "sharded_checkpoints=true", "epochs=40",
                              "save_every_n_steps=1000")
    # a process group per node, as srun's tasks
    nodes = launch_nodes(config, nproc_per_node=1, start_new_session=True)
    metrics = out / "logs" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert all(node.poll() is None for node in nodes) and time.time() < deadline
        time.sleep(0.1)
    for node in nodes:
        os.killpg(node.pid, signal.SIGTERM)
    outputs = [node.communicate(timeout=300) for node in nodes]
    stderr = "".join(err for _, err in outputs)
    assert [node.returncode for node in nodes] == [EXIT_STOPPED, EXIT_STOPPED], stderr[-4000:]
    assert "Traceback" not in stderr and "Stopped on SIGTERM after optimizer step" in stderr, stderr[-4000:]
    # the command to paste on every node: the launchers' own flags, no placeholder (issue 40 item 11)
    assert ("Continue on every node with: tune run --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint "
            "localhost:") in stderr and "resume_from_checkpoint=true  (exit status 75)" in stderr, stderr[-4000:]
    assert "<your torchrun flags" not in stderr
    (saved,) = list_checkpoints(str(out))
    verify_checkpoint(saved)
    assert saved.name == f"step_{read_jsonl(metrics)[-1]['step']}"  # the last step logged is the one saved


def test_bad_tensor_parallel_settings_stop_before_the_model_loads(smollm2_assets, tmp_path):
    """Under torchrun, one line, exit 2, nothing written. The checks themselves, in one process: the ranks
    (tests/unit/config/test_upstream_keys.py), the head counts and a model without a plan
    (tests/unit/parallel/test_tensor_parallel.py)."""
    launcher, overrides = ["--nproc_per_node", "2"], ["tensor_parallel_dim=2", "model.num_kv_heads=1"]
    words = "config key 'tensor_parallel_dim': 2 does not divide the model's num_kv_heads=1"
    out = tmp_path / "run"
    config = tmp_path / "bad.yaml"
    tiny = {"_component_": "torchtune_ext.model.builders.tiny_llama"}
    OmegaConf.save(tiny_alpaca16_config(CONFIG, tiny, smollm2_assets, tmp_path, out, *overrides), config)
    proc = run_tune(*launcher, RECIPE, "--config", str(config), timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()
