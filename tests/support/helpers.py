"""Shared test utilities: tiny models, synthetic samples, collation."""

import copy
import errno
import gc
import json
import os
from typing import Dict, List, Sequence

import torch
from torchtune.data import padded_collate_sft
from torchtune.models.llama3_2 import llama3_2

from torchtune_ext.train.loss import SummedCrossEntropyLoss

IGNORE = -100
VOCAB = 128


def tiny_model(seed: int = 0, vocab_size: int = VOCAB, embedding_std=None) -> torch.nn.Module:
    """A 2-layer random llama3_2 decoder (fp32, CPU) for exactness tests.

    ``embedding_std``: redraw the tied embedding with this std; torchtune's 1.0
    makes nearly every prediction certain (entropy ~0), 0.3 leaves a few nats.
    """
    torch.manual_seed(seed)
    model = llama3_2(
        vocab_size=vocab_size, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        max_seq_len=128, intermediate_dim=64, rope_base=10_000, scale_factor=1,
    )
    if embedding_std is not None:
        with torch.no_grad():
            model.tok_embeddings.weight.normal_(std=embedding_std)
    return model


def tiny_lora_model(seed: int = 0, vocab_size: int = VOCAB, lora_b_std: float = 0.03) -> torch.nn.Module:
    """:func:`tiny_model` with LoRA (rank 4, alpha 8) on every attention and MLP projection.

    Only the adapters are trainable. ``lora_b`` is drawn from N(0, lora_b_std^2)
    instead of zeros: with B = 0 the gradient of A is zero, so a test comparing
    gradients would check only half the adapter.
    """
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from torchtune_ext.model.builders import lora_tiny_llama

    torch.manual_seed(seed)
    model = lora_tiny_llama(
        ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8,
        vocab_size=vocab_size, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        intermediate_dim=64, max_seq_len=128,
    )
    adapter = get_adapter_params(model)
    set_trainable_params(model, adapter)
    with torch.no_grad():
        for name, param in adapter.items():
            if "lora_b" in name:
                param.normal_(std=lora_b_std)
    return model


def text_samples(lengths: Sequence[int], seed: int = 0) -> List[Dict[str, List[int]]]:
    """Text-completion samples: every label trainable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append({"tokens": tokens, "labels": list(tokens)})
    return out


def instruct_samples(prompt_lengths: Sequence[int], answer_lengths: Sequence[int], seed: int = 1):
    """Instruct samples: prompt labels masked with IGNORE, answer trainable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, a in zip(prompt_lengths, answer_lengths):
        tokens = torch.randint(3, VOCAB, (p + a,), generator=g).tolist()
        out.append({"tokens": tokens, "labels": [IGNORE] * p + tokens[p:]})
    return out


def collate(samples, pad_to: int = 0):
    """torchtune's SFT collator, optionally right-padded to ``pad_to`` columns."""
    batch = padded_collate_sft(samples, padding_idx=0, ignore_idx=IGNORE)
    extra = pad_to - batch["tokens"].size(1)
    if extra > 0:
        batch["tokens"] = torch.nn.functional.pad(batch["tokens"], (0, extra), value=0)
        batch["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=IGNORE)
    return batch


def windows(samples, batch_size: int, grad_accum: int, pad_to: int = 0):
    """Split samples in order into optimizer-step windows of micro-batches."""
    micro = [collate(samples[i:i + batch_size], pad_to) for i in range(0, len(samples), batch_size)]
    return [micro[i:i + grad_accum] for i in range(0, len(micro), grad_accum)]


def clone(model):
    return copy.deepcopy(model)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


class RecordingLoss(SummedCrossEntropyLoss):
    """Our loss, recording per micro-batch whether its graph waits for a later backward.

    ``recomputed`` holds each forward call's ``recompute_output``: True where
    backward runs once per optimizer step, False per micro-batch.
    """

    def __init__(self):
        super().__init__("auto", IGNORE)
        self.recomputed = []

    def forward(self, outputs, shifted_labels, recompute_output=False):
        self.recomputed.append(recompute_output)
        return super().forward(outputs, shifted_labels, recompute_output)


def copy_smollm2_tokenizer(assets, folder) -> None:
    """Put the bundled SmolLM2 tokenizer (tokenizer.json, tokenizer_config.json with its chat template) and
    generation config into ``folder``, as a downloaded model folder has them (``assets``: the assets root)."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(assets / "SmolLM2-135M-Instruct" / name, folder / name)


REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def run_worker(world_size: int, worker: str, *args: str, timeout: int = 600):
    """Run the module ``tests.support.<worker>`` with ``args`` as ``world_size`` ranks; return the CompletedProcess.

    One rank runs as a plain process (a group of one, as without torchrun);
    more under ``torch.distributed.run --standalone``. Either way the worker runs
    as a module (``-m``) from the repository root, with the root on PYTHONPATH, so
    that it imports ``tests.support`` as the tests do. Rank variables of the
    calling environment are dropped so that a test never joins another group.
    """
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + ["-m", f"tests.support.{worker}", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_tune(*args: str, timeout: int = 600, extra_env=None):
    """Run ``tune run ...`` from the repository root, as a user types it.

    PYTHONPATH points at this checkout so a worktree tests its own code.
    Returns the CompletedProcess (text output, not raising on failure).
    """
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), WANDB_SILENT="true")
    env.update(extra_env or {})
    return subprocess.run(
        ["tune", "run", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def read_jsonl(path):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def synthetic_sft_dataset(tokenizer=None, num_samples: int = 12, seed: int = 3, packed: bool = False,
                          max_seq_len: int = 64):
    """A list dataset of instruct samples with varied prompt and answer lengths.

    Usable as a config ``_component_`` (``helpers.synthetic_sft_dataset``):
    torchtune passes the tokenizer first, which is not needed here. With
    ``packed`` the samples, in order, are packed by torchtune's ``PackedDataset``
    into rows of ``max_seq_len`` tokens.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 12, (num_samples,), generator=g).tolist()
    answers = torch.randint(1, 20, (num_samples,), generator=g).tolist()
    samples = instruct_samples(prompts, answers, seed=seed)
    if packed:
        from torchtune.datasets import PackedDataset

        return PackedDataset(samples, max_seq_len=max_seq_len, padding_idx=0)
    return samples


