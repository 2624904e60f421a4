"""Recipe runs stopped by a real SIGTERM after chosen steps, in process: resume chains and elastic resume.

Used by tests/integration/recipes/test_resume_chain.py in the pytest process (one rank) and by
tests/support/resume_worker.py under torchrun (two ranks). The model, tokenizer and
data are tests/support/tiny_setup.py's (byte-level tokenizer, 2-layer Llama of width
32): a step takes milliseconds, so a chain of eleven runs costs seconds.

A run is stopped the way a scheduler stops it: after optimizer step ``k`` has
been logged, the process sends itself SIGTERM (on one rank only, under
torchrun), and the recipe's own handler finishes the step, saves and returns
the "stopped" exit status.

Runs use one CPU thread (``torch.set_num_threads(1)`` here; ``OMP_NUM_THREADS=1``
for subprocesses, which torchrun sets by itself): on a shared 2-core machine
a model this small runs several times faster on one thread, and results
compared bit for bit must come from the same thread count.
"""

import os
import signal
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from omegaconf import OmegaConf

from tests.support.dpo_tiny import RUNS as DPO_RUNS
from tests.support.helpers import read_jsonl, recipe_class
from tests.support.tiny_setup import DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, MAX_SEQ_LEN, write_tiny_setup
from torchtune_ext.config import DISTILLATION_KEYS, DISTRIBUTED_KEYS, LORA_KEYS, validate

RECIPES = {
    # name: (recipe file, class, extra schema keys)
    "full_single": ("recipes/full_finetune_single_device.py", "FullFinetuneRecipeSingleDevice", None),
    "lora_single": ("recipes/lora_finetune_single_device.py", "LoRAFinetuneRecipeSingleDevice", LORA_KEYS),
    "full_dist": ("recipes/full_finetune_distributed.py", "FullFinetuneRecipeDistributed", DISTRIBUTED_KEYS),
    "lora_dist": ("recipes/lora_finetune_distributed.py", "LoRAFinetuneRecipeDistributed",
                  {**LORA_KEYS, **DISTRIBUTED_KEYS}),
    # preference tuning (tests/support/dpo_tiny.py)
    **{f"dpo_{kind}": (file, cls, keys) for kind, (file, cls, _, _, keys) in DPO_RUNS.items()},
    # a LoRA student (tests/integration/recipes/test_distillation.py)
    "kd_lora_dist": ("recipes/knowledge_distillation_distributed.py", "KDRecipeDistributed",
                     {**DISTILLATION_KEYS, **LORA_KEYS, **DISTRIBUTED_KEYS}),
}
# 16 samples, batch 2 x 2 accumulation: 4 steps per epoch; 3 epochs; cosine LR with warmup; no periodic saves
SETTINGS = ["epochs=3", "batch_size=2", "gradient_accumulation_steps=2", "log_every_n_steps=1",
            "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "lr_scheduler.num_warmup_steps=2", "optimizer.lr=0.01", "keep_last_n_checkpoints=null"]
FIELDS = ("loss", "grad_norm", "lr", "num_tokens")
_classes: Dict[str, type] = {}


def setup(root: Path) -> Path:
    """The tiny model, tokenizer and 16-sample dataset under ``root`` (written once); returns the YAML."""
    config = root / "tiny.yaml"
    if not config.exists():
        write_tiny_setup(root, num_samples=16, metric_logger=False)
    return config


def lora_model(vocab_size: int) -> Dict:
    return {"_component_": "torchtune.models.llama3_2.lora_llama3_2", "lora_attn_modules": ["q_proj", "v_proj"],
            "apply_lora_to_mlp": True, "apply_lora_to_output": False, "lora_rank": 4, "lora_alpha": 8,
            "lora_dropout": 0.1, "vocab_size": vocab_size, "num_layers": LAYERS, "num_heads": HEADS,
            "num_kv_heads": KV_HEADS, "embed_dim": DIM, "max_seq_len": MAX_SEQ_LEN, "intermediate_dim": HIDDEN}


def config(setup_yaml: Path, recipe: str, output_dir: Path, *overrides: str):
    """The validated config of ``recipe`` on the tiny setup, with :data:`SETTINGS` and ``overrides``."""
    cfg = OmegaConf.load(setup_yaml)
    if recipe.startswith("lora"):
        cfg.model = lora_model(cfg.model.vocab_size)
        cfg.save_adapter_weights_only = True
    cfg.output_dir = str(output_dir)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([*SETTINGS, *overrides]))
    return validate(cfg, extra_keys=RECIPES[recipe][2])


def run(recipe: str, cfg, stop_after: Optional[int] = None, stop_rank: int = 0) -> int:
    """setup, train, cleanup; with ``stop_after``, SIGTERM on rank ``stop_rank`` once that step is logged.

    Returns what ``train()`` returns: 0, or the stopped exit status.
    """
    if recipe not in _classes:
        _classes[recipe] = recipe_class(*RECIPES[recipe][:2])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(_classes[recipe], cfg, stop_after, stop_rank)
    finally:
        torch.set_num_threads(threads)


def _run(recipe_cls, cfg, stop_after: Optional[int], stop_rank: int) -> int:
    rec = recipe_cls(cfg)
    rec.setup()
    if stop_after is not None:
        rank = int(os.environ.get("RANK", "0"))
        log = rec.run.metric_logger.log

        def log_then_signal(record):
            log(record)
            if record["step"] == stop_after and rank == stop_rank:
                os.kill(os.getpid(), signal.SIGTERM)

        rec.run.metric_logger.log = log_then_signal  # every rank calls it; only rank 0 writes
    status = rec.train()
    rec.cleanup()
    return status


def chain(recipe: str, setup_yaml: Path, output_dir: Path, stops: Sequence[int], *overrides: str,
          stop_ranks: Sequence[int] = (0,), finish: bool = True) -> list:
    """A fresh run stopped after ``stops[0]``, then one resume per further stop, then (``finish``) a resume to the end.

    The resumed runs' own checkpoints are what the next one resumes from.
    ``stop_ranks`` cycles over which rank receives the signal. Returns the exit statuses.
    """
    statuses = []
    for i, stop in enumerate([*stops, None] if finish else stops):
        resume = ["resume_from_checkpoint=true"] if i else []
        cfg = config(setup_yaml, recipe, output_dir, *overrides, *resume)
        statuses.append(run(recipe, cfg, stop_after=stop, stop_rank=stop_ranks[i % len(stop_ranks)]))
    return statuses


def launch(nproc: int, jobs: Sequence[dict], setup_yaml: Optional[Path] = None, timeout: int = 900) -> str:
    """Run ``jobs`` in one torchrun launch of ``nproc`` ranks (tests/support/resume_worker.py, whose docstring
    says what a job is); returns the launch's output (stdout, then stderr). ``setup_yaml``: the tiny setup the
    jobs without a ``config`` of their own run on."""
    import json

    from tests.support.helpers import run_worker

    proc = run_worker(nproc, "resume_worker", str(setup_yaml or "-"), json.dumps(list(jobs)), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def subprocess_env() -> Dict[str, str]:
    """Environment for ``tune run`` subprocesses: this checkout first, one thread (see the module docstring)."""
    from tests.support.helpers import REPO_ROOT

    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), WANDB_SILENT="true", OMP_NUM_THREADS="1")


def by_step(output_dir: Path) -> Dict[int, dict]:
    """The last metrics record of each step (a resumed run logs the steps after its checkpoint again)."""
    return {r["step"]: r for r in read_jsonl(output_dir / "logs" / "metrics.jsonl")}
