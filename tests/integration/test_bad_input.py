"""Bad input through the command line (``tune run``, a process of its own): one line, the right exit status.

The checks themselves, in this process: tests/unit/run/test_bad_input.py.
"""

from pathlib import Path

import pytest


def test_the_error_line_comes_after_the_wandb_summary_and_the_run_is_marked_failed(tmp_path):
    """A W&B run active at an expected error or a stop is finished first, with the recipe's exit status: its summary
    is printed before the error line, not after it by W&B's exit hook, and W&B records the run as failed."""
    import glob
    import subprocess
    import sys

    from wandb.proto import wandb_internal_pb2 as pb

    from tests.support.helpers import REPO_ROOT
    from tests.support.wandb_reader import _records

    ends = {  # an expected error (74), and a stop on a signal (75: the recipe then closes its logger)
        74: "report_and_exit('error: the line to read last', 74)\n",
        75: ("import torch\nfrom torchtune_ext.run.control.preemption import GracefulStop\n"
             "sys.exit(GracefulStop(torch.device('cpu')).stop(sys.argv[1], 5))\n"),
    }
    for status, end in ends.items():
        folder = tmp_path / str(status)
        script = ("import sys, wandb\n"
                  "from torchtune_ext.run.control.exits import report_and_exit\n"
                  "wandb.init(mode='offline', dir=sys.argv[1], project='p')\n"
                  "wandb.log({'loss': 1.0})\n" + end)
        proc = subprocess.run([sys.executable, "-c", script, str(folder)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        last = "error: the line to read last" if status == 74 else "Stopped on a signal on another rank after "
        assert proc.returncode == status and lines[-1].startswith(last), proc.stdout
        assert any("Run summary" in line for line in lines[:-1])
        (run_file,) = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
        exits = []
        for chunk in _records(Path(run_file).read_bytes()):
            record = pb.Record()
            record.ParseFromString(chunk)
            if record.WhichOneof("record_type") == "exit":
                exits.append(record.exit.exit_code)
        assert exits == [status]


@pytest.mark.parametrize("recipe,words", [
    ("recipes/full_finetune_single_devic.py", ["is neither one of torchtune's nor a file; the recipes here: ",
                                               "recipes/full_finetune_single_device.py"]),
    ("ABS", ["tune run imports a recipe file by its path relative to the working directory",
             "as recipes/full_finetune_single_device.py"]),
    # tune run drops the "extension" .full_finetune_single_device and would run the package recipes
    ("recipes.full_finetune_single_device", ["is neither one of torchtune's nor a file (tune run takes a file "
                                             "path; what follows the last '.' is read as its extension); the "
                                             "recipes here: ", "recipes/full_finetune_single_device.py"]),
], ids=["misspelled", "absolute", "dotted"])
def test_a_recipe_path_tune_run_cannot_import_is_a_command_line_error(recipe, words):
    """tune run makes a module name of the path: without the check, a misspelled or absolute path is an
    ImportError traceback with exit status 1."""
    import subprocess

    from tests.support.helpers import REPO_ROOT

    if recipe == "ABS":
        recipe = str(REPO_ROOT / "recipes" / "full_finetune_single_device.py")
    proc = subprocess.run(["tune", "run", recipe, "--config", "configs/smollm2/135M_full_single_device.yaml"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"tune run: error: recipe '{recipe}'" in proc.stderr
    for word in words:
        assert word in proc.stderr


def test_config_flag_without_a_file_is_a_command_line_error():
    """tune run reads the word after --config: without one it failed with an IndexError traceback, exit status 1."""
    from tests.support.helpers import run_tune

    for flag in ("--config", "--config="):
        proc = run_tune("recipes/full_finetune_single_device.py", flag, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == ("tune run: error: --config needs a file: --config FILE (a "
                                                        "path or the name of a torchtune config)")


def test_a_recipe_path_starting_with_dot_slash_runs(tmp_path):
    """tune run made the module name '.recipes.full_finetune_single_device' of './recipes/...py': an ImportError
    (relative module name) traceback. An output_dir under a file makes the recipe itself stop at once: its one
    line shows it ran."""
    from tests.support.helpers import run_tune

    (tmp_path / "afile").write_text("")
    proc = run_tune("./recipes/full_finetune_single_device.py", "--config",
                    "configs/smollm2/135M_full_single_device.yaml", f"output_dir={tmp_path / 'afile' / 'out'}",
                    timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: config key 'output_dir': "), proc.stderr


def test_torchtune_recipe_by_name_runs_upstreams_after_a_note_naming_ours(tmp_path):
    """A torchtune user's habit, ``tune run full_finetune_single_device``, runs torchtune's recipe, which knows
    none of this repository's config keys: it still runs (upstream recipes by name keep working), after a note.
    A missing config makes upstream's run end at once (its own FileNotFoundError), so the test costs no training."""
    import subprocess

    from tests.support.helpers import REPO_ROOT

    proc = subprocess.run(["tune", "run", "full_finetune_single_device", "--config", str(tmp_path / "none.yaml")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert ("note: 'full_finetune_single_device' runs torchtune's own recipe; this repository's (exact gradient "
            "accumulation, which configs/ are written for) is 'tune run recipes/full_finetune_single_device.py'"
            in proc.stderr), proc.stderr
    assert "site-packages/recipes/full_finetune_single_device.py" in proc.stderr  # torchtune's recipe ran (and failed)
    elsewhere = subprocess.run(["tune", "run", "full_finetune_single_device", "--config", str(tmp_path / "none.yaml")],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "note:" not in elsewhere.stderr  # no recipes/ of ours here: nothing to point at


def test_config_given_with_an_equals_sign_is_accepted_by_tune_run(tmp_path):
    """argparse's --config=FILE form: torchtune's tune run looks for a separate '--config' and says it is missing.
    A missing file shows the name reached the recipe's own check (one line, exit 2), also a packaged name."""
    import subprocess

    from tests.support.helpers import REPO_ROOT

    for config, words in ((str(tmp_path / "none.yaml"), f"'{tmp_path / 'none.yaml'}' does not exist"),
                          ("qwen2_5/0.5B_lora_single_device", "config key 'checkpointer.checkpoint_dir'")):
        proc = subprocess.run(["tune", "run", "recipes/lora_finetune_single_device.py", f"--config={config}"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "argument is required" not in proc.stderr, proc.stderr
        assert words in proc.stderr, proc.stderr


def test_wandb_that_cannot_start_under_torchrun_stops_every_rank_with_one_line(tmp_path):
    """Only rank 0 starts W&B: when it cannot (mode=online, no API key, no terminal), the other ranks must not go on
    into training and fail in a collective (a traceback per rank): exit 2, rank 0's line last, nothing left."""
    import subprocess

    from omegaconf import OmegaConf

    from tests.support import resume_jobs
    from tests.support.helpers import REPO_ROOT

    out = tmp_path / "out"
    cfg = resume_jobs.config(resume_jobs.setup(tmp_path), "full_dist", out)
    cfg.metric_logger = {"_component_": "torchtune.training.metric_logging.WandBLogger", "mode": "online",
                         "log_dir": str(out / "logs")}
    OmegaConf.save(cfg, tmp_path / "dist.yaml")
    home = tmp_path / "home"  # no ~/.netrc, no W&B settings: no credentials to find
    env = {k: v for k, v in resume_jobs.subprocess_env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / ".config" / "wandb"), WANDB_SILENT="true")
    proc = subprocess.run(["tune", "run", "--nproc_per_node", "2", "recipes/full_finetune_distributed.py", "--config",
                           str(tmp_path / "dist.yaml")], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: config key 'metric_logger': W&B could not start")
    assert not out.exists()


def test_wandb_server_that_cannot_be_reached_leaves_the_error_line_last(tmp_path):
    """An API key but no server (no network, a wrong base_url): W&B's service printed 'Find logs at: <folder>' at
    exit, after the error line, naming a folder the rollback removed. It is ended before the line now."""
    import subprocess

    from omegaconf import OmegaConf

    from tests.support import resume_jobs
    from tests.support.helpers import REPO_ROOT

    out = tmp_path / "out"
    cfg = resume_jobs.config(resume_jobs.setup(tmp_path), "full_single", out)
    cfg.metric_logger = {"_component_": "torchtune.training.metric_logging.WandBLogger", "mode": "online",
                         "log_dir": str(out / "logs")}
    OmegaConf.save(cfg, tmp_path / "online.yaml")
    env = {k: v for k, v in resume_jobs.subprocess_env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_API_KEY="0" * 40,
               WANDB_BASE_URL="http://127.0.0.1:9",  # the discard port: connection refused at once
               WANDB_INIT_TIMEOUT="3")
    proc = subprocess.run(["tune", "run", "recipes/full_finetune_single_device.py", "--config",
                           str(tmp_path / "online.yaml")], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    # one stream, as a terminal or a job log shows them: W&B's lines went to stdout
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("error: config key 'metric_logger': W&B could not start")
    assert not out.exists()


def test_a_misspelt_override_ends_tune_run_with_one_line_before_anything_loads(tiny_run, tmp_path):
    """The issue's command: exit 2, one line, nothing written (the output folder is not even created)."""
    from tests.support.helpers import run_tune

    config = tiny_run()
    out = tmp_path / "typo_out"
    proc = run_tune("recipes/full_finetune_single_device.py", "--config", str(config), f"output_dir={out}",
                    "optimzer.lr=1e-4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: config key 'optimzer.lr': typed on the command line, but this recipe has no key 'optimzer', so "
        "the value would be ignored. Did you mean 'optimizer'?"]
    assert not out.exists()


def test_a_bad_log_model_ends_tune_run_with_one_line_before_anything_loads(tiny_run, tmp_path):
    """metric_logger.log_model takes false, end or checkpoint: anything else is exit 2, one line naming the key
    and the values, and the output folder is not even created."""
    from tests.support.helpers import run_tune

    out = tmp_path / "log_model_out"
    proc = run_tune("recipes/full_finetune_single_device.py", "--config", str(tiny_run()), f"output_dir={out}",
                    "metric_logger._component_=torchtune.training.metric_logging.WandBLogger",
                    "metric_logger.mode=offline", "metric_logger.log_model=best")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]  # after the tiny config's note that it does not validate
    assert "Traceback" not in proc.stderr
    assert line.startswith("error: config key 'metric_logger.log_model': expected one of false, end, checkpoint")
    assert line.endswith("got 'best'") and not out.exists()