def synthetic_val_dataset(tokenizer=None, num_samples: int = 10, seed: int = 4, packed: bool = False,
                          max_seq_len: int = 64, all_masked: bool = False):
    """Validation data for the exactness tests: :func:`synthetic_sft_dataset`'s instruct
    samples (masked prompts, lengths 1 to 30, so batches are padded), a sample whose
    labels are all masked, a one-token sample (nothing to predict after the shift) and
    a run of one repeated token (predictable, so token accuracy is not near 0): 13
    samples, so batches of 3 or 8 leave a partial last batch.

    Usable as a config ``_component_`` (``helpers.synthetic_val_dataset``). With
    ``packed``, the samples in order are packed into rows of ``max_seq_len`` tokens;
    with ``all_masked``, every label of every sample is masked.
    """
    samples = synthetic_sft_dataset(num_samples=num_samples, seed=seed)
    samples.insert(3, {"tokens": [5, 6, 7, 8], "labels": [IGNORE] * 4})
    samples.insert(7, {"tokens": [9], "labels": [9]})
    samples.insert(10, {"tokens": [40, 41, 42] + [17] * 10, "labels": [IGNORE] * 3 + [17] * 10})
    if all_masked:
        samples = [{"tokens": s["tokens"], "labels": [IGNORE] * len(s["labels"])} for s in samples]
    if packed:
        from torchtune.datasets import PackedDataset

        return PackedDataset(samples, max_seq_len=max_seq_len, padding_idx=0)
    return samples


class ConstantLossModel(torch.nn.Module):
    """Each token id yields logits whose CE against label 0 is a chosen constant.

    With a vocabulary of two, CE(label 0) = log(1 + exp(-z)) where z is the
    logit gap; solving gives z = -log(exp(c) - 1). The prediction is label 0
    (argmax correct) exactly when c < log 2.
    """

    def __init__(self, per_token_loss):
        super().__init__()
        import math

        rows = [[-math.log(math.expm1(c)), 0.0] for c in per_token_loss]
        self.table = torch.nn.Parameter(torch.tensor(rows, dtype=torch.float64))

    def forward(self, tokens, **_):
        return self.table[tokens].float()


def constant_loss_sample(token_id, n_trainable):
    """A sample of ``token_id`` with ``n_trainable`` next-token predictions, all of label 0."""
    return {"tokens": [token_id] * (n_trainable + 1), "labels": [0] * (n_trainable + 1)}


def write_tiny_hf_checkpoint(path, seed: int = 0, embedding_std=None) -> Dict[str, torch.Tensor]:
    """Save a random ``torchtune_ext.model.builders.tiny_llama()`` as an HF checkpoint folder.

    The folder holds ``model.safetensors`` (HF key names, as
    ``FullModelHFCheckpointer(model_type="LLAMA3_2")`` reads them) and a
    ``config.json`` with the head counts the conversion needs. Its vocabulary
    is SmolLM2's, so the real tokenizer and data work with it. ``embedding_std``:
    redraw the tied embedding with this std (torchtune's 1.0 starts the loss near
    60 nats with near-certain predictions; 0.02 starts near ln(vocab) = 10.8).

    Returns:
        the model's state dict in torchtune key names (what loading gives back).
    """
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from torchtune.models import convert_weights

    from torchtune_ext.model.builders import tiny_llama

    torch.manual_seed(seed)
    model = tiny_llama()  # 4 heads, 2 kv heads, width 64
    if embedding_std is not None:
        torch.nn.init.normal_(model.tok_embeddings.weight, std=embedding_std)
    state = model.state_dict()
    hf = convert_weights.tune_to_hf(state, num_heads=4, num_kv_heads=2, dim=64, head_dim=16)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "head_dim": 16,
         "tie_word_embeddings": True}))
    return {k: v.clone() for k, v in state.items()}


