"""Fixtures and settings of both trees: tests/unit/ and tests/integration/.

The shared helpers are the package ``tests.support``: pytest imports the test
modules as ``tests.unit...`` and ``tests.integration...`` from the repository
root, so ``from tests.support.helpers import ...`` works in a test, and in a
process a test starts from the repository root with the root on PYTHONPATH.
"""

import os
from pathlib import Path

import pytest


def _share_the_cores() -> None:
    """Give each pytest-xdist worker, and every recipe process it starts, its share of the cores.

    By default each worker's torch, and each ``tune run`` it starts, takes one
    OpenMP thread per core: with two workers on two cores, four threads wait
    on each other's barriers (two concurrent real-model runs took 58 s with
    two threads each, 34 s with one). Subprocesses inherit the variable.
    A value set by the caller is kept.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores()

# torch.compile (test_compile_matches_eager) compiles in this process instead of
# starting inductor's pool of compile workers: the pool's start-up was most of
# that test's time (45 s alone, 100 s next to another worker; 10 s without it).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_configure(config):
    # In the processes that run tests: xdist workers, or the only process with -n 0 (not xdist's controller).
    if hasattr(config, "workerinput") or str(config.getoption("numprocesses", None) or 0) == "0":
        from tests.support.helpers import freeze_import_time_objects

        freeze_import_time_objects()


REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_assets() -> Path:
    """The repository's ``assets/`` folder; skips the test if the download has not been run."""
    from torchtune_ext.data.assets import (
        ALPACA_RELPATH,
        SHAKESPEARE_RELPATH,
        SMOLLM2_DIRNAME,
        MissingAssetError,
        require_assets,
    )

    root = REPO_ROOT / "assets"
    try:
        # The download command renames each asset into place only when complete.
        require_assets([root / SMOLLM2_DIRNAME, root / ALPACA_RELPATH, root / SHAKESPEARE_RELPATH])
    except MissingAssetError as err:
        first_missing = str(err).splitlines()[1].strip()
        pytest.skip(f"{first_missing} is missing; run `python -m torchtune_ext.download` in {REPO_ROOT}")
    return root


@pytest.fixture
def tiny_run(tmp_path, smollm2_assets):
    """Factory: ``tiny_run(**overrides)`` writes a tiny model/data/config, returns the config path."""
    from tests.support.tiny_run import make_tiny_run

    return lambda name="tiny", **overrides: make_tiny_run(tmp_path / name, smollm2_assets, **overrides)


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A recipe run in process installs SIGTERM/SIGINT handlers and removes them in cleanup; one whose
    setup fails (the command line would exit) leaves them: put the test process's own back."""
    import signal

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture(scope="session")
def family_assets(tmp_path_factory):
    """Factory: ``family_assets(name)`` -> (folder, torchtune-named weights, data file) of a tiny model of
    that family in its HF layout with its tokenizer (tests/support/families.py), written once per session."""
    from tests.support.families import write_family
    from tests.support.tiny_setup import write_dataset

    root = tmp_path_factory.mktemp("families")
    write_dataset(root / "data.json", 16)
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = (root / name, write_family(name, root / name), root / "data.json")
        return cache[name]

    return get


@pytest.fixture
def cfg(tmp_path):
    """The smallest valid recipe config: tiny model, files that exist (their content is not read beyond
    the safetensors header).

    Not validated yet; ``validate(cfg)`` fills in the defaults.
    """
    import torch
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"unused": torch.zeros(1)}, str(ckpt / "model.safetensors"))  # whole: the start-up checks read headers
    data = tmp_path / "data.json"
    data.write_text("[]")
    return OmegaConf.create({
        "output_dir": str(tmp_path / "out"),
        "model": {"_component_": "torchtune_ext.model.builders.tiny_llama"},
        "tokenizer": {"_component_": "torchtune_ext.data.tokenizer.smollm2_tokenizer", "path": str(ckpt)},
        "dataset": {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json", "data_files": str(data)},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": str(ckpt),
                         "checkpoint_files": ["model.safetensors"]},
        "optimizer": {"_component_": "torch.optim.AdamW"},
    })