def recipe_class(relpath: str, name: str):
    """Class ``name`` of the recipe file ``relpath`` (e.g. ``recipes/x.py``), imported by path."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(Path(relpath).stem, REPO_ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def tiny_recipe_config(config: str, model: Dict, assets, checkpoint_dir, output_dir, *overrides: str):
    """One of the shipped Alpaca configs, on a tiny checkpoint, for running in process.

    ``model`` replaces the config's model (a tiny builder matching
    :func:`write_tiny_hf_checkpoint`); sequences are cut to 128 tokens; only
    ``metrics.jsonl`` is written. ``overrides`` are ``key=value`` strings as on
    the ``tune run`` command line. The result is not yet validated.
    """
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO_ROOT / config)
    cfg.model = dict(model)
    cfg.checkpointer.checkpoint_dir = str(checkpoint_dir)
    cfg.tokenizer.path = str(assets / "SmolLM2-135M-Instruct")
    cfg.tokenizer.max_seq_len = 128
    cfg.dataset.data_files = str(assets / "data" / "alpaca_en_demo.json")
    # the whole file (the shipped split holds out the records of its dataset_val), no validation:
    # a test that validates sets run_val_every_n_steps itself
    cfg.dataset.split = "train"
    cfg.run_val_every_n_steps, cfg.run_val_at_start = None, False
    cfg.output_dir = str(output_dir)
    cfg.metric_logger = None
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


def tiny_alpaca16_config(config: str, model: Dict, assets, tmp_path, output_dir, *overrides: str):
    """:func:`tiny_recipe_config` on the first 16 Alpaca samples, with the tiny checkpoint in ``tmp_path/base``.

    The checkpoint and the 16-sample file are written once per ``tmp_path``.
    """
    checkpoint_dir = tmp_path / "base"
    if not checkpoint_dir.exists():
        write_tiny_hf_checkpoint(checkpoint_dir)
        alpaca = json.loads((assets / "data" / "alpaca_en_demo.json").read_text())
        (tmp_path / "alpaca16.json").write_text(json.dumps(alpaca[:16]))
    return tiny_recipe_config(config, model, assets, checkpoint_dir, output_dir,
                              f"dataset.data_files={tmp_path / 'alpaca16.json'}", *overrides)


def run_recipe(recipe_cls, cfg):
    """setup, train, cleanup, as ``recipe_main`` does; returns the recipe object."""
    recipe = recipe_cls(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    return recipe


def lr_jump_schedule(optimizer, num_training_steps: int, at_step: int, factor: float):
    """A constant LR schedule that multiplies the LR by ``factor`` from optimizer step ``at_step`` (1-based) on.

    Usable as an ``lr_scheduler`` component in tests: it destroys a model at a known step.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: factor if done + 1 >= at_step else 1.0)


def freeze_import_time_objects() -> None:
    """Leave the ~400k objects that importing torch and torchtune creates out of every garbage collection.

    torchtune's checkpointer calls ``gc.collect()`` for each file it loads, and a
    full collection walks every tracked object: 0.45 s per in-process recipe run
    here, which hundreds of in-process runs pay. ``gc.freeze()`` moves the objects
    that exist now (modules, classes, functions: alive until exit anyway) to a
    generation the collector skips; what the tests create later is collected as usual.
    Frozen objects are never freed and ``gc.get_objects()`` no longer lists them.
    """
    import torchtune.training  # noqa: F401

    gc.collect()
    gc.freeze()


def damage_same_size(file):
    """Zero the middle half of a file: the size stays, so a size check cannot tell."""
    data = bytearray(file.read_bytes())
    quarter = len(data) // 4
    data[quarter:3 * quarter] = bytes(2 * quarter)
    assert data != file.read_bytes()
    file.write_bytes(bytes(data))


def deny(monkeypatch, folder):
    """Make ``folder`` unreadable: chmod 000 as a user; as root (which reads anything) the stat of its entries
    fails as it would for a user."""
    if os.geteuid() != 0:
        folder.chmod(0)
        monkeypatch.undo = lambda real=monkeypatch.undo: (folder.chmod(0o755), real())
        return
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path).startswith(str(folder) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)


def backward_mode(once: bool) -> str:
    """The ``backward`` mode of a test that runs both: ``auto`` (one backward per step where it fits: always,
    without a memory guard), or one backward per micro-batch."""
    return "auto" if once else "per_micro_batch"
